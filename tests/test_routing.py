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
from host_placed import MIXTRAL, assert_close, decode_step, inputs_for, placed_plan

from einpage.compiler.partitioner import PartitionOptions, partition
from einpage.errors import GraphError, PlanError
from einpage.ir import GraphBuilder, MemGraph, validate
from einpage.ir.dtypes import DType
from einpage.ir.memgraph import ApplyNode, OffloadNode
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
    cfg, weights, graph, inputs = decode_step(MIXTRAL, hf, batch=1)
    tg, kept, on_host, mg = placed_plan(cfg, graph, "experts")
    inputs = inputs_for(mg, inputs)
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
    assert_close(run(mg, inputs, weights, order=3), want)
    assert len(seen) == cfg.layers and all(len(v) == cfg.experts for v in seen.values())
    assert all(len(v) == cfg.experts_per_token for v in ran.values())


@pytest.mark.parametrize("seed", [0, 1])
def test_threads_backend_skips_unchosen_experts_with_random_delays(mixtral_decode, seed,
                                                                   monkeypatch):
    cfg, weights, graph, inputs, mg, want = mixtral_decode
    ran, _ = _count_runs(monkeypatch)
    got = run_streams(mg, inputs, weights, Delayed(ThreadsBackend(poison=True), seed, 2e-3))
    assert_close(got.outputs, want)
    assert all(len(v) == cfg.experts_per_token for v in ran.values())


def test_the_device_only_plan_skips_too_and_gives_the_same_answers(hf_fixture):
    cfg, weights, graph, inputs = decode_step(MIXTRAL, hf_fixture, batch=2)
    tg, _, on_host, mg = placed_plan(cfg, graph, "kv", share=4)
    inputs = inputs_for(mg, inputs)
    assert any(n.guard is not None and not n.on_host for n in mg.nodes if n.kind == "apply")
    want = reference.evaluate(graph, inputs, weights)
    assert_close(run(mg, inputs, weights, order=2), want)
    assert_close(run_streams(mg, inputs, weights, "threads").outputs, want)


@pytest.fixture
def fake_cupy(monkeypatch, tmp_path_factory):
    yield from installed(monkeypatch, tmp_path_factory)


def test_cupy_backend_skips_unchosen_experts_and_never_captures(fake_cupy, hf_fixture,
                                                                monkeypatch):
    cfg, weights, graph, inputs = decode_step(MIXTRAL, hf_fixture, batch=1)
    tg, _, _, mg = placed_plan(cfg, graph, "kv", share=4)
    inputs = inputs_for(mg, inputs)
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
    assert_close(run_streams(mg, inputs, weights, backend).outputs, want)
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


# ------------------------------------------------------------------ guarded reloads

@pytest.fixture(scope="module")
def streamed_experts(request):
    """Mixtral decode at B=1 with every block on the device side at a quarter of the weights:
    the experts stream, each reloaded only where the router chose it."""
    hf = request.getfixturevalue("hf_fixture")
    cfg, weights, graph, inputs = decode_step(MIXTRAL, hf, batch=1)
    tg, _, _, mg = placed_plan(cfg, graph, "kv", share=4)
    inputs = inputs_for(mg, inputs)
    return cfg, weights, graph, inputs, tg, mg, reference.evaluate(graph, inputs, weights)


def _guarded_reloads(mg):
    return [n for n in mg.nodes if n.kind == "reload" and n.guard is not None]


def test_an_expert_streams_only_where_its_router_chose_it(streamed_experts):
    """Each expert weight block's reload carries its readers' guard and waits for the router
    that writes it; the other reloads stay plain."""
    cfg, weights, graph, inputs, tg, mg, want = streamed_experts
    guarded = _guarded_reloads(mg)
    assert guarded and len(guarded) < mg.count("reload")
    writer = {}
    for n in mg.nodes:
        if n.kind == "apply":
            writer[(n.write.tensor, n.write.offset)] = n.id
        if n.kind == "reload" and n.guard is not None:
            g = n.guard
            assert ".experts." in mg.tensors[n.tensor].name
            assert writer[(g.access.tensor, g.access.offset)] in n.deps  # the router ran first
            assert g.share == pytest.approx(cfg.experts_per_token / cfg.experts)
            readers = [a for a in mg.nodes if a.kind == "apply"
                       and any(r.tensor == n.tensor for r in a.reads)]
            assert readers and all(a.guard is not None and a.guard.index == g.index
                                   and a.reads[-1].tensor == g.access.tensor for a in readers)
    assert validate(mg)
    text = "\n".join(mg.around(guarded[0].id).splitlines())
    assert f" if %t{guarded[0].guard.access.tensor}@" in text


def test_skipped_reloads_give_the_reference_in_any_order(streamed_experts):
    """The NumPy executor poisons what a skipped reload leaves (NaN in every float dtype):
    the answers hold only because no apply reads it."""
    *_, inputs, tg, mg, want = streamed_experts
    weights = streamed_experts[1]
    for order in ("sequential", 3, 11):
        assert_close(run(mg, inputs, weights, order=order, poison_freed=True), want)


@pytest.mark.parametrize("seed", [0, 1])
def test_threads_backend_moves_only_the_chosen_experts(streamed_experts, seed):
    cfg, weights, graph, inputs, tg, mg, want = streamed_experts
    got = run_streams(mg, inputs, weights, Delayed(ThreadsBackend(poison=True), seed, 2e-3))
    assert_close(got.outputs, want)
    spans = {s.node: s.nbytes for s in got.measured.spans if s.queue == "h2d"}
    guarded = _guarded_reloads(mg)
    moved = [n for n in guarded if spans[n.id]]
    skipped = [n for n in guarded if not spans[n.id]]
    # one token: each layer's router picks experts_per_token of its experts
    assert moved and skipped
    assert len({n.guard.index for n in moved if n.guard.access.tensor
                == moved[0].guard.access.tensor}) == cfg.experts_per_token
    plain = sum(mg.tensors[n.tensor].bytes for n in mg.nodes
                if n.kind == "reload" and n.guard is None)
    assert got.measured.bytes("h2d") == plain + sum(mg.tensors[n.tensor].bytes for n in moved)


def test_cupy_backend_reads_the_guard_on_its_copy_stream(fake_cupy, streamed_experts,
                                                         monkeypatch):
    cfg, weights, graph, inputs, tg, mg, want = streamed_experts
    asked = []
    inner = CupyBackend.guard_on

    def recording(self, n):
        on = inner(self, n)
        asked.append((n.id, on))
        return on
    monkeypatch.setattr(CupyBackend, "guard_on", recording)
    backend = CupyBackend()
    assert_close(run_streams(mg, inputs, weights, backend).outputs, want)
    assert sorted(k for k, _ in asked) == sorted(n.id for n in _guarded_reloads(mg))
    assert any(on for _, on in asked) and not all(on for _, on in asked)


def test_a_guarded_reload_is_priced_at_its_share(streamed_experts):
    from einpage.predict.simulator import min_h2d_bytes, node_seconds
    *_, mg, _ = streamed_experts
    profile = get_device("h100-pcie")
    seconds = node_seconds(mg, profile)
    plain_mg = dataclasses.replace(mg, nodes=tuple(
        dataclasses.replace(n, guard=None) if n.kind == "reload" else n for n in mg.nodes))
    full = node_seconds(plain_mg, profile)
    for n in _guarded_reloads(mg):
        nbytes = mg.tensors[n.tensor].bytes
        assert full[n.id] == pytest.approx(nbytes / profile.h2d_bandwidth + profile.copy_latency)
        assert seconds[n.id] == pytest.approx(
            n.guard.share * nbytes / profile.h2d_bandwidth + profile.copy_latency)
    expected = sum(mg.tensors[n.tensor].bytes * (n.guard.share if n.guard else 1)
                   for n in mg.nodes if n.kind == "reload")
    assert min_h2d_bytes(mg) <= round(expected) < min_h2d_bytes(plain_mg)


def _with_node(mg, k, node):
    nodes = list(mg.nodes)
    nodes[k] = node
    return dataclasses.replace(mg, nodes=tuple(nodes))


def test_the_validator_refuses_broken_guarded_reloads(streamed_experts):
    """Rule 11: each mutation below computes a wrong answer in some order, and is refused."""
    *_, tg, mg, _ = streamed_experts
    r = _guarded_reloads(mg)[0]
    g = r.guard
    cases = {
        # another element than its readers' guard: a chosen expert's weights left garbage
        "reloaded only where element": dataclasses.replace(r, guard=dataclasses.replace(
            g, index=(g.index + 1) % 4)),
        "share": dataclasses.replace(r, guard=dataclasses.replace(g, share=g.share / 2)),
        # the router's output not yet written when the guard is read
        "writer .* is not an ancestor": dataclasses.replace(
            r, deps=tuple(d for d in r.deps if not (
                mg.nodes[d].kind == "apply" and mg.nodes[d].write.tensor == g.access.tensor))),
        "not live|its live instance is at": dataclasses.replace(r, guard=dataclasses.replace(
            g, access=dataclasses.replace(g.access, offset=g.access.offset + 256))),
        "element 1000000": dataclasses.replace(r, guard=dataclasses.replace(g, index=10 ** 6)),
    }
    for message, node in cases.items():
        with pytest.raises(PlanError, match=message):
            validate(_with_node(mg, r.id, node))
    # an offload of what a guarded reload made would copy garbage to the host
    reader = next(n for n in mg.nodes if n.kind == "apply" and n.id > r.id
                  and any(a.tensor == r.tensor for a in n.reads))
    nodes = list(mg.nodes)
    spill = OffloadNode(reader.id, r.tensor, r.offset, (r.id,))
    nodes.insert(reader.id, spill)
    renumbered = [dataclasses.replace(n, id=k, deps=tuple(d + (d >= reader.id) for d in n.deps))
                  if k > reader.id else n for k, n in enumerate(nodes)]
    with pytest.raises(PlanError, match="reloaded under a guard"):
        validate(dataclasses.replace(mg, nodes=tuple(renumbered)))
    # a reader that drops its guard would read garbage where the copy was skipped
    k = reader.id
    with pytest.raises(PlanError):
        validate(_with_node(mg, k, reader.unguarded()))


def test_guarded_reloads_round_trip_and_need_version_2(streamed_experts):
    *_, mg, _ = streamed_experts
    data = json.loads(json.dumps(mg.to_json()))
    node = next(d for d in data["nodes"] if "guard" in d)
    assert set(node["guard"]) == {"tensor", "offset", "index", "share"}
    again = MemGraph.from_json(data)
    assert _guarded_reloads(again) == _guarded_reloads(mg)
    validate(again)
    for key, value in (("share", 1.5), ("offset", 256.5), ("tensor", "3"), ("index", None)):
        bad = json.loads(json.dumps(data))
        next(d for d in bad["nodes"] if "guard" in d)["guard"][key] = value
        with pytest.raises((PlanError, ValueError, TypeError)):
            MemGraph.from_json(bad)
    with pytest.raises(PlanError, match="version 2"):
        dataclasses.replace(mg, graph=None).to_json()


def test_no_reload_is_guarded_where_most_experts_run(hf_fixture):
    """Prefill (every token picks its experts: each expert runs in nearly every pass) keeps
    its prefetches: a guarded reload could not start before its layer's router."""
    cfg, weights = resolve(str(hf_fixture(MIXTRAL)))
    graph = llama.prefill_graph(cfg).bind(B=1, S=16)
    tg = partition(graph, PartitionOptions(cfg.weight_bytes() // 32))
    from einpage.compiler.lower_options import GUARDED_RELOAD_SHARE, LowerOptions
    from einpage.compiler.lowering import lower
    from einpage.compiler.order import memory_aware_order
    from einpage.compiler.policies import get_policy
    from einpage.ir.taskgraph import reload_guards
    shares = {key[2] for key in reload_guards(tg).values()}
    assert shares and min(shares) > GUARDED_RELOAD_SHARE
    mg = lower(tg, memory_aware_order(tg), LowerOptions(cfg.weight_bytes() // 4,
                                                        get_policy("reuse-distance")))
    assert mg.count("reload") and not _guarded_reloads(mg)


def test_the_report_counts_the_guarded_reloads(streamed_experts):
    from einpage.cli.report import report_lines
    from einpage.compiler.report import PlanReport
    from einpage.predict import simulate
    *_, mg, _ = streamed_experts
    report = PlanReport.of_plan(mg, validate(mg), simulate(mg, get_device("h100-pcie")))
    guarded = _guarded_reloads(mg)
    raw = sum(mg.tensors[n.tensor].bytes for n in guarded)
    r = report.routing
    assert (r.reloads, r.reload_bytes) == (len(guarded), raw)
    assert r.expected_reload_bytes == round(sum(mg.tensors[n.tensor].bytes * n.guard.share
                                                for n in guarded)) < raw
    line = next(x for x in report_lines(report) if "routing:" in x)
    assert f"{len(guarded)} reloads" in line and "only when it is picked" in line
    data = report.to_json()
    assert data["guarded_reloads"] == len(guarded) and data["guarded_reload_bytes"] == raw


def test_a_plan_with_a_guarded_reload_is_never_captured(fake_cupy):
    from types import SimpleNamespace
    from einpage.ir.memgraph import Access, ReloadGuard, ReloadNode
    backend = CupyBackend()
    guard = ReloadGuard(Access(1, 0), 0, 0.25)
    backend.mg = SimpleNamespace(nodes=[ReloadNode(0, 0, 256, (), None, guard)])
    assert not backend.can_capture()
    backend.mg = SimpleNamespace(nodes=[ReloadNode(0, 0, 256, ())])
    assert backend.can_capture()


def test_the_room_search_bounds_a_step_by_its_expected_bytes(streamed_experts):
    """The search's per-set bound prices a guarded expert at its share, as the simulator does
    (at full bytes it exceeded plans that exist and stopped the search early)."""
    from einpage.compiler.lower_options import GUARDED_RELOAD_SHARE
    from einpage.compiler.resident import streamed_bytes
    from einpage.ir.taskgraph import reload_guards
    *_, tg, mg, _ = streamed_experts
    guarded = reload_guards(tg, GUARDED_RELOAD_SHARE)
    raw = sum(tg.blocks[b].bytes for b in guarded)
    expected = sum(tg.blocks[b].bytes * key[2] for b, key in guarded.items())
    shares = {b: key[2] for b, key in guarded.items()}
    assert streamed_bytes(tg) - streamed_bytes(tg, shares=shares) \
        == pytest.approx(raw - expected, abs=1)
