"""Applies placed on the host (issue "The host computes too", first step): the placement, plans
that run host applies in version 2, the validator's rule 10 refusing what breaks them, every
runtime giving the dense reference's answers for such plans, the host pool, the host cost model
and the planner choosing a placement only where the simulated pass is faster."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from fake_cupy import installed
from test_cli import assert_one_line_error, cli

from einpage.compiler import CompileOptions, compile_graph
from einpage.compiler.lower_options import LowerOptions
from einpage.compiler.lowering import lower
from einpage.compiler.order import memory_aware_order
from einpage.compiler.partitioner import PartitionOptions, partition
from einpage.compiler.placement import host_blocks, place_on_host
from einpage.compiler.policies import get_policy
from einpage.errors import InputError, PlanError
from einpage.ir import MemGraph, validate
from einpage.ir.dtypes import DType
from einpage.ir.memgraph import ApplyNode, OffloadNode, ReloadNode
from einpage.ir.ops import EinsumOp, GatherOp
from einpage.ir.spec import EinsumSpec
from einpage.models import llama, resolve
from einpage.predict.cost import host_apply_seconds
from einpage.predict.devices import get_device
from einpage.predict.hosts import HOSTS, HostProfile, get_host, load_host_file
from einpage.runtime import hostpool, kernels, reference, run
from einpage.runtime.backends.cuda import CupyBackend
from einpage.runtime.backends.inject import Delayed
from einpage.runtime.backends.threads import ThreadsBackend
from einpage.runtime.stream_executor import run_streams
from einpage.ir import scalar

MIXTRAL = "tiny-mixtral"


def _decode(model: str, hf_fixture=None, batch: int = 2, capacity: int = 64):
    if hf_fixture is not None:
        cfg, weights = resolve(str(hf_fixture(model)))
    else:
        cfg, weights = resolve(model, random_weights=True, seed=1)
    graph = llama.decode_graph(cfg).bind(B=batch, C=capacity)
    rng = np.random.default_rng(0)
    inputs = {"tokens": rng.integers(0, cfg.vocab, (batch, 1)),
              "pos": rng.integers(1, capacity - 1, batch)}
    return cfg, weights, graph, inputs


def _placed(cfg, graph, kind: str, share: int = 3):
    budget = cfg.weight_bytes() // share
    tg = partition(graph, PartitionOptions(budget // 8))
    order = memory_aware_order(tg)
    kept = host_blocks(tg, kind)
    on_host = place_on_host(tg, order, kept)
    mg = lower(tg, order, LowerOptions(budget, get_policy("reuse-distance"),
                                       outputs_to_host=True, on_host=on_host))
    return tg, kept, on_host, mg


def _inputs_for(mg, inputs):
    rng = np.random.default_rng(7)
    out = dict(inputs)
    for t in mg.inputs:
        if t.role == "cache":
            out[t.name] = rng.standard_normal(t.shape).astype(t.dtype.numpy)
    return out


def _close(got, want):
    assert set(got) == set(want)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], atol=1e-4, rtol=1e-5, err_msg=key)


@pytest.fixture(scope="module")
def llama_placed():
    cfg, weights, graph, inputs = _decode("tiny")
    tg, kept, on_host, mg = _placed(cfg, graph, "kv")
    inputs = _inputs_for(mg, inputs)
    return graph, weights, inputs, tg, kept, on_host, mg, reference.evaluate(graph, inputs,
                                                                            weights)


# ------------------------------------------------------------------ placement

def test_placement_keeps_every_writer_of_a_block_in_one_place(llama_placed):
    _, _, _, tg, kept, on_host, _, _ = llama_placed
    assert kept and all(tg.blocks[b].role == "cache" for b in kept)
    assert all(t.id in on_host for t in tg.tasks if any(b in kept for b in t.reads))
    for ws in tg.writers:
        assert len({w in on_host for w in ws}) <= 1
    # the projections by device weights stay on the device
    assert not any(tg.tasks[t].reads and any(tg.blocks[b].role == "weight"
                                               for b in tg.tasks[t].reads) for t in on_host)
    order = memory_aware_order(tg)
    assert place_on_host(tg, order, kept) == on_host  # deterministic
    assert place_on_host(tg, order, frozenset()) == frozenset()


# ------------------------------------------------------------------ plans and their runs

def test_a_placed_plan_is_valid_and_round_trips_version_2(llama_placed):
    *_, mg, _ = llama_placed
    report = validate(mg)
    assert report.proven and report.host_applies == sum(
        1 for n in mg.nodes if isinstance(n, ApplyNode) and n.on_host) > 0
    data = mg.to_json()
    assert data["version"] == 2
    host = [n for n in data["nodes"] if n.get("on") == "host"]
    assert host and all(a["offset"] is None for n in host for a in (*n["reads"], n["write"]))
    again = MemGraph.from_json(json.loads(json.dumps(data)))
    shape = lambda g: [(n.kind, getattr(n, "on", None), n.deps) for n in g.nodes]  # noqa: E731
    assert shape(again) == shape(mg)
    validate(again)
    assert " on host " in str(mg)


@pytest.mark.parametrize("order", ["sequential", 1, 2, 3])
def test_numpy_executor_gives_the_reference_in_any_order(llama_placed, order):
    _, weights, inputs, *_, mg, want = llama_placed
    _close(run(mg, inputs, weights, order=order), want)


@pytest.mark.parametrize("seed", [0, 1])
def test_threads_backend_gives_the_reference_with_random_delays(llama_placed, seed):
    _, weights, inputs, *_, mg, want = llama_placed
    got = run_streams(mg, inputs, weights, Delayed(ThreadsBackend(poison=True), seed, 2e-3))
    _close(got.outputs, want)
    assert any(s.queue == "host" for s in got.measured.spans)
    back = [s for s in got.measured.spans if s.queue == "h2d_host"]
    assert back and all(s.nbytes > 0 for s in back)
    assert got.measured.bytes("h2d") == sum(s.nbytes for s in got.measured.spans
                                            if s.queue in ("h2d", "h2d_host"))


def test_a_host_apply_s_block_comes_back_on_a_copy_queue_of_its_own(llama_placed):
    """A reload of a block an apply on the host wrote runs on `h2d_host`, every other copy to
    the device on `h2d`; the stream program orders every edge with it (`check_program`), and
    refuses one that puts such a reload on `h2d`; a fault there stops the pass with the error."""
    from einpage.runtime.backends.inject import Faulty, InjectedFault
    from einpage.runtime.streams import Step, check_program, compile_streams, queues_of
    _, weights, inputs, *_, mg, _ = llama_placed
    written = {n.write.tensor for n in mg.nodes if isinstance(n, ApplyNode) and n.on_host}
    queues = queues_of(mg)
    back = [n.id for n in mg.nodes if queues[n.id] == "h2d_host"]
    assert back and back == [n.id for n in mg.nodes
                             if isinstance(n, ReloadNode) and n.tensor in written]
    assert any(q == "h2d" for q in queues)
    program = compile_streams(mg)
    check_program(mg, program)
    assert any(s.queue == "h2d_host" and s.waits for s in program.steps)  # after its host apply
    wrong = dataclasses.replace(program, steps=tuple(
        Step(s.node, "h2d", s.waits) if s.node == back[0] else s for s in program.steps))
    with pytest.raises(PlanError, match="expected h2d_host"):
        check_program(mg, wrong)
    with pytest.raises(Exception) as caught:
        run_streams(mg, inputs, weights, Faulty(ThreadsBackend(), "h2d_host", 1))
    assert isinstance(caught.value, InjectedFault) or isinstance(caught.value.__cause__,
                                                                 InjectedFault)


def test_a_host_apply_s_block_waits_for_no_prefetch_but_shares_the_link(llama_placed):
    """Simulated, a reload of a block the host wrote starts once its deps are done and the
    `h2d_host` queue is free, whatever the h2d queue has in flight; the link carries both
    queues' bytes: the h2d queue's next copy starts no earlier than the link's time allows."""
    from einpage.predict.simulator import node_seconds, simulate
    *_, mg, _ = llama_placed
    profile = get_device("h100-pcie")
    seconds = node_seconds(mg, profile)
    sim = simulate(mg, profile, seconds)
    back = [n for n in mg.nodes if sim.engine[n.id] == "h2d_host"]
    assert back
    free = 0.0
    for n in back:  # in plan order on their own queue: each at its deps' end or the queue's
        assert sim.start[n.id] == pytest.approx(max([free, *(sim.end[d] for d in n.deps)]))
        free = sim.end[n.id]
    copies = [n.id for n in mg.nodes if sim.engine[n.id] in ("h2d", "h2d_host")]
    assert sim.h2d_s == pytest.approx(sum(seconds[k] for k in copies))
    # the link's bytes: from the first copy to the last, both queues' time fits
    first = min(sim.start[k] for k in copies)
    last = max(sim.end[k] for k in copies)
    assert last - first >= sim.h2d_s * (1 - 1e-9)


@pytest.mark.parametrize("kind", ["experts", "kv+experts"])
def test_mixtral_experts_on_the_host(hf_fixture, kind):
    cfg, weights, graph, inputs = _decode(MIXTRAL, hf_fixture)
    tg, kept, on_host, mg = _placed(cfg, graph, kind)
    assert any(".experts." in tg.blocks[b].source.input for b in kept) and on_host
    inputs = _inputs_for(mg, inputs)
    want = reference.evaluate(graph, inputs, weights)
    for order in ("sequential", 5):
        _close(run(mg, inputs, weights, order=order), want)
    _close(run_streams(mg, inputs, weights, "threads").outputs, want)


@pytest.fixture
def fake_cupy(monkeypatch, tmp_path_factory):
    yield from installed(monkeypatch, tmp_path_factory)


def test_cupy_backend_runs_host_applies_beside_its_streams(fake_cupy, llama_placed):
    _, weights, inputs, *_, mg, want = llama_placed
    backend = CupyBackend()
    backend.mg = mg  # what `open` sets: a pass with host applies is not captured
    assert not backend.can_capture()
    runtime = fake_cupy.cuda.runtime
    streams = []  # the stream of every copy to the device
    copy = runtime.memcpyAsync

    def recorded(dst, src, size, kind, stream):
        if kind == runtime.memcpyHostToDevice:
            streams.append(stream)
        return copy(dst, src, size, kind, stream)

    runtime.memcpyAsync = recorded
    try:
        _close(run_streams(mg, inputs, weights, backend).outputs, want)
    finally:
        runtime.memcpyAsync = copy
    assert len(set(streams)) == 2  # the h2d stream, and h2d_host's for the host's blocks


# ------------------------------------------------------------------ the validator's rule 10

def _mutant(mg, node_id: int, drop: int) -> MemGraph:
    nodes = list(mg.nodes)
    n = nodes[node_id]
    nodes[node_id] = dataclasses.replace(n, deps=tuple(d for d in n.deps if d != drop))
    return dataclasses.replace(mg, nodes=tuple(nodes))


def test_a_host_read_without_its_host_copy_is_refused(llama_placed):
    *_, mg, _ = llama_placed
    for n in mg.nodes:
        if isinstance(n, ApplyNode) and n.on_host:
            made = [d for d in n.deps if isinstance(mg.nodes[d], OffloadNode)]
            if made:
                broken = _mutant(mg, n.id, made[0])
                with pytest.raises(PlanError, match="reads on the host .* no host copy|"
                                                    "is not an ancestor"):
                    validate(broken)
                return
    pytest.fail("no host apply reads an offloaded block")


def test_a_reload_before_the_host_write_is_refused(llama_placed):
    *_, mg, _ = llama_placed
    for n in mg.nodes:
        if isinstance(n, ReloadNode):
            writers = [d for d in n.deps if isinstance(mg.nodes[d], ApplyNode)
                       and mg.nodes[d].on_host]
            if writers:
                with pytest.raises(PlanError, match="no host copy of it .* is an ancestor"):
                    validate(_mutant(mg, n.id, writers[0]))
                return
    pytest.fail("no reload reads a host apply's write")


def test_a_host_write_over_a_live_device_instance_is_refused(llama_placed):
    *_, mg, _ = llama_placed
    n = next(n for n in mg.nodes if isinstance(n, ApplyNode) and not n.on_host
             and not n.accumulate)
    # right after the device apply that created its write's instance, a host apply writes the
    # same tensor (reading nothing, so that only the write can break a rule)
    host = dataclasses.replace(n, id=n.id + 1, on="host", reads=(),
                               write=dataclasses.replace(n.write, offset=None), deps=(n.id,))
    broken = dataclasses.replace(mg, nodes=(*mg.nodes[:n.id + 1], host), outputs=(),
                                 graph=None)
    with pytest.raises(PlanError, match="on the host while it has a live device instance"):
        validate(broken)


# ------------------------------------------------------------------ the host pool

def test_the_pool_cuts_a_contraction_and_gives_the_same_numbers(monkeypatch):
    monkeypatch.setattr(hostpool, "MIN_POOLED_BYTES", 0)
    monkeypatch.setattr(hostpool, "workers", lambda: 3)
    spec = EinsumSpec.parse("bsnguj,btnuj->bngst")
    op = EinsumOp(spec, scalar.x(0) * scalar.x(1) * 0.125, "sum", DType.f32)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 1, 4, 2, 2, 8)).astype(np.float16)
    k = rng.standard_normal((2, 7, 4, 2, 8)).astype(np.float16)
    assert hostpool.split_axis(op, [q.shape, k.shape]) == "n"  # cuts both operands
    want = kernels.einsum(spec, op.join, "sum", [q, k], np.dtype(np.float32))
    out = np.empty(want.shape, np.float32)
    assert hostpool.pooled_einsum(op, [q, k], out, accumulate=False)
    np.testing.assert_array_equal(out, want)
    assert hostpool.pooled_einsum(op, [q, k], out, accumulate=True)
    np.testing.assert_allclose(out, 2 * want, rtol=1e-6)


# ------------------------------------------------------------------ cost and planning

def test_host_attention_costs_the_kernels_rate_or_without_them_numpys_cast():
    host = get_host("server-16c")

    class R:
        def __init__(self, shape, dtype, storage=None):
            self.shape, self.dtype, self.storage = shape, dtype, storage
            self.bytes = int(np.prod(shape)) * dtype.itemsize

    spec = EinsumSpec.parse("bsnguj,btnuj->bngst")
    op = EinsumOp(spec, scalar.x(0) * scalar.x(1), "sum", DType.f32)
    q, k = R((16, 1, 32, 1, 2, 64), DType.f16), R((16, 4096, 32, 2, 64), DType.f16)
    out = R((16, 32, 1, 1, 4096), DType.f32)
    # the kernels read the f16 KV block as it lies, two query rows (g) per (b, n): bound by
    # their rate on every core or by the memory, whichever is slower
    rows = 2
    through = np.prod(k.shape) / host.stored_rate * (1 + (rows - 1) / 8) / host.cores
    memory = (q.bytes + k.bytes) / host.memory_bandwidth
    s = host_apply_seconds(host, op, [q, k], out, False)
    assert s == pytest.approx(max(through, memory) + host.apply_overhead, rel=1e-6)
    numpy = dataclasses.replace(host, kernels=False)
    slow = host_apply_seconds(numpy, op, [q, k], out, False)
    cast = (np.prod(q.shape) + np.prod(k.shape)) / (host.convert_rate * host.cores)
    assert slow == pytest.approx(cast + host.apply_overhead, rel=1e-6)
    wide = [R(q.shape, DType.f32), R(k.shape, DType.f32)]
    assert host_apply_seconds(numpy, op, wide, out, False) < slow  # memory-bound instead


#: a host that computes anything at once (a placement then pays wherever it moves work)
_FAST_HOST = HostProfile("fast", 1e15, 1e15, 1e15, 1e15, 64, convert_rate=1e15,
                         dequant_rate=1e15, apply_overhead=5e-6)


def _profile(host: HostProfile):
    return dataclasses.replace(get_device("h100-pcie"), host=host)


def test_the_planner_places_on_the_host_only_where_it_is_faster():
    cfg, weights, graph, inputs = _decode("tiny", capacity=256)
    budget = cfg.weight_bytes() // 3
    fast = HostProfile("fast", 1e15, 1e15, 1e15, 1e15, 64, convert_rate=1e15, dequant_rate=1e15,
                       apply_overhead=0.0)
    slow = dataclasses.replace(fast, name="slow", matmul_flops=1e6, vector_flops=1e6,
                               convert_rate=1e3, stored_rate=1e3, packed_rate=1e3,
                               apply_overhead=1.0)
    placed = compile_graph(graph, CompileOptions(budget, device=_profile(fast),
                                                 host_compute=True))
    device = compile_graph(graph, CompileOptions(budget, device=_profile(fast),
                                                 host_compute=False, host_gather=False))
    never = compile_graph(graph, CompileOptions(budget, device=_profile(slow),
                                                host_compute=True))
    host_applies = lambda c: sum(1 for n in c.memgraph.nodes  # noqa: E731
                                 if isinstance(n, ApplyNode) and n.on_host)
    assert host_applies(placed) > 0 and host_applies(device) == host_applies(never) == 0
    assert placed.simulation.makespan_s < device.simulation.makespan_s
    assert placed.simulation.host_s > 0 and placed.report.efficiency <= 1.0 + 1e-9
    inputs = _inputs_for(placed.memgraph, inputs)
    _close(run(placed.memgraph, inputs, weights, order=4),
           reference.evaluate(graph, inputs, weights))


def test_the_winning_placement_is_lowered_by_stamp_too(monkeypatch):
    """The placement that wins is lowered again with every block placed where bytes were freed
    longest ago (`search.stamped_trials` on its own trials, whose base runs its host tasks),
    and the faster plan of the two is kept."""
    from einpage.compiler import search
    cfg, _, graph, _ = _decode("tiny", capacity=256)
    lowered = []
    real = search.lower
    monkeypatch.setattr(search, "lower", lambda tg, order, opts: lowered.append(
        (opts.on_host, opts.pack_low)) or real(tg, order, opts))
    fast = dataclasses.replace(_FAST_HOST, apply_overhead=0.0)
    placed = compile_graph(graph, CompileOptions(cfg.weight_bytes() // 3, device=_profile(fast),
                                                 host_compute=True, validate=False))
    on_host = frozenset(n.task for n in placed.memgraph.nodes  # (the placement's; not the
                        if isinstance(n, ApplyNode) and n.on_host  # partition's gathers)
                        and n.task not in placed.taskgraph.host_tasks)
    assert on_host and (on_host, False) in lowered and (on_host, True) in lowered


def test_the_critical_path_is_the_longest_chain_and_no_pass_beats_it(llama_placed):
    """Two branches from one input, joined by a third task, each task in a chain after the
    writers of what it reads: the longest chain is the longer branch plus the join. On a
    placed decode step (host attention between device projections, layer by layer) the
    simulated pass is no shorter than its longest chain."""
    from einpage.compiler.placement import critical_path
    from einpage.ir import GraphBuilder
    from einpage.predict.cost import task_seconds
    from einpage.predict.simulator import simulate
    g = GraphBuilder()
    x = g.input("x", (4, 4))
    a = g.einsum("ab->ab", x)
    b = g.einsum("ab,bc->ac", g.einsum("ab->ab", x), x)
    g.output("y", g.einsum("ab,ab->ab", a, b))
    tg = partition(g.build(), PartitionOptions(1 << 20))
    order = memory_aware_order(tg)
    seconds = [1.0, 2.0, 0.5, 3.0]  # a, the copy of x, its product, the join
    assert [tg.tasks[t].node for t in range(4)] == [a.id, b.id - 1, b.id, b.id + 1]
    assert critical_path(tg, order, seconds) == 2.0 + 0.5 + 3.0
    # a contraction cut in two: the second partial sum adds to the first's block after it
    g = GraphBuilder()
    g.output("y", g.einsum("ab,bc->ac", g.input("x", (4, 64)), g.input("w", (64, 4))))
    tg = partition(g.build(), PartitionOptions(1 << 20, cuts={2: {"b": 2}}))
    assert [t.accumulate for t in tg.tasks] == [False, True]
    assert critical_path(tg, memory_aware_order(tg), [1.0, 2.0]) == 3.0
    _, _, _, tg, _, on_host, mg, _ = llama_placed
    profile = get_device("h100-pcie")
    seconds = task_seconds(profile, tg, on_host)
    chain = critical_path(tg, memory_aware_order(tg), seconds)
    # longer than the device's compute: host attention lies on the chain between projections
    assert chain > sum(s for t, s in enumerate(seconds) if t not in on_host)
    assert simulate(mg, profile).makespan_s >= chain


def _toy_taskgraph(deps: list[list[int]], host: set[int]):
    """A taskgraph-shaped record: task t writes block t and reads the blocks of `deps[t]`."""
    from types import SimpleNamespace
    tasks = tuple(SimpleNamespace(id=t, reads=tuple(d), write=t) for t, d in enumerate(deps))
    return SimpleNamespace(tasks=tasks, writers=tuple((t,) for t in range(len(deps))),
                           host_tasks=frozenset()), frozenset(host)


def _best_schedule(deps: list[list[int]], host: set[int], seconds: list[float]) -> float:
    """The least makespan over every order of each queue (the host's tasks one at a time, the
    device's one at a time), each task starting once its deps and its queue's previous task
    are done."""
    from itertools import permutations
    on_host = [t for t in range(len(deps)) if t in host]
    device = [t for t in range(len(deps)) if t not in host]
    best = float("inf")
    for h in permutations(on_host):
        for d in permutations(device):
            prev = {t: q[k - 1] for q in (h, d) for k, t in enumerate(q) if k}
            end: dict[int, float] = {}
            left = list(range(len(deps)))
            while left:  # (any ready task: the orders fix the rest)
                ready = [t for t in left if all(x in end for x in deps[t])
                         and (t not in prev or prev[t] in end)]
                if not ready:
                    break  # the two orders deadlock each other
                for t in ready:
                    start = max([0.0, *(end[x] for x in deps[t]),
                                 *([end[prev[t]]] if t in prev else [])])
                    end[t] = start + seconds[t]
                    left.remove(t)
            if not left:
                best = min(best, max(end.values()))
    return best


def test_the_host_and_the_device_tasks_between_it_bound_every_schedule():
    """`separated_seconds`: the host's tasks plus the device tasks that every host task comes
    before or after, each queue running one task at a time. An alternating chain takes exactly
    that; on random graphs (every order of both queues tried) no schedule is shorter."""
    from einpage.compiler.placement import separated_seconds
    # host 0 -> device 1 -> host 2 -> device 3, and device 4 beside host 0: 4 does not separate
    deps = [[], [0], [1], [2], []]
    tg, host = _toy_taskgraph(deps, {0, 2})
    seconds = [1.0, 2.0, 3.0, 0.5, 1.0]
    assert separated_seconds(tg, host, seconds) == 1.0 + 2.0 + 3.0 + 0.5
    assert _best_schedule(deps, host, seconds) == 6.5  # 4 runs beside 0
    assert separated_seconds(tg, frozenset(), seconds) == 0.0
    rng = np.random.default_rng(5)
    tight = 0
    for _ in range(150):
        n = int(rng.integers(2, 8))
        deps = [sorted({int(x) for x in rng.integers(0, t, int(rng.integers(0, 3)))}) if t
                else [] for t in range(n)]
        host = {t for t in range(n) if rng.random() < 0.5}
        seconds = [float(x) for x in rng.integers(1, 5, n)]
        tg, hosted = _toy_taskgraph(deps, host)
        bound, best = separated_seconds(tg, hosted, seconds), _best_schedule(deps, host, seconds)
        assert bound <= best + 1e-12, (deps, host, seconds)
        tight += bound == best
    assert tight > 20  # not a bound that says nothing


def test_a_placed_pass_reports_the_device_tasks_between_the_host_s(llama_placed):
    """On a placed decode step the device tasks between the host's attention separate it: the
    bound is above the host's compute alone, and the simulated pass above the bound."""
    from einpage.compiler.placement import separated_seconds
    from einpage.predict.simulator import node_seconds, simulate
    _, _, _, tg, _, on_host, mg, _ = llama_placed
    profile = get_device("h100-pcie")
    durations = node_seconds(mg, profile)
    seconds = [0.0] * len(tg.tasks)
    for n in mg.nodes:
        if isinstance(n, ApplyNode):
            seconds[n.task] = durations[n.id]
    bound = separated_seconds(tg, on_host, seconds)
    assert bound > sum(seconds[t] for t in on_host)
    assert simulate(mg, profile, durations).makespan_s >= bound


@pytest.mark.parametrize("placed", [True, False])
def test_an_apply_takes_its_tasks_seconds_as_priced_for_the_search(llama_placed, placed):
    """The search prices each lowering's applies from the task seconds it knows (device, or
    host where placed) rather than pricing every apply again: the same durations."""
    from einpage.predict.cost import task_seconds
    from einpage.predict.simulator import node_seconds
    _, _, _, tg, _, on_host, mg, _ = llama_placed
    if not placed:
        on_host = frozenset()
        mg = lower(tg, memory_aware_order(tg), LowerOptions(mg.device_bytes,
                                                            get_policy("reuse-distance")))
    profile = get_device("h100-pcie")
    known = node_seconds(mg, profile, task_seconds(profile, tg, on_host))
    assert known == node_seconds(mg, profile)
    assert any(isinstance(n, ApplyNode) and n.on_host for n in mg.nodes) == placed


def test_placements_that_cannot_win_are_not_lowered(monkeypatch):
    """llama-7b's decode step of 8 rows over 768 at 16 GB runs 17.4 ms on the device alone.
    Every placement the planner weighs either streams more than that over the link or chains
    host attention and device projections for longer: none is lowered, and the plan is the
    device-only one."""
    from einpage.compiler import search
    from einpage.models.generation import decode_step_graph
    cfg, _ = resolve("llama-7b", random_weights=True)
    graph = decode_step_graph(cfg, 8, 768)
    placed = []
    real = search.lower
    monkeypatch.setattr(search, "lower",
                        lambda tg, order, opts: (opts.on_host and placed.append(opts.on_host))
                        or real(tg, order, opts))
    compiled = compile_graph(graph, CompileOptions(16 * 10**9, validate=False,
                                                   host_compute=True))
    assert not placed
    # (the host gathers the step's embedding rows: `compiler.host_gather`)
    assert all(isinstance(n.op, GatherOp) for n in compiled.memgraph.nodes
               if isinstance(n, ApplyNode) and n.on_host)
    assert compiled.simulation.makespan_s < 0.0175


def _cli_graph(line: str):
    from einpage.cli.main import build_parser
    from einpage.cli.plan import graph_from_args
    _, graph, sources, _, _ = graph_from_args(build_parser().parse_args(line.split()))
    return graph, sources


def test_a_placement_whose_first_room_does_not_fit_still_climbs():
    """llama-7b decode B=4 over 4096 rows at 3.4 GB: a placement's set at the device-only
    winner's room leaves the pass too little room; the shares beside it fit, and one of them
    is the plan (287.1 ms; dropping the placement gave 312.5 ms)."""
    graph, sources = _cli_graph("compile llama-7b --phase decode --batch 4 --past 4095 "
                                "--capacity 4096 --gpu-mem 3.4GB")
    compiled = compile_graph(graph, CompileOptions(int(3.4e9), sources=sources,
                                                   validate=False, host_compute=True))
    assert compiled.simulation.makespan_s < 0.290


def test_a_placement_the_floor_rules_out_still_seeds_its_refinement():
    """qwen2.5-72b decode B=16 over 2048 rows at 36 GB: a KV candidate (348 host tasks) runs
    2322 ms, beyond the climb's 3% of the best, so it is not lowered; refined twice (what its
    plan streams moved to the host too: 616, then 622 host tasks) it wins at 2221.6 ms
    (2225.0 ms where the unlowered candidate seeded nothing)."""
    graph, sources = _cli_graph("compile qwen2.5-72b --phase decode --batch 16 --past 2047 "
                                "--capacity 2048 --gpu-mem 36GB")
    compiled = compile_graph(graph, CompileOptions(36 * 10**9, sources=sources,
                                                   validate=False, host_compute=True))
    assert compiled.simulation.makespan_s < 2.2230


# ------------------------------------------------------------------ profiles and the CLI

def test_host_profiles_and_files(tmp_path):
    assert "server-16c" in HOSTS and get_host("server-16c").cores == 16
    with pytest.raises(InputError, match="unknown host 'nope'"):
        get_host("nope")
    path = tmp_path / "h.json"
    path.write_text(json.dumps(get_host("desktop-8c").to_json()))
    assert load_host_file(path) == get_host("desktop-8c")
    path.write_text(json.dumps({"name": "x", "matmul_flops": 1e12}))
    with pytest.raises(InputError, match="lacks"):
        load_host_file(path)
    bad = {**get_host("desktop-8c").to_json(), "cores": -1}
    path.write_text(json.dumps(bad))
    with pytest.raises(InputError, match="cores must be a positive number"):
        load_host_file(path)
    path.write_text(json.dumps({**get_host("desktop-8c").to_json(), "kernels": "yes"}))
    with pytest.raises(InputError, match="kernels must be true or false"):
        load_host_file(path)
    # a profile written before the kernels (no kernel rates) is priced by NumPy's paths
    old = {k: v for k, v in get_host("desktop-8c").to_json().items()
           if k not in ("kernels", "stored_rate", "packed_rate")}
    path.write_text(json.dumps(old))
    assert not load_host_file(path).kernels


def test_cli_host_flags(capsys, tmp_path):
    base = ("compile", "tiny", "--phase", "decode", "--past", "5", "--gpu-mem", "300KB",
            "--quiet", "--json")
    assert cli(*base, "--host", "server-64c", "--host-compute", "off") == 0
    capsys.readouterr()
    assert_one_line_error(capsys, cli(*base, "--host", "mainframe"), "unknown host 'mainframe'")
    (tmp_path / "h.json").write_text("{")
    assert_one_line_error(capsys, cli(*base, "--host-file", tmp_path / "h.json"),
                          "not a JSON host profile")
    assert cli("devices") == 0
    assert "server-16c" in capsys.readouterr().out


def test_a_host_budget_keeps_what_host_applies_read_in_host_memory(hf_fixture):
    """Under a host budget that sends weights to disk, the experts' weights the host computes
    on stay in host memory (a host apply reads no file), and they count against the budget."""
    from einpage.compiler.tiers import host_needs, place_tiers
    from einpage.predict.simulator import simulate
    cfg, weights, graph, inputs = _decode(MIXTRAL, hf_fixture)
    tg, kept, on_host, mg = _placed(cfg, graph, "experts")
    needs = host_needs(mg)
    kept_tensors = {t.id for t in mg.tensors if t.block in kept}
    assert not kept_tensors & set(needs.streamed)
    profile = get_device("h100-pcie")
    tiered = place_tiers(mg, simulate(mg, profile), needs.fixed_bytes + 64 * 4096, profile)
    validate(tiered.memgraph)
    disk = {n.tensor for n in tiered.memgraph.nodes if n.kind == "read"}
    assert disk and not disk & kept_tensors
    inputs = _inputs_for(mg, inputs)
    _close(run(tiered.memgraph, inputs, weights, order=2),
           reference.evaluate(graph, inputs, weights))


def test_the_planner_also_tries_hosting_only_what_the_device_streams(hf_fixture, monkeypatch):
    """Besides every expert (every KV block) on the host, each candidate is tried with only the
    blocks the best device-only plan streams: what it keeps resident is computed on the device
    (mixtral-8x7b decode at 24 GB with server-16c: 0.93 -> 0.72 s per step, bench/RESULTS.md).
    The planner keeps the fastest, and a placed plan still computes the reference."""
    from einpage.compiler import placement
    cfg, weights, graph, inputs = _decode(MIXTRAL, hf_fixture, batch=1)
    tried = []
    inner = placement.place_on_host

    def spy(tg, order, kept):
        experts = {b.id for b in tg.input_blocks
                   if b.source is not None and ".experts." in f".{b.source.input}"}
        tried.append((len(kept & experts), len(experts)))
        return inner(tg, order, kept)
    monkeypatch.setattr(placement, "place_on_host", spy)
    host = _FAST_HOST
    # at half the weights the device-only plan keeps some experts resident (at a third it
    # streams them all: an expert copied only when chosen costs a quarter of its bytes)
    compiled = compile_graph(graph, CompileOptions(cfg.weight_bytes() // 2,
                                                   device=_profile(host), host_compute=True))
    every = [k for k, n in tried if k == n]
    some = [k for k, n in tried if 0 < k < n]
    assert every and some  # all experts, and only the streamed ones
    inputs = _inputs_for(compiled.memgraph, inputs)
    _close(run(compiled.memgraph, inputs, weights, order=5),
           reference.evaluate(graph, inputs, weights))


def test_a_pass_bound_by_the_host_says_so():
    from einpage.cli.report import bound_sentence, report_lines
    cfg, weights, graph, inputs = _decode("tiny", capacity=256)
    compiled = compile_graph(graph, CompileOptions(cfg.weight_bytes() // 3, host_gather=False))
    sim = compiled.simulation
    busy = dataclasses.replace(sim, host_s=2 * sim.makespan_s + 1e-3)
    report = dataclasses.replace(compiled.report, simulation=busy)
    assert report.bound_by == "host"
    assert bound_sentence(report).startswith("host-bound: the host's CPU computes its applies")
    assert any(", host CPU " in line for line in report_lines(report))
    assert compiled.report.bound_by != "host"
    assert not any(", host CPU " in line for line in report_lines(compiled.report))


def test_groups_keep_blocks_that_add_into_one_block_together(llama_placed):
    """A KV store cut along the positions: the blocks of one head whose products add into the
    same output block form a group; shares take whole groups, spread over the layers."""
    from einpage.compiler import placement
    graph, weights, inputs, tg, kept, on_host, mg, want = llama_placed
    groups = placement.groups(tg, kept)
    assert frozenset().union(*groups) == kept and sum(map(len, groups)) == len(kept)
    for t in tg.tasks:  # two kept blocks one task reads, or whose readers write one block
        mine = [b for b in t.reads if b in kept]
        assert not mine or any(set(mine) <= g for g in groups)
    writes: dict[int, set[int]] = {}
    for t in tg.tasks:
        writes.setdefault(t.write, set()).update(b for b in t.reads if b in kept)
    for together in writes.values():
        assert not together or any(together <= g for g in groups)
    half = placement.share_of(tg, kept, 0.5)
    assert all(g <= half or not g & half for g in groups)  # whole groups
    assert 0.3 * len(groups) <= sum(1 for g in groups if g <= half) <= 0.7 * len(groups)
    # a share keeps every writer of a block in one place, as every placement does
    host = placement.place_on_host(tg, list(range(len(tg.tasks))), half)
    for b in {tg.tasks[t].write for t in host}:
        assert all(w in host for w in tg.writers[b])


def test_the_balanced_share_evens_the_host_against_the_link(llama_placed):
    from einpage.compiler import placement
    from einpage.predict.cost import task_seconds
    graph, weights, inputs, tg, kept, on_host, mg, want = llama_placed
    profile = _profile(get_host("server-16c"))
    seconds = task_seconds(profile, tg, on_host)
    host = sum(seconds[t] for t in on_host)
    nbytes = sum(tg.blocks[b].bytes for b in kept)
    # a link that copies them all in a third of the host's time: f = L / (H + L) = 1/4
    profile = dataclasses.replace(profile, h2d_bandwidth=3 * nbytes / host)
    link = nbytes / profile.h2d_bandwidth
    (f,) = placement.balanced_shares(tg, kept, on_host, seconds, profile)
    assert f == pytest.approx(link / (host + link), abs=1e-3) and f == pytest.approx(0.25,
                                                                                    abs=1e-3)
    assert placement.balanced_shares(tg, frozenset(), frozenset(), (), profile) == []
    # a host far slower than the link: no share worth a trial (none rounds to 0)
    slow = dataclasses.replace(profile, h2d_bandwidth=1e6 * nbytes / host)
    assert placement.balanced_shares(tg, kept, on_host, seconds, slow) == []
    # what the device-only plan keeps resident of them it may keep beside a placement too: the
    # balance then lies lower, between (L - Lr) / (H + L) and L / (H + L); both ends and the
    # middle are tried
    resident = frozenset(sorted(kept)[:len(kept) // 3])
    kept_link = sum(tg.blocks[b].bytes for b in resident) / profile.h2d_bandwidth
    low, mid, high = placement.balanced_shares(tg, kept, on_host, seconds, profile, resident)
    assert low == pytest.approx((link - kept_link) / (host + link), abs=1e-3) and low < high
    assert mid == pytest.approx((low + high) / 2, abs=2e-3) and high == f


def test_placement_refines_a_candidate_with_what_its_own_plan_streams(hf_fixture, monkeypatch):
    """After its candidates, the planner tries the best of each kind again with what that
    plan's own resident set leaves streaming moved to the host (mixtral-8x7b decode at 24 GB
    with server-16c: 0.244 -> 0.213 s per step, bench/RESULTS.md); a refined plan still
    computes the reference."""
    from einpage.compiler import placement
    cfg, weights, graph, inputs = _decode(MIXTRAL, hf_fixture, batch=1)
    refine = placement.streamed_groups
    refined = []

    def spy_refine(tg, kept, resident):
        refined.append(kept not in {placement.host_blocks(tg, k)
                                    for k in placement.KINDS})
        return refine(tg, kept, resident)
    monkeypatch.setattr(placement, "streamed_groups", spy_refine)
    host = _FAST_HOST
    compiled = compile_graph(graph, CompileOptions(cfg.weight_bytes() // 3,
                                                   device=_profile(host), host_compute=True))
    assert any(refined)  # asked what a placed plan streams of the rest: a refinement
    inputs = _inputs_for(compiled.memgraph, inputs)
    _close(run(compiled.memgraph, inputs, weights, order=2),
           reference.evaluate(graph, inputs, weights))
