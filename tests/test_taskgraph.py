"""`TaskGraph.verify()` on corrupted taskgraphs: a small partitioned graph is valid, and breaking
one invariant of the docstring at a time (block and task ids, read-after-write order, the
accumulate flags, input blocks never written, output blocks) gives a `GraphError` naming it."""
from __future__ import annotations

from dataclasses import replace

import pytest

from einpage.compiler import PartitionOptions, partition
from einpage.errors import GraphError
from einpage.ir import GraphBuilder, TaskGraph
from einpage.ir.ops import CopyOp, EinsumOp
from einpage.ir.taskgraph import OutputBlock


def _valid_taskgraph() -> TaskGraph:
    """y = (x @ w)**2 with the matmul cut in rows and in its contracted index, so its two output
    blocks are each written by a creating task and an accumulating one, then regridded:

        task 0: einsum[ab,bc->ac] sum(%b2, %b6) -> %b0       task 3: ... (%b5, %b7) -> += %b1
        task 1: einsum[ab,bc->ac] sum(%b3, %b7) -> += %b0    task 4: copy[2](%b0, %b1) -> %b9
        task 2: einsum[ab,bc->ac] sum(%b4, %b6) -> %b1       task 5: einsum[ac->ac] (%b9) -> %b8

    Blocks %b2..%b5 are x's, %b6 and %b7 w's (input blocks); %b8 is output y."""
    g = GraphBuilder()
    x = g.input("x", (4, 6))                                  # %0
    w = g.input("w", (6, 2), role="weight")                   # %1
    y = g.einsum("ab,bc->ac", x, w)                           # %2
    g.output("y", g.einsum("ac->ac", y, join=lambda v: v * v))  # %3, %4
    return partition(g.build(), PartitionOptions(1 << 20, cuts={y.id: {"a": 2, "b": 2}}))


def test_the_valid_taskgraph_has_the_shape_the_corruptions_assume():
    tg = _valid_taskgraph()
    tg.verify()
    assert tg.writers == ((0, 1), (2, 3), (), (), (), (), (), (), (5,), (4,))
    assert [t.accumulate for t in tg.tasks] == [False, True, False, True, False, False]
    assert [type(t.op) for t in tg.tasks] == [EinsumOp] * 4 + [CopyOp, EinsumOp]
    assert [t.reads for t in tg.tasks] == [(2, 6), (3, 7), (4, 6), (5, 7), (0, 1), (9,)]
    assert [b.id for b in tg.input_blocks] == [2, 3, 4, 5, 6, 7]
    assert [(o.block, o.name) for o in tg.outputs] == [(8, "y")]
    assert tg.deps == ((), (0,), (), (2,), (0, 1, 2, 3), (4,))


def test_the_blocks_each_task_touches_and_reads_each_once_in_order():
    """`TaskGraph.touched` (reads, then the write) and `read_once` (the reads), each block
    once, in the order the task names them: what the lowering walks per task."""
    tg = _valid_taskgraph()
    assert tg.touched == ((2, 6, 0), (3, 7, 0), (4, 6, 1), (5, 7, 1), (0, 1, 9), (9, 8))
    assert tg.read_once == tuple(t.reads for t in tg.tasks)
    # a task reading one block twice (x * x), and one accumulating into a block it reads
    twice = _tasks(tg, t5=dict(reads=(9, 9)), t1=dict(reads=(0, 3, 0)))
    assert twice.touched[5] == (9, 8) and twice.read_once[5] == (9,)
    assert twice.touched[1] == (0, 3) and twice.read_once[1] == (0, 3)


def _tasks(tg: TaskGraph, **changes: dict) -> TaskGraph:
    """`_tasks(tg, t3=dict(write=0))`: tg with task 3 replaced by one with those fields."""
    tasks = list(tg.tasks)
    for key, fields in changes.items():
        k = int(key[1:])
        tasks[k] = replace(tasks[k], **fields)
    return replace(tg, tasks=tuple(tasks))


def _blocks(tg: TaskGraph, k: int, **fields) -> TaskGraph:
    blocks = list(tg.blocks)
    blocks[k] = replace(blocks[k], **fields)
    return replace(tg, blocks=tuple(blocks))


def _unwritten_output(tg: TaskGraph) -> TaskGraph:
    """A new activation block %b10 that no task writes, named as output y."""
    extra = replace(tg.blocks[8], id=10, name="%3[extra]")
    return replace(tg, blocks=tg.blocks + (extra,), outputs=(OutputBlock(10, "y", (0, 0)),))


@pytest.mark.parametrize("corrupt, message", [
    pytest.param(lambda tg: _blocks(tg, 3, id=9), "block at position 3 has id 9",
                 id="block-id-not-position"),
    pytest.param(lambda tg: _tasks(tg, t2=dict(id=5)), "task at position 2 has id 5",
                 id="task-id-not-position"),
    pytest.param(lambda tg: _tasks(tg, t0=dict(reads=(9, 6))),
                 r"task 0 (einsum[ab,bc->ac] sum) reads %b9 before it is written",
                 id="reads-block-written-later"),
    pytest.param(lambda tg: _tasks(tg, t5=dict(reads=(8,))),
                 r"task 5 (einsum[ac->ac] x0**2) reads %b8 before it is written",
                 id="reads-its-own-write"),
    pytest.param(lambda tg: _tasks(tg, t0=dict(accumulate=True)),
                 "task 0: accumulate flag wrong for writer 0 of %b0",
                 id="first-writer-accumulates"),
    pytest.param(lambda tg: _tasks(tg, t3=dict(accumulate=False)),
                 "task 3: accumulate flag wrong for writer 1 of %b1",
                 id="later-writer-overwrites"),
    pytest.param(lambda tg: _tasks(tg, t4=dict(write=6)),
                 "input block %b6 (w[0,0]) is written by task 4",
                 id="input-block-written"),
    pytest.param(lambda tg: _blocks(tg, 9, source=tg.blocks[2].source),
                 "input block %b9 (%2[0,0]) is written by task 4",
                 id="written-block-made-input"),
    pytest.param(_unwritten_output, "output y block %b10 is never written",
                 id="output-never-written"),
    # a task of node %3 accumulating into a block of node %2: caught because task 4 read that
    # block before this last write of it
    pytest.param(lambda tg: _tasks(tg, t5=dict(write=0, accumulate=True)),
                 "task 4 (copy[2]) reads %b0 before its last write (task 5)",
                 id="last-task-writes-elsewhere"),
])
def test_verify_rejects_corrupted_taskgraph(corrupt, message):
    tg = _valid_taskgraph()
    tg.verify()  # the uncorrupted taskgraph is fine
    with pytest.raises(GraphError) as err:
        corrupt(tg).verify()
    assert str(err.value) == message


@pytest.mark.parametrize("corrupt, message", [
    # task 2 reads %b0 while task 3 (moved to accumulate into %b0) still writes it later
    pytest.param(lambda tg: _tasks(tg, t2=dict(reads=(0, 6)), t3=dict(write=0)),
                 "task 2 (einsum[ab,bc->ac] sum) reads %b0 before its last write (task 3)",
                 id="reads-block-still-being-accumulated"),
    pytest.param(lambda tg: replace(tg, outputs=(OutputBlock(10, "y", (0, 0)),)),
                 "output y names block %b10, but the taskgraph has blocks %b0..%b9",
                 id="output-block-out-of-range"),
    pytest.param(lambda tg: replace(tg, outputs=(OutputBlock(-1, "y", (0, 0)),)),
                 "output y names block %b-1, but the taskgraph has blocks %b0..%b9",
                 id="output-block-negative"),
    pytest.param(lambda tg: _tasks(tg, t0=dict(reads=(2, 10))),
                 "task 0 (einsum[ab,bc->ac] sum) names block %b10, but the taskgraph has blocks "
                 "%b0..%b9", id="read-block-out-of-range"),
    pytest.param(lambda tg: _tasks(tg, t4=dict(write=10)),
                 "names block %b10, but the taskgraph has blocks %b0..%b9",
                 id="write-block-out-of-range"),
])
def test_verify_rejects_dangling_ids_and_early_reads(corrupt, message):
    """Found missing by the tests above: ids out of range and reads of a block that is still
    being accumulated (task ids would then not be a topological order)."""
    with pytest.raises(GraphError) as err:
        corrupt(_valid_taskgraph()).verify()
    assert message in str(err.value)
