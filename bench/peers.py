"""The peers users pick, on the GPU einpage runs on, with einpage's own random weights: plain
PyTorch eager (the model fits), `torch.compile` (the model fits) and Hugging Face accelerate's
offload path (`device_map="auto"` with `max_memory={0: BUDGET, "cpu": ...}`, what
`from_pretrained(..., device_map="auto", max_memory=...)` builds).

The model is transformers' `LlamaForCausalLM` with the preset's shapes and dtype (`--model`,
default llama-7b, f16), its weights those of `einpage run MODEL --random-weights --seed SEED`
(`random_checkpoint.hf_arrays`: `einpage.models.checkpoint.RandomWeights`, each reshaped to
the Hugging Face layout: `schema.hf_tensor`, `schema.hf_shape`), so both sides compute the same function; with
`--checkpoint DIR` they are read from the checkpoint `bench/random_checkpoint.py` wrote (the
same values, and what the einpage rows of `bench/gpu_session.py` read too). The tokens are
the same random ids `bench/gpu_session.py` gives einpage (`--tokens-file`, else made with the
same seed).

Per peer, what it can run (`--which`, in order; each stops at `--deadline` seconds from start):
- `prefill`: one forward over B=1 x `--seq` tokens (logits for every position, as einpage's
  prefill), one warm-up then the median of `--reps` (accelerate: 1 warm-up, `--offload-reps`);
- `generate`: greedy `model.generate` of `--new` + 1 tokens after a `--prompt`-token prompt
  (`min_new_tokens` so that every run decodes the same count), against the same with one new
  token: decode seconds per step = the difference / `--new`. torch.compile runs the prefill only
  (its decode needs a static cache: a different program).

    python3 bench/peers.py --json out.json [--which eager,accelerate,compile] [--budget 4GB]
        [--seq 2048] [--prompt 512] [--new 64] [--reps 5] [--deadline 300]

It needs torch, transformers and accelerate, and a CUDA GPU: the device machine has them.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).absolute().parent.parent))
sys.path.insert(0, str(Path(__file__).absolute().parent))

from einpage.models import config as presets  # noqa: E402
from einpage.models import schema  # noqa: E402
from einpage.models.checkpoint import load_config  # noqa: E402
from einpage.units import parse_size  # noqa: E402
from random_checkpoint import hf_arrays, hf_config  # noqa: E402

T0 = time.perf_counter()


def elapsed() -> float:
    return time.perf_counter() - T0


def random_state(cfg, seed: int) -> dict:
    """einpage's random weights of `cfg` as a Hugging Face state dict of CPU tensors."""
    import torch
    return {k: torch.from_numpy(v)
            for k, v in hf_arrays(cfg, seed, schema.weight_shapes(cfg)).items()}


def checkpoint_state(directory: str) -> dict:
    """A checkpoint's tensors (bench/random_checkpoint.py's, or any Hugging Face one) as a
    state dict of CPU tensors."""
    from safetensors.torch import load_file
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists()
             else sorted(p.name for p in directory.glob("*.safetensors")))
    state = {}
    for name in files:  # the files the index lists (a stale shard beside them is not read)
        state.update(load_file(str(directory / name)))
    return state


def model_of(cfg, state: dict):
    """transformers' model of `cfg` on the CPU holding `state` (not copied), in its dtype."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(**hf_config(cfg))
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.float16)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if unexpected or any(not k.endswith("inv_freq") for k in missing):
        raise SystemExit(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    rotary = type(model.model.rotary_emb)
    model.model.rotary_emb = rotary(config=config)  # its buffers were made on "meta"
    return model.eval()


def synced(fn):
    import torch
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t = time.perf_counter()
    out = fn()
    sync()
    return time.perf_counter() - t, out


def prefill(model, ids, reps: int, deadline: float) -> dict:
    import torch
    with torch.inference_mode():
        first, _ = synced(lambda: model(input_ids=ids, use_cache=False))
        times = []
        for _ in range(reps):
            if elapsed() > deadline:
                break
            times.append(synced(lambda: model(input_ids=ids, use_cache=False))[0])
    return {"first_s": first, "median_s": statistics.median(times) if times else None,
            "runs_s": times}


def generate(model, prompt, new: int, deadline: float) -> dict:
    import torch

    def run(n: int):
        return model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                              max_new_tokens=n, min_new_tokens=n, do_sample=False,
                              pad_token_id=0)

    with torch.inference_mode():
        run(2)  # warm-up
        one, _ = synced(lambda: run(1))
        if elapsed() > deadline:
            return {"one_token_s": one}
        whole, out = synced(lambda: run(new + 1))
    assert out.shape[1] == prompt.shape[1] + new + 1
    decode = whole - one
    return {"one_token_s": one, "whole_s": whole, "decode_s": decode,
            "decode_step_s": decode / new, "decode_tokens_per_s": new / decode}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-7b")
    ap.add_argument("--which", default="eager,accelerate,compile")
    ap.add_argument("--budget", default="4GB", help="accelerate's max_memory for GPU 0")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--offload-reps", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checkpoint", help="read the weights from this checkpoint directory "
                    "(bench/random_checkpoint.py MODEL DIR: the same values, not made again)")
    ap.add_argument("--tokens-file", help="(1, seq) token ids (.npy), as given to einpage")
    ap.add_argument("--deadline", type=float, default=300.0)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    import torch
    import transformers
    if not torch.cuda.is_available() and "accelerate" in args.which.split(","):
        raise SystemExit("peers.py: accelerate's offload path needs a CUDA GPU")
    cfg = (load_config(Path(args.checkpoint)) if args.checkpoint
           else presets.preset(args.model))
    hf_config(cfg)  # a plain LLaMA, or one line and exit now (before making any weights)
    gpu = torch.cuda.is_available()  # without one (a smoke test on a CPU) eager and compile only
    dev = "cuda" if gpu else "cpu"
    if args.tokens_file:
        ids = np.load(args.tokens_file)[:1, :args.seq]
    else:
        ids = np.random.default_rng(0).integers(1, cfg.vocab, (1, args.seq), dtype=np.int64)
    result = {"model": args.checkpoint or args.model, "seq": args.seq, "prompt": args.prompt, "new": args.new,
              "budget": args.budget, "torch": torch.__version__,
              "transformers": transformers.__version__,
              "gpu": torch.cuda.get_device_name(0) if gpu else None, "peers": {}}

    def save():
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))

    t = time.perf_counter()
    state = (checkpoint_state(args.checkpoint) if args.checkpoint
             else random_state(cfg, args.seed))
    result["build_s"] = time.perf_counter() - t
    print(f"built the model (einpage's random weights) in {result['build_s']:.1f} s",
          flush=True)
    ids_t = torch.from_numpy(np.ascontiguousarray(ids))
    for peer in args.which.split(","):
        if elapsed() > args.deadline:
            result["peers"][peer] = {"skipped": "deadline"}
            continue
        t = time.perf_counter()
        compiled = dispatched = None
        model = model_of(cfg, state)  # each peer its own module, the weights shared on the CPU
        if peer == "eager":
            model.to(dev)
            got = {"prefill": prefill(model, ids_t.to(dev), args.reps, args.deadline)}
            save()
            got["generate"] = generate(model, ids_t[:, :args.prompt].to(dev), args.new,
                                       args.deadline)
        elif peer == "compile":
            model.to(dev)
            compiled = torch.compile(model)
            got = {"prefill": prefill(compiled, ids_t.to(dev), args.reps, args.deadline),
                   "note": "first_s includes compiling"}
        elif peer == "accelerate":
            from accelerate import dispatch_model, infer_auto_device_map
            budget = parse_size(args.budget)
            device_map = infer_auto_device_map(
                model, max_memory={0: budget, "cpu": 200 * 10**9},
                no_split_module_classes=["LlamaDecoderLayer"], dtype=torch.float16)
            offloaded = sorted({str(v) for v in device_map.values()})
            dispatched = dispatch_model(model, device_map=device_map, main_device=0,
                                        skip_keys="past_key_values")
            got = {"device_map_places": offloaded,
                   "on_gpu_modules": sum(v == 0 for v in device_map.values()),
                   "modules": len(device_map),
                   "prefill": prefill(dispatched, ids_t.to(dev), args.offload_reps,
                                      args.deadline)}
            save()
            got["generate"] = generate(dispatched, ids_t[:, :args.prompt].to(dev), args.new,
                                       args.deadline)
            got["max_memory_allocated"] = torch.cuda.max_memory_allocated()
        else:
            raise SystemExit(f"unknown peer {peer!r}")
        got["seconds"] = time.perf_counter() - t
        result["peers"][peer] = got
        model = compiled = dispatched = None
        import gc
        gc.collect()
        if gpu:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        print(peer, json.dumps(got), flush=True)
        save()
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
