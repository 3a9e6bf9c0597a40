"""Routing at run time (issue "The host computes too", part 3): a guarded node is computed only
where its guard element is nonzero and is all zeros elsewhere; Mixtral guards each expert's FFN
by whether any token chose it; the partitioner makes guarded tasks that read the guard block
last; every runtime skips a guarded apply whose guard is off (moving no byte, writing zeros
where it would create a block); the validator refuses a guard that does not fit; prediction
prices a guarded op at its expected share."""
from __future__ import annotations

import dataclasses
import json
from collections import defaultdict

import numpy as np
import pytest
import sympy
from fake_cupy import installed
from test_host_compute import MIXTRAL, _close, _decode, _inputs_for, _placed

from einpage.compiler.partitioner import PartitionOptions, partition
from einpage.errors import GraphError, PlanError
from einpage.ir import GraphBuilder, MemGraph, validate
from einpage.ir.dtypes import DType
from einpage.ir.memgraph import ApplyNode
from einpage.ir.ops import EinsumOp, GuardedOp, op_from_json
from einpage.ir.spec import EinsumSpec
from einpage.models import llama, resolve
from einpage.predict.cost import apply_seconds, host_apply_seconds
from einpage.predict.devices import get_device
from einpage.runtime import blockops, reference, run
from einpage.runtime.backends.cuda import CupyBackend
from einpage.runtime.backends.inject import Delayed
from einpage.runtime.backends.threads import ThreadsBackend
from einpage.runtime.stream_executor import run_streams


def _guarded_graph():
    """y = (x @ w) guarded by flag[1]; out = y * scale + x (scale multiplies y)."""
    g = GraphBuilder()
    x = g.input("x", (4, 8), "f32")
    w = g.input("w", (8, 8), "f32", role="weight")
    flag = g.input("flag", (3,), "f32")
    with g.guard(flag, 1, share=0.25):
        y = g.einsum("im,mn->in", x, w)
    g.output("out", g.einsum("in,in->in", y, x, join=lambda a, b: 2 * a + b))
    return g.build()


def test_a_guarded_node_is_zero_where_its_guard_is_off():
    graph = _guarded_graph()
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((4, 8)).astype(np.float32), rng.standard_normal((8, 8))
    weights = {"w": w.astype(np.float32)}.__getitem__
    on = reference.evaluate(graph, {"x": x, "flag": np.array([0, 3, 0], np.float32)}, weights)
    off = reference.evaluate(graph, {"x": x, "flag": np.array([1, 0, 1], np.float32)}, weights)
    np.testing.assert_allclose(on["out"], 2 * (x @ weights("w")) + x, rtol=1e-5)
    np.testing.assert_array_equal(off["out"], x)
    assert "if %2[1]" in str(graph)


def test_the_builder_and_verify_refuse_bad_guards():
    g = GraphBuilder()
    x = g.input("x", (4,), "f32")
    with pytest.raises(GraphError, match="outside"):
        with g.guard(x, 4):
            g.einsum("i->i", x)
    with g.guard(x, 0):
        with pytest.raises(GraphError, match="do not nest"):
            with g.guard(x, 1):
                pass
    with pytest.raises(GraphError, match=r"share 1\.5"):
        with g.guard(x, 0, share=1.5):
            g.einsum("i->i", x)
    with g.guard(x, 0):  # inputs, fills and outputs are never guarded
        f = g.fill((4,), lambda i: i)
    assert f.node.guard is None


def test_a_share_of_the_size_symbols_is_bound_with_them():
    cfg, _ = resolve("mixtral-8x7b", random_weights=True)
    graph = llama.decode_graph(cfg)
    guarded = [n for n in graph.nodes if n.guard is not None]
    assert guarded and all(isinstance(n.guard.share, sympy.Basic) for n in guarded)
    bound = graph.bind(B=1, C=16)
    share = {round(n.guard.share, 12) for n in bound.nodes if n.guard is not None}
    assert share == {0.25}  # one token picks 2 of 8
    share16 = {round(n.guard.share, 12) for n in graph.bind(B=16, C=16).nodes
               if n.guard is not None}
    assert share16 == {round(1 - 0.75 ** 16, 12)}


def test_partitioned_guarded_tasks_read_their_guard_block_last():
    graph = _guarded_graph()
    tg = partition(graph, PartitionOptions(64))  # small blocks: x @ w is cut
    flag = {b.id for b in tg.blocks if b.name.startswith("flag")}
    guarded = [t for t in tg.tasks if isinstance(t.op, GuardedOp)]
    assert len(guarded) > 1
    for t in guarded:
        assert t.reads[-1] in flag and t.op.share == 0.25 and isinstance(t.op.op, EinsumOp)
        block = tg.blocks[t.reads[-1]]
        assert block.origin[0] + t.op.index == 1  # element 1 of flag, in its block
    assert not any(isinstance(t.op, GuardedOp) for t in tg.tasks
                   if tg.blocks[t.write].node == len(graph.nodes) - 2)  # the consumer is not


def test_a_guarded_op_round_trips_and_bad_ones_are_refused():
    op = GuardedOp(EinsumOp(EinsumSpec.parse("ij,jk->ik"), sympy.Symbol("x0") * sympy.Symbol(
        "x1"), "sum", DType.f32), 3, 0.25)
    assert op_from_json(json.loads(json.dumps(op.to_json()))) == op
    for bad in ({"index": -1}, {"share": 0.0}, {"share": 1.5}, {"op": op.to_json()}):
        with pytest.raises(ValueError):
            op_from_json({**op.to_json(), **bad})


# ------------------------------------------------------------------ Mixtral at run time

@pytest.fixture(scope="module")
def mixtral_decode(request):
    """Mixtral decode at B=1 (one token: exactly k experts per layer run), experts on the host."""
    hf = request.getfixturevalue("hf_fixture")
    cfg, weights, graph, inputs = _decode(MIXTRAL, hf, batch=1)
    tg, kept, on_host, mg = _placed(cfg, graph, "experts")
    inputs = _inputs_for(mg, inputs)
    return cfg, weights, graph, inputs, mg, reference.evaluate(graph, inputs, weights)


def _count_runs(monkeypatch):
    """Which guards were on in the runs that follow: {(guard tensor): {index, ...}}."""
    ran: dict[int, set[int]] = defaultdict(set)
    seen: dict[int, set[int]] = defaultdict(set)
    inner = blockops._guarded

    def counting(n, reads, write, release):
        out = inner(n, reads, write, release)
        if n.guard is not None:
            seen[n.reads[-1].tensor].add(n.guard.index)
            if out[0] is not None:
                ran[n.reads[-1].tensor].add(n.guard.index)
        return out
    monkeypatch.setattr(blockops, "_guarded", counting)
    return ran, seen


def test_one_token_runs_only_the_experts_its_router_picks(mixtral_decode, monkeypatch):
    cfg, weights, graph, inputs, mg, want = mixtral_decode
    ran, seen = _count_runs(monkeypatch)
    _close(run(mg, inputs, weights, order=3), want)
    assert len(seen) == cfg.layers and all(len(v) == cfg.experts for v in seen.values())
    assert all(len(v) == cfg.experts_per_token for v in ran.values())


@pytest.mark.parametrize("seed", [0, 1])
def test_threads_backend_skips_unchosen_experts_with_random_delays(mixtral_decode, seed,
                                                                   monkeypatch):
    cfg, weights, graph, inputs, mg, want = mixtral_decode
    ran, _ = _count_runs(monkeypatch)
    got = run_streams(mg, inputs, weights, Delayed(ThreadsBackend(poison=True), seed, 2e-3))
    _close(got.outputs, want)
    assert all(len(v) == cfg.experts_per_token for v in ran.values())


def test_the_device_only_plan_skips_too_and_gives_the_same_answers(hf_fixture):
    cfg, weights, graph, inputs = _decode(MIXTRAL, hf_fixture, batch=2)
    tg, _, on_host, mg = _placed(cfg, graph, "kv", share=4)
    inputs = _inputs_for(mg, inputs)
    assert any(n.guard is not None and not n.on_host for n in mg.nodes if n.kind == "apply")
    want = reference.evaluate(graph, inputs, weights)
    _close(run(mg, inputs, weights, order=2), want)
    _close(run_streams(mg, inputs, weights, "threads").outputs, want)


@pytest.fixture
def fake_cupy(monkeypatch, tmp_path_factory):
    yield from installed(monkeypatch, tmp_path_factory)


def test_cupy_backend_skips_unchosen_experts_and_never_captures(fake_cupy, hf_fixture,
                                                                monkeypatch):
    cfg, weights, graph, inputs = _decode(MIXTRAL, hf_fixture, batch=1)
    tg, _, _, mg = _placed(cfg, graph, "kv", share=4)
    inputs = _inputs_for(mg, inputs)
    backend = CupyBackend()
    backend.mg = mg
    assert not backend.can_capture()
    ran: dict[int, set[int]] = defaultdict(set)
    inner = CupyBackend._guard_on

    def recording(self, n):
        on = inner(self, n)
        if on:
            ran[n.reads[-1].tensor].add(n.guard.index)
        return on
    monkeypatch.setattr(CupyBackend, "_guard_on", recording)
    want = reference.evaluate(graph, inputs, weights)
    _close(run_streams(mg, inputs, weights, backend).outputs, want)
    assert len(ran) == cfg.layers
    assert all(len(v) == cfg.experts_per_token for v in ran.values())


# ------------------------------------------------------------------ the validator and the file

def test_a_guard_that_does_not_fit_is_refused(mixtral_decode):
    *_, mg, _ = mixtral_decode
    nodes = list(mg.nodes)
    k = next(i for i, n in enumerate(nodes) if isinstance(n, ApplyNode) and n.guard is not None)
    n = nodes[k]
    nodes[k] = dataclasses.replace(n, op=dataclasses.replace(n.op, index=10 ** 6))
    with pytest.raises(PlanError, match="guards on element 1000000"):
        validate(dataclasses.replace(mg, nodes=tuple(nodes)))
    nodes[k] = n.unguarded()  # an apply that drops its guard no longer runs its task
    with pytest.raises(PlanError):
        validate(dataclasses.replace(mg, nodes=tuple(nodes)))


def test_guards_need_version_2(mixtral_decode):
    *_, mg, _ = mixtral_decode
    data = mg.to_json()
    assert data["version"] == 2 and any(op["kind"] == "guarded" for op in data["graph"]["ops"])
    again = MemGraph.from_json(json.loads(json.dumps(data)))
    guards = lambda g: [(n.id, n.op.to_json()) for n in g.nodes  # noqa: E731
                        if n.kind == "apply" and n.guard is not None]
    assert guards(again) == guards(mg) and guards(mg)
    with pytest.raises(PlanError, match="guarded applies is written as version 2"):
        dataclasses.replace(mg, graph=None).to_json()


# ------------------------------------------------------------------ prediction

def test_a_guarded_op_is_priced_at_its_share():
    profile = get_device("h100-pcie")
    r = dataclasses.make_dataclass("R", ["shape", "dtype", "bytes", "storage"])
    a, b = r((64, 4096), DType.f16, 64 * 4096 * 2, None), r((4096, 4096), DType.f16, 2 << 24, None)
    out, guard = r((64, 4096), DType.f16, 64 * 4096 * 2, None), r((8,), DType.f16, 16, None)
    op = EinsumOp(EinsumSpec.parse("ij,jk->ik"), sympy.Symbol("x0") * sympy.Symbol("x1"),
                  "sum", DType.f16)
    full = apply_seconds(profile, op, [a, b], out, False)
    quarter = apply_seconds(profile, GuardedOp(op, 2, 0.25), [a, b, guard], out, False)
    assert quarter == pytest.approx(0.25 * full + 0.75 * profile.launch_overhead)
    host = host_apply_seconds(profile.host, GuardedOp(op, 2, 0.25), [a, b, guard], out, False)
    assert host == pytest.approx(0.25 * host_apply_seconds(profile.host, op, [a, b], out, False)
                                 + 0.75 * profile.host.apply_overhead)


def test_the_report_says_the_prediction_is_an_expectation(mixtral_decode):
    from einpage.cli.report import report_lines
    from einpage.compiler.report import PlanReport
    from einpage.predict import simulate
    cfg, weights, graph, inputs, mg, want = mixtral_decode
    report = PlanReport.of_plan(mg, validate(mg), simulate(mg, get_device("h100-pcie")))
    guarded = [n for n in mg.nodes if n.kind == "apply" and n.guard is not None]
    share = 1 - (1 - cfg.experts_per_token / cfg.experts)  # one token
    r = report.routing
    assert (r.applies, r.on_host) == (len(guarded), sum(n.on_host for n in guarded))
    assert r.on_host and r.share_min == r.share_max == pytest.approx(share)
    line = next(x for x in report_lines(report) if "routing:" in x)
    assert f"{len(guarded)} guarded applies, {r.on_host} of them on the host" in line
    assert "expectation" in line and f"{share:.3f}" in line
    data = report.to_json()
    assert data["guarded_applies"] == len(guarded) and data["guarded_share_max"] == r.share_max
    plain = GraphBuilder()
    x = plain.input("x", (4, 4))
    plain.output("y", plain.einsum("ij->ij", x))
    from einpage.compiler import CompileOptions, compile_graph
    c = compile_graph(plain.build(), CompileOptions(1 << 20))
    assert c.report.routing is None and c.report.to_json()["guarded_applies"] == 0
    assert not any("routing:" in x for x in report_lines(c.report))
