"""einpage's LLaMA (graphs in the DSL, run by the dense reference) against the independent NumPy
oracle `llama_oracle` on checkpoints written by `checkpoints.write_checkpoint`, and against the
numbers Hugging Face transformers wrote into `tests/fixtures/`."""
from __future__ import annotations

import llama_oracle
import numpy as np
import pytest
from checkpoints import write_checkpoint

from einpage.errors import CheckpointError, InputError, ModelError
from einpage.ir.dtypes import DType
from einpage.ir.graph import Role
from einpage.models import generation, llama, resolve, schema
from einpage.models.config import PRESETS, preset
from einpage.models.kvstore import KVStore
from einpage.runtime import reference

# einpage in float32 against the float64 oracle: float32 rounding through two layers, with
# logits of size ~2, stays near 1e-6.
F32_ATOL = 1e-5
# einpage with float64=True computes the same math in the same precision as the oracle.
F64_ATOL = 1e-9


def runner(weights, float64=False):
    return lambda graph, inputs: reference.evaluate(graph, inputs, weights, float64=float64)


def tokens(vocab, shape, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, size=shape)


def oracle_logits(path, ids):
    cfg, weights = llama_oracle.load_hf_checkpoint(path)
    return llama_oracle.forward(cfg, weights, ids)


def max_err(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())


VARIANTS = {
    "gqa-4q-2kv": dict(heads=4, kv_heads=2),
    "gqa-4q-1kv": dict(heads=4, kv_heads=1),
    "mha": dict(heads=4, kv_heads=4),
    "tied": dict(tied=True),
    "rope_parameters-dialect": dict(dialect="rope_parameters", rope_theta=500.0),
    "top-dialect-theta": dict(dialect="top", rope_theta=500.0),
    "sharded-3": dict(shards=3),
    "head_dim-16": dict(hidden=32, heads=4, kv_heads=2, head_dim=16),
    "3-layers": dict(layers=3, intermediate=40, seed=9),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """`checkpoint(**kw)`: a written checkpoint directory, one per distinct `kw`."""
    made = {}

    def make(**kw):
        key = tuple(sorted(kw.items()))
        if key not in made:
            made[key] = write_checkpoint(tmp_path_factory.mktemp("ckpt"), **kw)
        return made[key]
    return make


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_prefill_matches_oracle(checkpoint, record_error, variant):
    path = checkpoint(**VARIANTS[variant])
    cfg, weights = resolve(str(path))
    assert cfg.dtype is DType.f32
    ids = tokens(cfg.vocab, (2, 7), seed=1)
    want, want_kv = oracle_logits(path, ids)

    out = generation.prefill(cfg, ids, runner(weights))
    assert out["logits"].shape == (2, 7, cfg.vocab) and out["logits"].dtype == np.float32
    err = max_err(out["logits"], want)
    record_error("checkpoints, f32 prefill vs oracle", err)
    assert err < F32_ATOL, f"{variant}: max abs error {err:.3e}"

    out64 = generation.prefill(cfg, ids, runner(weights, float64=True))
    err64 = max_err(out64["logits"], want)
    record_error("checkpoints, float64 prefill vs oracle", err64)
    assert err64 < F64_ATOL, f"{variant}: max abs error {err64:.3e}"
    # the KV cache: einpage [b, t, n, 2, j] is the oracle's [b, n, t, head_dim] (rotated keys)
    for layer, (k, v) in enumerate(want_kv):
        for ours, theirs in ((out64[f"cache.{layer}.k"], k), (out64[f"cache.{layer}.v"], v)):
            b, t, n, _, j = ours.shape
            assert max_err(ours.transpose(0, 2, 1, 3, 4).reshape(b, n, t, 2 * j), theirs) < F64_ATOL


def test_config_from_checkpoint(checkpoint):
    cfg, _ = resolve(str(checkpoint(heads=4, kv_heads=1, tied=True, dialect="rope_parameters",
                                    rope_theta=500.0, rms_eps=1e-5)))
    assert (cfg.heads, cfg.kv_heads, cfg.group, cfg.head_dim) == (4, 1, 4, 8)
    assert cfg.tied and cfg.rope_theta == 500.0 and cfg.rms_eps == 1e-5
    assert "lm_head" not in schema.weight_shapes(cfg)


def test_bf16_checkpoint_runs_in_f32(checkpoint, record_error):
    """NumPy has no bf16 arithmetic: the weights are read as bf16 (exactly what the oracle reads)
    and the model computes in float32 by default."""
    path = checkpoint(dtype="bf16", seed=4)
    cfg, weights = resolve(str(path))
    assert cfg.dtype is DType.f32
    assert weights("embed").dtype == np.dtype("bfloat16")
    ids = tokens(cfg.vocab, (2, 9), seed=2)
    out = generation.prefill(cfg, ids, runner(weights))["logits"]
    err = max_err(out, oracle_logits(path, ids)[0])
    record_error("bf16 checkpoint, f32 prefill vs oracle", err)
    assert err < F32_ATOL


def test_f16_checkpoint_runs_in_f16(checkpoint, record_error):
    """An f16 checkpoint computes in f16 by default: every node's result is stored as float16
    (11-bit significand, relative rounding 2^-11 ~ 4.9e-4), and that rounding compounds over the
    layers. With logits up to ~2 the half-ulp of the last rounding alone is ~1e-3; measured max
    errors are ~2e-3, so the bound is 1e-2 (about five f16 ulps at the largest logits) instead
    of the float32 bound."""
    path = checkpoint(dtype="f16", seed=5)
    cfg, weights = resolve(str(path))
    assert cfg.dtype is DType.f16
    ids = tokens(cfg.vocab, (2, 9), seed=3)
    out = generation.prefill(cfg, ids, runner(weights))["logits"]
    assert out.dtype == np.float16
    want = oracle_logits(path, ids)[0]
    err = max_err(out, want)
    record_error("f16 checkpoint, f16 prefill vs oracle", err)
    assert err < 1e-2
    # the same file computed in f32 is as accurate as an f32 checkpoint
    cfg32, weights32 = resolve(str(path), dtype=DType.f32)
    out32 = generation.prefill(cfg32, ids, runner(weights32))["logits"]
    assert max_err(out32, want) < F32_ATOL


@pytest.mark.parametrize("variant", ["gqa-4q-2kv", "gqa-4q-1kv", "tied"])
def test_greedy_matches_oracle(checkpoint, variant):
    path = checkpoint(**VARIANTS[variant])
    cfg, weights = resolve(str(path))
    prompt = tokens(cfg.vocab, (2, 5), seed=6)
    ocfg, oweights = llama_oracle.load_hf_checkpoint(path)
    want = llama_oracle.greedy(ocfg, oweights, prompt, 6)
    got = generation.greedy(cfg, prompt, 6, runner(weights))
    assert got.dtype == np.int64 and got.shape == (2, 6)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("n", [1, 4, 9])
@pytest.mark.parametrize("float64", [False, True])
def test_decode_step_matches_prefill(checkpoint, n, float64):
    """Prefill of n+1 tokens ends with the same logits as prefill of n, then one decode step
    over its KV store (capacity above n: the unused slots are masked out); the store then holds
    the whole prefill's keys and values."""
    cfg, weights = resolve(str(checkpoint(heads=4, kv_heads=2, seed=8)))
    run = runner(weights, float64)
    ids = tokens(cfg.vocab, (2, n + 1), seed=n)
    full = generation.prefill(cfg, ids, run)
    head = generation.prefill(cfg, ids[:, :n], run)
    store = KVStore(cfg, 2, n + 3, np.float64 if float64 else None)
    store.fill(head)
    store.arrays["cache.0.k"][:, n:] = 1e4  # stale slots beyond pos must not matter
    step_graph = llama.decode_graph(cfg).bind(B=2, C=n + 3)
    step = run(step_graph, {"tokens": ids[:, n:], "pos": store.pos.copy(), **store.view(n + 3)})
    atol = F64_ATOL if float64 else F32_ATOL
    assert step["logits"].shape == (2, 1, cfg.vocab)
    assert max_err(step["logits"][:, 0], full["logits"][:, -1]) < atol
    store.write(step)
    assert store.pos.tolist() == [n + 1, n + 1]
    for layer in range(cfg.layers):
        for kv in "kv":
            assert step[f"new.{layer}.{kv}"].shape == (2, 1, 2, 2, 4)
            name = f"cache.{layer}.{kv}"
            assert full[name].shape == (2, n + 1, 2, 2, 4)
            for b in range(2):
                assert max_err(store.rows(name, b), full[name][b]) < atol


def test_decode_rows_at_different_positions(checkpoint):
    """One step of a batch whose rows are at different positions equals each row's own step."""
    cfg, weights = resolve(str(checkpoint(heads=4, kv_heads=2, seed=8)))
    run = runner(weights)
    ids = tokens(cfg.vocab, (2, 7), seed=3)
    lengths = np.array([6, 3])
    store = KVStore(cfg, 2, 8)
    store.fill(generation.prefill(cfg, ids[:, :6], run), lengths)
    last = ids[np.arange(2), lengths]
    step = run(llama.decode_graph(cfg).bind(B=2, C=8),
               {"tokens": last[:, None], "pos": store.pos.copy(), **store.view(8)})
    for b, n in enumerate(lengths):
        alone = generation.prefill(cfg, ids[b:b + 1, :n + 1], run)["logits"][0, -1]
        assert max_err(step["logits"][b, 0], alone) < F32_ATOL


# ------------------------------------------------------------------ Hugging Face fixtures

# transformers computed these logits in float32 (for the bf16 fixture, from the bf16 weights
# upcast to float32); einpage computes in float32 too, so the two differ by float32 rounding in
# different operation orders: ~1e-7 at logits of ~0.3 (measured), bounded here by 2e-6.
FIXTURE_ATOL = 2e-6


@pytest.mark.parametrize("name", ["tiny-llama-f32", "tiny-llama-bf16"])
def test_fixture_logits(hf_fixture, record_error, name):
    path = hf_fixture(name)
    cfg, weights = resolve(str(path))
    assert cfg.dtype is DType.f32
    ids = np.load(path / "input_ids.npy")
    want = np.load(path / "logits.npy")
    got = generation.prefill(cfg, ids, runner(weights))["logits"]
    assert got.shape == want.shape and got.dtype == np.float32
    err = max_err(got, want)
    record_error(f"{name}: f32 prefill vs transformers", err)
    assert err < FIXTURE_ATOL, f"{name}: max abs error {err:.3e}"
    err64 = max_err(generation.prefill(cfg, ids, runner(weights, True))["logits"], want)
    record_error(f"{name}: float64 prefill vs transformers", err64)
    assert err64 < FIXTURE_ATOL


@pytest.mark.parametrize("name", ["tiny-llama-f32", "tiny-llama-bf16"])
def test_fixture_greedy(hf_fixture, name):
    path = hf_fixture(name)
    cfg, weights = resolve(str(path))
    prompt = np.load(path / "greedy_prompt.npy")
    want = np.load(path / "greedy_out.npy")
    got = generation.greedy(cfg, prompt, want.shape[1], runner(weights))
    np.testing.assert_array_equal(got, want)


# ------------------------------------------------------------------ presets


@pytest.mark.parametrize("name, billions", [
    ("llama-7b", 6.74), ("llama-13b", 13.02), ("llama-30b", 32.53), ("llama-65b", 65.29),
    ("llama2-7b", 6.74), ("llama2-13b", 13.02), ("llama2-70b", 68.98),
    ("llama3-8b", 8.03), ("llama3-70b", 70.55),
])
def test_preset_parameter_counts(name, billions):
    cfg = preset(name)
    assert abs(cfg.parameters / 1e9 - billions) <= 0.01, cfg.parameters
    assert cfg.weight_bytes() == 2 * cfg.parameters  # presets are f16
    assert cfg.weight_bytes(DType.f32) == 4 * cfg.parameters


def test_preset_shapes():
    assert (PRESETS["llama2-70b"].kv_heads, PRESETS["llama2-70b"].group) == (8, 8)
    assert PRESETS["llama3-8b"].rope_theta == 500000.0 and PRESETS["llama3-8b"].vocab == 128256
    assert PRESETS["llama-65b"].head_dim == 128


@pytest.mark.parametrize("name", ["llama-7b", "llama3-8b"])
def test_large_graphs_build_and_verify(name):
    cfg = preset(name)
    v, n, j = cfg.vocab, cfg.kv_heads, cfg.head_dim // 2
    prefill = llama.prefill_graph(cfg)
    prefill.verify()
    assert {s.name for s in prefill.symbols} == {"B", "S"}
    bound = prefill.bind(B=1, S=2048)
    outs = {o.op.name: o for o in bound.outputs}
    assert outs["logits"].shape == (1, 2048, v) and outs["logits"].dtype is DType.f16
    assert outs["cache.31.k"].shape == (1, 2048, n, 2, j)
    assert len(outs) == 1 + 2 * cfg.layers
    # the weight inputs are exactly the model's parameters
    weights = [node for node in bound.inputs if node.op.role is Role.weight]
    assert sum(int(np.prod(node.shape)) for node in weights) == cfg.parameters
    assert {node.op.name: node.shape for node in weights} == schema.weight_shapes(cfg)

    decode = llama.decode_graph(cfg)
    assert {s.name for s in decode.symbols} == {"B", "C"}
    step = decode.bind(B=2, C=2048)
    outs = {o.op.name: o for o in step.outputs}
    assert outs["logits"].shape == (2, 1, v)
    assert outs["new.0.v"].shape == (2, 1, n, 2, j)  # only the step's rows go back
    caches = [node for node in step.inputs if node.op.role is Role.cache]
    assert len(caches) == 2 * cfg.layers and caches[0].shape == (2, 2048, n, 2, j)
    assert step.input("pos").shape == (2,) and step.input("pos").dtype is DType.i64
    assert max(node.stage for node in step.nodes) == cfg.layers + 1


def test_hf_tensor_names_and_shapes():
    cfg = preset("llama2-70b")
    assert schema.hf_tensor("layers.3.wq") == "model.layers.3.self_attn.q_proj.weight"
    assert schema.hf_tensor("layers.0.w_down") == "model.layers.0.mlp.down_proj.weight"
    assert schema.hf_shape(cfg, "layers.0.wq") == (8192, 8192)
    assert schema.hf_shape(cfg, "layers.0.wk") == (1024, 8192)
    assert schema.hf_shape(cfg, "layers.0.wo") == (8192, 8192)
    assert schema.hf_shape(cfg, "layers.0.w_up") == (28672, 8192)


# ------------------------------------------------------------------ resolve and token checks


def test_random_weights_are_deterministic():
    cfg, weights = resolve("tiny", random_weights=True, seed=3)
    ids = np.array([[1, 2, 3]])
    a = generation.prefill(cfg, ids, runner(weights))["logits"]
    _, same = resolve("tiny", random_weights=True, seed=3)
    _, other = resolve("tiny", random_weights=True, seed=4)
    np.testing.assert_array_equal(generation.prefill(cfg, ids, runner(same))["logits"], a)
    assert not np.array_equal(generation.prefill(cfg, ids, runner(other))["logits"], a)
    assert np.isfinite(a).all()


def test_resolve_errors(tmp_path, checkpoint):
    assert resolve("llama-7b")[1] is None  # compile needs no weights
    with pytest.raises(ModelError, match="unknown model 'llama-8b'; presets: llama-7b"):
        resolve("llama-8b")
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        resolve(str(tmp_path / "absent"))
    with pytest.raises(ModelError, match="--random-weights takes a preset name"):
        resolve(str(checkpoint()), random_weights=True)


@pytest.mark.parametrize("ids, message", [
    (np.array([1, 2]), r"shape \(batch, length\), got \(2,\)"),
    (np.zeros((1, 0), np.int64), r"shape \(batch, length\), got \(1, 0\)"),
    (np.array([[1.0, 2.0]]), "must be integers, got dtype float64"),
    (np.array([[1, 64]]), "token id 64 out of range for a vocabulary of 64"),
    (np.array([[-1, 3]]), "token id -1 out of range"),
])
def test_bad_tokens(ids, message):
    cfg = preset("tiny")
    with pytest.raises(InputError, match=message):
        generation.check_tokens(cfg, ids)


def test_greedy_needs_a_positive_count():
    cfg, weights = resolve("tiny", random_weights=True)
    with pytest.raises(InputError, match="at least 1, got 0"):
        generation.greedy(cfg, np.array([[1]]), 0, runner(weights))
