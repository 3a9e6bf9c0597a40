"""The stream executor on the threads backend: one worker thread per queue, the plan's waits the
only ordering. With seeded random delays per queue it gives the dense reference's answer for
random graphs x budgets x policies and for a paged LLaMA; a failure injected on any queue, a
checkpoint that fails mid-pass, or Ctrl-C stops every queue promptly, releases the arena and
raises one typed error; the measured pass adds up. A session keeps its worker threads, each in
its queue context, from the first pass to `close`, and a fault or Ctrl-C in a later pass stops it
as in the first. The null backend runs a plan doing nothing."""
from __future__ import annotations

import _thread
import dataclasses
import gc
import signal
import threading
import time
from contextlib import contextmanager

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
from einpage.runtime.backends.null import NullBackend
from einpage.runtime.backends.threads import ThreadsBackend
from einpage.runtime.stream_executor import StreamSession, run_streams
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


def test_the_link_s_figures_count_both_copy_queues_and_their_overlap_once():
    """`Measured`'s h2d figures are the link's: bytes of both queues that copy host->device,
    busy while either copies (an overlap once), hidden where compute runs meanwhile."""
    from einpage.runtime.measured import Measured, Span
    spans = (Span(0, "compute", 0.0, 10.0, 0), Span(1, "h2d", 0.0, 10.0, 100),
             Span(2, "h2d_host", 1.0, 2.0, 10), Span(3, "h2d_host", 11.0, 12.0, 10))
    m = Measured("threads", 12.0, 0.0, 0, spans)
    assert m.bytes("h2d") == 120 and m.bytes("h2d_host") == 20
    assert m.busy_s("h2d") == pytest.approx(11.0) and m.busy_s("h2d_host") == pytest.approx(2.0)
    assert m.rate("h2d") == pytest.approx(120 / 11.0)
    assert m.hidden_fraction("h2d") == pytest.approx(10.0 / 11.0)
    assert m.hidden_fraction("h2d_host") == pytest.approx(0.5)


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


class Interrupting(Wrapped):
    """Sends Ctrl-C to the calling thread at one compute node of pass `at_pass` (1-based), then
    holds that node until the executor aborts (so the pass cannot end before the interrupt is
    seen)."""

    def __init__(self, inner, at_pass: int = 1):
        super().__init__(inner)
        self.at_pass, self.passes, self.sent = at_pass, 1, False
        self.aborted = threading.Event()

    def begin_pass(self):
        self.passes += 1
        super().begin_pass()

    def run(self, n):
        if self.passes == self.at_pass and n.id > 40 and not self.sent:
            self.sent = True
            _thread.interrupt_main()  # what Ctrl-C does to the calling thread
            assert self.aborted.wait(10), "the executor never aborted"
        super().run(n)

    def abort(self):
        self.aborted.set()
        super().abort()


@pytest.fixture
def python_handles_sigint():
    """Python's own Ctrl-C handler for the test: a shell that starts the suite in the
    background (`... &` without job control) starts it with SIGINT ignored, and then
    `_thread.interrupt_main` does nothing."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


@pytest.mark.usefixtures("python_handles_sigint")
def test_ctrl_c_stops_every_queue_and_releases_memory():
    _, mg, inputs, weights = small_llama(300_000)
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


class Traced(Wrapped):
    """Logs each queue context's entry and exit and the backend's close, and the threads each
    queue's calls run on, pass by pass."""

    def __init__(self, inner):
        super().__init__(inner)
        self.log: list[tuple] = []
        self.threads: list[dict[str, set[int]]] = [{}]

    @contextmanager
    def _context(self, queue):
        self.log.append(("enter", queue, threading.get_ident()))
        with self.inner.queue_context(queue):
            yield
        self.log.append(("exit", queue, threading.get_ident()))

    def queue_context(self, queue):
        return self._context(queue)

    def _before(self, queue):
        self.threads[-1].setdefault(queue, set()).add(threading.get_ident())

    def begin_pass(self):
        self.threads.append({})
        super().begin_pass()

    def close(self):
        self.log.append(("close",))
        super().close()


def test_a_session_keeps_its_threads_and_queue_contexts_across_passes():
    graph, mg, inputs, weights = small_llama(300_000)
    want = evaluate(graph, inputs, weights)["logits"]
    backend = Traced(Delayed(ThreadsBackend(poison=True), 0, 1e-4))
    before = threading.active_count()
    with StreamSession(mg, weights, backend) as session:
        for _ in range(3):
            got = session.run(inputs).outputs["logits"]
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        during = threading.active_count()
    queues = {s.queue for s in session.program.steps}
    assert queues == {"compute", "h2d", "d2h"} and len(backend.threads) == 3
    first = backend.threads[0]
    assert set(first) == queues and all(len(idents) == 1 for idents in first.values())
    assert all(per_pass == first for per_pass in backend.threads)  # the same thread every pass
    thread = {q: next(iter(idents)) for q, idents in first.items()}
    assert len(set(thread.values())) == len(queues) and threading.get_ident() not in thread.values()
    # each queue's context entered once for the session, on its thread; left there at close,
    # before the backend closes
    entries = [e for e in backend.log if e[0] == "enter"]
    exits = [e for e in backend.log if e[0] == "exit"]
    assert sorted(entries) == sorted(("enter", q, t) for q, t in thread.items())
    assert sorted(exits) == sorted(("exit", q, t) for q, t in thread.items())
    assert backend.log[-1] == ("close",) and backend.log.count(("close",)) == 1
    assert during == before + len(queues) and threading.active_count() == before


@pytest.mark.parametrize("queue", ["compute", "h2d", "d2h"])
def test_a_fault_in_the_third_pass_stops_every_queue_and_releases_memory(queue):
    graph, mg, inputs, weights = small_llama(300_000)
    want = evaluate(graph, inputs, weights)["logits"]
    program = compile_streams(mg, preload=True)
    per_pass = sum(1 for s in program.steps if s.queue == queue)
    at = (len(program.preloaded) if queue == "h2d" else 0) + 2 * per_pass + per_pass // 2
    inner = ThreadsBackend()
    backend = Tracked(Faulty(Delayed(inner, 1, 1e-4), queue, at))
    before = threading.active_count()
    session = StreamSession(mg, weights, backend, program)
    for _ in range(2):
        np.testing.assert_allclose(session.run(inputs).outputs["logits"], want, rtol=1e-4,
                                   atol=1e-5)
    t0 = time.perf_counter()
    with pytest.raises(ExecutionError, match=f"{queue} queue failed at node %[0-9]+ .*"
                                             "InjectedFault"):
        session.run(inputs)
    assert time.perf_counter() - t0 < 10
    assert session.closed and backend.closed and inner.arena is None and inner.host is None
    assert threading.active_count() == before  # every worker joined
    with pytest.raises(ExecutionError, match="closed"):
        session.run(inputs)


@pytest.mark.usefixtures("python_handles_sigint")
def test_ctrl_c_in_a_later_pass_stops_the_session_and_releases_memory():
    _, mg, inputs, weights = small_llama(300_000)
    inner = ThreadsBackend()
    before = threading.active_count()
    session = StreamSession(mg, weights, Interrupting(inner, at_pass=2))
    session.run(inputs)
    with pytest.raises(Interrupted):
        session.run(inputs)
    assert session.closed and inner.arena is None
    assert threading.active_count() == before


class BrokenContext(Wrapped):
    """A queue context that fails to enter or to exit on one queue."""

    def __init__(self, inner, queue: str, when: str):
        super().__init__(inner)
        self.queue, self.when = queue, when

    @contextmanager
    def _context(self, queue):
        if queue == self.queue and self.when == "enter":
            raise RuntimeError("no stream")
        with self.inner.queue_context(queue):
            yield
        if queue == self.queue and self.when == "exit":
            raise RuntimeError("stream lost")

    def queue_context(self, queue):
        return self._context(queue)


def test_a_queue_context_that_fails_is_a_typed_error_and_memory_is_released():
    _, mg, inputs, weights = small_llama(300_000)
    before = threading.active_count()
    inner = ThreadsBackend()
    with pytest.raises(ExecutionError, match="d2h queue failed at start: RuntimeError: no stream"):
        run_streams(mg, inputs, weights, BrokenContext(inner, "d2h", "enter"))
    assert inner.arena is None and threading.active_count() == before
    inner = ThreadsBackend()
    session = StreamSession(mg, weights, BrokenContext(inner, "compute", "exit"))
    session.run(inputs)
    with pytest.raises(ExecutionError, match="compute queue failed to leave its context: "
                                             "RuntimeError: stream lost"):
        session.close()
    assert inner.arena is None and threading.active_count() == before
    session.close()  # idempotent


def test_a_session_dropped_without_close_ends_its_threads():
    _, mg, inputs, weights = small_llama(300_000)
    before = threading.active_count()
    session = StreamSession(mg, weights, ThreadsBackend())
    session.run(inputs)
    assert threading.active_count() > before
    del session
    gc.collect()
    deadline = time.perf_counter() + 10
    while threading.active_count() > before and time.perf_counter() < deadline:
        time.sleep(0.01)
    assert threading.active_count() == before


def test_the_null_backend_runs_a_plan_and_reads_nothing():
    _, mg, inputs, _ = small_llama(300_000)
    read = []
    with StreamSession(mg, read.append, NullBackend()) as session:
        for _ in range(2):
            run = session.run(inputs)
            assert run.outputs["logits"].shape == (2, 16, preset("small").vocab)
            assert not run.outputs["logits"].any()
            assert len(run.measured.spans) == len(session.program.steps)
    assert read == []  # no weight was asked for


def test_spans_start_at_the_earliest_stamp():
    """A copy queue may begin before the compute queue's origin mark: the pass then starts
    at its earliest node, never at a negative time."""
    from types import SimpleNamespace

    from einpage.runtime.stream_executor import _spans
    mg = SimpleNamespace(nodes=[SimpleNamespace(tensor=0)] * 2,
                         tensors=[SimpleNamespace(bytes=64)])
    backend = SimpleNamespace(seconds=lambda a, b: b - a)
    spans = _spans(mg, backend, 1.0, {"h2d": [(0, 0.5, 2.0)], "compute": [(1, 1.5, 3.0)]})
    assert [(s.node, s.start, s.end) for s in spans] == [(0, 0.0, 1.5), (1, 1.0, 2.5)]
