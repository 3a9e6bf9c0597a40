"""Applies placed on the host (issue "The host computes too", first step): the placement, plans
that run host applies in version 2, the validator's rule 10 refusing what breaks them, every
runtime giving the dense reference's answers for such plans (the host's blocks coming back on a
copy queue of their own), the host pool, host profiles and the CLI's host flags. Their planning:
`test_host_planner.py`."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from fake_cupy import installed
from test_cli import assert_one_line_error, cli
from host_placed import (MIXTRAL, assert_close, decode_step, inputs_for, placed_llama,
                         placed_plan)

from einpage.compiler.order import memory_aware_order
from einpage.compiler.placement import place_on_host
from einpage.errors import InputError, PlanError
from einpage.ir import MemGraph, validate
from einpage.ir.dtypes import DType
from einpage.ir.memgraph import ApplyNode, OffloadNode, ReloadNode
from einpage.ir.ops import EinsumOp
from einpage.ir.spec import EinsumSpec
from einpage.predict.devices import get_device
from einpage.predict.hosts import HOSTS, get_host, load_host_file
from einpage.runtime import hostpool, kernels, reference, run
from einpage.runtime.backends.cuda import CupyBackend
from einpage.runtime.backends.inject import Delayed
from einpage.runtime.backends.threads import ThreadsBackend
from einpage.runtime.stream_executor import run_streams
from einpage.ir import scalar


@pytest.fixture(scope="module")
def llama_placed():
    return placed_llama()


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
    assert_close(run(mg, inputs, weights, order=order), want)


@pytest.mark.parametrize("seed", [0, 1])
def test_threads_backend_gives_the_reference_with_random_delays(llama_placed, seed):
    _, weights, inputs, *_, mg, want = llama_placed
    got = run_streams(mg, inputs, weights, Delayed(ThreadsBackend(poison=True), seed, 2e-3))
    assert_close(got.outputs, want)
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
    cfg, weights, graph, inputs = decode_step(MIXTRAL, hf_fixture)
    tg, kept, on_host, mg = placed_plan(cfg, graph, kind)
    assert any(".experts." in tg.blocks[b].source.input for b in kept) and on_host
    inputs = inputs_for(mg, inputs)
    want = reference.evaluate(graph, inputs, weights)
    for order in ("sequential", 5):
        assert_close(run(mg, inputs, weights, order=order), want)
    assert_close(run_streams(mg, inputs, weights, "threads").outputs, want)


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
        assert_close(run_streams(mg, inputs, weights, backend).outputs, want)
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
