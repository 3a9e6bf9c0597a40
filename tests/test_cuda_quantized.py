"""The CuPy backend on plans with packed (quantized) weights (`einpage.ir.storage`), on any machine
(the stand-in for CuPy, `fake_cupy`, runs the generated kernels on the host with g++):

- every dequantization kernel (`cuda_source.dequant_kernel`: each format, each logical dtype)
  gives `einpage.ir.quant.dequantize`'s values bit for bit, for random packed bytes with
  finite scales and for quantized values;
- every packed read of a quantized plan is dequantized into a workspace slot before its apply
  (`apply_plan.Unpack`), and `workspace_bytes` counts the slots, except the table of a gather (a
  quantized embedding, packed by rows): one `cuda_source.dequant_gather_kernel` dequantizes just
  the elements of the rows its ids pick, bit for bit as the NumPy runtimes do (`blockops._gather`,
  zeros outside a partial block's rows, a bad id of a whole table reported), with no slot;
- paged quantized LLaMA plans (prefill, a decode session replayed as a CUDA graph, a disk tier)
  equal the NumPy executor, moving and pinning the packed bytes and allocating nothing outside
  the workspace.

The NVRTC compile of every dequantization (and dequantizing gather) kernel for sm_90 is in
`test_nvrtc`.
"""
from __future__ import annotations

import functools

import math
from types import SimpleNamespace

import numpy as np
import pytest
from sessions import held_decode_steps
from fake_cupy import installed

from einpage.compiler import CompileOptions, compile_graph
from einpage.errors import InputError, PlanError
from einpage.ir.dtypes import DType
from einpage.ir.memgraph import ApplyNode
from einpage.ir.ops import GatherOp
from einpage.ir.storage import FORMATS, WRITABLE, Storage
from einpage.models import config, llama, resolve, schema
from einpage.runtime import blockops, executor
from einpage.runtime.backends import cuda_apply
from einpage.runtime.backends.apply_plan import (STATUS_BYTES, aligned, gathers_packed_rows,
                                                 plan_applies, plan_kernels, slot_bytes,
                                                 workspace_bytes)
from einpage.runtime.backends.cuda import CupyBackend
from einpage.runtime.backends.cuda_source import (DEVICE_DTYPE, dequant_gather_kernel,
                                                  dequant_kernel)
from einpage.runtime.backends.pinned import PinnedWeights
from einpage.runtime.planio import stored
from einpage.ir.quant import dequantize, quantize
from einpage.runtime.stream_executor import run_streams

#: the logical dtypes a packed block dequantizes to
TAGS = ("f32", "f16", "bf16")
#: byte offsets of each format's f16 scales (and minima) in a group
F16_FIELDS = {"q8_0": (0,), "q4_0": (0,), "q4_1": (0, 2), "q4_g128": (0,), "q4_k": (0, 2),
              "q6_k": (208,)}


@pytest.fixture
def fake_cupy(monkeypatch, tmp_path_factory):
    yield from installed(monkeypatch, tmp_path_factory)


def prepare(mg) -> None:
    """Make every kernel a plan runs (the stand-in compiles them in one g++ run)."""
    for plan in plan_applies(mg).values():
        for src in plan_kernels(plan):
            cuda_apply.compiled(src)


# ====================================================================== the kernels

def random_groups(fmt: str, groups: int, rng) -> np.ndarray:
    """`groups` packed groups of random bytes whose f16 fields are finite (random f16 bits of
    every magnitude, subnormals included; no inf, no NaN)."""
    f = FORMATS[fmt]
    raw = rng.integers(0, 256, (groups, f.group_bytes), dtype=np.uint8)
    for at in F16_FIELDS[fmt]:
        bits = rng.integers(0, 1 << 16, groups, dtype=np.uint16)
        bits = np.where((bits & 0x7C00) == 0x7C00, bits & 0xBFFF, bits)  # exponent 31 -> 15
        raw[:, at:at + 2] = bits.astype("<u2").view(np.uint8).reshape(groups, 2)
    assert np.isfinite(raw[:, F16_FIELDS[fmt][0]:][:, :2].copy().view(np.float16)).all()
    return raw


def _run_dequant(cp, stream, fmt: str, tag: str, packed: np.ndarray, count: int) -> np.ndarray:
    """The kernel's output (bits, the device dtype) for `count` elements of `packed`."""
    out = np.zeros(count, DEVICE_DTYPE[tag])
    with stream:
        cuda_apply.compiled(dequant_kernel(fmt, tag))(cp.adopt(packed.reshape(-1)),
                                                      cp.adopt(out))
    stream.synchronize()
    return out


def test_dequant_kernels_equal_numpy_bit_for_bit(fake_cupy):
    """Every format to every logical dtype: random packed bytes (finite scales of every
    magnitude) and quantized values of a 3-d block dequantize on the device to exactly
    `quant.dequantize`'s bits (f16 overflowing to inf alike)."""
    cp = fake_cupy
    stream = cp.cuda.Stream(non_blocking=True)
    for fmt in FORMATS:  # every kernel first: the stand-in builds them in one g++ run
        for tag in TAGS:
            cuda_apply.compiled(dequant_kernel(fmt, tag))
    rng = np.random.default_rng(29)
    for fmt, f in FORMATS.items():
        groups = 6 if f.group >= 128 else 24
        raw = random_groups(fmt, groups, rng)
        # a block of 3 rows of whole groups, its span the last axis
        shape = (3, groups // 3 * f.group)
        packed = raw.reshape(Storage(fmt, 1).packed_shape(shape))
        for tag in TAGS:
            dtype = DType(tag).numpy
            got = _run_dequant(cp, stream, fmt, tag, packed, math.prod(shape))
            with np.errstate(over="ignore"):
                want = dequantize(packed, Storage(fmt, 1), shape, dtype)
            assert want.dtype.itemsize == got.dtype.itemsize
            bits = np.dtype(f"u{got.dtype.itemsize}")
            mismatch = np.flatnonzero(got.view(bits) != want.reshape(-1).view(bits))
            assert not mismatch.size, (
                f"{fmt} -> {tag}: {mismatch.size} of {got.size} elements differ, first at "
                f"{mismatch[0]}: {got.view(dtype)[mismatch[0]]} vs "
                f"{want.reshape(-1)[mismatch[0]]}")
        if fmt in WRITABLE:  # what a checkpoint quantized block by block holds
            values = (rng.standard_normal((2, 2, 2 * f.group))
                      * np.exp(rng.uniform(-8, 4, (2, 2, 1)))).astype(np.float32)
            storage = Storage(fmt, 2)
            packed = quantize(values, storage)
            for tag in TAGS:
                dtype = DType(tag).numpy
                got = _run_dequant(cp, stream, fmt, tag, packed, values.size)
                want = dequantize(packed, storage, values.shape, dtype)
                np.testing.assert_array_equal(got.view(dtype), want.reshape(-1),
                                              err_msg=f"{fmt} -> {tag} (quantized values)")


def test_dequant_kernel_refuses_what_it_cannot_make():
    with pytest.raises(PlanError, match="f16, bf16 or f32"):
        dequant_kernel("q8_0", "i64")
    with pytest.raises(Exception, match="unknown storage format"):
        dequant_kernel("q3_k", "f32")
    names = {dequant_kernel(fmt, tag).name for fmt in FORMATS for tag in TAGS}
    assert len(names) == len(FORMATS) * len(TAGS)  # one kernel per format and dtype


# ====================================================================== gathers of packed tables

def _gather_info(fmt: str, shape: tuple[int, ...], full_rows: int, tag: str):
    """What `blockops._gather` reads of a packed table block (a stand-in `TensorInfo`)."""
    return SimpleNamespace(shape=shape, storage=Storage(fmt, 1), dtype=DType(tag),
                           source=SimpleNamespace(full_shape=(full_rows,) + shape[1:]))


def _numpy_gather(fmt, tag, out_tag, combine, packed, ids, row_offset, full_rows, shape, y0):
    """What the NumPy runtimes write: `blockops._gather`'s block, folded into `y0` in the
    write's compute dtype when accumulating, cast to the write's dtype (`apply_value`)."""
    info = _gather_info(fmt, shape, full_rows, tag)
    compute = DType(out_tag).compute
    with np.errstate(over="ignore", invalid="ignore"):  # random f16 scales overflow f16
        part = blockops._gather(GatherOp(row_offset), packed, ids, info)
        if combine:
            part = y0.astype(compute) + part.astype(compute)
        return part.astype(DType(out_tag).numpy).reshape(-1)


#: (table dtype, write dtype, combine) of each dequantizing gather the kernel test runs
GATHER_CASES = [(t, t, None) for t in TAGS] + [(t, "f32", "sum") for t in TAGS]


def test_dequant_gather_kernels_equal_numpy_bit_for_bit(fake_cupy):
    """Every format, every table dtype (written as itself, and summed into an f32 write): a
    packed table block of whole packed rows gathered by ids on the device is exactly what the
    NumPy runtimes make of it, for a block of a table cut by rows (ids outside it give what a
    row of zero bytes reads as) and for a whole table; a whole table's bad id sets the status
    words as `gather_kernel` does, a partial block's does not."""
    cp = fake_cupy
    stream = cp.cuda.Stream(non_blocking=True)
    for fmt in FORMATS:
        for tag, out_tag, combine in GATHER_CASES:
            cuda_apply.compiled(dequant_gather_kernel(fmt, out_tag, tag, combine))
    rng = np.random.default_rng(31)
    rows = 6
    for fmt, f in FORMATS.items():
        shape = (rows, 2 * f.group)
        packed = random_groups(fmt, rows * 2, rng).reshape(Storage(fmt, 1).packed_shape(shape))
        # (row offset, rows of the full table, ids): a block of a table cut by rows, a whole one
        cases = [(4, 16, rng.integers(0, 16, (2, 7))), (0, rows, rng.integers(0, rows, (3, 4)))]
        for row_offset, full_rows, ids in cases:
            partial = full_rows != rows
            if partial:  # both sides of the block's rows, and its edges
                ids[0, :4] = (row_offset - 1, row_offset, row_offset + rows - 1, row_offset + rows)
            out_shape = ids.shape + shape[1:]
            for tag, out_tag, combine in GATHER_CASES:
                dtype = DType(out_tag).numpy
                y0 = rng.standard_normal(out_shape).astype(dtype)
                want = _numpy_gather(fmt, tag, out_tag, combine, packed, ids, row_offset,
                                     full_rows, shape, y0)
                got = y0.reshape(-1).copy().view(DEVICE_DTYPE[out_tag])
                status = np.zeros(3, np.int64)
                kernel = cuda_apply.compiled(dequant_gather_kernel(fmt, out_tag, tag, combine))
                with stream:
                    kernel(cp.adopt(packed.reshape(-1)), cp.adopt(ids.reshape(-1)), rows,
                           shape[1], row_offset, int(partial), cp.adopt(got), cp.adopt(status))
                stream.synchronize()
                bits = np.dtype(f"u{got.dtype.itemsize}")
                mismatch = np.flatnonzero(got.view(bits) != want.view(bits))
                label = f"{fmt} {tag} -> {out_tag} ({combine}, partial {partial})"
                assert not mismatch.size, (
                    f"{label}: {mismatch.size} of {got.size} elements differ, first at "
                    f"{mismatch[0]}: {got.view(dtype)[mismatch[0]]} vs {want[mismatch[0]]}")
                assert not status.any(), (label, status)
        # a whole table and an id past its rows: reported, the row zero
        ids = np.array([1, rows + 3, 0])
        got = np.full(3 * shape[1], 7, np.float32)
        status = np.zeros(3, np.int64)
        with stream:
            cuda_apply.compiled(dequant_gather_kernel(fmt, "f32", "f32"))(
                cp.adopt(packed.reshape(-1)), cp.adopt(ids), rows, shape[1], 0, 0,
                cp.adopt(got), cp.adopt(status))
        stream.synchronize()
        assert status.tolist() == [1, rows + 3, rows], fmt
        assert not got[shape[1]:2 * shape[1]].any(), fmt


def test_dequant_gather_kernel_refuses_what_it_cannot_make():
    with pytest.raises(PlanError, match="f16, bf16 or f32"):
        dequant_gather_kernel("q8_0", "f32", "i64")
    with pytest.raises(PlanError, match="float block"):
        dequant_gather_kernel("q8_0", "i64", "f32")
    names = {dequant_gather_kernel(fmt, out, tag, combine).name for fmt in FORMATS
             for tag, out, combine in GATHER_CASES}
    assert len(names) == len(FORMATS) * len(GATHER_CASES)
    assert not names & {dequant_kernel(fmt, tag).name for fmt in FORMATS for tag in TAGS}


# ====================================================================== plans

def quantized_plan(fmt: str, dtype: DType = DType.f32, phase: str = "prefill",
                   model: str = "small", fraction: int = 3, seed: int = 0):
    """(config, weights, inputs, compiled) of a quantized LLaMA pass paged under `fraction` of
    its (packed) weights."""
    cfg, weights = resolve(model, random_weights=True, seed=seed, dtype=dtype, quantize=fmt)
    rng = np.random.default_rng(seed)
    if phase == "prefill":
        graph = llama.prefill_graph(cfg).bind(B=1, S=16)
        inputs = {"tokens": rng.integers(0, cfg.vocab, (1, 16))}
    else:
        from einpage.models.generation import decode_step_graph
        graph = decode_step_graph(cfg, 2, 8)
        inputs = None
    return cfg, weights, inputs, _compiled(graph, cfg.weight_bytes() // fraction)


@functools.lru_cache(maxsize=16)
def _compiled(graph, budget: int):
    """A plan compiled once for the tests that read it (q4_g128's takes seconds); the weights
    stay each test's own (a pinned store remembers its source)."""
    return compile_graph(graph, CompileOptions(budget))


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1", "q4_g128"])
def test_every_packed_read_is_dequantized_into_the_workspace(fmt):
    _, _, _, compiled = quantized_plan(fmt)
    mg = compiled.memgraph
    plans = plan_applies(mg)
    packed_reads = 0
    for n in mg.nodes:
        if not isinstance(n, ApplyNode) or n.on_host:  # (the embedding rows: the host's)
            continue
        plan = plans[n.id]
        packed = [k for k, a in enumerate(n.reads) if mg.tensors[a.tensor].storage is not None
                  and not (k == 0 and gathers_packed_rows(n, mg.tensors[a.tensor]))]
        assert [u.read for u in plan.unpacks] == packed
        for u in plan.unpacks:
            t = mg.tensors[n.reads[u.read].tensor]
            assert u.kernel == dequant_kernel(t.storage.format, t.dtype.value)
            assert u.nbytes == math.prod(t.shape) * t.dtype.itemsize > t.bytes
            assert u.kernel in plan_kernels(plan)
        assert slot_bytes(plan) == (sum(aligned(u.nbytes) for u in plan.unpacks)
                                    + sum(aligned(t) for t in plan.temps))
        packed_reads += len(packed)
    assert packed_reads >= 4 * 7  # every matrix of every layer, the head
    need = workspace_bytes(mg)
    assert need == max(slot_bytes(p) for p in plans.values()) + STATUS_BYTES
    largest = max(sum(aligned(u.nbytes) for u in p.unpacks) for p in plans.values())
    assert need >= largest + STATUS_BYTES > STATUS_BYTES


def _packed_gathers(mg) -> list:
    return [n for n in mg.nodes if isinstance(n, ApplyNode) and isinstance(n.op, GatherOp)
            and gathers_packed_rows(n, mg.tensors[n.reads[0].tensor])]


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1", "q4_g128"])
def test_a_packed_embedding_is_gathered_without_a_workspace_slot(fake_cupy, fmt):
    """The small LLaMA quantized (its embedding packed by rows), under a budget that cuts the
    embedding by rows: each gather of it runs one dequantizing gather kernel over the packed
    bytes where they lie, takes no workspace slot for its table (`workspace_bytes` counts none),
    and (run end to end for q4_1, the slowest of the stand-in's kernels to emulate being the
    others' arithmetic, checked bit for bit above) the logits and KV cache equal the NumPy
    executor's."""
    cfg = schema.quantized(config.preset("small"), fmt)
    weights = resolve("small", random_weights=True, seed=3, quantize=fmt)[1]
    graph = llama.prefill_graph(cfg).bind(B=1, S=8)
    # (gathered on the device: a pass that does not fit gathers on the host by default)
    mg = compile_graph(graph, CompileOptions(cfg.weight_bytes() // 6,
                                             host_gather=False)).memgraph
    plans = plan_applies(mg)
    gathers = _packed_gathers(mg)
    assert gathers
    cut = 0
    for n in gathers:
        plan, table = plans[n.id], mg.tensors[n.reads[0].tensor]
        write = mg.tensors[n.write.tensor]
        cut += table.shape[0] < table.source.full_shape[0]
        assert table.storage.format == fmt and table.storage.span < len(table.shape)
        assert plan.unpacks == ()
        view = plan.arrays[0]
        assert view.packed and view.shape == (table.storage.nbytes(tuple(table.shape)),)
        assert plan.kernel == dequant_gather_kernel(fmt, write.dtype.value, table.dtype.value,
                                                    "sum" if n.accumulate else None)
        assert plan.kernel in plan_kernels(plan) and plan.status
        assert slot_bytes(plan) == sum(aligned(t) for t in plan.temps) < aligned(
            math.prod(table.shape) * table.dtype.itemsize) + slot_bytes(plan)
    assert cut == len(gathers) > 1  # every block of the embedding is a row block
    assert workspace_bytes(mg) == max(slot_bytes(p) for p in plans.values()) + STATUS_BYTES
    if fmt != "q4_1":
        return
    tokens = np.random.default_rng(3).integers(0, cfg.vocab, (1, 8))
    tokens[0, :3] = (0, cfg.vocab - 1, cfg.vocab // 2)  # the first and last rows
    want = executor.run(mg, {"tokens": tokens}, weights)
    prepare(mg)
    backend = CupyBackend()
    got = run_streams(mg, {"tokens": tokens}, weights, backend=backend).outputs
    _close(got, want, DType.f32, f"{fmt} embedding cut by rows")
    assert backend.arena is None


def test_a_bad_token_of_a_whole_packed_embedding_is_an_input_error(fake_cupy):
    """A budget that keeps the packed embedding whole: an id past its rows is the NumPy
    executor's `InputError`, reported by the dequantizing gather's status words."""
    cfg = schema.quantized(config.preset("small"), "q4_0")
    weights = resolve("small", random_weights=True, seed=4, quantize="q4_0")[1]
    graph = llama.prefill_graph(cfg).bind(B=1, S=16)
    mg = compile_graph(graph, CompileOptions(4 * cfg.weight_bytes())).memgraph
    gathers = _packed_gathers(mg)
    assert gathers and all(mg.tensors[n.reads[0].tensor].shape[0] == cfg.vocab for n in gathers)
    tokens = np.random.default_rng(4).integers(0, cfg.vocab, (1, 16))
    prepare(mg)
    backend = CupyBackend()
    want = executor.run(mg, {"tokens": tokens}, weights)
    _close(run_streams(mg, {"tokens": tokens}, weights, backend=backend).outputs, want,
           DType.f32, "q4_0 whole embedding")
    tokens[0, 5] = cfg.vocab + 2
    with pytest.raises(InputError, match=f"index {cfg.vocab + 2} out of range"):
        executor.run(mg, {"tokens": tokens}, weights)
    with pytest.raises(InputError, match=f"index {cfg.vocab + 2} out of range for a table of "
                                         f"{cfg.vocab} rows"):
        run_streams(mg, {"tokens": tokens}, weights, backend=backend)
    assert backend.arena is None


def test_an_apply_writing_a_packed_block_is_a_plan_error():
    _, _, _, compiled = quantized_plan("q8_0", model="tiny")
    mg = compiled.memgraph
    n = next(n for n in mg.nodes if isinstance(n, ApplyNode)
             and any(mg.tensors[a.tensor].storage is not None for a in n.reads))
    packed = next(a for a in n.reads if mg.tensors[a.tensor].storage is not None)
    from dataclasses import replace

    from einpage.runtime.backends.apply_plan import plan_apply
    bad = replace(n, write=replace(n.write, tensor=packed.tensor, offset=packed.offset))
    with pytest.raises(PlanError, match="packed"):
        plan_apply(mg, bad)


# ====================================================================== end to end

def _close(got, want, dtype: DType, label: str) -> None:
    tol = 1e-5 if dtype == DType.f32 else 0.05
    for name in want:
        a, b = np.asarray(got[name], np.float64), np.asarray(want[name], np.float64)
        assert a.shape == b.shape, (label, name)
        scale = max(1.0, float(np.abs(b).max()))
        assert float(np.abs(a - b).max()) <= tol * scale, \
            f"{label} {name}: max abs error {np.abs(a - b).max():.3e}"


def _streamed_weights(mg) -> list:
    """The weight blocks the backend pins (streamed from host memory, not read from disk)."""
    from einpage.runtime.backends.base import host_layout
    return [mg.tensors[t] for t in host_layout(mg, stage_sources=True).streamed
            if mg.tensors[t].role == "weight" and mg.tensors[t].source is not None]


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1", "q4_g128"])
def test_paged_quantized_prefill_equals_the_numpy_executor(fake_cupy, fmt):
    """The small LLaMA with its matrices packed, paged under a third of its packed weights:
    the logits and the KV cache equal the NumPy executor's; the packed bytes are what is
    pinned and copied."""
    cfg, weights, inputs, compiled = quantized_plan(fmt)
    mg = compiled.memgraph
    assert compiled.report.traffic.reload_bytes > 0 and mg.device_bytes < cfg.weight_bytes()
    want = executor.run(mg, inputs, weights)
    prepare(mg)
    backend = CupyBackend()
    got = run_streams(mg, inputs, weights, backend=backend).outputs
    _close(got, want, DType.f32, f"{fmt} prefill")
    assert backend.arena is None
    streamed = _streamed_weights(mg)
    assert any(t.storage is not None for t in streamed)
    store = PinnedWeights.for_source(fake_cupy, weights)
    # each streamed block pinned once, in its stored (packed) bytes
    assert store.pinned_bytes == sum(math.prod(stored(t)[1]) * stored(t)[0].itemsize
                                     for t in streamed)


@pytest.mark.parametrize("fmt, dtype", [("q4_0", DType.bf16), ("q8_0", DType.f16),
                                        ("q4_1", DType.bf16)])
def test_quantized_blocks_dequantize_to_half_precision(fake_cupy, fmt, dtype):
    """Logical bf16 and f16: the dequantized operands are rounded to the block's dtype and go
    to cuBLAS as half operands."""
    cfg, weights, inputs, compiled = quantized_plan(fmt, dtype, fraction=4)
    mg = compiled.memgraph
    want = executor.run(mg, inputs, weights)
    prepare(mg)
    got = run_streams(mg, inputs, weights, backend=CupyBackend()).outputs
    _close(got, want, dtype, f"{fmt} {dtype}")


def test_plans_of_other_formats_share_no_pinned_blocks(fake_cupy):
    """One weight source, two plans cutting the weights alike but packing them otherwise: the
    second must not be given the first one's pinned bytes."""
    cfg, weights = resolve("small", random_weights=True, seed=1)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab, (1, 16))
    for fmt in ("q8_0", "q4_0", None):
        c = resolve("small", quantize=fmt)[0]  # the same weights, packed as `fmt`
        graph = llama.prefill_graph(c).bind(B=1, S=16)
        mg = compile_graph(graph, CompileOptions(cfg.weight_bytes() // 12)).memgraph
        want = executor.run(mg, {"tokens": tokens}, weights)
        prepare(mg)
        got = run_streams(mg, {"tokens": tokens}, weights, backend=CupyBackend()).outputs
        _close(got, want, DType.f32, f"{fmt} after another format")


def test_quantized_decode_session_replays_a_cuda_graph(fake_cupy):
    """A decode step of the quantized model held open: the second pass is captured (the
    dequantization kernels with the rest) and later passes replay it; every step's logits
    equal the threads backend's, and no pass allocates outside the workspace."""
    from einpage.runtime.backends.threads import ThreadsBackend
    cfg, weights, _, compiled = quantized_plan("q4_0", phase="decode", fraction=3, seed=5)
    mg = compiled.memgraph
    assert compiled.report.traffic.reload_bytes > 0
    prepare(mg)
    prompt = np.array([[4, 8, 15, 16, 23], [42, 1, 2, 3, 5]]) % cfg.vocab

    def allocates_nothing(backend):
        assert backend.hook.allocations == 0, backend.hook.bytes
        assert backend.hidden_allocations == 0, backend.hidden_bytes

    want, _ = held_decode_steps(cfg, weights, mg, prompt, ThreadsBackend(), True)
    backend = CupyBackend()
    got, replays = held_decode_steps(cfg, weights, mg, prompt, backend, False,
                                     after_pass=allocates_nothing)
    assert replays == 2  # the second pass captured and replayed, the third replayed
    for k, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5, err_msg=f"step {k}")
    assert backend.arena is None


def test_quantized_disk_tier_on_the_stand_in(fake_cupy):
    """A host budget small enough that packed weight blocks are read from the checkpoint
    every pass (quantized as they are read) into the host arena, then copied to the device:
    the logits equal the NumPy executor's."""
    import dataclasses

    from conftest import FIXTURES

    from einpage.compiler.tiers import STAGING_BLOCKS, host_needs
    from einpage.ir.memgraph import HOST_ALIGNMENT, ReadNode
    path = FIXTURES / "tiny-llama-f32"
    if not (path / "model.safetensors").exists():
        pytest.skip(f"Hugging Face fixture {path} not found")
    cfg, weights = resolve(str(path), quantize="q8_0")
    assert cfg.formats
    ids = np.load(path / "input_ids.npy")
    graph = llama.prefill_graph(cfg).bind(B=ids.shape[0], S=ids.shape[1])
    base = CompileOptions(cfg.weight_bytes() // 4)
    free = compile_graph(graph, base).memgraph
    needs = host_needs(free)
    largest = max(free.tensors[i].bytes for i in needs.streamed)
    host = (needs.fixed_bytes + STAGING_BLOCKS[0] * -(-largest // HOST_ALIGNMENT)
            * HOST_ALIGNMENT + needs.streamed_bytes // 3)
    mg = compile_graph(graph, dataclasses.replace(base, host_bytes=host)).memgraph
    reads = [mg.tensors[n.tensor] for n in mg.nodes if isinstance(n, ReadNode)]
    assert any(t.storage is not None for t in reads)
    # the device side of the tiered plan is the unconstrained one's (tests/test_tiers.py)
    want = executor.run(free, {"tokens": ids}, weights)
    prepare(mg)
    got = run_streams(mg, {"tokens": ids}, weights, backend=CupyBackend()).outputs
    _close(got, want, DType.f32, "q8_0 disk tier")
