"""Quantized weights (storage formats): GGUF's rounding, the packed layout, cuts on whole groups,
plans that move packed bytes and compute what the dequantized model computes, the plan file and
the validator's rules for them, and the command line."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from einpage.cli import main
from einpage.compiler import CompileOptions, compile_graph
from einpage.errors import CheckpointError, GraphError, PlanError
from einpage.ir.builder import GraphBuilder
from einpage.ir.memgraph import MemGraph, ReloadNode
from einpage.ir.storage import FORMATS, WRITABLE, Storage, storage_for
from einpage.ir.validator import validate
from einpage.models import config, llama, schema
from einpage.models.checkpoint import RandomWeights
from einpage.runners import run_plan
from einpage.runtime import evaluate
from einpage.runtime.executor import run
from einpage.ir.quant import dequantize, quantize

gguf = pytest.importorskip("gguf")


def cli(*argv) -> int:
    try:
        return main([str(a) for a in argv])
    except SystemExit as exc:  # argparse's own errors
        return exc.code
GGML = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0,
        "q4_1": gguf.GGMLQuantizationType.Q4_1}


def _awkward(rows: int = 24) -> np.ndarray:
    """Rows of groups that catch rounding differences: zeros, constants, ties, a negative
    extreme, tiny and huge magnitudes."""
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((rows, 64)) * rng.uniform(1e-3, 30, (rows, 1))).astype(np.float32)
    x[0] = 0
    x[1] = 2.5
    x[2, :32] = -7.0
    x[2, 5] = -9.0
    x[3] = np.linspace(-8, 8, 64)
    x[4] *= 1e-6
    x[5] = np.round(x[5] * 4) / 4  # many exact halves
    x[6, :32] = 1e-30  # a scale below f16's smallest
    x[7] = np.clip(x[7] / np.abs(x[7]).max() * 6e4, -6e4, 6e4)  # near f16's largest
    return x


@pytest.mark.parametrize("fmt", sorted(GGML))
def test_quantize_gives_the_bytes_gguf_writes(fmt):
    x = _awkward()
    packed = quantize(x, Storage(fmt, 1))
    want = gguf.quants.quantize(x, GGML[fmt])
    assert packed.dtype == np.uint8 and packed.shape == want.shape
    assert np.array_equal(packed, want)
    back = dequantize(packed, Storage(fmt, 1), x.shape, np.float32)
    assert np.array_equal(back, gguf.quants.dequantize(want, GGML[fmt]))


@pytest.mark.parametrize("fmt,ggml", [("q4_k", "Q4_K"), ("q6_k", "Q6_K")])
def test_k_quants_dequantize_as_gguf(fmt, ggml):
    f = FORMATS[fmt]
    rng = np.random.default_rng(3)
    raw = rng.integers(0, 256, (6, f.group_bytes), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.0123).tobytes(), np.uint8)
    if fmt == "q4_k":  # d and dmin lead the block
        raw[:, 0:2], raw[:, 2:4] = scale, scale
    else:  # d ends it
        raw[:, -2:] = scale
    got = dequantize(raw.reshape(3, -1), Storage(fmt, 1), (3, 2 * f.group), np.float32)
    want = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, ggml))
    assert np.array_equal(got.reshape(-1), want.reshape(-1))


@pytest.mark.parametrize("fmt", WRITABLE)
@pytest.mark.parametrize("logical", [np.float16, "bfloat16"])
def test_dequantizing_for_float32_math_gives_the_logical_values(fmt, logical):
    """The NumPy runtimes dequantize straight to float32 holding the f16/bf16 values (the 4-bit
    formats gather from each group's 16 rounded levels): bit for bit the f16/bf16 block, cast."""
    import ml_dtypes
    logical = np.dtype(ml_dtypes.bfloat16) if logical == "bfloat16" else np.dtype(logical)
    x = _awkward(16).reshape(-1, 128)
    st = Storage(fmt, 1)
    packed = quantize(x, st)
    want = dequantize(packed, st, x.shape, logical).astype(np.float32)
    got = dequantize(packed, st, x.shape, np.float32, rounded=logical)
    assert np.array_equal(got, want, equal_nan=True)
    exact = dequantize(packed, st, x.shape, np.float32)
    assert np.array_equal(exact.astype(logical).astype(np.float32), want, equal_nan=True)


def test_q4_g128_is_within_half_a_step():
    x = _awkward(8).reshape(4, 128)
    st = Storage("q4_g128", 1)
    back = dequantize(quantize(x, st), st, x.shape, np.float32)
    step = (np.maximum(x.max(1), 0) - np.minimum(x.min(1), 0)) / 15
    assert np.all(np.abs(back - x) <= step[:, None] * 0.5 + 1e-3 * step[:, None] + 1e-30)


def test_storage_spans_the_fewest_axes_of_whole_groups():
    # wo of a head_dim 128 model: groups along j (64 = 2 groups), any head cut
    assert storage_for("q4_0", (4096, 32, 1, 2, 64), 4) == Storage("q4_0", 1)
    # head_dim 16: one row of a head pair's (g, 2, j) = 2*2*8 = 32 elements
    st = storage_for("q4_0", (64, 2, 2, 2, 8), 4)
    assert st == Storage("q4_0", 3) and st.quantum((64, 2, 2, 2, 8)) == 2
    assert storage_for("q4_0", (64, 176), 1) is None  # rows of 176: not whole groups
    assert st.packed_shape((64, 2, 2, 2, 8)) == (64, 2, 18)
    with pytest.raises(PlanError, match="whole rows"):
        st.packed_box((0, 0, 0, 0, 0), (64, 2, 2, 1, 8), (64, 2, 2, 2, 8))
    with pytest.raises(PlanError, match="whole groups"):
        st.packed_box((0, 0, 0, 0, 0), (64, 2, 1, 2, 8), (64, 2, 2, 2, 8))
    with pytest.raises(PlanError, match="whole groups"):
        Storage("q8_0", 1).packed_box((0, 16), (4, 32), (4, 64))


def test_a_packed_block_is_a_box_of_the_whole_tensors_bytes():
    x = np.random.default_rng(1).standard_normal((6, 4, 64)).astype(np.float32)
    st = Storage("q4_1", 1)
    whole = quantize(x, st)
    origin, shape = st.packed_box((2, 1, 32), (3, 2, 32), x.shape)
    box = whole[tuple(slice(o, o + n) for o, n in zip(origin, shape))]
    assert np.array_equal(box, quantize(x[2:5, 1:3, 32:64], st))


def test_only_weights_of_whole_groups_take_a_storage():
    g = GraphBuilder()
    with pytest.raises(GraphError, match="only weights"):
        g.input("x", (4, 32), storage=Storage("q8_0", 1))
    with pytest.raises(GraphError, match="not whole groups"):
        g.input("w", (4, 48), role="weight", storage=Storage("q8_0", 1))
    w = g.input("w", (4, 64), role="weight", storage=Storage("q8_0", 1))
    for use in (lambda: g.output("o", w), lambda: g.slice(w, 1, 0, 48),
                lambda: g.concat([w, w], 1), lambda: g.reshape(w, (2, 128))):
        with pytest.raises(GraphError, match="only einsums and gathers read it"):
            use()


SMALL = config.preset("small")  # hidden 128, ffn 352 (w_down stays f32 under q4_g128)


def _tokens(b=1, s=12):
    return (np.arange(b * s).reshape(b, s) * 7 + 3) % SMALL.vocab


@pytest.mark.parametrize("fmt", WRITABLE)
def test_paged_prefill_computes_the_dequantized_model(fmt):
    cfg = schema.quantized(SMALL, fmt)
    weights = RandomWeights(SMALL, 0)
    graph = llama.prefill_graph(cfg).bind(B=1, S=12)
    want = evaluate(graph, {"tokens": _tokens()}, weights)
    dense = evaluate(llama.prefill_graph(SMALL).bind(B=1, S=12), {"tokens": _tokens()}, weights)
    assert not np.allclose(want["logits"], dense["logits"], atol=1e-3)  # really quantized
    compiled = compile_graph(graph, CompileOptions(cfg.weight_bytes() // 4))
    mg = compiled.memgraph
    assert validate(mg).proven
    packed = [t for t in mg.tensors if t.storage is not None]
    assert packed and all(t.storage.format == fmt for t in packed)
    reloaded = [n for n in mg.nodes if isinstance(n, ReloadNode)]
    assert any(mg.tensors[n.tensor].storage is not None for n in reloaded)  # streams packed
    for order in ("sequential", 5):
        got = run(mg, {"tokens": _tokens()}, weights, order=order)
        np.testing.assert_allclose(got["logits"], want["logits"], rtol=1e-5, atol=1e-5)
    got, _ = run_plan(mg, {"tokens": _tokens()}, weights, backend="threads")
    np.testing.assert_allclose(got["logits"], want["logits"], rtol=1e-5, atol=1e-5)


def _decode_inputs(graph) -> dict:
    """Two rows at positions 5 and 11 of a random KV store."""
    rng = np.random.default_rng(0)
    inputs = {"tokens": np.array([[3], [9]]), "pos": np.array([5, 11])}
    for t in graph.inputs:
        if t.op.role.value == "cache":
            inputs[t.op.name] = rng.standard_normal(tuple(t.shape)).astype(np.float32)
    return inputs


def test_a_decode_step_over_a_kv_store_with_packed_weights():
    cfg = schema.quantized(SMALL, "q8_0")
    weights = RandomWeights(SMALL, 0)
    graph = llama.decode_graph(cfg).bind(B=2, C=16)
    inputs = _decode_inputs(graph)
    want = evaluate(graph, inputs, weights)
    compiled = compile_graph(graph, CompileOptions(cfg.weight_bytes() // 3))
    got = run(compiled.memgraph, inputs, weights, order=3)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_packed_weights_split_finer_keep_whole_groups_and_their_values(fmt):
    """A decode step's packed weights cut finer than the rest (`PartitionOptions.split_weights`,
    what `driver._split_streamed` does to the weights a plan streams): their blocks are sized
    by their packed bytes (a cap of a quarter of a projection's packed bytes cuts it in four,
    not in four times its logical-to-packed ratio), cut at whole groups, and the plan computes
    the dequantized model's logits in any order."""
    from einpage.compiler.lower_options import LowerOptions
    from einpage.compiler.lowering import lower
    from einpage.compiler.order import memory_aware_order
    from einpage.compiler.partitioner import PartitionOptions, partition
    from einpage.compiler.policies import get_policy
    from einpage.ir.graph import Input
    cfg = schema.quantized(SMALL, fmt)
    weights = RandomWeights(SMALL, 0)
    graph = llama.decode_graph(cfg).bind(B=2, C=16)
    packed = [n for n in graph.nodes if isinstance(n.op, Input) and n.op.storage is not None
              and n.op.name.startswith("layers.")]
    wq = next(n for n in packed if n.op.name == "layers.0.wq")
    cap = wq.op.storage.nbytes(tuple(wq.shape)) // 4
    tg = partition(graph, PartitionOptions(1 << 30, split_weights=frozenset({wq.id}),
                                           split_bytes=cap))
    blocks = [b for b in tg.blocks if b.node == wq.id]
    assert len(blocks) == 4 and all(b.bytes <= cap for b in blocks)
    assert all(b.storage is not None for b in blocks)
    inputs = _decode_inputs(graph)
    want = evaluate(graph, inputs, weights)
    mg = lower(tg, memory_aware_order(tg),
               LowerOptions(cfg.weight_bytes() // 3, get_policy("reuse-distance")))
    assert validate(mg).proven
    for order in (0, 3):
        got = run(mg, inputs, weights, order=order)
        np.testing.assert_allclose(got["logits"], want["logits"], rtol=1e-5, atol=1e-5)


def test_the_plan_moves_and_counts_packed_bytes():
    f32 = compile_graph(llama.prefill_graph(SMALL).bind(B=1, S=12),
                        CompileOptions(SMALL.weight_bytes() // 4))
    cfg = schema.quantized(SMALL, "q4_0")
    q4 = compile_graph(llama.prefill_graph(cfg).bind(B=1, S=12),
                       CompileOptions(cfg.weight_bytes() // 4))
    figures = q4.report.compiled
    assert sum(dict(figures.weight_formats).values()) == figures.weight_bytes  # both aligned
    assert cfg.weight_bytes() < SMALL.weight_bytes() * 0.16  # 4.5 of 32 bits, norms aside
    assert dict(q4.report.compiled.weight_formats)["q4_0"] > 0
    for t in q4.memgraph.tensors:
        if t.storage is not None:
            assert t.bytes == t.storage.nbytes(t.shape) < np.prod(t.shape) * t.dtype.itemsize
    assert q4.report.traffic.reload_weight_bytes < f32.report.traffic.reload_weight_bytes / 4


def test_cuts_keep_whole_groups_at_every_budget():
    cfg = schema.quantized(SMALL, "q4_0")
    graph = llama.prefill_graph(cfg).bind(B=1, S=12)
    for divisor in (2, 6, 16):
        mg = compile_graph(graph, CompileOptions(cfg.weight_bytes() // divisor)).memgraph
        assert validate(mg).proven  # the translation rule checks every packed box
        cut = [t for t in mg.tensors if t.storage is not None and t.shape != t.source.full_shape]
        for t in cut:
            t.storage.packed_box(t.source.origin, t.shape, t.source.full_shape)
    assert cut  # the smallest budget cuts packed weights


@pytest.fixture(scope="module")
def q8_plan():
    cfg = schema.quantized(SMALL, "q8_0")
    graph = llama.prefill_graph(cfg).bind(B=1, S=12)
    return compile_graph(graph, CompileOptions(cfg.weight_bytes() // 3)).memgraph


def test_a_plan_file_keeps_each_tensors_storage(q8_plan, tmp_path):
    path = tmp_path / "plan.json"
    q8_plan.save(path)
    data = json.loads(path.read_text())
    assert data["version"] == 2
    stored = [t["storage"] for t in data["tensors"] if "storage" in t]
    assert stored and stored[0] == {"format": "q8_0", "group": 32, "span": 1}
    back = MemGraph.load(path)
    assert [t.storage for t in back.tensors] == [t.storage for t in q8_plan.tensors]
    assert validate(back).proven
    weights = RandomWeights(SMALL, 0)
    np.testing.assert_array_equal(run(back, {"tokens": _tokens()}, weights)["logits"],
                                  run(q8_plan, {"tokens": _tokens()}, weights)["logits"])


def test_storage_needs_version_2(q8_plan):
    data = q8_plan.to_json()
    data["version"] = 1
    data.pop("graph")
    with pytest.raises(PlanError, match="version 1 plan cannot hold storage"):
        MemGraph.from_json(data)


def _packed_tid(mg: MemGraph) -> int:
    return next(t.id for t in mg.tensors if t.storage is not None)


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.update(bytes=t["bytes"] + 2), "takes"),
    (lambda t: t.update(storage={"format": "q4_0", "group": 32, "span": 1}), "bytes is"),
    (lambda t: t.pop("storage"), "bytes is"),
])
def test_a_damaged_storage_is_refused(q8_plan, edit, message):
    data = q8_plan.to_json()
    edit(data["tensors"][_packed_tid(q8_plan)])
    with pytest.raises(PlanError, match=message):
        MemGraph.from_json(data).verify()


def test_the_validator_proves_a_tensors_storage_is_its_blocks(q8_plan):
    from dataclasses import replace
    k = _packed_tid(q8_plan)
    t = q8_plan.tensors[k]
    swapped = replace(t, storage=Storage("q4_0", 1), bytes=Storage("q4_0", 1).nbytes(t.shape))
    tensors = q8_plan.tensors[:k] + (swapped,) + q8_plan.tensors[k + 1:]
    with pytest.raises(PlanError, match="is stored as q4_0 .span 1., but its block"):
        validate(replace(q8_plan, tensors=tensors))


class _Packed:
    """A weight source holding weights packed (as a GGUF file does)."""

    def __init__(self, fmt: str, cfg):
        self.dense, self.fmt, self.cfg = RandomWeights(SMALL, 0), fmt, cfg
        self.formats = dict(cfg.formats)

    def storage(self, name):
        st = schema.weight_storage(self.cfg)
        return st.get(name)

    def __call__(self, name):
        st = self.storage(name)
        value = np.asarray(self.dense(name))
        return value if st is None else quantize(value, st)


def test_a_packed_source_runs_quantized_and_unpacked_plans():
    cfg = schema.quantized(SMALL, "q4_1")
    source = _Packed("q4_1", cfg)
    graph = llama.prefill_graph(cfg).bind(B=1, S=12)
    want = evaluate(graph, {"tokens": _tokens()}, RandomWeights(SMALL, 0))
    assert np.array_equal(evaluate(graph, {"tokens": _tokens()}, source)["logits"],
                          want["logits"])
    mg = compile_graph(graph, CompileOptions(cfg.weight_bytes() // 3)).memgraph
    np.testing.assert_allclose(run(mg, {"tokens": _tokens()}, source)["logits"], want["logits"],
                               rtol=1e-5, atol=1e-5)
    # the same packed file planned unpacked: dequantized as the plan reads it
    plain = compile_graph(llama.prefill_graph(SMALL).bind(B=1, S=12),
                          CompileOptions(SMALL.weight_bytes() // 3)).memgraph
    np.testing.assert_allclose(run(plain, {"tokens": _tokens()}, source)["logits"],
                               want["logits"], rtol=1e-5, atol=1e-5)
    other = compile_graph(llama.prefill_graph(schema.quantized(SMALL, "q8_0")).bind(B=1, S=12),
                          CompileOptions(cfg.weight_bytes())).memgraph
    with pytest.raises(CheckpointError, match="stored as q4_1, but the plan reads it as q8_0"):
        run(other, {"tokens": _tokens()}, source)


def test_compile_and_run_quantize_on_the_command_line(tmp_path, capsys):
    assert cli("compile", "llama-65b", "--gpu-mem", "16GB", "--quantize", "q4_0",
               "--cpu-mem", "unlimited", "--quiet", "--json") == 0
    q4 = json.loads(capsys.readouterr().out)
    assert cli("compile", "llama-65b", "--gpu-mem", "16GB", "--cpu-mem", "unlimited",
               "--quiet", "--json") == 0
    f16 = json.loads(capsys.readouterr().out)
    assert q4["quantize"] == "q4_0" and q4["weight_formats"]["q4_0"] > 36e9
    assert q4["weight_bytes"] < f16["weight_bytes"] * 0.3
    assert q4["makespan_s"] < f16["makespan_s"] * 0.45
    plan = tmp_path / "p.json"
    assert cli("compile", "small", "--gpu-mem", "300KB", "--seq", "12", "--quantize", "q8_0",
               "-o", str(plan), "--quiet") == 0
    out = capsys.readouterr().out
    assert "q8_0" in out
    assert cli("run", "small", "--random-weights", "--tokens", "3,10,17", "--gpu-mem", "300KB",
               "--quantize", "q8_0", "--backend", "threads", "--out", str(tmp_path / "a.npy")) == 0
    assert np.isfinite(np.load(tmp_path / "a.npy")).all()


def test_an_unknown_quantize_format_is_one_line(capsys):
    assert cli("compile", "llama-7b", "--gpu-mem", "4GB", "--quantize", "q3_k") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "q3_k" in err


# ---------------------------------------------------------------- the KV store in 8 bits

KV_BASE = config.ModelConfig("kv32", 96, 64, 96, 2, 4, 2, 32, dtype=config.DType.f32)


def test_a_q8_0_kv_store_holds_packed_rows_and_generates_what_the_reference_does():
    from dataclasses import replace

    from einpage.models.generation import greedy
    from einpage.models.kvstore import KVStore
    from einpage.runners import PlanRunner, dense_runner
    cfg = replace(KV_BASE, kv_format="q8_0")
    store = KVStore(cfg, 2, 64)
    first = store.arrays["cache.0.k"]
    assert first.dtype == np.uint8 and first.shape == (2, 64, 2, 34)  # per head: 32 values, one scale
    weights = RandomWeights(KV_BASE, 0)
    prompt = np.array([[3, 5, 7, 11, 13], [2, 4, 6, 8, 10]])
    want = greedy(cfg, prompt, 10, dense_runner(weights))
    for backend in ("numpy", "threads"):  # threads: the session writes rows into device blocks
        runner = PlanRunner(weights, CompileOptions(cfg.weight_bytes() // 2), backend)
        np.testing.assert_array_equal(greedy(cfg, prompt, 10, runner), want)


def test_a_decode_step_reads_the_packed_store_as_the_reference_does():
    from dataclasses import replace
    cfg = replace(KV_BASE, kv_format="q8_0")
    graph = llama.decode_graph(cfg).bind(B=2, C=16)
    st = schema.kv_storage(cfg)
    rng = np.random.default_rng(4)
    inputs = {"tokens": np.array([[3], [9]]), "pos": np.array([5, 11])}
    for t in graph.inputs:
        if t.op.role.value == "cache":
            assert t.op.storage == st
            inputs[t.op.name] = quantize(rng.standard_normal(tuple(t.shape)), st)
    weights = RandomWeights(KV_BASE, 0)
    want = evaluate(graph, inputs, weights)
    mg = compile_graph(graph, CompileOptions(cfg.weight_bytes() // 2)).memgraph
    assert any(t.role == "cache" and t.storage == st for t in mg.tensors)
    got = run(mg, inputs, weights, order=2)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-5)


def test_a_packed_store_given_unpacked_is_an_input_error():
    from dataclasses import replace

    from einpage.errors import InputError
    cfg = replace(KV_BASE, kv_format="q8_0")
    graph = llama.decode_graph(cfg).bind(B=1, C=8)
    inputs = {"tokens": np.array([[3]]), "pos": np.array([2])}
    for t in graph.inputs:
        if t.op.role.value == "cache":
            inputs[t.op.name] = np.zeros(tuple(t.shape), np.float32)  # not packed
    with pytest.raises(InputError, match="expected its packed bytes of shape"):
        evaluate(graph, inputs, RandomWeights(KV_BASE, 0))


def test_kv_q8_0_halves_the_decode_bytes_at_8192(capsys):
    rows = {}
    for kv in ((), ("--kv-dtype", "q8_0")):
        assert cli("compile", "llama-7b", "--phase", "decode", "--past", "8191", "--gpu-mem",
                   "16GB", "--cpu-mem", "unlimited", "--quiet", "--json", "--host-compute", "off",
                   *kv) == 0
        rows[kv] = json.loads(capsys.readouterr().out)
    q8, f16 = rows[("--kv-dtype", "q8_0")], rows[()]
    assert q8["capacity"] == f16["capacity"] == 8192
    assert q8["kv_bytes"] <= 0.55 * f16["kv_bytes"]  # 34 bytes per 32 values: 0.531
    assert q8["kv_dtype"] == "q8_0"


def test_kv_q8_0_needs_whole_groups_per_head(capsys):
    assert cli("compile", "small", "--phase", "decode", "--past", "10", "--gpu-mem", "1MB",
               "--kv-dtype", "q8_0") == 2  # head_dim 16
    assert "head_dim a multiple of 32" in capsys.readouterr().err


# ---------------------------------------------------------------- GGUF files on the command line

GGUF = Path(__file__).parent / "fixtures" / "gguf" / "tiny-qwen2"


def test_a_saved_plan_runs_on_the_gguf_file_it_was_compiled_from(tmp_path, capsys):
    plan, out = tmp_path / "p.json", tmp_path / "a.npy"
    assert cli("compile", GGUF / "model-q4_0.gguf", "--gpu-mem", "60KB", "--seq", "3", "-o",
               plan, "--quiet") == 0
    assert "q4_0" in capsys.readouterr().out
    assert cli("run", plan, "--checkpoint", GGUF / "model-q4_0.gguf", "--tokens", "1,2,3",
               "--backend", "threads", "--out", out) == 0
    direct = tmp_path / "b.npy"
    assert cli("run", GGUF / "model-q4_0.gguf", "--tokens", "1,2,3", "--backend", "threads",
               "--out", direct) == 0
    np.testing.assert_allclose(np.load(out), np.load(direct), atol=1e-2)  # f16 activations
    capsys.readouterr()
    assert cli("run", plan, "--checkpoint", GGUF / "model-q8_0.gguf", "--tokens", "1,2,3") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "stored as q8_0, but the plan reads it as q4_0" in err


@pytest.mark.parametrize("argv,message", [
    (("--quantize", "q8_0"), "is a GGUF file, whose weights are stored as they are"),
    (("--kv-dtype", "q8_0"), "head_dim a multiple of 32"),
])
def test_gguf_options_that_do_not_apply_are_one_line(argv, message, capsys):
    assert cli("compile", GGUF / "model-q4_0.gguf", "--gpu-mem", "1MB", "--seq", "4",
               *argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_a_broken_gguf_file_is_one_line(tmp_path, capsys):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes((GGUF / "model-q4_0.gguf").read_bytes()[:5000])
    assert cli("compile", cut, "--gpu-mem", "1MB") == 2
    other = tmp_path / "other.bin"
    other.write_bytes(b"not a model at all")
    assert cli("compile", other, "--gpu-mem", "1MB") == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "GGUF" in err[0] and "not a checkpoint directory or a GGUF file" in err[1]


def test_a_quantized_bias_in_a_gguf_file_is_read_as_a_whole_row(tmp_path):
    """A 1-D tensor's GGUF row is all of it (llama.cpp never writes one packed, but a file
    may): read packed over all its axes, and run."""
    import gguf as gg
    from gguf_files import gguf_spec

    from einpage.models import resolve
    src = Path(__file__).parent / "fixtures" / "tiny-qwen2"
    spec = gguf_spec(src, "q8_0")
    values, _ = spec.tensors["blk.0.attn_q.bias"]
    spec.tensor("blk.0.attn_q.bias", gg.quants.quantize(values.astype(np.float32),
                                                         gg.GGMLQuantizationType.Q8_0),
                gg.GGMLQuantizationType.Q8_0)
    path = spec.write(tmp_path / "bias.gguf")
    cfg, weights = resolve(str(path), dtype=config.DType.f32)
    st = weights.storage("layers.0.bq")
    assert st is not None and st.format == "q8_0"
    assert dict(cfg.formats)["layers.0.bq"] == "q8_0"
    graph = llama.prefill_graph(cfg).bind(B=1, S=4)
    want = evaluate(graph, {"tokens": np.array([[1, 2, 3, 4]])}, weights)
    mg = compile_graph(graph, CompileOptions(cfg.weight_bytes() // 2)).memgraph
    got = run(mg, {"tokens": np.array([[1, 2, 3, 4]])}, weights)
    np.testing.assert_allclose(got["logits"], want["logits"], rtol=1e-5, atol=1e-5)


def test_a_gather_reads_a_packed_table_as_it_lies_in_the_cost_model():
    """Priced as its kernel runs: no dequantization of the whole table block first."""
    from einpage.ir.ops import GatherOp
    from einpage.ir.taskgraph import Block
    from einpage.predict.cost import apply_seconds, logical_bytes
    from einpage.predict.devices import get_device
    profile = get_device("h100-pcie")
    st = Storage("q4_0", 1)
    table = Block(0, 0, (0, 0), (32000, 4096), config.DType.f16, "weight", "embed", None, st)
    plain = Block(0, 0, (0, 0), (32000, 4096), config.DType.f16, "weight", "embed")
    ids = Block(1, 1, (0, 0), (1, 8), config.DType.i64, "activation", "tokens")
    out = Block(2, 2, (0, 0, 0), (1, 8, 4096), config.DType.f16, "activation", "x")
    packed = apply_seconds(profile, GatherOp(0), [table, ids], out, False)
    unpacked = apply_seconds(profile, GatherOp(0), [plain, ids], out, False)
    assert table.bytes < logical_bytes(table) and packed < unpacked


def test_a_generation_forecast_plans_the_formats_asked_for(capsys):
    """`compile --max-new-tokens` forecasts the generation with the weights and KV store in the
    formats given: every plan moves fewer bytes, so the forecast is faster."""
    seconds = {}
    for extra in ((), ("--quantize", "q4_0", "--kv-dtype", "q8_0")):
        assert cli("compile", "llama3.2-1b", "--gpu-mem", "1GB", "--max-new-tokens", "16",
                   "--seq", "512", "--cpu-mem", "unlimited", "--quiet", *extra) == 0
        line = capsys.readouterr().out.splitlines()[1]
        seconds[extra] = float(line.split(":")[1].split(" s ")[0])
    assert seconds[("--quantize", "q4_0", "--kv-dtype", "q8_0")] < 0.6 * seconds[()]
