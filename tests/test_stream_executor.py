"""The stream executor on the threads backend: one worker thread per queue, the plan's waits the
only ordering. With seeded random delays per queue it gives the dense reference's answer for
random graphs x budgets x policies and for a paged LLaMA; a failure injected on any queue, a
checkpoint that fails mid-pass, or Ctrl-C stops every queue promptly, releases the arena and
raises one typed error; the measured pass adds up."""
from __future__ import annotations

import _thread
import dataclasses
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_compile import _reference, compile_at, random_graphs

from einpage.compiler import CompileOptions, compile_graph
from einpage.errors import CheckpointError, ExecutionError, Interrupted
from einpage.models import llama
from einpage.models.checkpoint import RandomWeights
from einpage.models.config import preset
from einpage.runtime import evaluate
from einpage.runtime.backends.inject import Delayed, Faulty, Wrapped
from einpage.runtime.backends.threads import ThreadsBackend
from einpage.runtime.stream_executor import run_streams
from einpage.runtime.streams import check_program, compile_streams


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=random_graphs(), block=st.sampled_from([256, 1024, 4096]),
       slack=st.sampled_from([1.0, 1.3, 2.0, 100.0]),
       policy=st.sampled_from(["reuse-distance", "lru", "layerwise"]),
       seed=st.integers(0, 1000))
def test_random_plans_on_threads_with_delays_match_reference(case, block, slack, policy, seed):
    graph, arrays, weights = case
    compiled = compile_at(graph, block, slack, policy)
    if compiled is None:
        return
    mg = compiled.memgraph
    program = compile_streams(mg, preload=True)
    check_program(mg, program)
    got = run_streams(mg, arrays, weights.__getitem__,
                      Delayed(ThreadsBackend(poison=True), seed, 2e-4), program).outputs
    want = _reference(graph, arrays, weights)
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-9, atol=1e-12, err_msg=name)


def small_llama(budget: int, policy: str = "reuse-distance"):
    cfg = preset("small")
    graph = llama.prefill_graph(cfg).bind(B=2, S=16)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab, (2, 16))
    compiled = compile_graph(graph, CompileOptions(budget, policy=policy))
    return graph, compiled.memgraph, {"tokens": tokens}, RandomWeights(cfg, seed=1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_paged_llama_on_threads_matches_reference(seed):
    graph, mg, inputs, weights = small_llama(300_000)
    assert mg.count("reload") > 0 and mg.count("offload") > 0  # the budget forces paging
    run = run_streams(mg, inputs, weights, Delayed(ThreadsBackend(poison=True), seed, 5e-4))
    want = evaluate(graph, inputs, weights)
    np.testing.assert_allclose(run.outputs["logits"], want["logits"], rtol=1e-4, atol=1e-5)
    m = run.measured
    assert m.backend == "threads" and m.wall_s > 0
    assert m.bytes("h2d") == mg.moved_bytes("reload") + sum(
        mg.tensors[n.tensor].bytes for n in mg.nodes
        if n.kind == "input" and n.at == "device" and n.deps)
    assert m.bytes("d2h") == mg.moved_bytes("offload")
    assert 0 <= m.hidden_fraction("h2d") <= 1
    busy = m.busy_s("compute")
    assert 0 < busy <= m.wall_s * 1.01 and abs(m.compute_stall_s - (m.wall_s - busy)) < 1e-9
    spans = sorted((s for s in m.spans if s.queue == "compute"), key=lambda s: s.start)
    assert all(a.end <= b.start + 1e-9 for a, b in zip(spans, spans[1:]))  # a queue is in order


def test_resident_weights_load_before_the_pass():
    graph, mg, inputs, weights = small_llama(50_000_000)  # everything fits
    program = compile_streams(mg, preload=True)
    assert program.preloaded and mg.count("reload") == 0
    run = run_streams(mg, inputs, weights, ThreadsBackend(), program)
    # the weights load once, before the pass; only the activations (the token ids) come in
    # during it, as they would every pass of a plan held open
    tokens = sum(t.bytes for t in mg.tensors if t.role == "activation" and t.source is not None)
    assert run.measured.load_bytes > 0 and run.measured.bytes("h2d") == tokens > 0
    np.testing.assert_allclose(run.outputs["logits"], evaluate(graph, inputs, weights)["logits"],
                               rtol=1e-4, atol=1e-5)


class Tracked(Wrapped):
    """Records whether the backend was closed."""
    closed = False

    def close(self) -> None:
        super().close()
        self.closed = True


@pytest.mark.parametrize("queue,at", [("compute", 5), ("h2d", 3), ("d2h", 1), ("h2d", 0)])
def test_a_fault_on_any_queue_stops_every_queue_and_releases_memory(queue, at):
    _, mg, inputs, weights = small_llama(300_000)
    inner = ThreadsBackend()
    backend = Tracked(Faulty(Delayed(inner, 0, 2e-4), queue, at))
    before = threading.active_count()
    t0 = time.perf_counter()
    with pytest.raises(ExecutionError, match=f"{queue} queue failed at node %[0-9]+ .*"
                                             "InjectedFault"):
        run_streams(mg, inputs, weights, backend)
    assert time.perf_counter() - t0 < 10
    assert backend.closed and inner.arena is None and inner.host is None
    time.sleep(0.05)
    assert threading.active_count() == before  # no worker left behind


def test_a_checkpoint_that_fails_mid_pass_keeps_its_error_type():
    _, mg, inputs, weights = small_llama(300_000)
    reads = {"n": 0}

    class Broken:
        """A weight whose third block read fails as a truncated file would."""
        def __init__(self, array):
            self.array, self.shape = array, array.shape

        def __getitem__(self, index):
            reads["n"] += 1
            if reads["n"] == 3:
                raise CheckpointError("model.safetensors: read failed (file truncated?)")
            return self.array[index]

    inner = ThreadsBackend()
    with pytest.raises(CheckpointError, match="read failed"):
        run_streams(mg, inputs, lambda name: Broken(weights(name)), inner)
    assert inner.arena is None


def test_an_unexpected_error_is_typed_and_names_the_node():
    _, mg, inputs, weights = small_llama(300_000)
    backend = Faulty(ThreadsBackend(), "compute", 2, ZeroDivisionError("boom"))
    with pytest.raises(ExecutionError, match=r"compute queue failed at node %\d+ \(apply\): "
                                             "ZeroDivisionError: boom"):
        run_streams(mg, inputs, weights, backend)


def test_ctrl_c_stops_every_queue_and_releases_memory():
    _, mg, inputs, weights = small_llama(300_000)

    class Interrupting(Wrapped):
        """Sends Ctrl-C to the calling thread at one compute node, then holds that node until
        the executor aborts (so the pass cannot end before the interrupt is seen)."""
        aborted = threading.Event()

        def run(self, n):
            if n.id > 40 and not getattr(self, "sent", False):
                self.sent = True
                _thread.interrupt_main()  # what Ctrl-C does to the calling thread
                assert self.aborted.wait(10), "the executor never aborted"
            super().run(n)

        def abort(self):
            self.aborted.set()
            super().abort()

    inner = ThreadsBackend()
    with pytest.raises(Interrupted):
        run_streams(mg, inputs, weights, Interrupting(inner))
    assert inner.arena is None


def test_the_waits_are_what_orders_the_queues():
    """Without its waits the same program on the same slow copies gives a wrong answer: the delays
    do reorder the queues, so the tests above show the waits are enough."""
    graph, mg, inputs, weights = small_llama(300_000)
    program = compile_streams(mg, preload=True)
    no_waits = dataclasses.replace(program, steps=tuple(dataclasses.replace(s, waits=())
                                                        for s in program.steps),
                                   events=frozenset())

    class SlowCopies(Wrapped):
        def copy_h2d(self, n):
            time.sleep(2e-3)
            super().copy_h2d(n)

    want = evaluate(graph, inputs, weights)["logits"]
    got = run_streams(mg, inputs, weights, SlowCopies(ThreadsBackend(poison=True)),
                      program).outputs
    np.testing.assert_allclose(got["logits"], want, rtol=1e-4, atol=1e-5)
    with np.errstate(all="ignore"):
        bad = run_streams(mg, inputs, weights, SlowCopies(ThreadsBackend(poison=True)),
                          no_waits).outputs
    assert not np.allclose(bad["logits"], want, rtol=1e-4, atol=1e-5, equal_nan=False)
