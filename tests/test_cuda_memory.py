"""The CuPy backend's device memory (`einpage.runtime.backends.cuda_memory`) and what it must
do right on a first GPU run, shown on the stand-in for CuPy (`fake_cupy`), which checks what
CUDA and cuBLAS would reject: every region 256-aligned whatever the budget; `--gpu-mem` counts
the CUDA context, the cuBLAS handles and workspace, and the apply workspace (cuBLAS allocates
nothing of its own); small budgets run; every call with the backend's device current; every
kernel compiled at `open`, none in a pass; KV rows written back from pinned memory."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from fake_cupy import CONTEXT_BYTES, HANDLE_BYTES, installed
from hypothesis import given
from hypothesis import strategies as st
from sessions import held_decode_steps

from einpage.compiler import CompileOptions, compile_graph
from einpage.errors import BudgetError
from einpage.ir.dtypes import DType
from einpage.models import llama, resolve
from einpage.predict.devices import get_device
from einpage.runners import PlanRunner
from einpage.runtime import executor
from einpage.runtime.backends.apply_plan import STATUS_BYTES, workspace_bytes
from einpage.runtime.backends.cuda import CupyBackend
from einpage.runtime.backends.cuda_memory import (CUBLAS_WORKSPACE_BYTES, GRANULE, cublas_workspace,
                                                  regions, reserve)
from einpage.runtime.stream_executor import run_streams


@pytest.fixture
def fake_cupy(monkeypatch, tmp_path_factory):
    yield from installed(monkeypatch, tmp_path_factory)


@pytest.fixture
def two_gpus(monkeypatch, tmp_path_factory):
    yield from installed(monkeypatch, tmp_path_factory, devices=2)


# ====================================================================== pure: regions, budgets

@given(arena=st.integers(1, 1 << 34), slots=st.integers(0, 1 << 30),
       cublas=st.one_of(st.none(), st.integers(0, 1 << 26)))
def test_every_region_starts_256_aligned_and_none_overlap(arena, slots, cublas):
    r = regions(arena, slots, cublas)
    starts = [0, r.cublas_at, r.slots_at, r.status_at]
    sizes = [r.arena, r.cublas, r.slots, STATUS_BYTES]
    assert all(s % 256 == 0 for s in starts)
    assert all(a + n <= b for a, n, b in zip(starts, sizes, starts[1:] + [r.total]))
    assert r.cublas == (cublas_workspace(arena) if cublas is None else cublas)


@given(budget=st.integers(1 << 20, 1 << 36), context=st.integers(0, 1 << 30),
       workspace=st.integers(STATUS_BYTES, 1 << 26))
def test_a_reservation_adds_up_to_its_budget(budget, context, workspace):
    try:
        r = reserve(budget, context, workspace)
    except BudgetError as exc:
        assert exc.available == budget and exc.needed > budget
        assert "\n" not in str(exc)
        return
    assert r.arena > 0 and r.arena % 256 == 0
    assert r.arena + r.context + r.cublas + r.workspace + r.padding == budget
    assert r.padding >= GRANULE
    # what the backend allocates for it fits the budget with the context
    allocation = regions(r.arena, workspace - STATUS_BYTES, r.cublas).total
    assert context + -(-allocation // GRANULE) * GRANULE <= budget
    assert r.cublas == cublas_workspace(r.arena)
    assert r.cublas == CUBLAS_WORKSPACE_BYTES or r.arena < 17 * CUBLAS_WORKSPACE_BYTES


# ====================================================================== on the stand-in

def _tiny(dtype=DType.f32, budget_extra: int = 0, fraction: int = 4):
    cfg, weights = resolve("tiny", random_weights=True, seed=11, dtype=dtype)
    tokens = np.random.default_rng(2).integers(0, cfg.vocab, (2, 6))
    graph = llama.prefill_graph(cfg).bind(B=2, S=6)
    budget = cfg.weight_bytes(DType.f32) // fraction + budget_extra
    return cfg, weights, tokens, graph, budget


@pytest.mark.parametrize("extra", [1, 13, 130])
def test_an_arena_of_any_size_keeps_every_region_aligned(fake_cupy, extra):
    """Most budgets are not multiples of 256: the regions after the arena still start
    256-aligned (the stand-in asserts it for every region, view and cuBLAS operand)."""
    cfg, weights, tokens, graph, budget = _tiny(DType.bf16, extra)
    mg = compile_graph(graph, CompileOptions(budget)).memgraph
    assert mg.device_bytes % 256 != 0
    want = executor.run(mg, {"tokens": tokens}, weights)
    got = run_streams(mg, {"tokens": tokens}, weights, backend=CupyBackend()).outputs
    np.testing.assert_allclose(got["logits"], want["logits"], atol=0.05)
    assert fake_cupy.gemms > 0 and fake_cupy.sticky is None


def test_gpu_mem_is_all_the_process_takes(fake_cupy):
    """A runner on cupy plans for what the budget leaves once the (measured) CUDA context and
    cuBLAS handles, cuBLAS's workspace and the apply workspace are taken; the process then
    holds no more than the budget, and cuBLAS allocates nothing of its own."""
    cfg, weights, tokens, graph, _ = _tiny()
    budget = CONTEXT_BYTES + 3 * HANDLE_BYTES + (48 << 20) + 12_345
    runner = PlanRunner(weights, CompileOptions(budget), backend="cupy")
    assert runner.context_bytes >= CONTEXT_BYTES + 2 * HANDLE_BYTES
    want = executor.run(compile_graph(graph, CompileOptions(1 << 30)).memgraph,
                        {"tokens": tokens}, weights)
    with runner.open(graph) as session:
        got = session.run({"tokens": tokens})
        taken = max(fake_cupy.used)
    np.testing.assert_allclose(got["logits"], want["logits"], atol=1e-5)
    r = runner.reservation
    assert r is not None and r.budget == budget and r.context == runner.context_bytes
    assert taken <= budget, (taken, budget)
    assert all(h["workspace"] is not None or not h["own_workspace"]
               for h in fake_cupy.handles.values())
    assert not any(h["own_workspace"] for h in fake_cupy.handles.values())
    line = r.lines()[0]
    assert "plan arena" in line and "CUDA context" in line and "cuBLAS workspace" in line


def test_a_small_budget_runs_and_one_below_the_context_says_why(fake_cupy):
    """The runner's reserve is what the plan's applies need, not a fixed share: a plan's arena
    may be a few hundred kilobytes; a budget the CUDA context alone exceeds is one clear
    error."""
    cfg, weights, tokens, graph, small = _tiny()
    runner = PlanRunner(weights, CompileOptions(0), backend="cupy")
    budget = runner.context_bytes + GRANULE + small + 4096 + cublas_workspace(small) + 1024
    runner = PlanRunner(weights, CompileOptions(budget), backend="cupy")
    compiled, workspace = runner.plan(graph)
    assert workspace == workspace_bytes(compiled.memgraph) < 1 << 20
    assert compiled.report.traffic.reload_bytes > 0  # it pages
    runner(graph, {"tokens": tokens})
    with pytest.raises(BudgetError, match="CUDA context") as err:
        PlanRunner(weights, CompileOptions(small), backend="cupy").plan(graph)
    assert "\n" not in str(err.value) and "--arena" in str(err.value)
    # the plan's arena itself, the rest on top: the same plan as a budget around it
    arena = PlanRunner(weights, CompileOptions(small), backend="cupy", arena=True)
    again, _ = arena.plan(graph)
    assert again.memgraph.device_bytes == small
    assert arena.reservation.arena == small and arena.reservation.budget > small
    np.testing.assert_allclose(arena(graph, {"tokens": tokens})["logits"],
                               runner(graph, {"tokens": tokens})["logits"], atol=1e-5)


def test_every_call_runs_with_the_backends_device_current(two_gpus):
    """On device 1 of two, a launch, memset or event record issued while device 0 is current
    fails (as CUDA's does): a whole pass, its outputs and close run clean."""
    cfg, weights, tokens, graph, budget = _tiny()
    mg = compile_graph(graph, CompileOptions(budget)).memgraph
    want = executor.run(mg, {"tokens": tokens}, weights)
    backend = CupyBackend(device=1)
    got = run_streams(mg, {"tokens": tokens}, weights, backend=backend).outputs
    np.testing.assert_allclose(got["logits"], want["logits"], atol=1e-5)
    assert two_gpus.contexts[1] and two_gpus.sticky is None  # the work went to device 1
    assert backend.arena is None
    # and the stand-in does refuse a launch on device 1's stream while device 0 is current
    from fake_streams import CUDARuntimeError
    with two_gpus.cuda.Device(1):
        stream = two_gpus.cuda.Stream(non_blocking=True)
        memory = two_gpus.cuda.Memory(256)
    with two_gpus.cuda.Device(0), pytest.raises(CUDARuntimeError, match="ResourceHandle"):
        two_gpus.cuda.MemoryPointer(memory, 0).memset_async(0, 256, stream)


def test_open_returns_with_its_warm_up_done(fake_cupy):
    """`open` runs every kernel once on the empty arena: that garbage must be written before
    the resident blocks are loaded over it, so nothing of it is in flight when `open`
    returns."""
    from einpage.runtime.planio import PlanIO
    cfg, weights, tokens, graph, budget = _tiny(DType.bf16)
    mg = compile_graph(graph, CompileOptions(budget)).memgraph
    backend = CupyBackend()
    backend.open(mg, PlanIO(mg, {"tokens": tokens}, weights))
    try:
        assert all(s.done for s in backend._streams.values())
    finally:
        backend.close()


@pytest.mark.parametrize("slots", [1, 2])
def test_staging_slots_are_reused_only_once_copied(fake_cupy, monkeypatch, slots):
    """Resident blocks load through a ring of pinned staging slots: with one or two slots,
    every read waits for the copy out of the slot it overwrites."""
    from einpage.runtime.backends import cuda
    monkeypatch.setattr(cuda, "STAGING_SLOTS", slots)
    cfg, weights, tokens, graph, budget = _tiny(DType.f32, fraction=2)
    mg = compile_graph(graph, CompileOptions(budget)).memgraph
    assert sum(n.kind == "input" and n.at == "device" for n in mg.nodes) > 4 * slots
    want = executor.run(mg, {"tokens": tokens}, weights)
    got = run_streams(mg, {"tokens": tokens}, weights, backend=CupyBackend()).outputs
    np.testing.assert_allclose(got["logits"], want["logits"], atol=1e-5)


def test_kernels_compile_at_open_and_never_in_a_pass(fake_cupy):
    cfg, weights, tokens, graph, budget = _tiny(DType.bf16)
    mg = compile_graph(graph, CompileOptions(budget)).memgraph
    backend = CupyBackend()
    seen = []

    class Counting(CupyBackend):
        def open(self, mg, io):
            super().open(mg, io)
            seen.append(len(fake_cupy.compiles))

    backend = Counting()
    run_streams(mg, {"tokens": tokens}, weights, backend=backend)
    assert seen and seen[0] == len(fake_cupy.compiles) > 0
    assert backend.compile_s > 0


def test_kv_rows_go_back_from_pinned_memory_without_synchronizing(fake_cupy, monkeypatch):
    """A decode session's rows written between steps are async copies from pinned memory
    (no pageable copy, which would synchronize), and the steps equal the threads backend; with
    one pinned row slot every write reuses the slot the last copy reads."""
    from einpage.runtime.backends import cuda
    monkeypatch.setattr(cuda, "ROW_SLOTS", 1)
    from einpage.models.generation import decode_step_graph, prefill
    from einpage.models.kvstore import KVStore
    from einpage.runtime import evaluate
    from einpage.runtime.backends.threads import ThreadsBackend
    from einpage.runtime.stream_executor import StreamSession
    cfg, weights = resolve("tiny", random_weights=True, seed=5)
    prompt = np.array([[4, 8, 15, 16, 23], [42, 1, 2, 3, 5]]) % cfg.vocab
    graph = decode_step_graph(cfg, 2, 8)
    mg = compile_graph(graph, CompileOptions(cfg.weight_bytes() * 11 // 10)).memgraph
    assert any(n.kind == "input" and n.at == "device" and mg.tensors[n.tensor].role == "cache"
               for n in mg.nodes)  # (and paged: some blocks stream)
    assert mg.count("reload") > 0
    copies = []

    def steps(backend):
        store = KVStore(cfg, 2, 8)
        out = prefill(cfg, prompt, lambda g, i: evaluate(g, i, weights))
        store.fill(out)
        last = np.argmax(out["logits"][:, -1], axis=-1)
        logits = []
        with StreamSession(mg, weights, backend) as session:
            for _ in range(3):
                step = session.run({"tokens": last[:, None], "pos": store.pos.copy(),
                                    **store.view(8)}).outputs
                before = fake_cupy.pageable_copies
                for name, lead, row in store.write(step):
                    session.write(name, lead, row)
                copies.append(fake_cupy.pageable_copies - before)
                last = np.argmax(step["logits"][:, -1], axis=-1)
                logits.append(step["logits"])
        return np.stack(logits)

    want = steps(ThreadsBackend())
    copies.clear()
    got = steps(CupyBackend())
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    assert copies == [0, 0, 0]


def test_streamed_weights_are_pinned_once_per_model(fake_cupy):
    """Two sessions of one plan, and a plan cut alike, read the streamed weight blocks pinned by
    the first; a plan cut otherwise replaces them instead of adding to them."""
    from einpage.runtime.backends.pinned import PinnedWeights
    cfg, weights, tokens, graph, budget = _tiny()
    mg = compile_graph(graph, CompileOptions(budget)).memgraph
    want = executor.run(mg, {"tokens": tokens}, weights)
    for _ in range(2):
        got = run_streams(mg, {"tokens": tokens}, weights, backend=CupyBackend()).outputs
        np.testing.assert_allclose(got["logits"], want["logits"], atol=1e-5)
    store = PinnedWeights.for_source(fake_cupy, weights)
    first = store.fills
    assert first > 0 and store.pinned_bytes > 0
    other = compile_graph(llama.prefill_graph(cfg).bind(B=1, S=3),
                          CompileOptions(budget)).memgraph
    run_streams(other, {"tokens": tokens[:1, :3]}, weights, backend=CupyBackend())
    assert store.fills - first < first  # most blocks are cut alike: shared, not pinned again
    assert all(n == 0 for n in store.users.values())  # every session released its blocks


def test_decode_steps_replay_one_captured_graph(fake_cupy):
    """Without per-node timing, a session's second pass is captured as a CUDA graph and every
    pass from then on is one launch of it: no backend call per node, the KV rows written
    between steps seen by the next, each step's embedding rows gathered on the host before its
    launch (the graph's prologue: a stale row would change the step), every step equal to the
    threads backend's."""
    from einpage.models.generation import decode_step_graph
    from einpage.runtime.backends.threads import ThreadsBackend
    cfg, weights = resolve("tiny", random_weights=True, seed=9)
    prompt = np.array([[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]]) % cfg.vocab
    graph = decode_step_graph(cfg, 2, 8)
    # (a link slow enough for the tiny table's rows to be gathered on the host)
    h100 = get_device("h100-pcie")
    slow = dataclasses.replace(h100, h2d_bandwidth=h100.h2d_bandwidth / 20, launch_overhead=0.0,
                               host=dataclasses.replace(h100.host, apply_overhead=0.0))
    mg = compile_graph(graph, CompileOptions(cfg.weight_bytes() // 3, device=slow)).memgraph
    calls = []

    class Counting(CupyBackend):
        def run(self, n):
            calls.append(n.id)
            super().run(n)

    def steps(backend, timing):
        return held_decode_steps(cfg, weights, mg, prompt, backend, timing)

    want, _ = steps(ThreadsBackend(), True)
    backend = Counting()
    got, replays = steps(backend, False)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    applies = sum(n.kind == "apply" and not n.on_host for n in mg.nodes)
    # the embedding rows are gathered on the host, before each replay (its prologue)
    assert any(n.kind == "apply" and n.on_host for n in mg.nodes)
    assert replays == 2 and len(calls) == 2 * applies  # pass 1 eager, pass 2 captured
    # per-node timing times the pass the workers issue; the replays are timed as a whole
    timed_backend = Counting()
    calls.clear()
    seen = []
    timed, replays = held_decode_steps(cfg, weights, mg, prompt, timed_backend, True,
                                       after_pass=lambda b: seen.append(len(calls)))
    assert replays == 2 and seen[0] == seen[1] // 2 == applies
    np.testing.assert_allclose(timed, want, rtol=0, atol=1e-5)


def test_timing_says_what_the_budget_holds_besides_the_plan(fake_cupy, capsys):
    """`einpage run --backend cupy --timing` prints the budget's split: the plan's arena, the
    measured context and handles, cuBLAS's and the applies' workspaces."""
    from test_cli import cli
    assert cli("run", "tiny", "--random-weights", "--tokens", "1,2,3", "--backend", "cupy",
               "--gpu-mem", "400MB", "--timing") == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("device budget"))
    assert "400.00 MB" in line and "CUDA context and cuBLAS handles" in line
    assert "kernels compiled in" in out


def test_timed_passes_after_the_first_replay_the_captured_graph(fake_cupy, capsys, tmp_path):
    """`--timing --passes N` on cupy times the first pass node by node and the rest as the
    untimed run runs them: one launch of the captured pass each, timed as a whole, and priced
    with the profile's graph launch gap instead of the host's issue per node."""
    import json

    from test_cli import cli

    from einpage.predict import PROFILES
    profile = dict(PROFILES["h100-pcie"].to_json(), launch_overhead=1e-3,
                   graph_launch_overhead=1e-6, name="slow-issue")
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile))
    assert cli("run", "tiny", "--random-weights", "--tokens", "1,2,3", "--backend", "cupy",
               "--gpu-mem", "400MB", "--timing", "--passes", "4", "--device-file", path) == 0
    lines = capsys.readouterr().out.splitlines()
    first = next(k for k, x in enumerate(lines) if x.startswith("pass 1 of 4"))
    capture = next(k for k, x in enumerate(lines) if x.startswith("pass 2 of 4"))
    later = next(k for k, x in enumerate(lines)
                 if x.startswith("median of the 2 replays (pass 2 captured the graph)"))
    assert "graph" not in lines[first]
    assert "captured as a CUDA graph, then launched: wall only" in lines[capture]
    assert "one CUDA graph launch: wall only" in lines[later]
    assert "compute busy" in lines[first + 2]  # the first pass's spans

    def predicted(k):  # "  wall   <measured> |  <predicted> ms  (..x)"
        value, unit = lines[k + 1].split("|")[1].split()[:2]
        return float(value) * {"s": 1, "ms": 1e-3}[unit]
    assert predicted(first) > 100 * predicted(later)  # 1 ms per kernel issued, 1 us replayed
    assert predicted(capture) == predicted(first)  # the captured pass also issued every node


def test_calibrate_measures_the_graph_launch_gap_where_the_backend_captures(fake_cupy):
    """`node_overhead`: per node issued, and per node replayed as one captured graph (cupy);
    the threads backend captures nothing."""
    from einpage.calibrate import node_overhead
    issued, replayed = node_overhead("cupy", nodes=20)
    assert issued > 0 and replayed is not None and replayed > 0
    assert node_overhead("threads", nodes=20)[1] is None


def test_a_trace_issues_every_pass_node_by_node(fake_cupy, tmp_path):
    """`--trace` wants every node of every pass: no CUDA graph replays then, so the trace holds
    all the passes' spans."""
    import json

    from test_cli import cli
    path = tmp_path / "t.json"
    assert cli("run", "tiny", "--random-weights", "--tokens", "1,2,3", "--backend", "cupy",
               "--gpu-mem", "400MB", "--passes", "3", "--trace", path) == 0
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    per_pass = {e["pid"] for e in events}
    assert len(per_pass) == 3, per_pass


def test_host_gathers_are_a_replays_prologue_without_copies_back(fake_cupy):
    """A host gather reads its table and ids where they lie, also where the device holds them
    (a tied table resident for the logits: its checkpoint bytes; ids an input that only the
    host reads stays at host): no offload feeds it, so it runs before each launch of the
    captured pass (a gather waiting on an offload inside the graph is refused by CUDA), and
    every step equals the threads backend's."""
    from dataclasses import replace as swap

    from einpage.compiler.host_gather import with_host_gathers
    from einpage.compiler.lower_options import LowerOptions
    from einpage.compiler.lowering import lower
    from einpage.compiler.order import memory_aware_order
    from einpage.compiler.partitioner import PartitionOptions, partition
    from einpage.compiler.policies import get_policy
    from einpage.compiler.resident import persistent_blocks
    from einpage.ir import validate
    from einpage.models.generation import decode_step_graph
    from einpage.runtime.backends.threads import ThreadsBackend
    cfg, weights = resolve("tiny-tied", random_weights=True, seed=9)
    h100 = get_device("h100-pcie")
    slow = swap(h100, h2d_bandwidth=h100.h2d_bandwidth / 20, launch_overhead=0.0,
                host=swap(h100.host, apply_overhead=0.0))
    tg = with_host_gathers(partition(decode_step_graph(cfg, 2, 8), PartitionOptions(4096)), slow)
    tables = {tg.tasks[t].reads[0] for t in tg.host_tasks}
    resident = frozenset(tables & persistent_blocks(tg))
    assert resident  # the logits read the table on the device
    for inputs_at_device in (False, True):
        mg = lower(tg, memory_aware_order(tg), LowerOptions(
            cfg.weight_bytes(), get_policy("reuse-distance"), resident=resident,
            inputs_at_device=inputs_at_device))
        validate(mg)
        assert not any(n.kind == "offload" for n in mg.nodes)
        prompt = np.array([[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]]) % cfg.vocab
        want, _ = held_decode_steps(cfg, weights, mg, prompt, ThreadsBackend(), True)
        got, replays = held_decode_steps(cfg, weights, mg, prompt, CupyBackend(), False)
        assert replays >= 2
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
