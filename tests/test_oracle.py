"""Tests of the NumPy LLaMA oracle itself and of the tiny checkpoint writer."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # also works under --import-mode=importlib

from checkpoints import bf16_bits, write_checkpoint
from llama_oracle import forward, greedy, load_hf_checkpoint

from conftest import FIXTURES

# Both fixtures' logits were computed by transformers in float32 -- for the bf16 one,
# from the bf16-stored weights upcast to float32 (see its README.md). The oracle reads
# the same bf16 values exactly, so only float32-vs-float64 arithmetic differs and a
# float32-level tolerance applies to both (measured max abs error ~1e-7, logits ~0.3).
LOGITS_ATOL = {"tiny-llama-f32": 2e-6, "tiny-llama-bf16": 2e-6}


def _fixture(name):
    path = FIXTURES / name
    if not (path / "model.safetensors").exists():
        pytest.skip(f"fixture {path} not found (expected in tests/fixtures/)")
    return path


@pytest.fixture(scope="module", params=sorted(LOGITS_ATOL))
def fixture(request):
    path = _fixture(request.param)
    cfg, weights = load_hf_checkpoint(path)
    return request.param, path, cfg, weights


def test_fixture_logits(fixture):
    name, path, cfg, weights = fixture
    ids = np.load(path / "input_ids.npy")
    expected = np.load(path / "logits.npy")
    logits, _ = forward(cfg, weights, ids)
    assert logits.shape == expected.shape
    assert logits.dtype == np.float64
    err = np.abs(logits - expected).max()
    assert err < LOGITS_ATOL[name], f"{name}: max abs error {err:.3e}"


def test_fixture_greedy(fixture):
    _, path, cfg, weights = fixture
    prompt = np.load(path / "greedy_prompt.npy")
    expected = np.load(path / "greedy_out.npy")
    out = greedy(cfg, weights, prompt, expected.shape[1])
    assert out.dtype == np.int64
    np.testing.assert_array_equal(out, expected)


def test_fixture_config_parsing(fixture):
    _, _, cfg, weights = fixture
    assert cfg["rope_theta"] == 10000.0  # fixtures use the rope_parameters dialect
    assert cfg["head_dim"] == 16
    assert weights["lm_head.weight"].shape == (cfg["vocab_size"], cfg["hidden_size"])


# ---------------------------------------------------------------- cache consistency


@pytest.fixture(scope="module")
def gqa_model(tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp("gqa"), heads=4, kv_heads=2, seed=3)
    return load_hf_checkpoint(path)


@pytest.mark.parametrize("n", [1, 5, 12])
def test_decode_step_matches_prefill(gqa_model, n):
    cfg, weights = gqa_model
    ids = np.random.default_rng(n).integers(0, cfg["vocab_size"], size=(2, n + 1))
    full, full_kv = forward(cfg, weights, ids)
    _, kv = forward(cfg, weights, ids[:, :n])
    step, step_kv = forward(cfg, weights, ids[:, n:], kv)
    np.testing.assert_allclose(step[:, 0], full[:, -1], rtol=0, atol=1e-12)
    for (k1, v1), (k2, v2) in zip(full_kv, step_kv):
        assert k1.shape == (2, cfg["num_key_value_heads"], n + 1, cfg["head_dim"])
        np.testing.assert_allclose(k2, k1, rtol=0, atol=1e-12)
        np.testing.assert_allclose(v2, v1, rtol=0, atol=1e-12)


def test_chunked_prefill_matches_full(gqa_model):
    cfg, weights = gqa_model
    ids = np.random.default_rng(7).integers(0, cfg["vocab_size"], size=(1, 10))
    full, _ = forward(cfg, weights, ids)
    a, kv = forward(cfg, weights, ids[:, :4])
    b, _ = forward(cfg, weights, ids[:, 4:], kv)
    np.testing.assert_allclose(np.concatenate([a, b], axis=1), full, rtol=0, atol=1e-12)


def test_greedy_matches_uncached_argmax(gqa_model):
    cfg, weights = gqa_model
    seq = np.random.default_rng(11).integers(0, cfg["vocab_size"], size=(2, 6))
    out = greedy(cfg, weights, seq, 4)
    for _ in range(4):
        logits, _ = forward(cfg, weights, seq)
        seq = np.concatenate([seq, logits[:, -1].argmax(-1)[:, None]], axis=1)
    np.testing.assert_array_equal(out, seq[:, -4:])


# ---------------------------------------------------------------- checkpoint writer round trip


def _reference_weights(tmp_path, **kw):
    """The writer's float32 weights, recovered through a separate f32 checkpoint."""
    kw = {**kw, "dtype": "f32", "shards": 1}
    return load_hf_checkpoint(write_checkpoint(tmp_path / "ref", **kw))[1]


def _quantize(x, dtype):
    if dtype == "f16":
        return x.astype(np.float16).astype(np.float64)
    if dtype == "bf16":
        return (bf16_bits(x).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return x


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("shards", [1, 2])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("dialect", ["top", "rope_parameters"])
def test_write_checkpoint_round_trip(tmp_path, dtype, shards, tied, dialect):
    kw = dict(hidden=32, layers=2, heads=4, kv_heads=2, intermediate=48, vocab=64, tied=tied, seed=5, rope_theta=500.0)
    path = write_checkpoint(tmp_path / "ckpt", dtype=dtype, shards=shards, dialect=dialect, **kw)
    cfg, weights = load_hf_checkpoint(path)

    assert cfg["rope_theta"] == 500.0
    assert cfg["tie_word_embeddings"] is tied
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 2, 8)

    ref = _reference_weights(tmp_path, **kw)
    assert set(weights) == set(ref)
    for name, arr in ref.items():
        np.testing.assert_array_equal(weights[name], _quantize(arr, dtype), err_msg=name)
    if tied:
        np.testing.assert_array_equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])

    files = sorted(p.name for p in path.glob("*.safetensors"))
    if shards == 1:
        assert files == ["model.safetensors"]
    else:
        assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
        index = json.loads((path / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"].values()) == set(files)
        assert index["metadata"]["total_size"] == sum((path / f).stat().st_size for f in files) - sum(
            8 + int.from_bytes((path / f).read_bytes()[:8], "little") for f in files
        )


def test_write_checkpoint_names_and_shapes(tmp_path):
    path = write_checkpoint(tmp_path, hidden=32, heads=4, kv_heads=2, head_dim=16, intermediate=48, vocab=64, layers=1)
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert config["rope_theta"] == 10000.0 and "rope_parameters" not in config
    _, w = load_hf_checkpoint(path)
    p = "model.layers.0."
    assert w[p + "self_attn.q_proj.weight"].shape == (64, 32)
    assert w[p + "self_attn.k_proj.weight"].shape == (32, 32)
    assert w[p + "self_attn.o_proj.weight"].shape == (32, 64)
    assert w[p + "mlp.gate_proj.weight"].shape == (48, 32)
    assert w[p + "mlp.down_proj.weight"].shape == (32, 48)
    assert w["model.norm.weight"].shape == (32,)


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_writer_output_loads_with_safetensors(tmp_path, dtype):
    st = pytest.importorskip("safetensors.numpy")
    if dtype == "bf16":
        pytest.importorskip("ml_dtypes")  # registers bfloat16 with numpy for safetensors
    path = write_checkpoint(tmp_path, dtype=dtype, shards=2, tied=True)
    _, ours = load_hf_checkpoint(path)
    theirs = {}
    for f in sorted(path.glob("*.safetensors")):
        theirs.update(st.load_file(f))
    assert set(theirs) == set(ours) - {"lm_head.weight"}
    for name, arr in theirs.items():
        np.testing.assert_array_equal(np.asarray(arr, dtype=np.float64), ours[name], err_msg=name)


def test_bf16_rounding_is_nearest_even():
    x = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-9, -2.5], dtype=np.float32)
    got = (bf16_bits(x).astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(got, [1.0, 1.0, 1.0 + 2**-6, 1.0, -2.5])
