"""One cuBLAS call from three strided matrices (`einpage.runtime.backends.gemm_call`), run by the
stand-in's cuBLAS (`fake_cupy`: column-major semantics, leading dimensions and alignment
checked as cuBLAS does) on row- and column-major views of every operand type, equals NumPy."""
from __future__ import annotations

import numpy as np
import pytest
from fake_cupy import installed
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from einpage.errors import PlanError
from einpage.ir.dtypes import DType
from einpage.runtime.backends.cuda_source import DEVICE_DTYPE
from einpage.runtime.backends import cublas_lib
from einpage.runtime.backends.gemm_call import C_TAGS, gemm_call, matrix


@pytest.fixture
def fake_cupy(monkeypatch, tmp_path_factory):
    yield from installed(monkeypatch, tmp_path_factory)


def _operand(rng, shape, tag, transposed, pad):
    """A device array of logical `shape` (batch?, rows, cols), stored row-major or (with
    `transposed`) column-major per matrix, rows `pad` elements longer than needed."""
    *lead, r, c = shape
    inner = (c, r) if transposed else (r, c)
    store = np.zeros((*lead, inner[0], inner[1] + pad), DEVICE_DTYPE[tag])
    values = rng.standard_normal((*lead, *inner)).astype(DType(tag).numpy)
    store[..., :inner[1]] = values.view(DEVICE_DTYPE[tag])
    view = store[..., :inner[1]]
    logical = values.astype(np.float64)
    if transposed:
        view, logical = np.swapaxes(view, -1, -2), np.swapaxes(logical, -1, -2)
    return store, view, logical


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(m=st.integers(1, 5), n=st.integers(1, 5), k=st.integers(1, 5),
       batch=st.sampled_from([0, 3]), tag=st.sampled_from(["f16", "bf16", "f32", "f64"]),
       ta=st.booleans(), tb=st.booleans(), pad=st.integers(0, 2), wide=st.booleans(),
       alpha=st.sampled_from([1.0, 0.5]), beta=st.sampled_from([0.0, 1.0]),
       seed=st.integers(0, 99))
def test_gemm_calls_equal_numpy(fake_cupy, m, n, k, batch, tag, ta, tb, pad, wide, alpha, beta,
                                seed):
    cp = fake_cupy
    rng = np.random.default_rng(seed)
    lead = (batch,) if batch else ()
    c_tag = C_TAGS[tag][-1] if wide else tag
    sa, a, la = _operand(rng, (*lead, m, k), tag, ta, pad)
    sb, b, lb = _operand(rng, (*lead, k, n), tag, tb, pad)
    sc, c, lc = _operand(rng, (*lead, m, n), c_tag, False, pad)
    call = gemm_call(matrix(a.shape, a.strides, tag), matrix(b.shape, b.strides, tag),
                     matrix(c.shape, c.strides, c_tag))
    assert call.batch == batch
    if min(m, n, k) > 1:  # a transposed view is a transpose flag, never a copy
        assert (call.transa, call.transb) == (int(tb), int(ta))
    keep = [cp.adopt(x) for x in (sa, sb, sc)]
    stream = cp.cuda.Stream(non_blocking=True)
    handle = cp.cuda.device.get_cublas_handle()
    cublas_lib.set_stream(handle, stream.ptr)
    cublas_lib.gemm(handle, call, a.ctypes.data, b.ctypes.data, c.ctypes.data, alpha, beta)
    stream.synchronize()
    want = alpha * (la @ lb) + beta * lc
    got = c.view(DType(c_tag).numpy).astype(np.float64) if c_tag == "bf16" else \
        c.astype(np.float64)
    tol = {"f64": 1e-12, "f32": 1e-5}.get(c_tag, 2e-2)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    assert sc[..., n:].max(initial=0) == 0  # nothing written past a row
    del keep


def test_what_cublas_cannot_read_in_place_is_a_plan_error():
    row = matrix((4, 6), (24, 4), "f32")
    with pytest.raises(PlanError, match="neither row- nor column-major"):
        gemm_call(matrix((4, 6), (48, 8), "f32"), matrix((6, 2), (8, 4), "f32"),
                  matrix((4, 2), (8, 4), "f32"))
    with pytest.raises(PlanError, match="operands of one type"):
        gemm_call(row, matrix((6, 2), (4, 2), "f16"), matrix((4, 2), (8, 4), "f32"))
    with pytest.raises(PlanError, match="not row-major"):
        gemm_call(row, matrix((6, 2), (8, 4), "f32"), matrix((4, 2), (4, 16), "f32"))
    with pytest.raises(PlanError, match="c of f16 or f32"):
        gemm_call(matrix((4, 6), (12, 2), "f16"), matrix((6, 2), (4, 2), "f16"),
                  matrix((4, 2), (4, 2), "bf16"))
