"""A preset's `--random-weights` written once as a Hugging Face checkpoint directory, so that
many runs on a GPU lease read them from the page cache instead of making them again.

`einpage run llama-7b --random-weights` makes every weight block on the host as the plan reads
it (`models.checkpoint.RandomWeights`): on the first GPU leases that cost 75 s per run for
llama-7b (13.48 GB at ~180 MB/s), most of a 15-minute lease over four rows. This writes the same
values once — each tensor `RandomWeights(cfg, seed)(name)` in the preset's dtype, reshaped to
the Hugging Face layout (`schema.hf_tensor`, `schema.hf_shape`) — as one safetensors shard per
layer plus one for the embedding, final norm and head, with `model.safetensors.index.json` and
a `config.json` that `einpage.models.checkpoint.load_config` reads back as the preset's shapes.
The shards are made in parallel processes (one per core: the hashing is NumPy work that threads
share badly). `einpage run DIR` then computes what `einpage run MODEL --random-weights --seed
SEED` computes, and `bench/peers.py --checkpoint DIR` loads the same weights into transformers.

    python3 bench/random_checkpoint.py llama-7b /tmp/llama-7b-random [--seed 0] [--workers N]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).absolute().parent.parent))

from einpage.models import config as presets  # noqa: E402
from einpage.models import schema  # noqa: E402
from einpage.models.checkpoint import RandomWeights  # noqa: E402

_DTYPES = {"f16": ("float16", np.float16), "f32": ("float32", np.float32)}


def hf_config(cfg) -> dict:
    """The Hugging Face `config.json` of a plain LLaMA preset (no biases, no experts, no rope
    scaling, no sliding window, no per-head norms)."""
    if (cfg.family != "llama" or cfg.experts or cfg.qkv_bias or cfg.o_bias or cfg.qk_norm
            or cfg.rope_scaling or cfg.sliding_window or cfg.formats or cfg.kv_format):
        raise SystemExit(f"{cfg.name}: only plain LLaMA presets are supported here")
    if cfg.dtype.value not in _DTYPES:
        raise SystemExit(f"{cfg.name}: dtype {cfg.dtype.value} is not written (f16, f32)")
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
            "vocab_size": cfg.vocab, "hidden_size": cfg.hidden,
            "intermediate_size": cfg.intermediate, "num_hidden_layers": cfg.layers,
            "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.kv_heads,
            "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_eps, "rope_theta": cfg.rope_theta,
            "max_position_embeddings": cfg.context or 4096,
            "tie_word_embeddings": cfg.tied, "hidden_act": "silu",
            "torch_dtype": _DTYPES[cfg.dtype.value][0]}


def shards(cfg) -> dict[str, list[str]]:
    """Graph weight names by shard file: one per layer, then the rest."""
    names = list(schema.weight_shapes(cfg))
    total = cfg.layers + 1
    out: dict[str, list[str]] = {}
    for name in names:
        part = int(name.split(".")[1]) + 1 if name.startswith("layers.") else total
        out.setdefault(f"model-{part:05d}-of-{total:05d}.safetensors", []).append(name)
    return out


def hf_arrays(cfg, seed: int, names) -> dict[str, np.ndarray]:
    """`RandomWeights(cfg, seed)` of the graph weights `names`, by Hugging Face tensor name, in
    the preset's dtype and the Hugging Face layout: the values of `--random-weights`."""
    hf_config(cfg)  # a preset this can write
    weights = RandomWeights(cfg, seed)
    dtype = _DTYPES[cfg.dtype.value][1]
    return {schema.hf_tensor(n): np.asarray(weights(n)).astype(dtype)
            .reshape(schema.hf_shape(cfg, n)) for n in names}


def _write_shard(model: str, seed: int, directory: str, file: str, names: list[str]) -> int:
    from safetensors.numpy import save_file

    from einpage.models.checkpoint import RandomArray
    RandomArray._PARALLEL_CHUNKS = 1 << 62  # one process per core already: no threads in it
    arrays = hf_arrays(presets.preset(model), seed, names)
    save_file(arrays, str(Path(directory) / file))
    return sum(a.nbytes for a in arrays.values())


def write(model: str, directory: str | Path, seed: int = 0, workers: int | None = None) -> int:
    """Write `model`'s random weights to `directory` (made); returns the bytes of tensor data.
    A directory already holding a complete checkpoint of the same model and seed is kept."""
    cfg = presets.preset(model)
    directory = Path(directory)
    stamp = {"model": model, "seed": seed}
    done = directory / "einpage-random.json"
    parts = shards(cfg)
    if done.exists() and json.loads(done.read_text()) == stamp:
        return sum(f.stat().st_size for f in directory.glob("*.safetensors"))
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_config(cfg), indent=1))
    weight_map = {schema.hf_tensor(n): f for f, names in parts.items() for n in names}
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    with ProcessPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
        sizes = list(pool.map(_write_shard, *zip(*[(model, seed, str(directory), f, names)
                                                   for f, names in parts.items()])))
    done.write_text(json.dumps(stamp))
    return sum(sizes)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a plain LLaMA preset (einpage models)")
    ap.add_argument("directory")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    nbytes = write(args.model, args.directory, args.seed, args.workers)
    seconds = time.perf_counter() - t0
    print(f"wrote {args.model} (seed {args.seed}) to {args.directory}: {nbytes / 1e9:.2f} GB in "
          f"{seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
