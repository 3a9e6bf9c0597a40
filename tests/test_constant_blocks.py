"""Blocks known at partition time (`einpage.compiler.constants`): which fill blocks are constant,
how joins fold constant operands, and the partitioner dropping the tasks of masked-out blocks.
Plans with dropped tasks give the dense reference's outputs on the NumPy executor and the threads
backend: causal, offset-causal (a mixed block off the diagonal) and sliding-window masks, a max
and a sum over masked blocks, an output block no partial reaches, and the small LLaMA prefill."""
from __future__ import annotations

import math

import numpy as np
import pytest
import sympy

from einpage.compiler import CompileOptions, compile_graph
from einpage.compiler.constants import (Folded, constant_expr, dtype_value, fill_constant, fold,
                                        identity)
from einpage.compiler.partitioner import PartitionOptions, partition
from einpage.ir import scalar
from einpage.ir.builder import GraphBuilder
from einpage.ir.dtypes import DType
from einpage.ir.ops import FillOp, op_from_json
from einpage.models import llama
from einpage.models.checkpoint import RandomWeights
from einpage.models.config import preset
from einpage.runtime import evaluate
from einpage.runtime.backends.threads import ThreadsBackend
from einpage.runtime.executor import run
from einpage.runtime.stream_executor import run_streams

s, t = scalar.index(0), scalar.index(1)
x0, x1, x2 = scalar.x(0), scalar.x(1), scalar.x(2)
INF = math.inf
CAUSAL = sympy.Piecewise((0, t <= s), (-sympy.oo, True))


def band(w: int) -> sympy.Expr:
    """Sliding window of `w` keys: query s sees keys s - w < t <= s."""
    return sympy.Piecewise((0, sympy.And(t <= s, s - t < w)), (-sympy.oo, True))


# ------------------------------------------------------------------ fill_constant

def test_causal_blocks_off_the_diagonal_are_constant():
    assert fill_constant(CAUSAL, (0, 4), (4, 4)) == -INF   # above the diagonal
    assert fill_constant(CAUSAL, (4, 0), (4, 4)) == 0.0    # below
    assert fill_constant(CAUSAL, (4, 4), (4, 4)) is None   # on it: mixed
    assert fill_constant(CAUSAL, (3, 4), (1, 4)) == -INF   # a row just above it
    assert fill_constant(CAUSAL, (2, 0), (3, 3)) == 0.0    # touches it at one corner
    assert fill_constant(CAUSAL, (1, 0), (3, 3)) is None   # crosses it at one corner


def test_sliding_window_blocks():
    w = band(4)
    assert fill_constant(w, (0, 4), (4, 4)) == -INF        # above the diagonal
    assert fill_constant(w, (8, 0), (4, 4)) == -INF        # below the band
    assert fill_constant(w, (4, 0), (4, 4)) is None        # on the band's lower edge
    assert fill_constant(w, (4, 4), (4, 4)) is None        # on the diagonal
    assert fill_constant(band(16), (4, 0), (4, 4)) == 0.0  # inside a wide band
    # Or / Not of linear relations
    outside = sympy.Piecewise((-sympy.oo, sympy.Or(t > s, sympy.Not(s - t < 4))), (0, True))
    assert fill_constant(outside, (8, 0), (4, 4)) == -INF
    assert fill_constant(outside, (0, 4), (4, 4)) == -INF
    assert fill_constant(outside, (4, 4), (4, 4)) is None


def test_what_is_not_known():
    nonlinear = sympy.Piecewise((0, s * t < 3), (1, True))
    assert fill_constant(nonlinear, (4, 4), (4, 4)) is None
    diagonal = sympy.Piecewise((1, sympy.Eq(s, t)), (0, True))
    assert fill_constant(diagonal, (0, 4), (4, 4)) is None  # Eq is not decided, even off it
    assert fill_constant(sympy.Piecewise((1, sympy.Ne(s, t)), (0, True)), (0, 4), (4, 4)) is None
    size = scalar.size_symbol("S")
    assert fill_constant(sympy.Piecewise((0, t <= s + size), (1, True)), (0, 0), (2, 2)) is None
    assert fill_constant(s + t, (0, 0), (1, 1)) is None      # index symbols: never constant
    assert fill_constant(sympy.sqrt(-1 + 0 * s), (0,), (3,)) is None  # not real
    assert fill_constant(CAUSAL, (0, 4), (0, 4)) is None     # empty box


def test_constant_expressions_and_nested_piecewise():
    assert fill_constant(sympy.Rational(3, 2), (0,), (5,)) == 1.5
    assert fill_constant(2 * CAUSAL + 1, (4, 0), (4, 4)) == 1.0
    nested = sympy.Piecewise((sympy.Piecewise((1, s >= 8), (2, True)), t <= s), (3, True))
    assert fill_constant(nested, (8, 0), (4, 4)) == 1.0
    assert fill_constant(nested, (4, 0), (4, 4)) == 2.0
    assert fill_constant(nested, (0, 4), (4, 4)) == 3.0
    # a branch never taken is never looked at (its inner condition would be undecided)
    assert fill_constant(sympy.Piecewise((3, t > s), (nested, True)), (0, 4), (4, 4)) == 3.0


# ------------------------------------------------------------------ fold

def test_fold_to_constants():
    assert fold(x0 + x1, {1: -INF}, 2) == Folded(-INF, None, ())
    assert fold(scalar.exp(x0 - x1), {0: -INF}, 2) == Folded(0.0, None, ())
    assert fold(x0 / x1, {0: 0.0}, 2) == Folded(0.0, None, ())
    assert fold(x0 * x1 * 0.125, {0: 0.0}, 2) == Folded(0.0, None, ())
    assert fold(x0, {0: 2.5}, 1) == Folded(2.5, None, ())
    assert fold(sympy.Max(x0, x1), {0: -INF}, 2) == Folded(None, x0, (1,))


def test_fold_to_reduced_joins():
    assert fold(x0 + x1, {1: 0.0}, 2) == Folded(None, x0, (0,))
    got = fold(x0 * x1 + x2, {1: 2.0}, 3)
    assert got.kept == (0, 2) and sympy.simplify(got.join - (2 * x0 + x1)) == 0
    assert fold(x0 / x1, {1: 0.0}, 2) is None              # x0 / 0: no real value
    assert fold(x0 - x1, {0: INF, 1: INF}, 2) is None      # inf - inf is nan


def test_identities_and_values():
    assert (identity("sum"), identity("max"), identity("min")) == (0.0, -INF, INF)
    assert dtype_value(0.1, DType.f16) == float(np.float16(0.1))
    assert dtype_value(-INF, DType.f32) == -INF
    assert dtype_value(2.5, DType.i64) is None and dtype_value(3.0, DType.i64) == 3.0
    for v in (0.0, -INF, INF, 7.0, 0.08838834764831845):
        op = FillOp(constant_expr(v), (0, 0))
        again = op_from_json(op.to_json())
        assert float(again.expr) == v  # plan files keep the constant exactly


# ------------------------------------------------------------------ attention graphs

def attention_graph(n: int, d: int, mask_expr: sympy.Expr | None = CAUSAL, *, extra=False):
    """softmax(q k^T * scale + mask) v over `n` positions, as LLaMA writes it; with `extra`, also
    a max over masked scores and a 0/1-masked sum (rows s < n/2 see nothing: zero rows)."""
    g = GraphBuilder()
    x = g.input("x", (n, d), "f64")
    # q, k, v of one x: the query and key positions are one axis class, cut alike
    q, k, v = (g.einsum("sd,de->se", x, g.input(name, (d, d), "f64")) for name in "qkv")
    scores = g.einsum("sd,td->st", q, k, join=lambda a, c: a * c * 0.25, agg="sum")
    mask = g.fill((n, n), mask_expr, dtype="f64")
    masked = g.einsum("st,st->st", scores, mask, join=lambda a, c: a + c)
    top = g.einsum("st->s", masked, join=lambda a: a, agg="max")
    e = g.einsum("st,s->st", masked, top, join=lambda a, c: scalar.exp(a - c))
    total = g.einsum("st->s", e, join=lambda a: a, agg="sum")
    probs = g.einsum("st,s->st", e, total, join=lambda a, c: a / c)
    g.output("out", g.einsum("st,td->sd", probs, v))
    nodes = {"scores": scores.id, "mask": mask.id, "masked": masked.id, "probs": probs.id}
    if extra:
        # max over the masked scores as one two-operand contraction: -inf partials are dropped
        g.output("rowmax", g.einsum("st,st->s", scores, mask, join=lambda a, c: a + c, agg="max"))
        late = g.fill((n, n), sympy.Piecewise((1, t <= s - n // 2), (0, True)), dtype="f64")
        g.output("late", g.einsum("st,st,td->sd", scores, late, v))
        # constant blocks a graph output and a copy (reshape) must read: filled for them
        doubled = g.einsum("st->st", mask, join=lambda a: 2 * a)
        g.output("doubled", doubled)
        g.output("flat", g.reshape(doubled, (n * n,)))
        nodes["doubled"] = doubled.id
    return g.build(), nodes


def inputs(n: int, d: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((n, d)),
            **{name: rng.standard_normal((d, d)) / d for name in "qkv"}}


def grid_parts(tg, node: int) -> int:
    """Parts of a square [n, n] node's layout on its first axis."""
    return len({b.origin[0] for b in tg.blocks if b.node == node})


def tasks_of(tg, node: int) -> list:
    return [task for task in tg.tasks if task.node == node]


N, D = 64, 8
BLOCK = 16384  # cuts s and t into 4 parts


def test_causal_attention_drops_the_blocks_above_the_diagonal():
    graph, nodes = attention_graph(N, D)
    before = partition(graph, PartitionOptions(BLOCK, drop_constant_blocks=False))
    after = partition(graph, PartitionOptions(BLOCK))
    p = grid_parts(before, nodes["scores"])
    assert p == 4
    above = p * (p - 1) // 2
    assert len(tasks_of(before, nodes["scores"])) == p * p
    assert len(tasks_of(after, nodes["scores"])) == p * p - above  # QK^T above: dead
    # every op of the chain loses the blocks above the diagonal; nothing else changes
    assert len(before.tasks) - len(after.tasks) >= 6 * above
    masked = tasks_of(after, nodes["masked"])
    assert len(masked) == p * (p + 1) // 2
    # below the diagonal `scores + 0` reads no mask block; on it the mixed mask block is read
    reduced = [task for task in masked if len(task.op.spec.inputs) == 1]
    assert len(reduced) == above and all(task.op.join == x0 for task in reduced)
    assert len(tasks_of(after, nodes["mask"])) == p  # only the diagonal blocks are filled
    assert len(tasks_of(after, nodes["probs"])) == p * (p + 1) // 2
    assert not [b for b in after.blocks if b.node == nodes["mask"] and b.origin[1] > b.origin[0]]


def _check_plan(graph, arrays, budget, block, drop=True):
    want = evaluate(graph, arrays)
    compiled = compile_graph(graph, CompileOptions(budget, block_bytes=block,
                                                   drop_constant_blocks=drop))
    mg = compiled.memgraph
    got = run(mg, arrays, order="sequential")
    shuffled = run(mg, arrays, order=7)
    threads = run_streams(mg, arrays, None, ThreadsBackend(poison=True)).outputs
    assert set(got) == set(want)
    for name in want:
        for out in (got, shuffled, threads):
            np.testing.assert_allclose(out[name], want[name], rtol=1e-12, atol=1e-12,
                                       err_msg=name)
    return compiled


@pytest.mark.parametrize("budget", [1 << 20, 40_000])  # everything fits / it pages
def test_causal_attention_plan_equals_the_reference(budget):
    graph, nodes = attention_graph(N, D)
    arrays = inputs(N, D)
    after = _check_plan(graph, arrays, budget, BLOCK)
    before = _check_plan(graph, arrays, budget, BLOCK, drop=False)
    assert len(after.taskgraph.tasks) < len(before.taskgraph.tasks)
    assert after.simulation.compute_s < before.simulation.compute_s


def test_sliding_window_drops_blocks_below_the_band_too():
    w = 10
    graph, nodes = attention_graph(N, D, band(w))
    arrays = inputs(N, D, seed=1)
    causal_graph, _ = attention_graph(N, D)
    window = partition(graph, PartitionOptions(BLOCK))
    causal = partition(causal_graph, PartitionOptions(BLOCK))
    p = grid_parts(window, nodes["scores"])
    # blocks of 16 rows: a window of 10 keys reaches one block below the diagonal
    assert p == 4
    assert len(tasks_of(window, nodes["scores"])) == p + (p - 1)
    assert len(tasks_of(causal, nodes["scores"])) == p * (p + 1) // 2
    _check_plan(graph, arrays, 1 << 20, BLOCK)
    _check_plan(graph, arrays, 40_000, BLOCK)


def test_offset_mask_with_a_mixed_block_off_the_diagonal():
    # query s sees keys t <= s + 5: the blocks just above the diagonal are mixed too
    shifted = sympy.Piecewise((0, t <= s + 5), (-sympy.oo, True))
    graph, nodes = attention_graph(N, D, shifted)
    tg = partition(graph, PartitionOptions(BLOCK))
    p = grid_parts(tg, nodes["scores"])
    assert len(tasks_of(tg, nodes["scores"])) == p * (p + 1) // 2 + (p - 1)
    _check_plan(graph, inputs(N, D, seed=2), 1 << 20, BLOCK)


def test_max_and_sum_contractions_over_masked_blocks():
    graph, nodes = attention_graph(N, D, extra=True)
    arrays = inputs(N, D, seed=3)
    after = _check_plan(graph, arrays, 1 << 20, BLOCK)
    before = _check_plan(graph, arrays, 1 << 20, BLOCK, drop=False)
    tg = after.taskgraph
    rowmax = next(n for n in graph.nodes if n.kind == "einsum" and str(n.op.spec) == "st,st->s")
    p = grid_parts(tg, nodes["scores"])
    partials = tasks_of(tg, rowmax.id)
    assert len(partials) == p * (p + 1) // 2  # the -inf partials (max identity) are gone
    assert sum(not t_.accumulate for t_ in partials) == p  # one creates each output block
    # "late" (keys t <= s - 32): rows s < 32 see nothing, so their output blocks are 0 (the sum's
    # identity) and filled only for the output; where the 0/1 mask block is all ones the
    # partial reads no mask block (x0 * 1 * x2); the two mixed blocks are read as they are
    # (the builder writes the three-operand product as scores * late, then @ v)
    late_fill = max(n.id for n in graph.nodes if n.kind == "fill")
    scaled = next(n for n in graph.nodes if n.kind == "einsum" and late_fill in n.inputs)
    late = next(n for n in graph.nodes if n.kind == "einsum" and scaled.id in n.inputs)
    reads = sorted(len(t_.op.spec.inputs) for t_ in tasks_of(tg, scaled.id))
    assert reads == [1, 2, 2]
    assert len(tasks_of(tg, late.id)) == 3 + 2  # three partials, two zero blocks filled
    fills = [t_ for t_ in tg.tasks if isinstance(t_.op, FillOp) and t_.node == late.id]
    assert len(fills) == 2 and all(float(t_.op.expr) == 0 for t_ in fills)
    assert all(not t_.accumulate for t_ in fills)
    # 2 * mask is constant off the diagonal: those blocks are filled (with constant
    # expressions) for the output and the reshape that read them, once each
    doubled = tasks_of(tg, nodes["doubled"])
    fills = [t_ for t_ in doubled if isinstance(t_.op, FillOp)]
    assert len(doubled) == p * p and len(fills) == p * (p - 1)
    assert {float(t_.op.expr) for t_ in fills} == {0.0, -INF}
    reshape = next(t_ for t_ in tg.tasks if t_.node == nodes["doubled"] + 2)
    assert len(reshape.reads) == p * p and all(f.id < reshape.id for f in fills)
    assert len(tg.tasks) < len(before.taskgraph.tasks)


def test_dead_tasks_are_removed_and_ids_dense():
    g = GraphBuilder()
    a = g.input("a", (8, 8), "f64")
    g.einsum("ij->ij", a, join=lambda v: 2 * v)  # read by nothing
    g.output("b", g.einsum("ij->ij", a, join=lambda v: v + 1))
    tg = partition(g.build(), PartitionOptions(1 << 20))
    assert len(tg.tasks) == 1 and [b.id for b in tg.blocks] == list(range(len(tg.blocks)))
    kept = partition(g.build(), PartitionOptions(1 << 20, drop_constant_blocks=False))
    assert len(kept.tasks) == 2


def test_no_constant_no_change():
    graph, _ = attention_graph(N, D, sympy.Piecewise((0, sympy.Eq(s, t)), (1, True)))
    a = partition(graph, PartitionOptions(BLOCK))
    b = partition(graph, PartitionOptions(BLOCK, drop_constant_blocks=False))
    assert a == b


# ------------------------------------------------------------------ LLaMA

def test_small_llama_prefill_drops_masked_blocks_and_equals_the_reference():
    cfg = preset("small")
    graph = llama.prefill_graph(cfg).bind(B=1, S=64)
    weights = RandomWeights(cfg, seed=3)
    tokens = np.random.default_rng(4).integers(0, cfg.vocab, (1, 64))
    want = evaluate(graph, {"tokens": tokens}, weights)
    budget = 200_000
    before = compile_graph(graph, CompileOptions(budget, drop_constant_blocks=False))
    after = compile_graph(graph, CompileOptions(budget))
    mask = next(n for n in graph.nodes if n.kind == "fill" and len(n.shape) == 2)
    assert grid_parts(before.taskgraph, mask.id) >= 2  # the sequence is cut
    assert len(after.taskgraph.tasks) < len(before.taskgraph.tasks)
    assert after.simulation.compute_s < before.simulation.compute_s
    for compiled in (after, before):
        got = run(compiled.memgraph, {"tokens": tokens}, weights, order=5)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5,
                                       err_msg=name)
    got = run_streams(after.memgraph, {"tokens": tokens}, weights,
                      ThreadsBackend(poison=True)).outputs
    np.testing.assert_allclose(got["logits"], want["logits"], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ the CuPy backend

@pytest.fixture
def fake_cupy(monkeypatch, tmp_path_factory):
    from fake_cupy import installed
    yield from installed(monkeypatch, tmp_path_factory)


def test_masked_plans_on_the_cupy_backend_host_stand_in(fake_cupy):
    """Constant fills and reduced joins as generated CUDA C (compiled for the host by g++)."""
    from test_cuda_source import kernel_sources

    from einpage.runtime.backends import cuda, cuda_apply
    graph, _ = attention_graph(N, D, band(10), extra=True)
    arrays = inputs(N, D, seed=5)
    mg = compile_graph(graph, CompileOptions(100_000, block_bytes=BLOCK)).memgraph
    for src in kernel_sources([mg]):
        cuda_apply.compiled(src)
    backend = cuda.CupyBackend()
    got = run_streams(mg, arrays, None, backend=backend).outputs
    want = evaluate(graph, arrays)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-10, atol=1e-10, err_msg=name)
    assert backend.arena is None
