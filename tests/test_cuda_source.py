"""The CUDA C the CuPy backend generates (`einpage.runtime.backends.cuda_source`), on any machine:
every join and fill of the LLaMA graphs and every dequantization kernel is valid C99 (`cc`), the
printer spells constants and powers as NumPy computes them, every kernel runs on the host
(`g++`, through the stand-in for CuPy in `fake_cupy`) with NumPy's results, bf16 rounding bit for
bit. The device compile (NVRTC, for sm_90) of every family's kernels is `test_nvrtc`; the
dequantization kernels' arithmetic, bit for bit, is `test_cuda_quantized`.
"""
from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest
import sympy
from fake_cupy import installed

from einpage.compiler import CompileOptions, compile_graph
from einpage.errors import PlanError
from einpage.ir import scalar
from einpage.ir.dtypes import DType
from einpage.ir.memgraph import ApplyNode
from einpage.ir.storage import FORMATS
from einpage.ir.ops import EinsumOp, FillOp
from einpage.models import llama
from einpage.models.config import preset
from einpage.runtime import kernels
from einpage.runtime.backends import cuda_apply
from einpage.runtime.backends.apply_plan import plan_applies, plan_kernels
from einpage.runtime.backends.cuda_source import (COMPUTE_CTYPE, DEVICE_DTYPE, PREAMBLE,
                                                  c_expression,
                                                  convert_kernel, dequant_kernel, fill_function,
                                                  fill_kernel, gather_kernel, join_function,
                                                  join_kernel, reduce_kernel, tag_of)

CC = shutil.which("cc") or shutil.which("gcc")


# ====================================================================== plans of LLaMA graphs

def llama_plan(dtype: DType = DType.f32, phase: str = "prefill", budget: int = 40_000):
    """(config, graph, memgraph) of the tiny LLaMA's prefill or decode pass under `budget`."""
    cfg = preset("tiny").with_dtype(dtype)
    graph = (llama.prefill_graph(cfg).bind(B=2, S=5) if phase == "prefill"
             else llama.decode_graph(cfg).bind(B=2, C=4))
    return cfg, graph, compile_graph(graph, CompileOptions(budget)).memgraph


def tiny_llama_plans() -> list:
    """Prefill and decode plans of the tiny LLaMA in f32, bf16 and f16."""
    return [llama_plan(dt, ph)[2] for dt in (DType.f32, DType.bf16, DType.f16)
            for ph in ("prefill", "decode")]


@pytest.fixture(scope="module")
def llama_plans():
    return tiny_llama_plans()


def kernel_sources(mgs) -> list:
    """Every distinct kernel the plans of `mgs` run, by name."""
    seen = {}
    for mg in mgs:
        for plan in plan_applies(mg).values():
            for src in plan_kernels(plan):
                seen.setdefault(src.name, src)
    return [seen[k] for k in sorted(seen)]


# ====================================================================== C99 (cc)

def _joins_and_fills(mgs):
    joins, fills = {}, {}
    for mg in mgs:
        for n in mg.nodes:
            if isinstance(n, ApplyNode) and isinstance(n.op, EinsumOp):
                ctype = COMPUTE_CTYPE[n.op.dtype.value]
                joins[(scalar.to_text(n.op.join), len(n.reads), ctype)] = n.op.join
            elif isinstance(n, ApplyNode) and isinstance(n.op, FillOp):
                fills[(scalar.to_text(n.op.expr), len(mg.tensors[n.write.tensor].shape))] = \
                    n.op.expr
    return joins, fills


@pytest.mark.skipif(CC is None, reason="no C compiler (cc/gcc)")
def test_every_llama_join_and_fill_is_valid_c99(tmp_path, llama_plans):
    joins, fills = _joins_and_fills(llama_plans)
    assert len(joins) >= 8 and len(fills) >= 2
    parts = [PREAMBLE]
    for k, ((_, nargs, ctype), join) in enumerate(sorted(joins.items(), key=str)):
        parts.append(join_function(join, nargs, ctype, f"join_{k}"))
    for k, ((_, ndim), expr) in enumerate(sorted(fills.items(), key=str)):
        parts.append(fill_function(expr, ndim, f"fill_{k}"))
    # a float function using them, so nothing is optimised away unseen
    parts.append("float ep_use(float x) { return x + (float)join_0(x, x); }\n")
    source = tmp_path / "joins.c"
    source.write_text("\n".join(parts))
    result = subprocess.run([CC, "-std=c99", "-Wall", "-Werror=implicit-function-declaration",
                             "-c", str(source), "-o", str(tmp_path / "joins.o")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr + "\n" + source.read_text()


@pytest.mark.skipif(CC is None, reason="no C compiler (cc/gcc)")
def test_every_dequant_kernel_is_valid_c99(tmp_path):
    """The functions of every dequantization kernel (each format, each output dtype) are C99
    too, warnings as errors (the host and the device build the same text)."""
    for fmt in FORMATS:
        src = dequant_kernel(fmt, "f32")
        assert src.in_params == "raw uint8 q" and src.out_params == "float32 y"
        assert "ep_dequant(&q[" in src.operation
        source = tmp_path / f"dequant_{fmt}.c"
        source.write_text(src.preamble + "float ep_use(const unsigned char* b, int e) "
                          "{ return ep_dequant(b, e); }\n")
        result = subprocess.run([CC, "-std=c99", "-Wall", "-Wextra", "-Werror", "-c",
                                 str(source), "-o", str(tmp_path / f"{fmt}.o")],
                                capture_output=True, text=True)
        assert result.returncode == 0, result.stderr + "\n" + source.read_text()
    for tag, param in (("f16", "float16"), ("bf16", "uint16")):
        src = dequant_kernel("q4_0", tag)
        assert src.out_params == f"{param} y"


def test_printer_spells_what_numpy_computes():
    x0 = scalar.x(0)
    assert c_expression(x0 ** 2, "float") == "((x0)*(x0))"
    assert c_expression(scalar.rsqrt(x0 / 128 + 1e-6), "float").startswith("(1.0F/sqrtf(")
    assert "9.99999997e-07F" in c_expression(x0 + 1e-6, "float")  # the float32 NumPy uses
    assert c_expression(sympy.Piecewise((0, x0 > 1), (-sympy.oo, True)), "double") == \
        "((x0 > 1) ? ( 0 ) : ( (-EP_INF) ))"
    assert c_expression(sympy.pi * x0, "double") == "3.141592653589793*x0"


def test_fill_with_an_unbound_symbol_is_a_plan_error():
    with pytest.raises(PlanError, match="bind every size symbol"):
        fill_function(scalar.index(0) + scalar.size_symbol("P"), 1)


# ====================================================================== host and device

@pytest.fixture
def fake_cupy(monkeypatch, tmp_path_factory):
    yield from installed(monkeypatch, tmp_path_factory)


def test_generated_kernels_run_on_the_host_as_numpy_computes(fake_cupy):
    """Conversions, joins with broadcasting, reductions with accumulate, fills and gathers of
    every dtype, run from their C source, equal NumPy (bf16 rounding bit for bit)."""
    cp = fake_cupy
    rng = np.random.default_rng(0)
    x0, x1 = scalar.x(0), scalar.x(1)
    stream = cp.cuda.Stream(non_blocking=True)

    def dev(a):
        """A device view of a live, C-contiguous host array (the stand-in's device memory)."""
        assert a.flags.c_contiguous
        return cp.adopt(a)

    def run(kernel, *args, **kwargs):
        """Launch on a stream and wait: the stand-in runs kernels later, as a device does."""
        with stream:
            cuda_apply.compiled(kernel)(*args, **kwargs)
        stream.synchronize()

    bf = DType.bf16.numpy
    values = (rng.standard_normal(4096) * np.exp(rng.uniform(-30, 30, 4096))).astype(np.float64)
    values[:4] = [np.inf, -np.inf, np.nan, 0.0]
    for src_dt, dst_tag in [(np.float32, "bf16"), (np.float64, "bf16"), (np.float64, "f16"),
                            (np.float32, "f16"), (np.float64, "f32")]:
        src = values.astype(src_dt)
        out = np.zeros(src.shape, DEVICE_DTYPE[dst_tag])
        kernel = convert_kernel(tag_of(src.dtype), dst_tag)
        run(kernel, dev(src), dev(out))
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
    kernel = join_kernel(join, ("f32", "bf16"), "float", "bf16", 0.5, "max")
    y_dev = y.view(np.uint16).copy()
    run(kernel, dev(a), np.lib.stride_tricks.as_strided(
        dev(b.view(np.uint16)), (3, 4), (0, 2)), dev(y_dev))
    part = scalar.join_function(join, 2)(a, b.astype(np.float32)) * np.float32(0.5)
    want = np.maximum(y.astype(np.float32), part).astype(bf)
    np.testing.assert_array_equal(y_dev.view(bf).astype(np.float32), want.astype(np.float32))
    # a reduction (max over the last axis), accumulating into f16
    s = rng.standard_normal((5, 7)).astype(np.float32)
    acc = rng.standard_normal(5).astype(np.float16)
    kernel = reduce_kernel(x0 ** 2, ("f32",), "float", "f16", "max", None, "sum")
    acc_dev = acc.copy()
    run(kernel, dev(s), 0, out=dev(acc_dev), axis=(1,))
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
        run(fill_kernel(n.op.expr, len(shape), "f32"), *flat, dev(out.reshape(-1)))
        want = scalar.evaluate_fill(n.op.expr, n.op.origin, shape, np.float32)
        np.testing.assert_array_equal(out, want)
    # a partial gather of a row block, accumulating
    table = rng.standard_normal((4, 3)).astype(np.float32)
    ids = np.array([[0, 5, 6], [7, 9, 4]], np.int64)
    y = rng.standard_normal((2, 3, 3)).astype(np.float32)
    status = np.zeros(3, np.int64)
    kernel = gather_kernel("f32", "f32", "sum")
    y_dev = y.copy()
    run(kernel, dev(table.reshape(-1)), dev(ids.reshape(-1)), 4, 3, 4, 1,
                           dev(y_dev.reshape(-1)), dev(status))
    want = y + kernels.gather(table, ids, 4, partial=True)
    np.testing.assert_allclose(y_dev, want, rtol=1e-6)
    assert not status.any()
