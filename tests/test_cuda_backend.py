"""The CuPy backend (`einpage.runtime.backends.cuda`, its applies planned by `apply_plan`), end
to end. The kernel sources are tested in `test_cuda_source`, the GEMM plans in `test_gemm_plan`.

On any machine:
- every apply of the LLaMA plans has a plan, contractions run as GEMMs, and `workspace_bytes`
  covers every apply;
- the whole backend runs on the host against a stand-in for CuPy (`fake_cupy.FakeCupy`: NumPy
  arrays over raw memory, kernels compiled by g++, and the conditions under which CuPy would
  allocate a temporary turned into assertion errors): LLaMA plans, every Hugging Face fixture and
  random plans equal the NumPy executor, faults leak nothing;
- without a GPU, `cuda_usable()` is False and `CupyBackend()` raises one clear `BackendError`.

With a GPU (`cuda_usable()`), the same end-to-end tests run on the real device, plus the check
that a pass allocates nothing outside the workspace.
"""
from __future__ import annotations

import gc
import math
import subprocess
import sys
import types

import numpy as np
import pytest
import sympy
from fake_cupy import installed
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_compile import compile_at, random_graphs
from test_cuda_source import kernel_sources, llama_plan, tiny_llama_plans

from einpage.compiler import CompileOptions, compile_graph
from einpage.errors import BackendError, ExecutionError, InputError, ModelError
from einpage.ir import GraphBuilder, scalar
from einpage.ir.dtypes import DType
from einpage.ir.memgraph import ApplyNode
from einpage.ir.ops import EinsumOp, FillOp
from einpage.models import llama, resolve
from einpage.models.generation import greedy
from einpage.runtime import evaluate, executor
from einpage.runtime.backends import cuda, cuda_apply
from einpage.ir.spec import EinsumSpec
from einpage.runtime.backends.apply_plan import (SHORT_SUM, STATUS_BYTES, KernelApply,
                                                 MatmulApply, plan_applies, slot_bytes,
                                                 workspace_bytes)
from einpage.runtime.backends.gemm_plan import matmul_plan
from einpage.runtime.backends.cuda import CupyBackend, cuda_usable
from einpage.runtime.stream_executor import run_streams

GPU = cuda_usable()
from conftest import FIXTURES


# ====================================================================== the host stand-in or a GPU

@pytest.fixture
def fake_cupy(monkeypatch, tmp_path_factory):
    yield from installed(monkeypatch, tmp_path_factory)


@pytest.fixture(params=["host", "gpu"])
def device(request):
    """Makes backends: on the host against `FakeCupy`, or on a real GPU."""
    if request.param == "gpu":
        if not GPU:
            pytest.skip("no GPU: no usable CUDA device (cupy missing or no device)")
        cuda._hook_class.cache_clear()
        cuda_apply.KERNELS.clear()
        return types.SimpleNamespace(kind="gpu", fake=None)
    return types.SimpleNamespace(kind="host", fake=request.getfixturevalue("fake_cupy"))


def prepare(mg) -> None:
    """Make every kernel a plan runs (the host stand-in compiles them in one g++ run)."""
    for src in kernel_sources([mg]):
        cuda_apply.compiled(src)


# ====================================================================== CPU: apply plans, workspace

@pytest.fixture(scope="module")
def llama_plans():
    return tiny_llama_plans()


def test_every_llama_apply_has_a_plan_and_contractions_use_gemm(llama_plans):
    """Contractions run on cuBLAS but short sums (the rotary's 2x2 rotations): one kernel."""
    short = set()
    for mg in llama_plans:
        plans = plan_applies(mg)
        for n in mg.nodes:
            if not isinstance(n, ApplyNode) or not isinstance(n.op, EinsumOp):
                continue
            spec = n.op.spec
            product = scalar.scaled_product_factor(n.op.join, len(n.reads)) is not None
            if not (product and len(n.reads) == 2 and spec.contracted):
                continue
            sizes = spec.sizes([mg.tensors[r.tensor].shape for r in n.reads])
            if math.prod(sizes[c] for c in spec.contracted) <= SHORT_SUM:
                short.add(str(spec))
                assert isinstance(plans[n.id], KernelApply), (n.id, str(spec))
                assert plans[n.id].axes is not None and plans[n.id].temps == ()
            else:
                assert isinstance(plans[n.id], MatmulApply), (n.id, str(spec))
    assert {"bsngrj,surj->bsnguj", "bsnrj,surj->bsnuj"} <= short  # the prefill's rotations


def test_attention_reads_heads_in_place_and_writes_its_block():
    """Attention's operands are s-major ([b, s, n, g, u, j]): strided-batched GEMMs read each
    head with a batch stride of one head and a leading dimension of one row, and the values
    product writes its block the same way: no copies, no epilogue."""
    shapes = {"bsnguj,btnuj->bngst": [(1, 16, 4, 1, 2, 8), (1, 16, 4, 2, 8)],
              "bngst,btnrj->bsngrj": [(1, 4, 1, 16, 16), (1, 16, 4, 2, 8)]}
    for spec, (a, b) in shapes.items():
        plan = matmul_plan(EinsumSpec.parse(spec), [a, b], ("f16", "f16"), "f32", "f16", 1.0,
                           False)
        assert plan.batched and not plan.left.copy and not plan.right.copy and plan.direct
        assert plan.temps == (), spec


def test_workspace_bytes_is_positive_deterministic_and_covers_every_apply(llama_plans):
    for mg in llama_plans:
        need = workspace_bytes(mg)
        assert need == workspace_bytes(mg) == cuda.workspace_bytes(mg)
        assert need > STATUS_BYTES and need % 256 == 0
        plans = plan_applies(mg)
        assert max(slot_bytes(p) for p in plans.values()) + STATUS_BYTES == need
    _, _, again = llama_plan(DType.bf16, "prefill")
    assert workspace_bytes(again) == workspace_bytes(llama_plans[2])


# ====================================================================== CPU: no GPU here

@pytest.mark.skipif(GPU, reason="a GPU is usable here")
def test_without_a_gpu_the_backend_says_so_in_one_line():
    assert cuda_usable() is False
    with pytest.raises(BackendError) as err:
        CupyBackend()
    message = str(err.value)
    assert message.startswith("--backend cupy: no usable CUDA GPU (") and "\n" not in message
    from einpage.runtime.backends import make_backend
    from einpage.runtime.backends import resolve as resolve_backend
    assert resolve_backend("auto") == "threads"
    with pytest.raises(BackendError):
        make_backend("cupy")


def test_importing_the_backend_does_not_import_cupy():
    code = ("import sys, einpage.runtime.backends.cuda as c, einpage.runtime.backends as b; "
            "b.resolve('threads'); print('cupy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


# ====================================================================== end to end

def _paged_llama(dtype: DType, fraction: int = 4, seed: int = 3, batch: int = 2, seq: int = 6):
    cfg, weights = resolve("tiny", random_weights=True, seed=seed, dtype=dtype)
    tokens = np.random.default_rng(seed).integers(0, cfg.vocab, (batch, seq))
    graph = llama.prefill_graph(cfg).bind(B=batch, S=seq)
    compiled = compile_graph(graph, CompileOptions(cfg.weight_bytes(DType.f32) // fraction))
    return cfg, weights, tokens, compiled


def _close(got, want, dtype: DType, label: str):
    tol = {DType.f32: 1e-5, DType.f64: 1e-10}.get(dtype, 0.05)
    for name in want:
        a, b = np.asarray(got[name], np.float64), np.asarray(want[name], np.float64)
        scale = max(1.0, float(np.abs(b).max()))
        assert a.shape == b.shape, (label, name)
        assert float(np.abs(a - b).max()) <= tol * scale, f"{label} {name}: " \
            f"max abs error {np.abs(a - b).max():.3e}"


@pytest.mark.parametrize("dtype", [DType.f32, DType.bf16, DType.f16])
@pytest.mark.parametrize("fraction", [4, 12])
def test_paged_llama_equals_the_numpy_executor(device, dtype, fraction):
    cfg, weights, tokens, compiled = _paged_llama(dtype, fraction)
    mg = compiled.memgraph
    assert compiled.report.traffic.reload_bytes > 0
    want = executor.run(mg, {"tokens": tokens}, weights)
    prepare(mg)
    backend = CupyBackend()
    got = run_streams(mg, {"tokens": tokens}, weights, backend=backend).outputs
    _close(got, want, dtype, f"{device.kind} {dtype} 1/{fraction}")
    assert backend.arena is None


@pytest.mark.parametrize("parallel", ["pipeline", "tensor"])
def test_a_pipelines_ranks_on_the_cupy_backend(device, parallel):
    """Two ranks, each on a backend of its own (two threads of one process, a local group):
    sends copy their blocks out on the send stream, recvs refill the pinned copies the reloads
    read, and nothing is captured; the logits equal one device's NumPy executor (a pipeline's
    from its last rank; tensor parallelism's, every rank's slice of the vocabulary joined)."""
    from einpage.compiler.parallel import compile_parallel
    from einpage.runtime.comm import LocalCommunicator
    from einpage.runtime.ranks import run_rank, run_together
    from einpage.runtime.shards import assemble
    cfg, weights, tokens, compiled = _paged_llama(DType.f32, 6)
    graph = llama.prefill_graph(cfg).bind(B=tokens.shape[0], S=tokens.shape[1])
    pipeline = compile_parallel(graph, 2, CompileOptions(cfg.weight_bytes() // 6), parallel)
    for src in kernel_sources(pipeline.programs):  # both ranks' kernels in one build
        cuda_apply.compiled(src)
    passes = [tokens, (tokens * 7 + 1) % cfg.vocab]  # a stale pinned copy shows in pass 2
    want = [executor.run(compiled.memgraph, {"tokens": t}, weights)["logits"] for t in passes]
    comms = LocalCommunicator.group(2, timeout=60)
    backends = [CupyBackend(), CupyBackend()]
    results = run_together({r: (lambda r=r: run_rank(pipeline.programs[r], comms[r],
                                                     [{"tokens": t} for t in passes], weights,
                                                     backend=backends[r]))
                            for r in range(2)}, comms)
    got = assemble(pipeline.programs, results)["logits"]
    n = tokens.shape[0]
    assert got.shape[0] == 2 * n  # two passes: the second not captured
    for k in range(2):
        _close({"logits": got[k * n:(k + 1) * n]}, {"logits": want[k]}, DType.f32,
               f"{device.kind} {parallel}, pass {k + 1}")
    assert all(b.arena is None for b in backends)


def test_tight_budget_offloads_and_decodes_greedily(device):
    cfg, weights = resolve("tiny", random_weights=True, seed=5)
    prompt = np.array([[4, 8, 15, 16], [23, 42, 1, 2]]) % cfg.vocab
    options = CompileOptions(cfg.weight_bytes() // 8)

    def streams(graph, inputs):
        mg = compile_graph(graph, options).memgraph
        prepare(mg)
        return run_streams(mg, inputs, weights, backend=CupyBackend()).outputs

    def numpy(graph, inputs):
        return executor.run(compile_graph(graph, options).memgraph, inputs, weights)

    np.testing.assert_array_equal(greedy(cfg, prompt, 4, streams), greedy(cfg, prompt, 4, numpy))
    graph = llama.prefill_graph(cfg).bind(B=2, S=8)
    options = CompileOptions(9_000)
    compiled = compile_graph(graph, options)
    assert compiled.report.traffic.offload_count > 0
    tokens = np.arange(16).reshape(2, 8) % cfg.vocab
    _close(streams(graph, {"tokens": tokens}), numpy(graph, {"tokens": tokens}), DType.f32,
           f"{device.kind} offloading")


def _fixtures():
    if not FIXTURES.is_dir():
        return ["missing"]
    return sorted(p.name for p in FIXTURES.iterdir() if (p / "model.safetensors").exists())


@pytest.mark.parametrize("name", _fixtures())
def test_fixture_logits_under_paging(device, name, record_error):
    path = FIXTURES / name
    if not (path / "model.safetensors").exists():
        pytest.skip(f"Hugging Face fixture {path} not found")
    try:
        cfg, weights = resolve(str(path))
    except ModelError as exc:
        pytest.skip(f"{name}: {exc}")
    ids = np.load(path / "input_ids.npy")
    want = np.load(path / "logits.npy")
    graph = llama.prefill_graph(cfg).bind(B=ids.shape[0], S=ids.shape[1])
    compiled = compile_graph(graph, CompileOptions(cfg.weight_bytes() // 4))
    mg = compiled.memgraph
    assert compiled.report.traffic.reload_bytes > 0
    reference = executor.run(mg, {"tokens": ids}, weights)["logits"]
    prepare(mg)
    got = run_streams(mg, {"tokens": ids}, weights, backend=CupyBackend()).outputs["logits"]
    err_numpy = float(np.abs(got - reference).max())
    err_hf = float(np.abs(got - want).max())
    record_error(f"{name}: cupy ({device.kind}) vs numpy executor", err_numpy)
    record_error(f"{name}: cupy ({device.kind}) vs transformers", err_hf)
    # float32 rounding of this fixture: the dense reference in float32 against float64 (the
    # family fixtures' sharp attention makes it ~1e-5; see tests/test_families.py)
    from einpage.runtime import reference as dense
    exact = dense.evaluate(graph, {"tokens": ids}, weights, float64=True)["logits"]
    rounding = float(np.abs(dense.evaluate(graph, {"tokens": ids}, weights)["logits"]
                            - exact).max())
    tol = max(1e-5, 3 * rounding)
    # transformers' float32 logits carry their own rounding: its distance from the exact ones
    hf_rounding = float(np.abs(want - exact).max())
    assert err_numpy < tol and err_hf < tol + hf_rounding, (err_numpy, err_hf, rounding,
                                                            hf_rounding)


def _hand_plans():
    """Memgraphs built by hand (as in test_executor) for what compiled plans rarely hold: an
    apply writing into the bytes it frees (a transpose and a GEMM: staged through the
    workspace), pieces that cannot be reshaped in place, a copy into a viewed write, gathers,
    fills and copies accumulating, an input at device issued during the pass (staging slot),
    an offloaded output, and f64 arithmetic on bf16 storage."""
    from test_executor import Plan, einsum, whole_input

    from einpage.ir.ops import CopyOp, GatherOp, Piece

    x0 = scalar.x(0)
    rng = np.random.default_rng(7)
    cases = {}

    p = Plan(1 << 14)
    x, nx = whole_input(p, "x", (8, 16), 0)
    w, nw = whole_input(p, "w", (8, 16), 2048)
    y, z = p.tensor((16, 8)), p.tensor((16, 16))
    ny = p.apply(einsum("ij->ji", 2 * x0), [(x, 0)], (y, 0), [nx], frees=[(x, 0)])
    p.apply(einsum("ij,jk->ik"), [(y, 0), (w, 2048)], (z, 0), [ny, nw], frees=[(y, 0)])
    p.output(z, "device", 0, "z")
    cases["frees"] = (p.build(), {"x": rng.standard_normal((8, 16)).astype(np.float32),
                                  "w": rng.standard_normal((8, 16)).astype(np.float32)}, {})

    p = Plan(1 << 14)
    x, nx = whole_input(p, "x", (4, 6), 0)
    m, v = p.tensor((2, 6)), p.tensor((3, 4))
    p.apply(CopyOp((Piece(0, ((0, 4), (1, 4)), ((0, 2), (0, 6))),)), [(x, 0)], (m, 256), [nx])
    p.apply(CopyOp((Piece(0, ((1, 2), (0, 6)), ((0, 1), (0, 6))),
                    Piece(0, ((0, 2), (3, 6)), ((1, 2), (0, 6)))), view=(2, 6)),
            [(x, 0)], (v, 512), [nx])
    p.output(m, "device", 256, "m")
    p.output(v, "device", 512, "v")
    cases["pieces"] = (p.build(), {"x": rng.standard_normal((4, 6)).astype(np.float32)}, {})

    p = Plan(1 << 14)
    t0 = p.block("table", (4, 3), (0, 0), (2, 3), role="weight")
    t1 = p.block("table", (4, 3), (2, 0), (2, 3), role="weight")
    r0 = p.reload(t0, 0, [p.input(t0, "host")])
    r1 = p.reload(t1, 256, [p.input(t1, "host")])
    ids, nids = whole_input(p, "ids", (3,), 512, dtype="i64")
    y, zz = p.tensor((3, 3)), p.tensor((4, 3), "f16")
    g0 = p.apply(GatherOp(0), [(t0, 0), (ids, 512)], (y, 768), [r0, nids])
    g1 = p.apply(GatherOp(2), [(t1, 256), (ids, 512)], (y, 768), [r1, nids, g0],
                 accumulate=True)
    f = p.apply(FillOp(scalar.index(0) - scalar.index(1) / 3, (1, 0)), [], (y, 768), [g1],
                accumulate=True)
    fz = p.apply(FillOp(sympy.Float(1.5) + 0 * scalar.index(0), (0, 0)), [], (zz, 1024), [])
    p.apply(CopyOp((Piece(0, ((0, 2), (0, 3)), ((1, 3), (0, 3))),)), [(y, 768)], (zz, 1024),
            [f, fz], accumulate=True)
    p.output(y, "device", 768, "y")
    p.output(zz, "device", 1024, "zz")
    cases["accumulate"] = (p.build(), {"ids": np.array([3, 0, 2])},
                           {"table": rng.standard_normal((4, 3)).astype(np.float32)})

    p = Plan(1 << 14)
    x, nx = whole_input(p, "x", (4, 4), 0, dtype="bf16")
    y, z = p.tensor((4, 4), "bf16"), p.tensor((4, 4))
    ny = p.apply(einsum("ij->ij", scalar.exp(x0) / 3, dtype="f64"), [(x, 0)], (y, 256), [nx])
    p.offload(y, 256, [ny])
    free = p.free(x, 0, [ny])
    u = p.block("u", (4, 4), (0, 0), (4, 4))
    nu = p.input(u, "device", 0, [free])
    p.apply(einsum("ij,ij->ij", scalar.x(0) * scalar.x(1)), [(y, 256), (u, 0)], (z, 512),
            [ny, nu])
    p.output(y, "host", None, "y")
    p.output(z, "device", 512, "z")
    cases["staging"] = (p.build(), {"x": rng.standard_normal((4, 4)).astype(DType.bf16.numpy),
                                    "u": rng.standard_normal((4, 4)).astype(np.float32)}, {})
    return cases


@pytest.mark.parametrize("case", ["frees", "pieces", "accumulate", "staging"])
def test_hand_made_plans_equal_the_numpy_executor(device, case):
    mg, inputs, weights = _hand_plans()[case]
    want = executor.run(mg, inputs, weights.__getitem__)
    plans = plan_applies(mg)
    if case == "frees":
        assert all(not p.plan.direct if isinstance(p, MatmulApply) else p.staged
                   for p in plans.values())
    if case == "pieces":
        assert any(q.temp for p in plans.values() for q in p.pieces)
    prepare(mg)
    got = run_streams(mg, inputs, weights.__getitem__, backend=CupyBackend()).outputs
    for name in want:
        np.testing.assert_allclose(np.asarray(got[name], np.float64),
                                   np.asarray(want[name], np.float64), rtol=1e-6, atol=1e-6,
                                   err_msg=f"{case}: {name}")


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(case=random_graphs(), block=st.sampled_from([256, 1024, 4096]),
       slack=st.sampled_from([1.0, 1.3, 2.0, 100.0]),
       policy=st.sampled_from(["reuse-distance", "lru", "layerwise"]))
def test_random_plans_equal_the_numpy_executor(device, case, block, slack, policy):
    graph, arrays, weights = case
    compiled = compile_at(graph, block, slack, policy)
    if compiled is None:
        return
    mg = compiled.memgraph
    want = executor.run(mg, arrays, weights.__getitem__)
    dense = evaluate(graph, arrays, weights.__getitem__, float64=True)
    prepare(mg)
    got = run_streams(mg, arrays, weights.__getitem__, backend=CupyBackend()).outputs
    for name in want:
        where = f"{name} ({policy}, slack {slack}, block {block})"
        np.testing.assert_allclose(got[name], want[name], rtol=1e-9, atol=1e-9, err_msg=where)
        np.testing.assert_allclose(got[name], dense[name], rtol=1e-9, atol=1e-9, err_msg=where)


def test_a_gather_out_of_range_is_an_input_error(device):
    g = GraphBuilder()
    table = g.input("table", (5, 3), "f32", role="weight")
    ids = g.input("ids", (4,), "i64")
    g.output("rows", g.gather(table, ids))
    mg = compile_graph(g.build(), CompileOptions(1 << 16)).memgraph
    weights = {"table": np.arange(15, dtype=np.float32).reshape(5, 3)}
    prepare(mg)
    backend = CupyBackend()
    got = run_streams(mg, {"ids": np.array([4, 0, 2, 2])}, weights.__getitem__,
                      backend=backend).outputs
    np.testing.assert_array_equal(got["rows"], weights["table"][[4, 0, 2, 2]])
    with pytest.raises(InputError, match="index 9 out of range for a table of 5 rows"):
        run_streams(mg, {"ids": np.array([1, 9, 0, 0])}, weights.__getitem__, backend=backend)
    assert backend.arena is None


class _Faulty(CupyBackend):
    """Raises inside the `after`-th call of `where` (run or copy_h2d)."""

    def __init__(self, where: str, after: int, **options):
        super().__init__(**options)
        self.where, self.after, self.calls = where, after, 0

    def _tick(self, where: str) -> None:
        if where == self.where:
            self.calls += 1
            if self.calls == self.after:
                raise RuntimeError(f"injected fault in {where}")

    def run(self, n):
        self._tick("run")
        super().run(n)

    def copy_h2d(self, n):
        self._tick("copy_h2d")
        super().copy_h2d(n)


@pytest.mark.parametrize("where, after", [("run", 1), ("run", 30), ("copy_h2d", 3)])
def test_a_fault_stops_every_queue_and_frees_the_arena(device, where, after):
    cfg, weights, tokens, compiled = _paged_llama(DType.f32, 4)
    mg = compiled.memgraph
    prepare(mg)
    big = 1 << 30 if device.kind == "gpu" else None
    free_before = _free_device_bytes(device)
    backend = _Faulty(where, after, workspace_bytes=big)
    with pytest.raises(ExecutionError, match="injected fault"):
        run_streams(mg, {"tokens": tokens}, weights, backend=backend)
    assert backend.arena is None and backend.host is None
    if device.kind == "host":  # freed at close, even with the traceback alive
        from einpage.runtime.backends.pinned import PinnedWeights
        store = PinnedWeights.for_source(device.fake, weights)  # the model's pinned weights
        kept = {id(mem) for mem, _ in store.blocks.values()}
        assert not list(device.fake.live)
        assert all(id(mem) in kept for mem in device.fake.pinned_live)
    else:
        gc.collect()
        assert _free_device_bytes(device) > free_before - (256 << 20)
    backend.close()  # idempotent


def _free_device_bytes(device) -> int:
    if device.kind != "gpu":
        return 0
    import cupy
    return int(cupy.cuda.runtime.memGetInfo()[0])


def test_a_pass_allocates_nothing_outside_the_workspace(device):
    cfg, weights, tokens, compiled = _paged_llama(DType.bf16, 4)
    mg = compiled.memgraph
    prepare(mg)
    backend = CupyBackend()
    for _ in range(2):  # the second pass: kernels compiled, handles made
        run_streams(mg, {"tokens": tokens}, weights, backend=backend)
        assert backend.hook.allocations == 0, backend.hook.bytes
        assert backend.hidden_allocations == 0, backend.hidden_bytes
    assert backend.workspace_bytes == 0  # closed
    assert workspace_bytes(mg) > STATUS_BYTES


def test_a_workspace_below_the_plans_need_is_refused(device):
    cfg, weights, tokens, compiled = _paged_llama(DType.f32, 4)
    backend = CupyBackend(workspace_bytes=STATUS_BYTES)
    if workspace_bytes(compiled.memgraph) == STATUS_BYTES:
        pytest.skip("this plan needs no workspace slots")
    with pytest.raises(BackendError, match="below the"):
        run_streams(compiled.memgraph, {"tokens": tokens}, weights, backend=backend)
    assert backend.arena is None


def test_measured_timing_spans_every_node(device):
    cfg, weights, tokens, compiled = _paged_llama(DType.f32, 4)
    mg = compiled.memgraph
    prepare(mg)
    result = run_streams(mg, {"tokens": tokens}, weights, backend=CupyBackend())
    measured = result.measured
    assert measured.backend == "cupy"
    spans = measured.spans
    assert {s.queue for s in spans} >= {"compute", "h2d"}
    assert all(s.end >= s.start >= 0 for s in spans)


def test_decode_session_keeps_kv_rows_in_place(device):
    """A decode plan held open across steps on cupy, with some KV blocks resident and some
    streamed: each step's rows are written into the arena or the pinned copy, and the second
    step's logits equal the threads backend's."""
    from einpage.models.generation import decode_step_graph, prefill
    from einpage.models.kvstore import KVStore
    from einpage.runtime.backends.threads import ThreadsBackend
    from einpage.runtime.stream_executor import StreamSession
    cfg, weights = resolve("tiny", random_weights=True, seed=5)
    prompt = np.array([[4, 8, 15, 16, 23], [42, 1, 2, 3, 5]]) % cfg.vocab
    graph = decode_step_graph(cfg, 2, 8)
    for divisor in (1, 1.5, 2, 3, 4, 6, 8):
        compiled = compile_graph(graph, CompileOptions(int(cfg.weight_bytes() / divisor)))
        c = compiled.report.compiled
        if 0 < c.kv_resident_bytes < c.kv_bytes:
            break
    else:
        pytest.fail("no budget splits the KV store")
    mg = compiled.memgraph
    prepare(mg)

    def two_steps(backend):
        store = KVStore(cfg, 2, 8)
        out = prefill(cfg, prompt, lambda g, i: evaluate(g, i, weights))
        store.fill(out)
        last = np.argmax(out["logits"][:, -1], axis=-1)
        with StreamSession(mg, weights, backend) as session:
            for _ in range(2):
                step = session.run({"tokens": last[:, None], "pos": store.pos.copy(),
                                    **store.view(8)}).outputs
                for name, lead, row in store.write(step):
                    session.write(name, lead, row)
                last = np.argmax(step["logits"][:, -1], axis=-1)
        return step["logits"]

    want = two_steps(ThreadsBackend())
    backend = CupyBackend()
    got = two_steps(backend)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    assert backend.arena is None
