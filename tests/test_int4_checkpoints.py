"""AWQ and GPTQ checkpoints (`einpage.models.int4`): written here in each tool's layout from a
dense checkpoint's weights quantized to `q4_g128`, then read back as einpage's own q4_g128
bytes, run paged, and refused by name where einpage does not read the scheme."""
from __future__ import annotations

import json

import numpy as np
import pytest
from checkpoints import write_checkpoint
from safetensors.numpy import load_file, save_file

from einpage.compiler import CompileOptions
from einpage.errors import CheckpointError, InputError, ModelError
from einpage.ir.quant import quantize
from einpage.ir.storage import Storage
from einpage.models import resolve, schema
from einpage.models.generation import prefill
from einpage.models.int4 import AWQ_ORDER
from einpage.runners import dense_runner, paged_runner

SHAPE = dict(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=256, vocab=96)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _split(packed: np.ndarray, outs: int):
    """(q [in, out], zeros [in/128, out], scales [in/128, out]) of q4_g128 bytes [out, G, 68]."""
    groups = packed.reshape(outs, -1, 68)
    scales = np.ascontiguousarray(groups[..., :2].copy().view(np.float16)[..., 0].T)
    zeros = groups[..., 2].T.astype(np.uint32)
    nib = groups[..., 4:]
    q = np.concatenate([nib & 15, nib >> 4], axis=-1)  # [out, G, 128]
    return q.reshape(outs, -1).T.astype(np.uint32), zeros, scales


def _words(values: np.ndarray, order) -> np.ndarray:
    """Pack eight 4-bit values per int32 along the last axis, value order[i] in nibble i."""
    v = values.reshape(values.shape[:-1] + (-1, 8))[..., list(order)]
    out = np.zeros(v.shape[:-1], np.uint32)
    for i in range(8):
        out |= v[..., i] << np.uint32(4 * i)
    return out.view(np.int32)


def _int4_checkpoint(path, method: str, fmt: str = "gptq"):
    write_checkpoint(path, **SHAPE, dtype="f32")  # scales are f16 whatever the model dtype
    dense = load_file(str(path / "model.safetensors"))
    tensors = {}
    for name, w in dense.items():
        if not any(name.endswith(f"{p}.weight") for p in PROJECTIONS):
            tensors[name] = w
            continue
        outs = w.shape[0]
        q, zeros, scales = _split(quantize(w.astype(np.float32), Storage("q4_g128", 1)), outs)
        stem = name[:-len("weight")]
        if method == "awq":
            tensors[stem + "qweight"] = _words(q, AWQ_ORDER)
            tensors[stem + "qzeros"] = _words(zeros, AWQ_ORDER)
        else:
            tensors[stem + "qweight"] = _words(q.T, range(8)).T.copy()  # along the inputs
            stored = zeros - (1 if fmt == "gptq" else 0)
            tensors[stem + "qzeros"] = _words(stored & 15, range(8))
        tensors[stem + "scales"] = scales
    save_file(tensors, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = (
        {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
         "version": "gemm"} if method == "awq" else
        {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": False,
         "checkpoint_format": fmt})
    (path / "config.json").write_text(json.dumps(config))
    return path, dense


@pytest.mark.parametrize("method,fmt", [("awq", None), ("gptq", "gptq"), ("gptq", "gptq_v2")])
def test_int4_checkpoints_read_as_q4_g128_bytes_and_run_paged(tmp_path, method, fmt):
    path, dense = _int4_checkpoint(tmp_path / method, method, fmt or "gptq")
    cfg, weights = resolve(str(path))
    formats = dict(cfg.formats)
    assert formats and set(formats.values()) == {"q4_g128"}
    assert len(formats) == 7 * SHAPE["layers"]  # every projection, no embedding
    for name in formats:
        st = weights.storage(name)
        hf = dense[schema.hf_tensor(name)].astype(np.float32)
        want = quantize(hf.reshape(schema.weight_shapes(cfg)[name]), st)
        assert np.array_equal(np.asarray(weights(name)), want), name
        whole = weights(name)
        box = tuple(slice(0, n // 2 if d == 0 else n) for d, n in enumerate(whole.shape))
        assert np.array_equal(whole[box], want[box])  # a block reads only its words
    tokens = np.array([[5, 17, 3, 44, 9, 81]])
    want = prefill(cfg, tokens, dense_runner(weights))["logits"]
    got = prefill(cfg, tokens, paged_runner(weights, CompileOptions(cfg.weight_bytes() // 3)))
    np.testing.assert_allclose(got["logits"], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("change,error,message", [
    ({"group_size": 64}, ModelError, "in groups of 64 is not supported"),
    ({"desc_act": True}, ModelError, "desc_act"),
    ({"quant_method": "bitsandbytes"}, ModelError, "bitsandbytes"),
    ({"bits": 8}, ModelError, "8 bits"),
])
def test_int4_schemes_einpage_does_not_read_are_named(tmp_path, change, error, message):
    path, _ = _int4_checkpoint(tmp_path / "g", "gptq")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"].update(change)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(error, match=message):
        resolve(str(path))


def test_quantize_and_broken_words_on_an_int4_checkpoint(tmp_path):
    path, _ = _int4_checkpoint(tmp_path / "a", "awq")
    with pytest.raises(InputError, match="AWQ-quantized already"):
        resolve(str(path), quantize="q8_0")
    tensors = load_file(str(path / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.qweight"
    tensors[name] = tensors[name][:, :-1].copy()
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="qweight, qzeros, scales of shapes"):
        resolve(str(path))


def test_int32_is_only_for_packed_words(tmp_path):
    """A dense weight stored as int32 (outside an AWQ/GPTQ projection) is refused, not run."""
    write_checkpoint(tmp_path, **SHAPE, dtype="f32")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(np.int32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="is int32; a weight is f16, bf16, f32 or f64"):
        resolve(str(tmp_path))
