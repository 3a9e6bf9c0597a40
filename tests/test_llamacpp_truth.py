"""einpage on GGUF files made by llama.cpp, against llama.cpp's own numbers
(`tests/fixtures/gguf`, made by `tests/fixtures/make_gguf.py`; its README says how).

What is compared, and why those tolerances:
- llama.cpp's matmuls on a quantized file also quantize the *activations* (Q8_0 blocks for Q8_0
  and Q4_0 weights, Q8_1 for Q4_1), which einpage never does. So the like-for-like truth is
  llama.cpp run on an f32 file holding its own dequantization of each quantized file
  (`logits-<q>-dequant.npy`): the same weights, float32 activations. einpage, paged, with
  float32 activations, matches it to float32 summation-order noise (the bound below: 2e-5 of the
  logits' range; measured 1e-7..1e-5).
- Against llama.cpp's logits on the quantized file itself the difference is the activation
  quantization, a property of llama.cpp's kernels: for tiny-llama-f32 (small, smooth weights)
  it stays below 1e-2 (measured 3.6e-3 for Q8_0; the README has every family's figure).
- Greedy tokens: 32 steps from `greedy_prompt`, token for token those llama.cpp chose on the
  dequantized file (paged on one family; on the others with the dense reference, which the
  logits test holds the paged plans to).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from einpage.compiler import CompileOptions
from einpage.ir.dtypes import DType
from einpage.models import resolve
from einpage.models.generation import greedy, prefill
from einpage.runners import dense_runner, paged_runner

ROOT = Path(__file__).parent / "fixtures" / "gguf"
FAMILIES = sorted(p.name for p in ROOT.iterdir() if (p / "llamacpp.json").is_file()) \
    if ROOT.is_dir() else []


def _load(family: str, fmt: str):
    cfg, weights = resolve(str(ROOT / family / f"model-{fmt}.gguf"), dtype=DType.f32)
    facts = json.loads((ROOT / family / "llamacpp.json").read_text())
    return cfg, weights, facts


def _runner(cfg, weights):
    return paged_runner(weights, CompileOptions(cfg.weight_bytes() // 3))


CASES = [(family, fmt) for family in FAMILIES for fmt in ("q8_0", "q4_0")] + [
    ("tiny-llama-f32", "q4_1")] if FAMILIES else []


@pytest.mark.parametrize("family,fmt", CASES)
def test_paged_logits_equal_llamacpp_on_the_dequantized_weights(family, fmt):
    cfg, weights, facts = _load(family, fmt)
    assert cfg.formats and {f for _, f in cfg.formats} >= {fmt}
    tokens = np.array(facts["input_ids"])
    got = prefill(cfg, tokens, _runner(cfg, weights))["logits"]
    want = np.load(ROOT / family / facts["dequant_references"][fmt]["logits_file"])
    scale = float(np.abs(want).max())
    assert np.abs(got - want).max() <= 2e-5 * max(scale, 1.0)


def test_llamacpp_own_quantized_kernels_differ_by_their_activation_rounding():
    cfg, weights, facts = _load("tiny-llama-f32", "q8_0")
    tokens = np.array(facts["input_ids"])
    got = prefill(cfg, tokens, _runner(cfg, weights))["logits"]
    theirs = np.load(ROOT / "tiny-llama-f32" / facts["files"]["q8_0"]["logits_file"])
    assert 1e-5 < np.abs(got - theirs).max() < 1e-2


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_greedy_tokens_are_llamacpps_over_32_steps(family, fmt):
    cfg, weights, facts = _load(family, fmt)
    prompt = np.array(facts["greedy_prompt"])
    want = np.array(facts["dequant_references"][fmt]["greedy"])
    run = _runner(cfg, weights) if family == "tiny-llama-f32" else dense_runner(weights)
    got = greedy(cfg, prompt, want.shape[1], run)
    np.testing.assert_array_equal(np.asarray(got)[:, -want.shape[1]:], want)
