"""The catalogue of bad input (issue 16): every case is a command line that must end with exit
status 2, exactly one line on stderr (`einpage: error: ...`, naming what was wrong), no
traceback, and no file left behind. The cases gather the refusals tested one by one elsewhere
(test_cli, test_cli_predict, test_cli_backends, test_paged_llama, test_decode, test_text,
test_checkpoint, test_families) with those of issue 16: options that do not apply, budgets
beyond reason, device files, plans run with the wrong checkpoint or as a decode step, and
non-finite answers. Each runs in-process, in an empty working directory."""
from __future__ import annotations

import json
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import llama_oracle
import numpy as np
import pytest
from checkpoints import write_checkpoint, write_safetensors
from conftest import FIXTURES
from test_cli import assert_one_line_error, cli

from einpage.runtime.backends import cuda_usable


@dataclass(frozen=True)
class Case:
    """`einpage ARGV` (placeholders: `{tmp}` the case's own directory, and the shared files of
    `world`), the text its one line must hold, what `setup(tmp, world)` writes first, and what
    the case needs (`text`: a tokenizer fixture; `no-gpu`: no usable GPU)."""
    id: str
    argv: str
    needle: str
    setup: Callable[[Path, dict], None] | None = None
    needs: str | None = None


# ------------------------------------------------------------------ what cases write first

def _token_file(content):
    def setup(tmp: Path, world: dict) -> None:
        if isinstance(content, bytes):
            (tmp / "ids.npy").write_bytes(content)
        else:
            np.save(tmp / "ids.npy", content)
    return setup


def _config(change):
    """A copy of the world's checkpoint at `{tmp}/ckpt`, its config.json changed."""
    def setup(tmp: Path, world: dict) -> None:
        path = shutil.copytree(world["ckpt"], tmp / "ckpt")
        config = json.loads((path / "config.json").read_text())
        change(config)
        (path / "config.json").write_text(json.dumps(config))
    return setup


def _config_text(text: str | None):
    def setup(tmp: Path, world: dict) -> None:
        path = shutil.copytree(world["ckpt"], tmp / "ckpt")
        if text is None:
            (path / "config.json").unlink()
        else:
            (path / "config.json").write_text(text)
    return setup


def _drop_tensor(name: str):
    def setup(tmp: Path, world: dict) -> None:
        path = shutil.copytree(world["ckpt"], tmp / "ckpt")
        tensors = llama_oracle.read_safetensors(path / "model.safetensors")
        del tensors[name]
        write_safetensors(path / "model.safetensors", tensors)
    return setup


def _file(name: str, content: str | bytes | None):
    """`{tmp}/name` with `content` (None: a directory of that name)."""
    def setup(tmp: Path, world: dict) -> None:
        path = tmp / name
        if content is None:
            path.mkdir()
        elif isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
    return setup


def _plan_json(change: Callable[[dict], None]):
    """The world's prefill plan at `{tmp}/bad.json`, its JSON changed."""
    def setup(tmp: Path, world: dict) -> None:
        data = json.loads(world["plan"].read_text())
        change(data)
        (tmp / "bad.json").write_text(json.dumps(data))
    return setup


def _swap_first_reads(data: dict) -> None:
    """The first apply reading two distinct tensors of one shape reads them the other way round:
    memory and shapes still agree, only the plan's graph shows the wrong block."""
    shape = {t["id"]: t["shape"] for t in data["tensors"]}
    n = next(n for n in data["nodes"] if n["kind"] == "apply" and len(n["reads"]) == 2
             and n["reads"][0]["tensor"] != n["reads"][1]["tensor"]
             and shape[n["reads"][0]["tensor"]] == shape[n["reads"][1]["tensor"]])
    n["reads"].reverse()


def _text_ckpt(change: Callable[[Path], None]):
    """A copy of the world's text checkpoint at `{tmp}/ckpt`, changed."""
    def setup(tmp: Path, world: dict) -> None:
        change(shutil.copytree(world["text"], tmp / "ckpt"))
    return setup


def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


# ------------------------------------------------------------------ the catalogue

C = Case
CASES = [
    # --- models, checkpoints and config.json (test_cli, test_checkpoint, test_families)
    C("no-such-directory", "run {tmp}/absent --tokens 1", "absent: no such checkpoint directory"),
    C("unknown-preset", "run llama-8b --random-weights --tokens 1",
      "unknown model 'llama-8b'; presets: llama-7b"),
    C("preset-without-weights", "generate llama-7b --tokens 1 --max-new-tokens 2",
      "llama-7b: a preset has no weights; pass --random-weights"),
    C("random-weights-of-a-checkpoint", "run {ckpt} --random-weights --tokens 1",
      "--random-weights takes a preset name, not a checkpoint directory"),
    C("random-weights-of-a-gguf-file", "run {tmp}/m.gguf --random-weights --tokens 1",
      "--random-weights takes a preset name, not a GGUF file",
      lambda tmp, world: shutil.copy(Path(__file__).parent / "fixtures" / "gguf" / "tiny-qwen2"
                                     / "model-q4_0.gguf", tmp / "m.gguf")),
    C("compile-unknown-model", "compile nosuch --gpu-mem 16GB", "unknown model"),
    C("model-type-gpt-neox", "run {tmp}/ckpt --tokens 1", "model_type 'gpt_neox' is not supported",
      _config(lambda c: c.update(model_type="gpt_neox"))),
    C("model-type-gemma2", "run {tmp}/ckpt --tokens 1", "model_type 'gemma2' is not supported",
      _config(lambda c: c.update(model_type="gemma2"))),
    C("model-type-missing", "run {tmp}/ckpt --tokens 1", "model_type None is not supported",
      _config(lambda c: c.pop("model_type"))),
    C("config-missing-key", "run {tmp}/ckpt --tokens 1", "missing key 'hidden_size'",
      _config(lambda c: c.pop("hidden_size"))),
    C("config-layers-a-string", "run {tmp}/ckpt --tokens 1", "bad value",
      _config(lambda c: c.update(num_hidden_layers="two"))),
    C("config-layers-negative", "run {tmp}/ckpt --tokens 1", "num_hidden_layers must be",
      _config(lambda c: c.update(num_hidden_layers=-2))),
    C("config-heads-a-bool", "run {tmp}/ckpt --tokens 1", "must be a non-negative",
      _config(lambda c: c.update(num_attention_heads=True))),
    C("config-eps-a-string", "run {tmp}/ckpt --tokens 1", "rms_norm_eps must be a positive",
      _config(lambda c: c.update(rms_norm_eps="x"))),
    C("config-dtype-int8", "run {tmp}/ckpt --tokens 1", "unknown dtype 'int8'",
      _config(lambda c: c.update(torch_dtype="int8"))),
    C("config-rope-dynamic", "run {tmp}/ckpt --tokens 1", "rope_type 'dynamic'",
      _config(lambda c: c.update(rope_scaling={"rope_type": "dynamic", "factor": 2.0}))),
    C("config-rope-yarn", "run {tmp}/ckpt --tokens 1", "rope_type 'yarn'",
      _config(lambda c: c.update(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}))),
    C("config-rope-longrope", "run {tmp}/ckpt --tokens 1", "rope_type 'longrope'",
      _config(lambda c: c.update(rope_parameters={"rope_type": "longrope",
                                                  "rope_theta": 1e4}))),
    C("config-llama3-rope-incomplete", "run {tmp}/ckpt --tokens 1",
      "missing key 'original_max_position_embeddings'",
      _config(lambda c: c.update(rope_parameters={"rope_type": "llama3", "factor": 8.0}))),
    C("config-rope-factor-negative", "run {tmp}/ckpt --tokens 1",
      "factor must be a positive number",
      _config(lambda c: c.update(rope_parameters={"rope_type": "linear", "factor": -1}))),
    C("config-hidden-act-gelu", "run {tmp}/ckpt --tokens 1", "hidden_act 'gelu' is not supported",
      _config(lambda c: c.update(hidden_act="gelu"))),
    C("config-hidden-act-gelu-tanh", "run {tmp}/ckpt --tokens 1", "hidden_act",
      _config(lambda c: c.update(hidden_act="gelu_pytorch_tanh"))),
    C("config-mlp-bias", "run {tmp}/ckpt --tokens 1", "mlp_bias is not supported",
      _config(lambda c: c.update(mlp_bias=True))),
    C("config-window-zero", "run {tmp}/ckpt --tokens 1", "sliding_window must be at least 1",
      _config(lambda c: c.update(model_type="mistral", sliding_window=0))),
    C("config-layer-type", "run {tmp}/ckpt --tokens 1",
      "layer type 'chunked_attention' is not supported",
      _config(lambda c: c.update(model_type="qwen2", use_sliding_window=True, sliding_window=4,
                                 layer_types=["full_attention", "chunked_attention"]))),
    C("config-experts", "run {tmp}/ckpt --tokens 1", "5 experts per token of 4",
      _config(lambda c: c.update(model_type="mixtral", num_local_experts=4,
                                 num_experts_per_tok=5))),
    C("config-tied-a-string", "run {tmp}/ckpt --tokens 1", "must be true or false",
      _config(lambda c: c.update(tie_word_embeddings="yes"))),
    C("config-unparsable", "run {tmp}/ckpt --tokens 1", "config.json: cannot parse",
      _config_text("{not json")),
    C("config-a-list", "run {tmp}/ckpt --tokens 1", "expected a JSON object",
      _config_text("[1, 2]")),
    C("config-missing", "run {tmp}/ckpt --tokens 1", "ckpt: no config.json", _config_text(None)),
    C("missing-tensor", "run {tmp}/ckpt --tokens 1", "missing tensor 'model.norm.weight'",
      _drop_tensor("model.norm.weight")),
    C("compile-config-negative-layers", "compile {tmp}/ckpt --gpu-mem 1MB --seq 4",
      "num_hidden_layers must be", _config(lambda c: c.update(num_hidden_layers=-2))),

    # --- tokens (test_cli)
    C("token-file-not-npy", "run tiny --random-weights --tokens-file {tmp}/ids.npy",
      "not a .npy array", _token_file(b"1,2,3\n")),
    C("token-file-1d", "run tiny --random-weights --tokens-file {tmp}/ids.npy",
      "integer array of shape (batch, length), got int64 (3,)", _token_file(np.array([1, 2, 3]))),
    C("token-file-float", "run tiny --random-weights --tokens-file {tmp}/ids.npy",
      "integer array of shape (batch, length), got float64 (1, 2)",
      _token_file(np.array([[1.0, 2.0]]))),
    C("token-file-missing", "run tiny --random-weights --tokens-file {tmp}/ids.npy",
      "no such token file"),
    C("token-out-of-range", "run tiny --random-weights --tokens 1,2,64",
      "token id 64 out of range for a vocabulary of 64"),
    C("token-negative", "run tiny --random-weights --tokens=-3,2",
      "token id -3 out of range for a vocabulary of 64"),
    C("tokens-not-integers", "run tiny --random-weights --tokens 1,x",
      "--tokens '1,x': expected comma-separated integers"),
    C("tokens-empty", "run tiny --random-weights --tokens ,", "--tokens is empty"),
    C("token-file-out-of-range", "generate {ckpt} --tokens-file {tmp}/ids.npy "
      "--max-new-tokens 2", "token id 64 out of range for a vocabulary of 64",
      _token_file(np.array([[1, 64]]))),
    C("prompt-beyond-context", "run {ckpt} --tokens-file {tmp}/ids.npy",
      "a prompt of 129 tokens needs 129 positions; the model's context is 128",
      _token_file(np.ones((1, 129), np.int64))),

    # --- argparse (test_cli, test_text)
    C("no-input", "run tiny --random-weights",
      "one of the arguments --prompt --prompt-file --tokens --tokens-file is required"),
    C("generate-without-count", "generate tiny --tokens 1", "--max-new-tokens"),
    C("unknown-dtype", "run tiny --tokens 1 --dtype f8", "invalid choice: 'f8'"),
    C("unknown-command", "frobnicate", "invalid choice: 'frobnicate'"),
    C("two-inputs", "run tiny --random-weights --prompt a --tokens 1", "not allowed with argument"),
    C("unknown-backend", "run tiny --random-weights --tokens 1 --backend tpu",
      "invalid choice: 'tpu'"),
    C("unknown-phase", "compile tiny --gpu-mem 1MB --phase train", "invalid choice: 'train'"),
    C("batch-not-an-integer", "compile tiny --gpu-mem 1MB --batch two",
      "argument --batch: invalid int value"),
    C("unknown-option", "compile tiny --gpu-mem 1MB --frobnicate", "unrecognized arguments"),

    # --- sizes and budgets (test_paged_llama, issue 16)
    C("gpu-mem-1e400", "compile llama-7b --gpu-mem 1e400", "bad --gpu-mem '1e400': too large"),
    C("gpu-mem-nan", "compile tiny --gpu-mem nan", "bad --gpu-mem 'nan'"),
    C("gpu-mem-inf", "compile tiny --gpu-mem inf", "bad --gpu-mem 'inf'"),
    C("gpu-mem-negative", "compile tiny --gpu-mem=-1GB", "bad --gpu-mem '-1GB'"),
    C("gpu-mem-zero", "compile tiny --gpu-mem 0", "bad --gpu-mem '0': must be positive"),
    C("gpu-mem-words", "compile llama-7b --gpu-mem lots", "bad --gpu-mem 'lots'"),
    C("run-gpu-mem-1e400", "run tiny --random-weights --tokens 1 --gpu-mem 1e400",
      "bad --gpu-mem '1e400': too large"),
    C("run-gpu-mem-nan", "run tiny --random-weights --tokens 1 --gpu-mem nan",
      "bad --gpu-mem 'nan'"),
    C("generate-gpu-mem-inf", "generate tiny --random-weights --tokens 1 --max-new-tokens 2 "
      "--gpu-mem inf", "bad --gpu-mem 'inf'"),
    C("block-bytes-words", "compile tiny --gpu-mem 1MB --block-bytes big", "bad --block-bytes"),
    C("graph-too-large", "compile llama-7b --gpu-mem 4MB", "too large to plan"),
    C("budget-below-a-task", "compile tiny --gpu-mem 300 --seq 4", "budget 300 B is too small"),
    C("unknown-policy", "compile llama-7b --gpu-mem 16GB --policy fifo", "unknown policy"),
    C("policy-none-does-not-fit", "compile llama-65b --gpu-mem 16GB --policy none",
      "resident weights"),
    C("batch-zero", "compile llama-7b --gpu-mem 16GB --batch 0", "--batch"),
    C("seq-zero", "compile tiny --gpu-mem 1MB --seq 0", "--seq must be at least 1, got 0"),
    C("budget-above-the-device", "compile tiny --gpu-mem 200GB --device t4 --seq 4",
      "--gpu-mem 200.00 GB is more than the 16.00 GB of the device t4"),
    C("run-budget-above-the-device", "run tiny --random-weights --tokens 1 --gpu-mem 200GB "
      "--device t4 --timing", "more than the 16.00 GB of the device t4"),
    C("generation-budget-above-the-device", "compile tiny --gpu-mem 200GB --device t4 "
      "--max-new-tokens 2", "more than the 16.00 GB of the device t4"),

    # --- compile: options of one phase given to the other (test_decode, issue 16)
    C("past-on-prefill", "compile tiny --gpu-mem 1MB --seq 4 --past 3",
      "--past and --capacity describe a decode step"),
    C("capacity-on-prefill", "compile tiny --gpu-mem 1MB --capacity 8",
      "--past and --capacity describe a decode step"),
    C("seq-on-decode", "compile tiny --gpu-mem 1MB --phase decode --seq 4",
      "--seq is the prompt of a prefill; a decode step reads --past rows"),
    C("capacity-below-past", "compile tiny --gpu-mem 1MB --phase decode --past 10 --capacity 8",
      "cannot hold position 10"),
    C("past-negative", "compile tiny --gpu-mem 1MB --phase decode --past=-1",
      "--past must be non-negative"),
    C("generation-of-a-decode-step", "compile tiny --gpu-mem 1MB --phase decode "
      "--max-new-tokens 4", "drop --phase decode"),
    C("generation-of-no-tokens", "compile tiny --gpu-mem 1MB --max-new-tokens 0", "at least 1"),
    C("generation-to-one-plan-file", "compile tiny --gpu-mem 1MB --max-new-tokens 4 -o p.json",
      "writes one plan"),

    # --- run and generate: options that do not apply (issue 16)
    C("policy-without-budget", "run tiny --random-weights --tokens 1 --policy lru",
      "--policy chooses what a --gpu-mem budget evicts: give --gpu-mem too"),
    C("generate-policy-without-budget", "generate tiny --random-weights --tokens 1 "
      "--max-new-tokens 2 --policy lru", "--policy chooses what a --gpu-mem budget evicts"),
    C("reference-takes-no-budget", "run {ckpt} --tokens 1,2,3 --backend reference "
      "--gpu-mem 1MB", "--backend reference runs no plan"),
    C("reference-takes-no-policy", "run {ckpt} --tokens 1 --backend reference --policy lru",
      "--backend reference runs no plan"),
    C("device-without-timing", "run tiny --random-weights --tokens 1 --device t4",
      "--device and --device-file price the passes --timing prints"),
    C("checkpoint-without-a-plan", "run {ckpt} --checkpoint {ckpt} --tokens 1",
      "--checkpoint gives the weights of a plan file"),
    C("max-new-tokens-zero", "generate tiny --random-weights --tokens 1 --max-new-tokens 0",
      "--max-new-tokens must be at least 1, got 0"),
    C("kv-granule-zero", "generate tiny --random-weights --tokens 1 --max-new-tokens 2 "
      "--kv-granule 0", "--kv-granule must be at least 1, got 0"),

    # --- plan files (test_paged_llama, issue 16)
    C("plan-with-gpu-mem", "run {plan} --checkpoint {ckpt} --tokens 1,2,3 --gpu-mem 1MB",
      "is a plan file: it runs with the budget, policy and dtype it was compiled for"),
    C("plan-with-dtype", "run {plan} --checkpoint {ckpt} --tokens 1,2,3 --dtype f16",
      "drop --dtype"),
    C("plan-with-random-weights", "run {plan} --checkpoint {ckpt} --tokens 1,2,3 "
      "--random-weights", "drop --random-weights"),
    C("plan-with-policy", "run {plan} --checkpoint {ckpt} --tokens 1,2,3 --policy lru",
      "drop --policy"),
    C("plan-on-the-reference", "run {plan} --checkpoint {ckpt} --tokens 1,2,3 "
      "--backend reference", "--backend reference runs graphs, not plan files"),
    C("plan-without-checkpoint", "run {plan} --tokens 1,2,3",
      "running a plan file needs --checkpoint DIR"),
    C("plan-token-shape", "run {plan} --checkpoint {ckpt} --tokens 1,2",
      "the plan was compiled for tokens of shape (1, 3), got (1, 2)"),
    C("plan-token-out-of-range", "run {plan} --checkpoint {ckpt} --tokens 1,2,99",
      "token id out of range for a vocabulary of 64"),
    C("plan-other-model", "run {plan} --checkpoint {other} --tokens 1,2,3",
      "tensor 'model.embed_tokens.weight' has shape (64, 48), but the plan reads it as (64, 32)"),
    C("plan-other-dtype", "run {plan} --checkpoint {f16} --tokens 1,2,3",
      "tensor 'model.embed_tokens.weight' is f16, but the plan was compiled from a checkpoint "
      "of f32"),
    C("plan-of-a-decode-step", "run {decode} --checkpoint {ckpt} --tokens 1",
      "is a decode step: it runs inside a generation"),
    C("plan-not-json", "run {tmp}/bad.json --checkpoint {ckpt} --tokens 1", "bad.json",
      _file("bad.json", "not json")),
    C("plan-other-format", "run {tmp}/bad.json --checkpoint {ckpt} --tokens 1", "bad.json",
      _file("bad.json", '{"format": "other"}')),
    C("plan-version-9", "run {tmp}/bad.json --checkpoint {ckpt} --tokens 1", "bad.json",
      _file("bad.json", '{"format": "einpage.memgraph", "version": 9}')),
    C("plan-empty", "run {tmp}/bad.json --checkpoint {ckpt} --tokens 1", "bad.json",
      _file("bad.json", '{"format": "einpage.memgraph", "version": 1}')),
    C("inspect-not-json", "inspect {tmp}/bad.json", "bad.json", _file("bad.json", "not json")),
    C("inspect-other-format", "inspect {tmp}/bad.json", "bad.json",
      _file("bad.json", '{"format": "other"}')),
    C("inspect-version-9", "inspect {tmp}/bad.json", "bad.json",
      _file("bad.json", '{"format": "einpage.memgraph", "version": 9}')),
    C("inspect-empty", "inspect {tmp}/bad.json", "bad.json",
      _file("bad.json", '{"format": "einpage.memgraph", "version": 1}')),
    C("inspect-missing", "inspect {tmp}/absent.json", "absent.json"),
    C("plan-graph-edited", "run {tmp}/bad.json --checkpoint {ckpt} --tokens 1,2,3",
      "the graph section (or the plan's inputs or results) was damaged or edited",
      _plan_json(lambda d: d["graph"]["tasks"].pop())),
    C("inspect-plan-read-of-another-block", "inspect {tmp}/bad.json", "but task",
      _plan_json(_swap_first_reads)),
    C("inspect-plan-storage-format", "inspect {tmp}/bad.json",
      "the plan uses storage format 'q3_k', which this einpage does not run",
      _plan_json(lambda d: d["tensors"][0].__setitem__(
          "storage", {"format": "q3_k", "group": 256, "span": 1}))),
    C("inspect-plan-storage-malformed", "inspect {tmp}/bad.json", "expected {format, group, span}",
      _plan_json(lambda d: d["tensors"][0].__setitem__("storage", {"format": "q4_0"}))),
    C("inspect-plan-storage-size", "inspect {tmp}/bad.json", "cannot be stored as q8_0",
      _plan_json(lambda d: d["tensors"][0].__setitem__(
          "storage", {"format": "q8_0", "group": 32, "span": 1}))),
    C("compile-quantize-unknown", "compile tiny --gpu-mem 1MB --seq 4 --quantize q2",
      "invalid choice: 'q2'"),
    C("compile-kv-dtype-of-a-prefill", "compile llama-7b --gpu-mem 16GB --kv-dtype q8_0",
      "--kv-dtype is the KV store a decode step reads; a prefill reads none"),
    C("run-kv-dtype", "run tiny --random-weights --tokens 1,2 --kv-dtype q8_0",
      "--kv-dtype is the KV store decode steps read; run is a prefill"),
    C("compile-zero-budget", "compile tiny --gpu-mem 0 --seq 4", "must be positive"),

    # --- device profiles (test_cli_predict, issue 16)
    C("unknown-device", "compile tiny --gpu-mem 1MB --seq 4 --device h100", "unknown device"),
    C("device-file-missing", "compile tiny --gpu-mem 1MB --seq 4 --device-file /nonexistent/p.json",
      "no such device profile"),
    C("device-file-and-device-missing", "compile tiny --gpu-mem 1MB --device t4 "
      "--device-file x.json", "x.json: no such device profile"),
    C("h2d-bandwidth-words", "compile tiny --gpu-mem 1MB --seq 4 --h2d-bandwidth fast",
      "bad --h2d-bandwidth"),
    C("h2d-bandwidth-negative", "compile tiny --gpu-mem 1MB --seq 4 --h2d-bandwidth=-1GB/s",
      "bad --h2d-bandwidth"),
    C("flops-zero", "compile tiny --gpu-mem 1MB --seq 4 --flops 0", "bad --flops"),
    C("lookahead-words", "compile tiny --gpu-mem 1MB --seq 4 --lookahead soon",
      "bad --lookahead"),
    C("lookahead-zero", "compile tiny --gpu-mem 1MB --seq 4 --lookahead 0ms", "bad --lookahead"),
    C("device-file-not-json", "compile tiny --gpu-mem 1MB --device-file {tmp}/p.json",
      "not a JSON device profile", _file("p.json", "{")),
    C("device-file-zero-bandwidth", "compile tiny --gpu-mem 1MB --device-file {tmp}/p.json",
      "hbm_bandwidth", _file("p.json", '{"matmul_flops": 1e12, "hbm_bandwidth": 0, '
                                       '"h2d_bandwidth": 1e9}')),
    C("device-file-a-number", "compile tiny --gpu-mem 1MB --device-file {tmp}/p.json",
      "a device profile is a JSON object", _file("p.json", "3")),
    C("device-file-of-several", "compile tiny --gpu-mem 1MB --seq 4 --device-file {devices}",
      "profiles: pick one with --device"),
    C("device-file-without-that-device", "compile tiny --gpu-mem 1MB --seq 4 "
      "--device-file {devices} --device h100", "no profile 'h100'; it holds h100-pcie"),
    C("device-file-of-another-device", "compile tiny --gpu-mem 1MB --seq 4 "
      "--device-file {tmp}/p.json --device t4", "the profile is 'v100', not --device 't4'",
      lambda tmp, world: (tmp / "p.json").write_text(
          json.dumps(json.loads(world["devices"].read_text())["v100"]))),

    # --- outputs that cannot be written: nothing is left behind (test_cli_backends)
    C("plan-to-no-directory", "compile tiny --gpu-mem 1MB --seq 4 -o /nonexistent/p.json",
      "/nonexistent"),
    C("trace-to-no-directory", "compile tiny --gpu-mem 1MB --seq 4 --trace /nonexistent/t.json",
      "/nonexistent"),
    C("logits-to-no-directory", "run tiny --random-weights --tokens 1 --out /nonexistent/x.npy",
      "/nonexistent"),
    C("calibrate-to-no-directory", "calibrate -o {tmp}/no/such/dir/p.json", "no/such/dir"),

    # --- non-finite answers (issue 16)
    C("nan-weights-next-token", "run {nan} --tokens 1,2", "non-finite logits"),
    C("nan-weights-saved-logits", "run {nan} --tokens 1,2 --out logits.npy", "non-finite logits"),
    C("nan-weights-paged", "run {nan} --tokens 1,2 --gpu-mem 20KB --backend numpy",
      "non-finite logits"),
    C("nan-weights-generate", "generate {nan} --tokens 1,2 --max-new-tokens 2",
      "non-finite logits"),

    # --- backends (test_cli_backends)
    C("cupy-without-a-gpu", "run {ckpt} --tokens 1,2,3 --backend cupy", "cupy", needs="no-gpu"),
    C("calibrate-cupy-without-a-gpu", "calibrate --backend cupy",
      "--backend cupy: no usable CUDA GPU (", needs="no-gpu"),

    # --- text in (test_text)
    C("prompt-without-tokenizer", "generate {ckpt} --prompt hi --max-new-tokens 2",
      "no tokenizer.json: this checkpoint has no tokenizer"),
    C("prompt-with-a-preset", "run tiny --random-weights --prompt hi",
      "need a checkpoint directory with a tokenizer.json"),
    C("malformed-tokenizer", "run {tmp}/ckpt --prompt hi",
      "not a tokenizer the tokenizers library can read",
      _text_ckpt(lambda p: (p / "tokenizer.json").write_text('{"model": 3')), needs="text"),
    C("prompt-file-empty", "generate {text} --prompt-file {tmp}/p.txt --max-new-tokens 2",
      "the prompt file is empty", _file("p.txt", b""), needs="text"),
    C("prompt-file-newline", "generate {text} --prompt-file {tmp}/p.txt --max-new-tokens 2",
      "the prompt file is empty", _file("p.txt", b"\n"), needs="text"),
    C("prompt-file-empty-line", "generate {text} --prompt-file {tmp}/p.txt --max-new-tokens 2",
      "line 2 is empty", _file("p.txt", b"one\n\nthree\n"), needs="text"),
    C("prompt-file-not-utf8", "generate {text} --prompt-file {tmp}/p.txt --max-new-tokens 2",
      "not UTF-8 text", _file("p.txt", b"\xff\xfe\x00bad"), needs="text"),
    C("prompt-file-missing", "generate {text} --prompt-file {tmp}/p.txt --max-new-tokens 2",
      "no such prompt file", needs="text"),
    C("prompt-file-a-directory", "generate {text} --prompt-file {tmp}/p.txt --max-new-tokens 2",
      "cannot read prompt file", _file("p.txt", None), needs="text"),
    C("prompt-not-utf8", "run {text} --prompt caf\udce9",
      "the prompt is not valid UTF-8 text (byte 0xe9 at character 3)", needs="text"),
    C("prompt-empty", "run {text} --prompt=", "--prompt is empty", needs="text"),
    C("second-prompt-empty", "run {text} --prompt a --prompt=", "--prompt 2 is empty",
      needs="text"),
    C("prompt-beyond-the-context", "run {text} --prompt " + "x" * 200,
      "a prompt of 201 tokens needs 201 positions; the model's context is 128", needs="text"),
    C("prompt-and-new-tokens-beyond-the-context", "generate {text} --prompt " + "x" * 120
      + " --max-new-tokens 20", "a prompt of 121 tokens and 20 new tokens needs 140 positions",
      needs="text"),
    C("text-without-input", "run {text}", "one of the arguments --prompt --prompt-file --tokens "
      "--tokens-file", needs="text"),
    # --- issue 33's escapes: each once a traceback, a warning or a silent answer
    C("tokens-beyond-64-bits", "run tiny --random-weights --tokens 99999999999999999999999",
      "token id 99999999999999999999999 is out of range"),
    C("tokens-file-uint64-max", "run tiny --random-weights --tokens-file {tmp}/ids.npy",
      "token id 18446744073709551615 is out of range",
      _token_file(np.array([[2 ** 64 - 1]], np.uint64))),
    C("seq-beyond-reason", "compile llama-7b --gpu-mem 16GB --seq 1000000000000",
      "graph too large to plan"),
    C("h2d-bandwidth-vanishing", "compile llama-7b --gpu-mem 16GB --h2d-bandwidth 1e-300",
      "below 1 B/s"),
    C("flops-vanishing", "compile llama-7b --gpu-mem 16GB --flops 1e-30", "below 1 FLOP/s"),
    C("config-head-dim-zero", "run {tmp}/ckpt --tokens 1", "head_dim must be a positive integer",
      _config(lambda c: c.update(head_dim=0))),
    C("add-bos-token-a-number", "run {tmp}/ckpt --prompt hi",
      "tokenizer_config.json: add_bos_token must be true or false, got 5",
      _text_ckpt(lambda p: _edit_json(p / "tokenizer_config.json", add_bos_token=5)),
      needs="text"),
    C("bos-token-names-no-token", "run {tmp}/ckpt --prompt hi",
      "tokenizer_config.json: add_bos_token is set but bos_token names no token",
      _text_ckpt(lambda p: _edit_json(p / "tokenizer_config.json", add_bos_token=True,
                                      bos_token="<nowhere>")), needs="text"),
]


# ------------------------------------------------------------------ the shared files


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    """Files the cases share, made once: a checkpoint and plans compiled from it (a prefill of
    3 tokens and a decode step), checkpoints of another shape, of another dtype and with NaN
    weights, every device profile as `einpage devices --json` prints it, and (where the fixture
    is there) a checkpoint with a tokenizer."""
    root = tmp_path_factory.mktemp("world")
    ckpt = write_checkpoint(root / "ckpt")
    nan = write_checkpoint(root / "nan")
    tensors = llama_oracle.read_safetensors(nan / "model.safetensors")
    tensors["model.norm.weight"][:] = np.nan
    write_safetensors(nan / "model.safetensors", tensors)
    files = {"ckpt": ckpt, "nan": nan, "other": write_checkpoint(root / "other", hidden=48),
             "f16": write_checkpoint(root / "f16", dtype="f16"),
             "plan": root / "plan.json", "decode": root / "decode.json",
             "devices": root / "devices.json"}
    assert cli("compile", ckpt, "--gpu-mem", "20KB", "--seq", "3", "-o", files["plan"],
               "--quiet") == 0
    assert cli("compile", ckpt, "--gpu-mem", "20KB", "--phase", "decode", "--past", "3", "-o",
               files["decode"], "--quiet") == 0
    from einpage.predict import PROFILES
    files["devices"].write_text(json.dumps({n: p.to_json() for n, p in PROFILES.items()}))
    source = FIXTURES / "tiny-llama31"
    if (source / "tokenizer.json").is_file():
        text = write_checkpoint(root / "text", vocab=260, seed=5)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(source / name, text / name)
        files["text"] = text
    return files


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def test_case_ids_are_unique():
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_ends_with_one_line(case, world, tmp_path, capsys, monkeypatch):
    if case.needs == "text" and "text" not in world:
        pytest.skip("the tiny-llama31 fixture (its tokenizer) is not here")
    if case.needs == "no-gpu" and cuda_usable():
        pytest.skip("a GPU is usable here")
    monkeypatch.chdir(tmp_path)
    if case.setup is not None:
        case.setup(tmp_path, world)
    before, shared = _tree(tmp_path), _tree(world["ckpt"].parent)
    argv = [arg.format(tmp=tmp_path, **world) for arg in shlex.split(case.argv)]
    capsys.readouterr()
    assert_one_line_error(capsys, cli(*argv), case.needle)
    assert _tree(tmp_path) == before, "a file was left behind"
    assert _tree(world["ckpt"].parent) == shared, "a file was left behind"


@pytest.mark.parametrize("command", ["compile", "run", "generate"])
def test_ctrl_c_exits_130_from_every_command(command, monkeypatch, capsys):
    """Ctrl-C ends every command with status 130 and one line, whether it arrives as Python's
    KeyboardInterrupt or as the stream runtime's `Interrupted` (its queues stopped)."""
    import importlib

    from einpage.errors import Interrupted
    cli_main = importlib.import_module("einpage.cli.main")
    for raised in (KeyboardInterrupt(), Interrupted("interrupted: every queue stopped")):
        def handler(args, raised=raised):
            raise raised
        for group in cli_main.GROUPS:
            if command in group.HANDLERS:
                monkeypatch.setitem(group.HANDLERS, command, handler)
        argv = {"compile": ["compile", "tiny", "--gpu-mem", "1MB"],
                "run": ["run", "tiny", "--random-weights", "--tokens", "1"],
                "generate": ["generate", "tiny", "--random-weights", "--tokens", "1",
                             "--max-new-tokens", "1"]}[command]
        capsys.readouterr()
        assert cli_main.main(argv) == 130
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "interrupted" in err[0]
