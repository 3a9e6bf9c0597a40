"""The CuPy backend (`einpage.runtime.backends.cuda`, planned by `cuda_kernels`).

On any machine:
- GEMM plans for many specs, run with `xp=numpy`, equal `np.einsum`, and the views they claim
  need no copy are views; kernel layouts and no-copy reshapes equal NumPy's;
- the generated C: every join and fill of the LLaMA graphs is valid C99 (`cc`), every kernel
  compiles for the device (`nvcc`, where present), and runs on the host (`g++`) with NumPy's
  results;
- the whole backend runs on the host against a stand-in for CuPy (`_FakeCupy`: NumPy arrays over
  raw memory, kernels compiled by g++, and the conditions under which CuPy would allocate a
  temporary turned into assertion errors): LLaMA plans, every Hugging Face fixture and random
  plans equal the NumPy executor, faults leak nothing;
- without a GPU, `cuda_usable()` is False and `CupyBackend()` raises one clear `BackendError`.

With a GPU (`cuda_usable()`), the same end-to-end tests run on the real device, plus the check
that a pass allocates nothing outside the workspace.
"""
from __future__ import annotations

import ctypes
import gc
import hashlib
import math
import re
import shutil
import subprocess
import sys
import threading
import time
import types
import weakref
from pathlib import Path

import numpy as np
import pytest
import sympy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_compile import compile_at, random_graphs

from einpage.compiler import CompileOptions, compile_graph
from einpage.errors import BackendError, ExecutionError, InputError, ModelError, PlanError
from einpage.ir import GraphBuilder, scalar
from einpage.ir.dtypes import DType
from einpage.ir.memgraph import ApplyNode
from einpage.ir.ops import EinsumOp, FillOp
from einpage.ir.spec import EinsumSpec
from einpage.models import llama, resolve
from einpage.models.config import preset
from einpage.models.generation import greedy
from einpage.runtime import evaluate, executor, kernels
from einpage.runtime.backends import cuda
from einpage.runtime.backends import cuda_kernels as ck
from einpage.runtime.backends.cuda import CupyBackend, cuda_usable
from einpage.runtime.stream_executor import run_streams

GPU = cuda_usable()
CXX = shutil.which("g++") or shutil.which("c++")
CC = shutil.which("cc") or shutil.which("gcc")
NVCC = shutil.which("nvcc")
FIXTURES = Path(__file__).resolve().parent.parent.parent / "shared" / "fixtures"
needs_gpu = pytest.mark.skipif(not GPU, reason="no usable CUDA GPU (cupy missing or no device)")


# ====================================================================== plans of LLaMA graphs

def llama_plan(dtype: DType = DType.f32, phase: str = "prefill", budget: int = 40_000):
    cfg = preset("tiny").with_dtype(dtype)
    graph = (llama.prefill_graph(cfg).bind(B=2, S=5) if phase == "prefill"
             else llama.decode_graph(cfg).bind(B=2, P=3))
    return cfg, graph, compile_graph(graph, CompileOptions(budget)).memgraph


@pytest.fixture(scope="module")
def llama_plans():
    return [llama_plan(dt, ph)[2] for dt in (DType.f32, DType.bf16, DType.f16)
            for ph in ("prefill", "decode")]


def kernel_sources(mgs) -> list:
    seen = {}
    for mg in mgs:
        for plan in ck.plan_applies(mg).values():
            for src in ck.plan_kernels(plan):
                seen.setdefault(src.name, src)
    return [seen[k] for k in sorted(seen)]


# ====================================================================== CPU: GEMM plans

SPECS = ["ab,bc->ac", "ab,cb->ac", "ba,bc->ca", "bhqd,bhkd->bhqk", "bsm,fm->bsf", "bsf,mf->bsm",
         "bsm,ngrjm->bsngrj", "bsngrj,mngrj->bsm", "bngst,btnrj->bsngrj", "bsnguj,btnuj->bngst",
         "bsngrj,surj->bsnguj", "ab,b->a", "a,a->", "abc,cd->dba", "ka,kb->ba", "xab,xbc->cax",
         "b,b->b", "ij,j->i", "j,ij->i"]


def _reference_apply(spec, a, b, factor, write, accumulate, compute):
    part = kernels.einsum(EinsumSpec.parse(spec), factor * scalar.product(2), "sum", [a, b],
                          compute)
    if accumulate:
        part = kernels.combine("sum", write.astype(compute), part)
    return part.astype(write.dtype)


def _run_plan(spec, shapes, tags, out_tag, factor, accumulate, seed=0):
    """(plan, result, reference, operands) of one GEMM apply run with NumPy; Nones without a
    GEMM form."""
    rng = np.random.default_rng(seed)
    es = EinsumSpec.parse(spec)
    compute_tag = ("f64" if "f64" in tags or out_tag == "f64" else
                   "f16" if set(tags) == {"f16"} else "f32")
    plan = ck.matmul_plan(es, shapes, tags, compute_tag, out_tag, factor, accumulate)
    if plan is None:
        return None, None, None, None
    a, b = (rng.standard_normal(s).astype(DType(t).numpy) for s, t in zip(shapes, tags))
    write = rng.standard_normal(es.output_shape(shapes)).astype(DType(out_tag).numpy)
    want = _reference_apply(spec, a, b, factor, write, accumulate, DType(compute_tag).compute)
    got = write.copy()
    ck.execute_matmul(plan, ck.MatmulOps(np, plan), a, b, got)
    return plan, got, want, (a, b)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("factor, accumulate", [(1.0, False), (0.25, False), (1.0, True),
                                                (0.5, True)])
@pytest.mark.parametrize("tags, out_tag", [(("f64", "f64"), "f64"), (("f32", "f32"), "f32"),
                                           (("bf16", "f32"), "bf16"), (("f16", "f16"), "f32"),
                                           (("f16", "f16"), "f16")])
def test_matmul_plans_equal_einsum(spec, factor, accumulate, tags, out_tag):
    es = EinsumSpec.parse(spec)
    rng = np.random.default_rng(len(spec))
    sizes = {c: int(rng.integers(2, 5)) for c in set("".join(es.inputs))}
    shapes = [tuple(sizes[c] for c in t) for t in es.inputs]
    plan, got, want, _ = _run_plan(spec, shapes, tags, out_tag, factor, accumulate)
    if not es.contracted:
        assert plan is None  # a product without a sum runs as an elementwise kernel
        return
    assert plan is not None
    tol = 1e-12 if out_tag == "f64" else (2e-2 if {"bf16", "f16"} & {*tags, out_tag} else 1e-4)
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol,
                               atol=tol, err_msg=f"{spec}: {plan}")


@st.composite
def two_operand_specs(draw):
    letters = "abcdef"
    used = draw(st.lists(st.sampled_from(letters), min_size=1, max_size=5, unique=True))
    a = draw(st.permutations(used)).copy()[:draw(st.integers(0, len(used)))]
    rest = [c for c in used if c not in a]
    b = draw(st.permutations(used))[:draw(st.integers(0, len(used)))]
    b = list(dict.fromkeys(list(b) + rest))
    both = [c for c in dict.fromkeys(a + b)]
    out = [c for c in draw(st.permutations(both)) if draw(st.booleans())]
    sizes = {c: draw(st.integers(1, 4)) for c in both}
    return f"{''.join(a)},{''.join(b)}->{''.join(out)}", sizes


@settings(max_examples=150, deadline=None)
@given(case=two_operand_specs(), factor=st.sampled_from([1.0, 0.5]), accumulate=st.booleans(),
       direct_dtype=st.booleans(), seed=st.integers(0, 100))
def test_random_matmul_plans_equal_einsum(case, factor, accumulate, direct_dtype, seed):
    spec, sizes = case
    es = EinsumSpec.parse(spec)
    shapes = [tuple(sizes[c] for c in t) for t in es.inputs]
    tags = ("f64", "f64") if direct_dtype else ("f32", "f64")
    plan, got, want, operands = _run_plan(spec, shapes, tags, "f64", factor, accumulate, seed)
    if plan is None:
        a, b = es.inputs
        assert not es.contracted or any(c not in es.output for c in set(a) ^ set(b))
        return
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=str(plan))
    # what the plan reads without a copy is a view of the operand (no hidden copy in reshape)
    x, y = operands[::-1] if plan.swap else operands
    for arr, op in ((x, plan.left), (y, plan.right)):
        if not op.copy:
            view = arr.transpose(op.perm).reshape(op.gemm_shape)
            assert np.shares_memory(view, arr) or arr.size <= 1
            assert view.flags.c_contiguous or (not plan.batched and view.flags.f_contiguous)
    if plan.direct:
        out = np.empty(es.output_shape(shapes))
        assert np.shares_memory(out.reshape(plan.c_shape), out)


def test_weight_matmuls_need_no_copy():
    """LLaMA's projections read Hugging Face's [out, in] weights transposed in place."""
    plan = ck.matmul_plan(EinsumSpec.parse("bsm,fm->bsf"), [(1, 6, 32), (48, 32)],
                          ("f32", "f32"), "f32", "f32", 1.0, False)
    assert not plan.batched and not plan.left.copy and not plan.right.copy and plan.direct
    assert plan.temps == ()
    staged = ck.matmul_plan(EinsumSpec.parse("bsm,fm->bsf"), [(1, 6, 32), (48, 32)],
                            ("f32", "f32"), "f32", "f32", 1.0, False, staged=True)
    assert not staged.direct and staged.temps == (6 * 48 * 4,)


def test_f16_projections_run_natively():
    """f16 x f16 -> f16 without scale or accumulation: no conversions, no output slot (cuBLAS
    accumulates in float32 and rounds once); with accumulation both operands go to float32."""
    spec, shapes = EinsumSpec.parse("bsm,vm->bsv"), [(1, 6, 32), (64, 32)]
    plan = ck.matmul_plan(spec, shapes, ("f16", "f16"), "f16", "f16", 1.0, False)
    assert plan.dtype == np.float16 and plan.direct and plan.temps == ()
    plan = ck.matmul_plan(spec, shapes, ("f16", "f16"), "f16", "f16", 1.0, True)
    assert plan.dtype == np.float32 and plan.left.copy and plan.right.copy and not plan.direct


def test_dot_products_stay_batched():
    """A 1x1 GEMM would make CuPy reduce with temporaries: plans keep it 3-d."""
    plan = ck.matmul_plan(EinsumSpec.parse("a,a->"), [(5,), (5,)], ("f32", "f32"), "f32",
                          "f32", 1.0, False)
    assert plan.batched and plan.c_shape == (1, 1, 1)


# ====================================================================== CPU: layouts

@settings(max_examples=100, deadline=None)
@given(case=two_operand_specs(), agg=st.sampled_from(["sum", "max", "min"]),
       seed=st.integers(0, 100))
def test_kernel_layouts_equal_reference(case, agg, seed):
    """The broadcast views a generated kernel reads (`operand_layout`) give the reference."""
    spec, sizes = case
    es = EinsumSpec.parse(spec)
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal(tuple(sizes[c] for c in t)) for t in es.inputs]
    join = scalar.exp(scalar.x(0) / 4) - scalar.x(1)
    want = kernels.einsum(es, join, agg if es.contracted else None, arrays, np.dtype(np.float64))
    order = es.join_indices
    views = [np.lib.stride_tricks.as_strided(a, *ck.operand_layout(t, order, sizes, 8))
             for a, t in zip(arrays, es.inputs)]
    value = scalar.join_function(join, 2)(*views)
    if es.contracted:
        value = {"sum": np.sum, "max": np.max, "min": np.min}[agg](
            value, axis=tuple(range(len(es.output), len(order))))
    np.testing.assert_allclose(value, want, rtol=1e-12, atol=1e-12)


@settings(max_examples=200, deadline=None)
@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=4), data=st.data())
def test_nocopy_reshape_strides_match_numpy(shape, data):
    base = np.arange(int(np.prod(shape)) * 2, dtype=np.float32).reshape([2] + shape)
    view = base[1].transpose(data.draw(st.permutations(range(len(shape)))))
    if data.draw(st.booleans()) and view.shape[0] > 1:
        view = view[:-1]
    sizes = [int(v) for v in np.array(view.shape)]
    factors = data.draw(st.permutations(sizes))
    newshape = [int(np.prod(factors))] if data.draw(st.booleans()) else factors
    newshape = data.draw(st.sampled_from([newshape, sizes[::-1], [1] + sizes]))
    if int(np.prod(newshape)) != view.size:
        return
    strides = ck.nocopy_reshape_strides(view.shape, view.strides, newshape, 4)
    try:
        expected = view.reshape(newshape, copy=False)
    except ValueError:
        assert strides is None
        return
    assert strides is not None
    got = np.lib.stride_tricks.as_strided(view, newshape, strides)
    np.testing.assert_array_equal(got, expected)


# ====================================================================== CPU: generated C

def _joins_and_fills(mgs):
    joins, fills = {}, {}
    for mg in mgs:
        for n in mg.nodes:
            if isinstance(n, ApplyNode) and isinstance(n.op, EinsumOp):
                ctype = ck.COMPUTE_CTYPE[n.op.dtype.value]
                joins[(scalar.to_text(n.op.join), len(n.reads), ctype)] = n.op.join
            elif isinstance(n, ApplyNode) and isinstance(n.op, FillOp):
                fills[(scalar.to_text(n.op.expr), len(mg.tensors[n.write.tensor].shape))] = \
                    n.op.expr
    return joins, fills


@pytest.mark.skipif(CC is None, reason="no C compiler (cc/gcc)")
def test_every_llama_join_and_fill_is_valid_c99(tmp_path, llama_plans):
    joins, fills = _joins_and_fills(llama_plans)
    assert len(joins) >= 8 and len(fills) >= 2
    parts = [ck.PREAMBLE]
    for k, ((_, nargs, ctype), join) in enumerate(sorted(joins.items(), key=str)):
        parts.append(ck.join_function(join, nargs, ctype, f"join_{k}"))
    for k, ((_, ndim), expr) in enumerate(sorted(fills.items(), key=str)):
        parts.append(ck.fill_function(expr, ndim, f"fill_{k}"))
    # a float function using them, so nothing is optimised away unseen
    parts.append("float ep_use(float x) { return x + (float)join_0(x, x); }\n")
    source = tmp_path / "joins.c"
    source.write_text("\n".join(parts))
    result = subprocess.run([CC, "-std=c99", "-Wall", "-Werror=implicit-function-declaration",
                             "-c", str(source), "-o", str(tmp_path / "joins.o")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr + "\n" + source.read_text()


def test_printer_spells_what_numpy_computes():
    x0 = scalar.x(0)
    assert ck.c_expression(x0 ** 2, "float") == "((x0)*(x0))"
    assert ck.c_expression(scalar.rsqrt(x0 / 128 + 1e-6), "float").startswith("(1.0F/sqrtf(")
    assert "9.99999997e-07F" in ck.c_expression(x0 + 1e-6, "float")  # the float32 NumPy uses
    assert ck.c_expression(sympy.Piecewise((0, x0 > 1), (-sympy.oo, True)), "double") == \
        "((x0 > 1) ? ( 0 ) : ( (-EP_INF) ))"
    assert ck.c_expression(sympy.pi * x0, "double") == "3.141592653589793*x0"


def test_fill_with_an_unbound_symbol_is_a_plan_error():
    with pytest.raises(PlanError, match="bind every size symbol"):
        ck.fill_function(scalar.index(0) + scalar.size_symbol("P"), 1)


# ---------------------------------------------------------------------- host execution (g++)

_CT = {"float16": "float16", "uint16": "unsigned short", "float32": "float",
       "float64": "double", "int64": "long long", "int32": "int"}
_NP = {"float16": np.float16, "uint16": np.uint16, "float32": np.float32, "float64": np.float64,
       "int64": np.int64, "int32": np.int32}

_HOST_HEADER = r"""
#include <math.h>
#include <string.h>
#include <stdbool.h>
#include <stddef.h>
struct float16 {
  _Float16 v;
  float16() {}
  float16(float f) : v((_Float16)f) {}
  operator float() const { return (float)v; }
};
template <class T> struct RawArr { T* p; T& operator[](long long k) const { return p[k]; } };
"""


class _Param:
    def __init__(self, text: str, is_input: bool):
        words = text.split()
        self.raw = words[0] == "raw"
        self.type, self.name = words[-2], words[-1]
        self.is_input = is_input
        # our kernels' convention: a*, y are broadcast arrays; other non-raw params are scalars
        self.array = self.raw or re.fullmatch(r"a\d+|y", self.name) is not None

    @property
    def ctype(self) -> str:
        return _CT[self.type]


def _params(in_params: str, out_params: str) -> list[_Param]:
    return ([_Param(p, True) for p in in_params.split(",") if p.strip()]
            + [_Param(p, False) for p in out_params.split(",") if p.strip()])


def _offsets(arrays: list[_Param], flat: str) -> str:
    n = max(len(arrays), 1)
    return (f"long long off[{n}] = {{0}}; {{ long long q = {flat}; "
            "for (int d = ndim - 1; d >= 0; --d) { long long ix = q % shape[d]; q /= shape[d]; "
            f"for (int k = 0; k < {len(arrays)}; ++k) off[k] += ix * strides[k * ndim + d]; }} }}")


def _bind(params: list[_Param], arrays: list[_Param]) -> str:
    lines, s = [], 0
    for p in params:
        if not p.array:
            lines.append(f"const {p.ctype} {p.name} = ({p.ctype})sc[{s}];")
            s += 1
            continue
        k = arrays.index(p)
        if p.raw:
            const = "const " if p.is_input else ""
            lines.append(f"RawArr<{const}{p.ctype}> {p.name}{{({const}{p.ctype}*)A[{k}]}};")
    return "\n".join(lines)


def _refs(arrays: list[_Param], outputs: bool) -> str:
    out = []
    for k, p in enumerate(arrays):
        if p.raw or (not p.is_input) != outputs:
            continue
        const = "const " if p.is_input else ""
        out.append(f"{const}{p.ctype} &{p.name} = *({const}{p.ctype}*)(A[{k}] + off[{k}]);")
    return " ".join(out)


def _host_source(src) -> str:
    ns = f"ns_{src.name}"
    head = f"namespace {ns} {{\n{src.preamble}\n}}\n"
    sig = (f'extern "C" void {src.name}(void** A_, const long long* shape, '
           "const long long* strides, int ndim, long long size, int nout, const long long* sc)")
    if isinstance(src, ck.ElementwiseSource):
        params = _params(src.in_params, src.out_params)
        arrays = [p for p in params if p.array]
        return head + f"""{sig} {{
  using namespace {ns};
  char** A = (char**)A_; (void)nout;
  {_bind(params, arrays)}
  for (long long i = 0; i < size; ++i) {{
    {_offsets(arrays, "i")}
    {_refs(arrays, False)} {_refs(arrays, True)}
    {src.operation};
  }}
}}
"""
    params = _params(src.in_params, src.out_params)
    arrays = [p for p in params if p.array]
    return head + f"""#define REDUCE(a, b) ({src.reduce_expr})
#define POST_MAP(a) ({src.post_map_expr})
{sig} {{
  using namespace {ns};
  typedef {src.reduce_type} _type_reduce;
  char** A = (char**)A_;
  {_bind(params, arrays)}
  long long outsize = 1, redsize = 1;
  for (int d = 0; d < ndim; ++d) {{ if (d < nout) outsize *= shape[d]; else redsize *= shape[d]; }}
  for (long long o = 0; o < outsize; ++o) {{
    _type_reduce _s = _type_reduce({src.identity});
    for (long long r = 0; r < redsize; ++r) {{
      {_offsets(arrays, "o * redsize + r")}
      {_refs(arrays, False)}
      _type_reduce _a = static_cast<_type_reduce>({src.map_expr});
      _s = REDUCE(_s, _a);
    }}
    {{ {_offsets(arrays, "o * redsize")}
      {_refs(arrays, True)}
      POST_MAP(_s); }}
  }}
}}
#undef REDUCE
#undef POST_MAP
"""


class HostKernels:
    """Generated kernels compiled for the host by g++, in batches, loaded with ctypes."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.pending: dict = {}
        self.functions: dict = {}

    def add(self, src) -> None:
        if src.name not in self.functions:
            self.pending[src.name] = src

    def function(self, name: str):
        if name not in self.functions:
            self.build()
        return self.functions[name]

    def build(self) -> None:
        sources = list(self.pending.values())
        self.pending = {}
        if not sources:
            return
        text = _HOST_HEADER + "\n".join(_host_source(s) for s in sources)
        digest = hashlib.sha1(text.encode()).hexdigest()[:16]
        lib = self.directory / f"k_{digest}.so"
        if not lib.exists():
            cpp = self.directory / f"k_{digest}.cpp"
            cpp.write_text(text)
            result = subprocess.run([CXX, "-O1", "-shared", "-fPIC", "-w", "-o", str(lib),
                                     str(cpp)], capture_output=True, text=True)
            assert result.returncode == 0, result.stderr[-4000:]
        dll = ctypes.CDLL(str(lib))
        for s in sources:
            fn = getattr(dll, s.name)
            fn.restype = None
            self.functions[s.name] = fn


def _call(fn, arrays, shape, strides, scalars, nout=0):
    ptrs = (ctypes.c_void_p * max(len(arrays), 1))(*[a.ctypes.data for a in arrays])
    shp = np.asarray(shape, np.int64)
    std = np.asarray(strides, np.int64).reshape(-1)
    sc = np.asarray(list(scalars) or [0], np.int64)
    size = int(np.prod(shape)) if len(shape) else 1
    fn(ptrs, shp.ctypes.data_as(ctypes.c_void_p), std.ctypes.data_as(ctypes.c_void_p),
       ctypes.c_int(len(shape)), ctypes.c_longlong(size), ctypes.c_int(nout),
       sc.ctypes.data_as(ctypes.c_void_p))


# ---------------------------------------------------------------------- a stand-in for CuPy

class _Raw:
    def __init__(self, ptr: int):
        self.ptr = ptr


class _Pointer:
    """`cupy.cuda.MemoryPointer` over host memory: copies and memsets run at once."""

    def __init__(self, mem, offset: int):
        self.mem = mem
        self.ptr = mem.ptr + offset

    def __add__(self, n: int):
        return _Pointer(self.mem, self.ptr - self.mem.ptr + int(n))

    def memset_async(self, value, size, stream=None):
        ctypes.memset(self.ptr, value, size)

    def copy_from_host_async(self, mem, size, stream=None):
        ctypes.memmove(self.ptr, mem, size)

    def copy_to_host_async(self, mem, size, stream=None):
        ctypes.memmove(mem, self.ptr, size)


class _Array(np.ndarray):
    """A device array: a NumPy view whose `.data` is a memory pointer, as CuPy's is."""

    @property
    def data(self):
        return _Pointer(_Raw(self.ctypes.data), 0)


class _FakeCupy(types.ModuleType):
    """Just the CuPy v14.2.0 API the backend calls, on the host. Streams run work when it is
    issued (the executor's host flags then order it, as for the threads backend). Where real
    CuPy would allocate a temporary (matmul on non-contiguous operands, a 1x1 dot, CUB
    reductions, arrays made without `memptr`) this one asserts or allocates through the
    thread's allocator, so a test sees it."""

    def __init__(self, host: HostKernels):
        super().__init__("cupy")
        self.host = host
        self.live = weakref.WeakSet()   # raw device allocations not yet freed
        self.pinned_live = weakref.WeakSet()
        tls = threading.local()
        fake = self

        class Memory:
            def __init__(self, size):
                self.buf = np.zeros(max(int(size), 1), np.uint8)
                self.ptr, self.size = self.buf.ctypes.data, int(size)
                fake.live.add(self)

        class PinnedMemory(Memory):
            def __init__(self, size):
                super().__init__(size)
                fake.live.discard(self)
                fake.pinned_live.add(self)

        class UnownedMemory:
            def __init__(self, ptr, size, owner, device_id=-1):
                self.ptr, self.size, self.owner = ptr, size, owner

        class Stream:
            def __init__(self, null=False, non_blocking=False, ptds=False, priority=None):
                assert non_blocking

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            def synchronize(self):
                pass

            def wait_event(self, event):
                assert event.recorded

        class Event:
            def __init__(self, block=False, disable_timing=False, interprocess=False):
                self.recorded, self.timing, self.t = False, not disable_timing, 0.0

            def record(self, stream=None):
                self.recorded, self.t = True, time.perf_counter()

            def synchronize(self):
                pass

        class Device:
            def __init__(self, device=0):
                self.id = device

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

        class MemoryHook:
            name = "MemoryHook"

            def __enter__(self):
                hooks = tls.__dict__.setdefault("hooks", {})
                assert self.name not in hooks
                hooks[self.name] = self
                return self

            def __exit__(self, *exc):
                del tls.hooks[self.name]

        def get_elapsed_time(a, b):
            assert a.timing and b.timing
            return (b.t - a.t) * 1000.0

        class using_allocator:
            def __init__(self, allocator=None):
                self.allocator = allocator

            def __enter__(self):
                self.previous = getattr(tls, "allocator", None)
                tls.allocator = self.allocator

            def __exit__(self, *exc):
                tls.allocator = self.previous

        def alloc(nbytes):
            allocator = getattr(tls, "allocator", None)
            if allocator is not None:
                return allocator(nbytes)
            for hook in getattr(tls, "hooks", {}).values():
                hook.malloc_preprocess(device_id=0, size=nbytes, mem_size=nbytes)
            return _Pointer(Memory(nbytes), 0)

        cuda = types.SimpleNamespace(
            is_available=lambda: True, runtime=types.SimpleNamespace(getDeviceCount=lambda: 1),
            Memory=Memory, UnownedMemory=UnownedMemory, MemoryPointer=_Pointer,
            PinnedMemory=PinnedMemory, Stream=Stream, Event=Event, Device=Device,
            MemoryHook=MemoryHook, get_elapsed_time=get_elapsed_time,
            using_allocator=using_allocator,
            device=types.SimpleNamespace(get_cublas_handle=lambda: 1))
        self.cuda = cuda
        self._alloc = alloc

    # ------------------------------------------------------------------ arrays
    def ndarray(self, shape, dtype=float, memptr=None, strides=None):
        dtype = np.dtype(dtype)
        shape = tuple(int(s) for s in shape)
        if memptr is None:
            memptr = self._alloc(math.prod(shape) * dtype.itemsize)
        if strides is None:
            strides = ck.contiguous_strides(shape, dtype.itemsize)
        assert all(s >= 0 for s in strides)
        extent = (sum((n - 1) * s for n, s in zip(shape, strides)) + dtype.itemsize
                  if math.prod(shape) else 0)
        buf = (ctypes.c_ubyte * max(extent, 1)).from_address(memptr.ptr)
        return np.ndarray(shape, dtype, buffer=buf, strides=tuple(strides)).view(_Array)

    def copyto(self, dst, src):
        assert dst.dtype == src.dtype and dst.shape == src.shape, (dst.dtype, src.dtype)
        np.copyto(dst, src)

    def matmul(self, a, b, out=None):
        assert out is not None and a.dtype == b.dtype == out.dtype
        assert out.flags.c_contiguous
        assert not np.may_share_memory(out, a) and not np.may_share_memory(out, b)
        if a.ndim <= 2 and b.ndim <= 2:
            assert a.ndim == b.ndim == 2
            assert a.dtype in (np.float16, np.float32, np.float64)
            for x in (a, b):  # CuPy's dot passes C or F matrices to cuBLAS, else copies
                assert x.flags.c_contiguous or x.flags.f_contiguous
            assert out.shape != (1, 1), "CuPy reduces a 1x1 dot with temporaries"
        else:  # strided-batched GEMM: ascontiguousarray copies anything else (f16 to f32)
            assert a.dtype in (np.float32, np.float64)
            assert a.ndim == b.ndim == out.ndim == 3 and a.shape[0] == b.shape[0]
            assert a.flags.c_contiguous and b.flags.c_contiguous
        if out.dtype == np.float16:  # cuBLAS: float32 compute type, one rounding
            out[...] = np.matmul(a.astype(np.float32), b.astype(np.float32))
        else:
            np.matmul(a, b, out=out)

    def ElementwiseKernel(self, in_params, out_params, operation, name="kernel",
                          reduce_dims=True, preamble="", no_return=False, **kwargs):
        src = ck.ElementwiseSource(name, in_params, out_params, operation, preamble)
        self.host.add(src)
        return _FakeKernel(self, src)

    def ReductionKernel(self, in_params, out_params, map_expr, reduce_expr, post_map_expr,
                        identity, name="reduce_kernel", reduce_type=None, reduce_dims=True,
                        preamble="", options=()):
        src = ck.ReductionSource(name, in_params, out_params, map_expr, reduce_expr,
                                 post_map_expr, identity, reduce_type, preamble)
        self.host.add(src)
        return _FakeKernel(self, src)


class _FakeKernel:
    def __init__(self, cp: _FakeCupy, src):
        self.cp, self.src = cp, src
        self.params = _params(src.in_params, src.out_params)

    def _check(self, p: _Param, a) -> None:
        assert np.dtype(a.dtype) == np.dtype(_NP[p.type]), f"{p.name}: {a.dtype} for {p.type}"

    def __call__(self, *args, out=None, axis=None):
        fn = self.cp.host.function(self.src.name)
        if isinstance(self.src, ck.ReductionSource):
            assert out is not None and len(args) == len(self.params) - 1
            assert len(args) >= 2, "one input: CuPy would take its CUB path"
            args = (*args, out)
        assert len(args) == len(self.params)
        arrays, scalars, broadcast = [], [], []
        for p, a in zip(self.params, args):
            if p.array:
                self._check(p, a)
                arrays.append(a)
                if p.raw:
                    assert a.ndim == 1 and a.flags.c_contiguous
                elif p.is_input:
                    broadcast.append(a.shape)
            else:
                assert isinstance(a, (int, np.integer)), (p.name, a)
                scalars.append(int(a))
        if isinstance(self.src, ck.ElementwiseSource):
            shape = np.broadcast_shapes(*broadcast, *[a.shape for p, a in zip(self.params, args)
                                                      if p.array and not p.raw
                                                      and not p.is_input])
            strides = []
            for p, a in zip(self.params, args):
                if p.array:
                    if p.raw:
                        strides.append([0] * len(shape))
                    else:
                        assert p.is_input or a.shape == shape
                        strides.append(np.broadcast_to(a, shape).strides)
            _call(fn, arrays, shape, strides, scalars)
            return
        shape = np.broadcast_shapes(*broadcast)
        axes = tuple(sorted(axis))
        nout = len(shape) - len(axes)
        assert axes == tuple(range(nout, len(shape))) and out.shape == shape[:nout]
        strides = [np.broadcast_to(a, shape).strides for a in arrays[:-1]]
        strides.append(tuple(out.strides) + (0,) * len(axes))
        _call(fn, arrays, shape, strides, scalars, nout)


@pytest.fixture(scope="session")
def host_kernels(tmp_path_factory):
    if CXX is None:
        pytest.skip("no C++ compiler (g++) to run the generated kernels on the host")
    return HostKernels(tmp_path_factory.mktemp("host-kernels"))


@pytest.fixture
def fake_cupy(host_kernels, monkeypatch):
    fake = _FakeCupy(host_kernels)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    cuda._hook_class.cache_clear()
    cuda._KERNELS.clear()
    yield fake
    cuda._hook_class.cache_clear()
    cuda._KERNELS.clear()


@pytest.fixture(params=["host", "gpu"])
def device(request):
    """Makes backends: on the host against `_FakeCupy`, or on a real GPU."""
    if request.param == "gpu":
        if not GPU:
            pytest.skip("no usable CUDA GPU (cupy missing or no device)")
        cuda._hook_class.cache_clear()
        cuda._KERNELS.clear()
        return types.SimpleNamespace(kind="gpu", fake=None)
    return types.SimpleNamespace(kind="host", fake=request.getfixturevalue("fake_cupy"))


def prepare(mg) -> None:
    """Make every kernel a plan runs (the host stand-in compiles them in one g++ run)."""
    for src in kernel_sources([mg]):
        cuda._compiled(src)


# ---------------------------------------------------------------------- kernels on the host

def test_generated_kernels_run_on_the_host_as_numpy_computes(fake_cupy):
    """Conversions, joins with broadcasting, reductions with accumulate, fills and gathers of
    every dtype, run from their C source, equal NumPy (bf16 rounding bit for bit)."""
    cp = fake_cupy
    rng = np.random.default_rng(0)
    x0, x1 = scalar.x(0), scalar.x(1)

    def dev(a):
        """A device view of a live, C-contiguous host array."""
        assert a.flags.c_contiguous
        return cp.ndarray(a.shape, a.dtype, memptr=_Pointer(_Raw(a.ctypes.data), 0))

    bf = DType.bf16.numpy
    values = (rng.standard_normal(4096) * np.exp(rng.uniform(-30, 30, 4096))).astype(np.float64)
    values[:4] = [np.inf, -np.inf, np.nan, 0.0]
    for src_dt, dst_tag in [(np.float32, "bf16"), (np.float64, "bf16"), (np.float64, "f16"),
                            (np.float32, "f16"), (np.float64, "f32")]:
        src = values.astype(src_dt)
        out = np.zeros(src.shape, ck.DEVICE_DTYPE[dst_tag])
        kernel = ck.convert_kernel(ck.tag_of(src.dtype), dst_tag)
        cuda._compiled(kernel)(dev(src), dev(out))
        with np.errstate(over="ignore"):
            want = src.astype(DType(dst_tag).numpy)
        got = out.view(DType(dst_tag).numpy)
        np.testing.assert_array_equal(got.astype(np.float64), want.astype(np.float64),
                                      err_msg=f"{src.dtype} -> {dst_tag}")
    # a join with broadcasting, a scale and accumulation into bf16
    a = rng.standard_normal((3, 4)).astype(np.float32)
    b = rng.standard_normal((4,)).astype(bf)
    y = rng.standard_normal((3, 4)).astype(bf)
    join = scalar.silu(x0) * x1
    kernel = ck.join_kernel(join, ("f32", "bf16"), "float", "bf16", 0.5, "max")
    y_dev = y.view(np.uint16).copy()
    cuda._compiled(kernel)(dev(a), np.lib.stride_tricks.as_strided(
        dev(b.view(np.uint16)), (3, 4), (0, 2)), dev(y_dev))
    part = scalar.join_function(join, 2)(a, b.astype(np.float32)) * np.float32(0.5)
    want = np.maximum(y.astype(np.float32), part).astype(bf)
    np.testing.assert_array_equal(y_dev.view(bf).astype(np.float32), want.astype(np.float32))
    # a reduction (max over the last axis), accumulating into f16
    s = rng.standard_normal((5, 7)).astype(np.float32)
    acc = rng.standard_normal(5).astype(np.float16)
    kernel = ck.reduce_kernel(x0 ** 2, ("f32",), "float", "f16", "max", None, "sum")
    acc_dev = acc.copy()
    cuda._compiled(kernel)(dev(s), 0, out=dev(acc_dev), axis=(1,))
    want = (acc.astype(np.float32) + (s ** 2).max(axis=1)).astype(np.float16)
    np.testing.assert_array_equal(acc_dev, want)
    # fills: LLaMA's rotary table and causal mask at an origin
    _, _, mg = llama_plan(DType.f32, "decode")
    fills = [n for n in mg.nodes if isinstance(n, ApplyNode) and isinstance(n.op, FillOp)]
    assert fills
    for n in fills:
        shape = tuple(mg.tensors[n.write.tensor].shape)
        out = np.zeros(shape, np.float32)
        flat = [v for o, m in zip(n.op.origin, shape) for v in (o, m)]
        cuda._compiled(ck.fill_kernel(n.op.expr, len(shape), "f32"))(*flat, dev(out.reshape(-1)))
        want = scalar.evaluate_fill(n.op.expr, n.op.origin, shape, np.float32)
        np.testing.assert_array_equal(out, want)
    # a partial gather of a row block, accumulating
    table = rng.standard_normal((4, 3)).astype(np.float32)
    ids = np.array([[0, 5, 6], [7, 9, 4]], np.int64)
    y = rng.standard_normal((2, 3, 3)).astype(np.float32)
    status = np.zeros(3, np.int64)
    kernel = ck.gather_kernel("f32", "f32", "sum")
    y_dev = y.copy()
    cuda._compiled(kernel)(dev(table.reshape(-1)), dev(ids.reshape(-1)), 4, 3, 4, 1,
                           dev(y_dev.reshape(-1)), dev(status))
    want = y + kernels.gather(table, ids, 4, partial=True)
    np.testing.assert_allclose(y_dev, want, rtol=1e-6)
    assert not status.any()


@pytest.mark.skipif(NVCC is None, reason="no nvcc")
def test_every_kernel_compiles_for_the_device(tmp_path, llama_plans):
    """Each kernel's body, inside minimal stand-ins for CuPy's CArray and kernel template,
    compiles as CUDA C++ (our preamble's device branch, CUDA's half type)."""
    head = r"""
#include <cuda_fp16.h>
#include <stddef.h>
class float16 {
  __half data_;
 public:
  __device__ float16() {}
  __device__ float16(float v) : data_(__float2half(v)) {}
  __device__ operator float() const { return __half2float(data_); }
};
template <class T> struct RawArr {
  T* p;
  __device__ T& operator[](long long k) const { return p[k]; }
};
"""
    parts = [head]
    for src in kernel_sources(llama_plans):
        params = _params(src.in_params, src.out_params)
        args = []
        for p in params:
            if p.raw:
                args.append(f"RawArr<{'const ' if p.is_input else ''}{p.ctype}> {p.name}")
            elif p.array:
                args.append(f"{'const ' if p.is_input else ''}{p.ctype} &{p.name}")
            else:
                args.append(f"const {p.ctype} {p.name}")
        if isinstance(src, ck.ElementwiseSource):
            body = f"{src.operation};"
            args.append("ptrdiff_t i")
        else:
            body = (f"typedef {src.reduce_type} _type_reduce;\n"
                    f"_type_reduce a = _type_reduce({src.identity}), b = ({src.map_expr});\n"
                    f"a = ({src.reduce_expr});\n"
                    f"({src.post_map_expr});")
        parts.append(f"namespace {src.name} {{\n{src.preamble}\n__device__ void k("
                     f"{', '.join(args)}) {{\n{body}\n}}\n}}\n")
    source = tmp_path / "kernels.cu"
    source.write_text("\n".join(parts))
    result = subprocess.run([NVCC, "-c", "-std=c++17", "-arch=sm_80", "-w", str(source), "-o",
                             str(tmp_path / "kernels.o")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]


# ====================================================================== CPU: workspace, plans

def test_every_llama_apply_has_a_plan_and_contractions_use_gemm(llama_plans):
    for mg in llama_plans:
        plans = ck.plan_applies(mg)
        for n in mg.nodes:
            if not isinstance(n, ApplyNode) or not isinstance(n.op, EinsumOp):
                continue
            product = scalar.scaled_product_factor(n.op.join, len(n.reads)) is not None
            if product and len(n.reads) == 2 and n.op.spec.contracted:
                assert isinstance(plans[n.id], ck.MatmulApply), (n.id, str(n.op.spec))


def test_workspace_bytes_is_positive_deterministic_and_covers_every_apply(llama_plans):
    for mg in llama_plans:
        need = ck.workspace_bytes(mg)
        assert need == ck.workspace_bytes(mg) == cuda.workspace_bytes(mg)
        assert need > ck.STATUS_BYTES and need % 256 == 0
        plans = ck.plan_applies(mg)
        assert max(ck.slot_bytes(p) for p in plans.values()) + ck.STATUS_BYTES == need
    _, _, again = llama_plan(DType.bf16, "prefill")
    assert ck.workspace_bytes(again) == ck.workspace_bytes(llama_plans[2])


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
    compiled = compile_graph(graph, CompileOptions(12_000))
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
    assert err_numpy < 1e-5 and err_hf < 1e-5, (err_numpy, err_hf)


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
    plans = ck.plan_applies(mg)
    if case == "frees":
        assert all(not p.plan.direct if isinstance(p, ck.MatmulApply) else p.staged
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
        assert not list(device.fake.live) and not list(device.fake.pinned_live)
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
    assert ck.workspace_bytes(mg) > ck.STATUS_BYTES


def test_a_workspace_below_the_plans_need_is_refused(device):
    cfg, weights, tokens, compiled = _paged_llama(DType.f32, 4)
    backend = CupyBackend(workspace_bytes=ck.STATUS_BYTES)
    if ck.workspace_bytes(compiled.memgraph) == ck.STATUS_BYTES:
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
