"""The compiled kernels that read a stored operand as it lies (`einpage.runtime.storedmm`):
decoded values bit for bit those of `quant.dequantize` on every code path, products equal to
NumPy's path, the contractions they take and refuse, and whole plans run through them."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from einpage.compiler import CompileOptions, compile_graph
from einpage.ir import scalar
from einpage.ir.dtypes import DType
from einpage.ir.ops import EinsumOp
from einpage.ir.quant import dequantize, quantize
from einpage.ir.spec import EinsumSpec
from einpage.ir import stored
from einpage.ir.storage import WRITABLE, Storage
from einpage.models import config, llama, schema
from einpage.models.checkpoint import RandomWeights
from einpage.runners import run_plan
from einpage.runtime import evaluate, kernels, storedmm
from einpage.runtime.executor import run

pytestmark = pytest.mark.skipif(not storedmm.available(),
                                reason="einpage.runtime._cpu not built (no C compiler at install)")

BF16 = np.dtype(ml_dtypes.bfloat16)
PATHS = ["avx512", "avx2", "portable"]


@pytest.fixture(params=PATHS)
def path(request):
    """Run the test on each of the kernels' code paths this CPU can take."""
    if request.param not in storedmm.isas():
        pytest.skip(f"this CPU has no {request.param}")
    best = storedmm.isas()[-1]
    storedmm.use_isa(request.param)
    yield request.param
    storedmm.use_isa(best)


def _awkward(rows: int, k: int, seed: int = 0) -> np.ndarray:
    """Rows that catch rounding and conversion differences: zeros, constants, ties, tiny values
    (subnormal scales and values), values near f16's largest, and ordinary ones."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, k)).astype(np.float32)
    w[0] = 0
    w[1] = 0.75
    w[2] = np.linspace(-8, 7, k)
    w[3] *= 1e-6
    w[4] *= 6e-8
    w[5] = np.clip(w[5] * 3e4, -6.5e4, 6.5e4)
    w[6, ::2] = -w[6, ::2] * 1e3
    return w


def _op(spec: str, factor: float = 1.0) -> EinsumOp:
    join = scalar.product(2) if factor == 1.0 else factor * scalar.product(2)
    return EinsumOp(EinsumSpec.parse(spec), join, None, DType.f16)


def _layout(op, x, w, storage=None, logical=np.float16, shape=None, w_first=False):
    shapes = [x.shape, shape or w.shape]
    dtypes = [x.dtype, w.dtype]
    storages, logicals = [None, storage], [np.dtype(np.float16), np.dtype(logical)]
    if w_first:
        shapes, dtypes, storages, logicals = (v[::-1] for v in (shapes, dtypes, storages, logicals))
    return stored.layout(op, tuple(map(tuple, shapes)), tuple(dtypes), tuple(storages),
                           tuple(logicals))


@pytest.mark.filterwarnings("ignore:overflow encountered")  # NumPy's path, levels past f16
@pytest.mark.parametrize("fmt", WRITABLE)
@pytest.mark.parametrize("logical", [np.float16, BF16, np.float32], ids=["f16", "bf16", "f32"])
def test_decoded_rows_are_the_dequantized_values_bit_for_bit(fmt, logical, path):
    storage = Storage(fmt, 1)
    w = _awkward(8, 256)
    packed = quantize(w, storage)
    rounded = None if np.dtype(logical) == np.float32 else logical
    want = dequantize(packed, storage, w.shape, np.float32, rounded=rounded)
    got = np.empty_like(want)
    code = stored._format(np.uint8, storage)
    storedmm._cpu.dequant(packed.reshape(-1), got, code, stored._ROUND.get(
        np.dtype(logical).name, 0), 256, 0, 8)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("dtype", [np.float16, BF16], ids=["f16", "bf16"])
def test_f16_and_bf16_rows_convert_exactly(dtype, path):
    w = _awkward(8, 200).astype(dtype)
    w.reshape(-1)[:4] = np.array([np.inf, -np.inf, np.nan, -0.0], np.float32).astype(dtype)
    got = np.empty((8, 200), np.float32)
    storedmm._cpu.dequant(w.view(np.uint8).reshape(-1), got, stored._format(w.dtype, None), 0,
                          200, 0, 8)
    want = w.astype(np.float32)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def _numpy_product(op, reads):
    return kernels.einsum(op.spec, op.join, op.agg, reads, np.dtype(np.float32))


@pytest.mark.parametrize("fmt", ["f16", "bf16", *WRITABLE])
@pytest.mark.parametrize("rows", [1, 3, 4, 6, 9, 40])
def test_products_equal_numpys_path(fmt, rows, path):
    """Few rows (`gemv`: blocks of 4 x 4 and their remainders) and many (tiles for the BLAS)."""
    rng = np.random.default_rng(rows)
    n, k = 44, 256
    w32 = _awkward(n, k, seed=rows) * 0.05
    op = _op("bsm,fm->bsf")
    x = rng.standard_normal((1, rows, k)).astype(np.float16)
    if fmt in ("f16", "bf16"):
        w = w32.astype(np.float16 if fmt == "f16" else BF16)
        lay, dense = _layout(op, x, w), w
    else:
        storage = Storage(fmt, 1)
        w = quantize(w32, storage)
        lay = _layout(op, x, w, storage, shape=(n, k))
        dense = dequantize(w, storage, (n, k), np.float32, rounded=np.float16)
    assert lay is not None
    got = storedmm.product(lay, [x, w])
    want = _numpy_product(op, [x, dense])
    assert got.shape == want.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6 * np.abs(want).max())


@pytest.mark.parametrize("fmt", WRITABLE)
@pytest.mark.parametrize("logical", [np.float16, BF16, np.float32], ids=["f16", "bf16", "f32"])
def test_one_row_against_levels_looked_up_where_they_lie(fmt, logical, path):
    """One row of x (decode at B=1): AVX-512 looks a 4-bit row's levels up from its nibbles
    where they lie, reading x in the lanes' order, instead of decoding the row first."""
    rng = np.random.default_rng(5)
    n, k = 37, 384
    storage = Storage(fmt, 1)
    w = quantize(_awkward(n, k, seed=5) * 0.05, storage)
    rounded = None if np.dtype(logical) == np.float32 else logical
    dense = dequantize(w, storage, (n, k), np.float32, rounded=rounded)
    op = _op("bsm,fm->bsf")
    x = rng.standard_normal((1, 1, k)).astype(np.float16)
    lay = _layout(op, x, w, storage, logical=logical, shape=(n, k))
    got = storedmm.product(lay, [x, w])
    want = np.einsum("bsm,fm->bsf", x.astype(np.float64), dense.astype(np.float64))
    scale = np.abs(x.astype(np.float64)) @ np.abs(dense.astype(np.float64)).T
    assert np.all(np.abs(got - want) <= 1e-6 * scale + 1e-30)


@pytest.mark.parametrize("spec,x_shape,w_shape,w_first,factor", [
    ("bsm,ngrjm->bsngrj", (1, 2, 64), (2, 2, 3, 4, 64), False, 1.0),  # several free indices
    ("bsngrj,mngrj->bsm", (1, 2, 2, 2, 3, 8), (40, 2, 2, 3, 8), False, 1.0),  # several summed
    ("sm,fm->fs", (5, 96), (24, 96), False, 1.0),  # the output transposed
    ("fm,bsm->bsf", (1, 12, 40), (30, 40), True, 0.125),  # W first; a scale; K not of 16
    ("bsm,fm->bsf", (2, 7, 40), (30, 40), False, 1.0),  # many rows (tiles), K of 8s
    # decode attention over a KV block: batch (b, n), rows t of W nuj apart, and its values
    ("bsnguj,btnuj->bngst", (2, 1, 3, 2, 2, 8), (2, 20, 3, 2, 8), False, 0.25),
    ("bngst,btnrj->bsngrj", (2, 3, 2, 1, 20), (2, 20, 3, 2, 8), False, 1.0),  # W[k, n] (rj)
    ("bsnguj,btnuj->bngst", (3, 2, 4, 1, 2, 8), (3, 20, 4, 2, 8), False, 1.0),  # several rows
])
def test_layouts_of_the_models_contractions(spec, x_shape, w_shape, w_first, factor, path):
    rng = np.random.default_rng(0)
    op = _op(spec, factor)
    x = rng.standard_normal(x_shape).astype(np.float16)
    w = rng.standard_normal(w_shape).astype(np.float16)
    lay = _layout(op, x, w, w_first=w_first)
    assert lay is not None and lay.transposed == spec.startswith("bngst")
    reads = [w, x] if w_first else [x, w]
    got = storedmm.product(lay, reads)
    want = _numpy_product(op, reads)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-5)


def test_a_whole_row_of_groups_is_needed_for_packed_weights():
    storage = Storage("q8_0", 2)
    x = np.ones((1, 1, 16), np.float16)
    packed = quantize(np.ones((8, 16, 4), np.float32), storage)
    # W "fmj" contracted over m only: its rows of m run across groups of (m, j)
    op = _op("bsm,fmj->bsfj")
    assert stored.layout(op, ((1, 1, 16), (8, 16, 4)), (x.dtype, packed.dtype),
                           (None, storage), (np.dtype(np.float16),) * 2) is None


@pytest.mark.parametrize("spec,dtypes,agg", [
    ("bsnguj,btnuj->bngst", (np.float32, np.float32), None),  # nothing stored narrow
    ("bsm,btm->bst", (np.float32, np.float16), None),  # a batch, and many rows of x
    ("bsm,fm->bsf", (np.float32, np.float32), None),  # nothing stored narrow
    ("bsm,fm->bsf", (np.float16, np.float16), "max"),  # not a sum of products
    ("bsm,fmb->bsf", (np.float32, np.float16), None),  # W's summed index between free ones
    ("bsm,m->bs", (np.float32, np.float16), None),  # a norm weight: too small
])
def test_what_the_kernels_leave_to_numpy(spec, dtypes, agg):
    op = EinsumOp(EinsumSpec.parse(spec), scalar.product(2), agg, DType.f16)
    parsed = EinsumSpec.parse(spec)
    dims = {c: 4 for c in "bngujtrm"} | {"f": 8, "s": 16}
    shapes = tuple(tuple(dims[c] for c in term) for term in parsed.inputs)
    old = stored.MIN_ELEMENTS
    stored.MIN_ELEMENTS = 64
    stored.layout.cache_clear()
    try:
        assert stored.layout(op, shapes, tuple(map(np.dtype, dtypes)), (None, None),
                               tuple(map(np.dtype, dtypes))) is None
    finally:
        stored.MIN_ELEMENTS = old
        stored.layout.cache_clear()


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_a_packed_kv_block_is_read_per_head(fmt, path):
    """A KV store kept packed (`--kv-dtype q8_0`: groups along a head's row): the scores of a
    decode step, each (b, n) reading its own rows of the block."""
    rng = np.random.default_rng(3)
    storage = Storage(fmt, 2)
    shape = (2, 24, 3, 2, 32)
    k32 = rng.standard_normal(shape).astype(np.float32)
    packed = quantize(k32, storage)
    q = rng.standard_normal((2, 1, 3, 2, 2, 32)).astype(np.float16)
    dense = dequantize(packed, storage, shape, np.float32, rounded=np.float16)
    op = _op("bsnguj,btnuj->bngst", 0.125)
    lay = _layout(op, q, packed, storage, shape=shape)
    assert lay is not None and lay.batch == (2, 3) and not lay.transposed
    got = storedmm.product(lay, [q, packed])
    np.testing.assert_allclose(got, _numpy_product(op, [q, dense]), rtol=2e-6, atol=1e-5)
    # the values: rows t of the block, each a run of whole groups (r, j)
    p = rng.standard_normal((2, 3, 2, 1, 24)).astype(np.float16)
    op = _op("bngst,btnrj->bsngrj")
    lay = _layout(op, p, packed, storage, shape=shape)
    assert lay is not None and lay.transposed and lay.group == 32
    got = storedmm.product(lay, [p, packed])
    np.testing.assert_allclose(got, _numpy_product(op, [p, dense]), rtol=2e-6, atol=1e-5)


def test_the_other_side_packed_is_left_to_numpy():
    storage = Storage("q8_0", 1)
    op = _op("bsm,fm->bsf")
    assert stored.layout(op, ((1, 4, 256), (64, 256)), (np.dtype(np.uint8), np.dtype(np.float16)),
                           (storage, None), (np.dtype(np.float16),) * 2) is None


def test_q4_k_is_left_to_numpy():
    storage = Storage("q4_k", 1)
    op = _op("bsm,fm->bsf")
    assert stored.layout(op, ((1, 1, 256), (4, 256)), (np.dtype(np.float16), np.dtype(np.uint8)),
                           (None, storage), (np.dtype(np.float16),) * 2) is None


def test_rows_cut_over_the_cores_give_the_same_bits(monkeypatch):
    rng = np.random.default_rng(1)
    w = quantize(rng.standard_normal((64, 512)).astype(np.float32), Storage("q4_0", 1))
    x = rng.standard_normal((1, 2, 512)).astype(np.float16)
    op = _op("bsm,fm->bsf")
    lay = _layout(op, x, w, Storage("q4_0", 1), shape=(64, 512))
    monkeypatch.setattr(storedmm, "POOL_ELEMENTS", 1)
    monkeypatch.setattr(storedmm.hostpool, "workers", lambda: 3)
    cut = storedmm.product(lay, [x, w])
    monkeypatch.setattr(storedmm, "POOL_ELEMENTS", 1 << 40)
    whole = storedmm.product(lay, [x, w])
    assert np.array_equal(cut, whole)


SMALL = config.preset("small")  # hidden 128, ffn 352


def _tokens(b=1, s=12):
    return (np.arange(b * s).reshape(b, s) * 7 + 3) % SMALL.vocab


@pytest.mark.parametrize("fmt,dtype", [("q4_0", DType.f32), ("q8_0", DType.f32),
                                       ("q4_1", DType.f16), (None, DType.f16), (None, DType.bf16)])
def test_paged_plans_through_the_kernels_compute_the_model(fmt, dtype, monkeypatch):
    """A paged prefill, quantized (float32 or f16 activations) and f16 or bf16, on the threads
    backend and the executor in a random order, with the kernels really taking the weights: the
    reference's answers to float32's tolerance where the activations are float32; where they are
    f16 or bf16 (rounded after every op, so the sums' order shows), no farther from the
    reference than NumPy's path is."""
    cfg = SMALL.with_dtype(dtype)
    cfg = schema.quantized(cfg, fmt) if fmt else cfg
    weights = RandomWeights(SMALL, 0)
    graph = llama.prefill_graph(cfg).bind(B=1, S=12)
    want = evaluate(graph, {"tokens": _tokens()}, weights)["logits"].astype(np.float32)
    mg = compile_graph(graph, CompileOptions(cfg.weight_bytes() // 3)).memgraph

    def error(logits):
        return float(np.abs(logits.astype(np.float32) - want).max())

    monkeypatch.setattr(storedmm, "_cpu", None)  # an install with no C compiler: NumPy's path
    stored.layout.cache_clear()
    try:
        numpy_error = error(run(mg, {"tokens": _tokens()}, weights, order=7)["logits"])
    finally:
        monkeypatch.undo()
        stored.layout.cache_clear()
    calls = []
    real = storedmm.product
    monkeypatch.setattr(storedmm, "product", lambda lay, reads: calls.append(lay) or real(lay, reads))
    bound = 1e-5 * np.abs(want).max() if dtype == DType.f32 else 1.5 * numpy_error
    got, _ = run_plan(mg, {"tokens": _tokens()}, weights, backend="threads")
    assert calls, "no apply went through the kernels"
    assert error(got["logits"]) <= bound
    assert error(run(mg, {"tokens": _tokens()}, weights, order=7)["logits"]) <= bound


@pytest.mark.parametrize("fmt", ["f16", "q4_0"])
def test_a_block_cut_by_columns_is_read_where_it_lies(fmt, monkeypatch):
    """A host apply reads a weight block in its checkpoint's array: a view whose rows are one
    stride apart. The kernels read it there (no copy), with the copy's answer."""
    rng = np.random.default_rng(5)
    full32 = rng.standard_normal((48, 512)).astype(np.float32)
    if fmt == "f16":
        full, block, shape, storage = full32.astype(np.float16), None, (48, 256), None
        block = full[:, 256:]
    else:
        storage = Storage(fmt, 1)
        full = quantize(full32, storage)  # rows of 16 groups of 18 bytes
        block, shape = full[:, 8 * 18:], (48, 256)
    assert not block.flags.c_contiguous
    x = rng.standard_normal((1, 2, 256)).astype(np.float16)
    op = _op("bsm,fm->bsf")
    lay = _layout(op, x, block, storage, shape=shape)
    copies = []
    real = np.ascontiguousarray
    monkeypatch.setattr(storedmm.np, "ascontiguousarray",
                        lambda a, *args, **kw: copies.append(a.shape) or real(a, *args, **kw))
    got = storedmm.product(lay, [x, block])
    assert (48, block.shape[1]) not in copies  # the block itself was not copied
    monkeypatch.undo()
    want = storedmm.product(lay, [x, np.ascontiguousarray(block)])
    assert np.array_equal(got, want)


def test_views_whose_rows_are_not_one_stride_apart_are_copied():
    """A size-1 row axis says nothing of the stride between the others; a broadcast weight's
    rows overlap: both are copied, with the right answer (found in review: the first gave wrong
    numbers, the second an error)."""
    rng = np.random.default_rng(9)
    parent = rng.standard_normal((2, 4, 3, 64)).astype(np.float16)
    w = parent[:, ::4]  # (2, 1, 3, 64): rows (2 x 3) are not one stride apart
    x = rng.standard_normal((2, 64)).astype(np.float16)
    op = _op("mk,fghk->mfgh")
    lay = stored.layout(op, (x.shape, w.shape), (x.dtype, w.dtype), (None, None),
                        (np.dtype(np.float16),) * 2)
    np.testing.assert_allclose(storedmm.product(lay, [x, w]), _numpy_product(op, [x, w]),
                               rtol=2e-6, atol=1e-5)
    row = rng.standard_normal(64).astype(np.float16)
    w = np.broadcast_to(row, (8, 64))
    op = _op("mk,nk->mn")
    lay = stored.layout(op, ((2, 64), w.shape), (x.dtype, w.dtype), (None, None),
                        (np.dtype(np.float16),) * 2)
    np.testing.assert_allclose(storedmm.product(lay, [x, w]), _numpy_product(op, [x, w]),
                               rtol=2e-6, atol=1e-5)


def test_nothing_to_compute_is_left_to_numpy():
    op = _op("mk,nk->mn")
    f16 = np.dtype(np.float16)
    assert stored.layout(op, ((0, 64), (8, 64)), (f16, f16), (None, None), (f16, f16)) is None
    op = _op("bsk,bnk->bsn")
    assert stored.layout(op, ((0, 1, 64), (0, 8, 64)), (f16, f16), (None, None),
                         (f16, f16)) is None


@pytest.mark.parametrize("call", [
    lambda c, z: c.gemv(z(16, "f4"), z(64, "u1"), z(4, "f4"), 1, 0, 1, 1, 2 ** 62,
                        z(1, "i8").tobytes(), 1, 0, 1, 0, 1, False),
    lambda c, z: c.dequant(z(64, "u1"), z(4, "f4"), 1, 0, 2 ** 61, 1, 2),
    lambda c, z: c.gemv(z(16, "f4"), z(64, "u1"), z(4, "f4"), 1, 0, 1, 1, 8,
                        np.full(1, 2 ** 62, np.int64).tobytes(), 16, 0, 1, 0, 1, False),
    lambda c, z: c.gemv(z(16, "f4"), z(64, "u1"), z(4, "f4"), 1, 0, 1, 1, 8,
                        z(1, "i8").tobytes(), 2 ** 62, 0, 1, 0, 1, True),
], ids=["huge-K", "huge-K-dequant", "huge-offset", "huge-stride"])
def test_arguments_past_the_buffers_are_refused_not_read(call):
    """Sizes whose products overflow 64 bits once passed the checks and read out of bounds
    (found in review); every one is a ValueError now."""
    with pytest.raises(ValueError):
        call(storedmm._cpu, lambda n, t: np.zeros(n, np.dtype(t)))
