"""Gathers on the host (`compiler.host_gather`): a pass that does not fit on the device picks its
embedding rows from the table in host memory, and only the rows cross the link. Which gathers
go there; the problem's bound against every plan of small graphs with them (a host gather drops
reads from the device, so the bound counts none of its table); the plans computing the dense
reference's and transformers' answers in random orders and on the stream backends; the row
gather on the host equal to the generic one; `--host-compute off` keeping them on the device."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from test_stream_bound import _copied, _every_plan, _gathered, _orders, _tied

from einpage.compiler import CompileOptions, compile_graph
from einpage.compiler.host_gather import host_gathers, with_host_gathers
from einpage.compiler.order import memory_aware_order
from einpage.compiler.partitioner import PartitionOptions, partition
from einpage.compiler.resident import (front_seconds, min_stream_bytes, min_stream_copies,
                                       pass_needs, persistent_blocks)
from einpage.ir import GraphBuilder, validate
from einpage.ir.memgraph import ApplyNode, ReloadNode
from einpage.ir.ops import GatherOp
from einpage.models import llama, resolve
from einpage.predict import simulate
from einpage.predict.cost import task_seconds
from einpage.predict.devices import get_device
from einpage.runtime import reference, run
from einpage.runtime.blockops import apply_value, host_apply_into
from einpage.runtime.stream_executor import run_streams

H100 = get_device("h100-pcie")
#: the tests' tables are kilobytes: a link 20 times slower, no launch or dispatch costs make them
#: worth gathering on the host and the link bind, as a gigabyte's table does on the real profile
PROFILE = dataclasses.replace(H100, h2d_bandwidth=H100.h2d_bandwidth / 20, launch_overhead=0.0,
                              host=dataclasses.replace(H100.host, apply_overhead=0.0))
#: a host too slow for any gather to pay: each apply costs a second
SLOW = dataclasses.replace(PROFILE, host=dataclasses.replace(PROFILE.host, apply_overhead=1.0))


def _host_applies(mg) -> list[ApplyNode]:
    return [n for n in mg.nodes if isinstance(n, ApplyNode) and n.on_host]


def test_a_weight_tables_gathers_go_to_the_host_where_they_pay():
    """Every task of a gather whose table is a weight and whose ids are an input, where the
    host picks its rows in less time than the table takes over the link; none on a slow host,
    none of a table that is no weight (an activation: it is on the device already)."""
    tg = partition(_gathered(), PartitionOptions(1 << 18))
    gathers = {t.id for t in tg.tasks if isinstance(t.op, GatherOp)}
    assert len(gathers) > 4  # the table cut by rows: each row block's task adds its rows
    assert host_gathers(tg, PROFILE) == gathers
    assert host_gathers(tg, SLOW) == frozenset()
    g = GraphBuilder()
    table = g.einsum("vm->vm", g.input("table", (4096, 64)))  # made in the pass
    g.output("y", g.gather(table, g.input("ids", (8,), "i64")))
    assert host_gathers(partition(g.build(), PartitionOptions(1 << 18)), PROFILE) == frozenset()


def test_a_tied_table_is_gathered_on_the_host_only_where_it_cannot_stay_resident():
    """A table the logits read too stays resident where the room allows: the device gather
    then costs nothing; larger than the room, it would cross twice, and the host gathers."""
    tg = partition(_tied(vocab=4096, width=64), PartitionOptions(1 << 16))
    gathers = {t.id for t in tg.tasks if isinstance(t.op, GatherOp)}
    table = sum(b.bytes for b in tg.input_blocks if b.name.startswith("table"))
    assert host_gathers(tg, PROFILE, room=table) == frozenset()
    assert host_gathers(tg, PROFILE, room=table - 1) == host_gathers(tg, PROFILE) == gathers


def test_each_token_blocks_rows_are_gathered_before_the_next_ones():
    """On the device each table block is read once for every token block (their sums in
    lockstep); on the host the table is in memory, so each token block's sum runs whole, and the
    first layer can start on the first token block's rows."""
    cfg, _ = resolve("small", random_weights=True)
    device = partition(llama.prefill_graph(cfg).bind(B=1, S=128),
                       PartitionOptions(cfg.weight_bytes() // 64))
    lockstep = [device.tasks[t].write for t in memory_aware_order(device)
                if isinstance(device.tasks[t].op, GatherOp)]
    assert len(lockstep) > len(set(lockstep)) > 1
    assert lockstep != sorted(lockstep, key=lockstep.index)  # every block's first term first
    tg = with_host_gathers(device, PROFILE)
    writes = [tg.tasks[t].write for t in memory_aware_order(tg) if t in tg.host_tasks]
    assert sorted(writes) == sorted(lockstep)
    assert writes == sorted(writes, key=writes.index)  # each block's terms together


def test_what_only_the_host_reads_is_no_device_need():
    """The table a host gather alone reads is no candidate to stay resident, no weight the
    device holds (`PassNeeds`), and the tasks' order and blocks are unchanged."""
    tg = partition(_gathered(), PartitionOptions(1 << 18))
    gathered = with_host_gathers(tg, PROFILE)
    assert gathered.tasks == tg.tasks and gathered.host_tasks
    table = {b.id for b in tg.input_blocks if b.name.startswith("table")}
    assert table <= persistent_blocks(tg) and not table & persistent_blocks(gathered)
    order = memory_aware_order(tg)
    before, after = pass_needs(tg, order), pass_needs(gathered, order)
    assert before.weight_bytes - after.weight_bytes >= sum(tg.blocks[b].bytes for b in table)
    assert after.max_working_set < before.max_working_set  # (a table block and its rows)


@pytest.mark.parametrize("make,block", [(_tied, 1024), (_gathered, 1 << 22)])
def test_no_plan_with_host_gathers_beats_the_bound(make, block):
    """Every resident set of what the device reads, several orders and budgets, each lowered
    with the gathers on the host: no plan copies fewer bytes or makes fewer copies than
    `min_stream_bytes` / `min_stream_copies`, none is faster than `front_seconds` over the
    device's compute. A table only gathered never crosses: those plans copy less than the bound
    of the same graph gathered on the device says any plan must, which is why that bound could
    not stand for them."""
    tg = partition(make(), PartitionOptions(block))
    host = with_host_gathers(tg, PROFILE)
    assert host.host_tasks
    persistent = sorted(persistent_blocks(host))
    assert 1 <= len(persistent) <= 8
    seconds = task_seconds(PROFILE, host)
    device_s = [0.0 if t in host.host_tasks else s for t, s in enumerate(seconds)]
    weights = sum(tg.blocks[b].bytes for b in persistent_blocks(tg))
    lowered = beaten = 0
    for order in _orders(host, 4):
        for budget in (weights // 4, weights // 2, weights):
            least = min_stream_bytes(host, order, budget)
            copies = min_stream_copies(host, order, budget)
            front = front_seconds(host, order, device_s, budget, PROFILE.h2d_bandwidth)
            old = min_stream_bytes(tg, order, budget)
            for kept, mg in _every_plan(host, order, budget, persistent):
                lowered += 1
                assert {n.task for n in _host_applies(mg)} == host.host_tasks
                assert _copied(mg) >= least, (order, budget, kept)
                assert mg.count("reload") >= copies, (order, budget, kept)
                assert simulate(mg, PROFILE).makespan_s >= front * (1 - 1e-9)
                beaten += _copied(mg) < old
    assert lowered >= 6 and bool(beaten) == (make is _gathered)


def _llama(model: str = "small", fraction: int = 4, seq: int = 16):
    cfg, weights = resolve(model, random_weights=True, seed=2)
    graph = llama.prefill_graph(cfg).bind(B=2, S=seq)
    tokens = np.random.default_rng(2).integers(0, cfg.vocab, (2, seq))
    tokens[0, :2] = (0, cfg.vocab - 1)  # the table's first and last rows
    return cfg, weights, graph, {"tokens": tokens}


def test_a_paged_plan_gathers_on_the_host_and_computes_its_graph():
    """A LLaMA prefill at a quarter of its weights: its embedding rows are gathered on the
    host (no reload of its table), the plan validates, and it gives the dense reference's
    logits in random topological orders and on the threads backend."""
    cfg, weights, graph, inputs = _llama()
    compiled = compile_graph(graph, CompileOptions(cfg.weight_bytes() // 4, device=PROFILE))
    mg = compiled.memgraph
    hosted = _host_applies(mg)
    assert hosted and all(isinstance(n.op, GatherOp) for n in hosted)
    tables = {a.tensor for n in hosted for a in n.reads[:1]}
    assert not any(isinstance(n, ReloadNode) and n.tensor in tables for n in mg.nodes)
    assert compiled.report.compiled.host_read_bytes == sum(
        mg.tensors[t].bytes for t in tables) > 0
    validate(mg)
    want = reference.evaluate(graph, inputs, weights)
    for order in ("sequential", 3, 11):
        got = run(mg, inputs, weights, order=order)
        np.testing.assert_allclose(got["logits"], want["logits"], rtol=1e-5, atol=1e-5)
    streamed = run_streams(mg, inputs, weights, backend="threads").outputs
    np.testing.assert_allclose(streamed["logits"], want["logits"], rtol=1e-5, atol=1e-5)


def test_the_hf_fixtures_logits_with_the_rows_gathered_on_the_host(hf_fixture):
    """transformers' logits of its tiny LLaMA, from a plan at a quarter of its weights whose
    embedding rows the host gathers (outside truth, not the reference alone)."""
    path = hf_fixture("tiny-llama-f32")
    cfg, weights = resolve(str(path))
    ids = np.load(path / "input_ids.npy")
    graph = llama.prefill_graph(cfg).bind(B=ids.shape[0], S=ids.shape[1])
    mg = compile_graph(graph, CompileOptions(cfg.weight_bytes() // 4, device=PROFILE)).memgraph
    assert any(isinstance(n.op, GatherOp) for n in _host_applies(mg))
    got = run_streams(mg, {"tokens": ids}, weights, backend="threads").outputs["logits"]
    np.testing.assert_allclose(got, np.load(path / "logits.npy"), rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_a_packed_table_is_gathered_on_the_host_by_its_rows(fmt):
    """A quantized embedding (packed by rows) gathered on the host: each row dequantized as the
    device's gather does, the logits the dequantized model's."""
    cfg, weights = resolve("small", random_weights=True, seed=4, quantize=fmt)
    graph = llama.prefill_graph(cfg).bind(B=1, S=8)
    tokens = np.random.default_rng(4).integers(0, cfg.vocab, (1, 8))
    mg = compile_graph(graph, CompileOptions(cfg.weight_bytes() // 6, device=PROFILE)).memgraph
    hosted = _host_applies(mg)
    assert hosted and all(mg.tensors[n.reads[0].tensor].storage is not None for n in hosted)
    device = compile_graph(graph, CompileOptions(cfg.weight_bytes() // 6,
                                                 host_gather=False)).memgraph
    assert not _host_applies(device)
    want = run(device, {"tokens": tokens}, weights)["logits"]
    got = run(mg, {"tokens": tokens}, weights, order=5)["logits"]
    np.testing.assert_array_equal(got, want)


def test_the_cost_model_pools_a_gather_where_the_host_does():
    from einpage.predict.cost import POOLED_BYTES
    from einpage.runtime.hostpool import MIN_POOLED_BYTES
    assert POOLED_BYTES == MIN_POOLED_BYTES


@pytest.mark.parametrize("rows", [8, 4096])  # one piece, and a range of rows per worker
def test_the_host_gathers_rows_as_the_generic_path_does(rows):
    """`blockops._gather_rows_into` (the host's: only the rows a table block holds, pooled over
    the host's cores) against the generic gather that writes every row in every block's task:
    the same values, accumulating and not, with ids in no block, in one, in several."""
    tg = partition(_gathered(vocab=1024, width=64, seq=rows), PartitionOptions(1 << 16))
    mg = compile_graph(_gathered(vocab=1024, width=64, seq=rows), CompileOptions(
        sum(b.bytes for b in tg.input_blocks) // 3, host_gather=False)).memgraph
    gathers = [n for n in mg.nodes if isinstance(n, ApplyNode) and isinstance(n.op, GatherOp)]
    assert len(gathers) > 2
    rng = np.random.default_rng(1)
    for n in gathers:
        ids = rng.integers(0, 1024, mg.tensors[n.reads[1].tensor].shape)
        info = mg.tensors[n.reads[0].tensor]
        table = rng.standard_normal(info.shape).astype(info.dtype.numpy)
        write = mg.tensors[n.write.tensor]
        for start in (np.zeros(write.shape), rng.standard_normal(write.shape)):
            start = start.astype(write.dtype.numpy)
            want = apply_value(n, mg.tensors, [table, ids], start.copy())
            got = start.copy()
            host_apply_into(n, mg.tensors, [table, ids], got)
            np.testing.assert_array_equal(got, want)


def test_host_compute_off_keeps_the_gathers_on_the_device(capsys):
    """`--host-compute off`: every task on the device; the default gathers llama-7b's embedding
    rows on the host at 4 GB and says so in the report."""
    import json

    from test_cli import cli
    cfg, _, graph, _ = _llama()
    off = compile_graph(graph, CompileOptions(cfg.weight_bytes() // 4, device=PROFILE,
                                              host_gather=False))
    assert not _host_applies(off.memgraph) and not off.taskgraph.host_tasks
    read = {}
    for flag in ("off", "auto"):
        assert cli("compile", "llama-7b", "--gpu-mem", "4GB", "--cpu-mem", "unlimited",
                   "--host-compute", flag, "--json") == 0
        read[flag] = json.loads(capsys.readouterr().out)["host_read_bytes"]
    assert read == {"off": 0, "auto": 262144000}
    assert cli("compile", "llama-7b", "--gpu-mem", "4GB", "--cpu-mem", "unlimited") == 0
    assert ("262.14 MB of embedding tables read on the host (only the rows a pass gathers cross "
            "the link)") in capsys.readouterr().out


def test_a_host_gather_reads_a_resident_weight_where_it_lies_and_never_a_kv_block():
    """A weight's input at device leaves its host copy (the checkpoint's bytes, which no pass
    changes: rule 10): a host gather reads a resident table with no offload; a KV-store block
    at device has none (the device's copy takes the new rows between passes), and the same
    plan with that tensor a cache block is refused."""
    from einpage.compiler.lower_options import LowerOptions
    from einpage.compiler.lowering import lower
    from einpage.compiler.policies import get_policy
    from einpage.errors import PlanError
    tg = with_host_gathers(partition(_tied(vocab=4096, width=64), PartitionOptions(1 << 16)),
                           PROFILE)
    tables = {tg.tasks[t].reads[0] for t in tg.host_tasks}
    mg = lower(tg, memory_aware_order(tg), LowerOptions(
        10**9, get_policy("reuse-distance"), resident=frozenset(tables)))
    validate(mg)
    reads = {a.tensor for n in _host_applies(mg) for a in n.reads}
    assert tables <= reads and not any(n.kind == "offload" for n in mg.nodes)
    graph = _tied(vocab=4096, width=64)
    rng = np.random.default_rng(3)
    weights = {x.op.name: rng.standard_normal(x.shape).astype(np.float32)
               for x in graph.inputs if x.op.role.value == "weight"}
    ids = {"ids": rng.integers(0, 4096, (4,))}
    want = reference.evaluate(graph, ids, weights.__getitem__)["logits"]
    for order in ("sequential", 7):  # the NumPy executor reads the table's source too
        np.testing.assert_allclose(run(mg, ids, weights.__getitem__, order=order)["logits"],
                                   want, rtol=1e-4, atol=1e-4)
    table = next(iter(tables))
    tensors = list(mg.tensors)
    tensors[table] = dataclasses.replace(tensors[table], role="cache")
    with pytest.raises(PlanError, match="no host copy"):
        validate(dataclasses.replace(mg, tensors=tuple(tensors)))
    # ... and a weight's input at device is no reload's host copy (rule 6): a resident table
    # freed and reloaded is refused
    from einpage.ir.memgraph import FreeNode
    start = next(n for n in mg.nodes if n.kind == "input" and n.tensor == table)
    nodes = list(mg.nodes)
    nodes += [FreeNode(len(nodes), table, start.offset, tuple(range(len(nodes)))),
              ReloadNode(len(nodes) + 1, table, start.offset, (len(nodes),))]
    with pytest.raises(PlanError, match="no host copy"):
        validate(dataclasses.replace(mg, nodes=tuple(nodes)))


@pytest.mark.parametrize("policy", ["reuse-distance", "lru", "layerwise"])
def test_no_policy_moves_a_table_only_the_host_reads(policy):
    cfg, weights, graph, inputs = _llama()
    mg = compile_graph(graph, CompileOptions(int(cfg.weight_bytes() / 1.5), policy=policy,
                                             device=PROFILE)).memgraph
    hosted = _host_applies(mg)
    assert hosted
    tables = {a.tensor for n in hosted for a in n.reads[:1]}
    assert not any(n.kind in ("reload", "input") and n.tensor in tables
                   and getattr(n, "at", "device") == "device" for n in mg.nodes)
    got = run(mg, inputs, weights, order=2)["logits"]
    np.testing.assert_allclose(got, reference.evaluate(graph, inputs, weights)["logits"],
                               rtol=1e-5, atol=1e-5)


def test_a_table_packed_across_its_rows_is_gathered_by_the_generic_path():
    """A q8_0 table whose groups span both axes (48 columns: no whole group in a row) cut by
    rows and gathered on the host: unpacked first, as on the device; the answer the same."""
    from einpage.ir.storage import Storage
    g = GraphBuilder()
    table = g.input("table", (8192, 48), role="weight", storage=Storage("q8_0", 2))
    x = g.gather(table, g.input("ids", (8,), "i64"))
    g.output("y", g.einsum("sm,nm->sn", x, g.input("w", (48, 48), role="weight")))
    graph = g.build()
    rng = np.random.default_rng(0)
    weights = {"table": rng.standard_normal((8192, 48)).astype(np.float32),
               "w": rng.standard_normal((48, 48)).astype(np.float32)}
    ids = {"ids": rng.integers(0, 8192, (8,))}
    got = {}
    for gather in (False, True):
        mg = compile_graph(graph, CompileOptions(1 << 16, device=PROFILE,
                                                 host_gather=gather)).memgraph
        assert bool(_host_applies(mg)) == gather
        got[gather] = run(mg, ids, weights.__getitem__, order=1)["y"]
    np.testing.assert_array_equal(got[True], got[False])
