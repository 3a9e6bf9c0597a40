"""`einpage run` and `einpage generate`: run a model (dense, or paged under `--gpu-mem`) or a
saved plan."""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from einpage.cli.common import report_logits, tokens_from_args
from einpage.errors import InputError
from einpage.ir.dtypes import DType, as_dtype
from einpage.units import parse_size


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="checkpoint directory, preset name (with --random-weights), "
                                 "or a plan file (run)")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--tokens", help="comma-separated token ids (one row)")
    group.add_argument("--tokens-file", help=".npy integer array of shape (batch, length)")
    p.add_argument("--random-weights", action="store_true",
                   help="make deterministic random weights for a preset")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=[d.value for d in DType if d is not DType.i64],
                   help="computation dtype (default: the checkpoint's; bf16 runs as f32 on NumPy)")
    p.add_argument("--gpu-mem", help="device budget (e.g. 16GB, 512MiB): compile a paged plan "
                                     "and run it on the executor")
    p.add_argument("--policy", default="reuse-distance", help="eviction policy (with --gpu-mem)")
    p.add_argument("--out", help="save results to this .npy file")


def add_commands(sub) -> None:
    run = sub.add_parser("run", help="prefill: logits or each row's next token")
    _add_model_args(run)
    run.add_argument("--checkpoint", help="weights for a plan file")
    gen = sub.add_parser("generate", help="greedy decoding with the KV cache")
    _add_model_args(gen)
    gen.add_argument("--max-new-tokens", type=int, required=True)


def _runner(args, weights):
    """Graph runner: the dense reference, or compile under --gpu-mem and execute the plan."""
    from einpage import runners
    if args.gpu_mem is None:
        return runners.dense_runner(weights)
    from einpage.compiler import CompileOptions
    options = CompileOptions(device_bytes=parse_size(args.gpu_mem, "--gpu-mem"), policy=args.policy)
    return runners.paged_runner(weights, options)


def _resolve(args):
    from einpage.models import resolve
    dtype = as_dtype(args.dtype) if args.dtype else None
    cfg, weights = resolve(args.model, random_weights=args.random_weights, seed=args.seed,
                           dtype=dtype)
    if weights is None:
        raise InputError(f"{args.model}: a preset has no weights; pass --random-weights or a "
                         "checkpoint directory")
    return cfg, weights


def cmd_run(args) -> None:
    if Path(args.model).is_file():
        return run_plan(args, tokens_from_args(args))
    from einpage.models.generation import prefill
    cfg, weights = _resolve(args)
    out = prefill(cfg, tokens_from_args(args), _runner(args, weights))
    report_logits(out["logits"], args.out)


def cmd_generate(args) -> None:
    from einpage.models.generation import greedy
    if args.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    cfg, weights = _resolve(args)
    new = greedy(cfg, tokens_from_args(args), args.max_new_tokens, _runner(args, weights))
    if args.out:
        np.save(args.out, new.astype(np.int64))
        print(f"saved new tokens {new.shape} to {args.out}")
    else:
        for row, ids in enumerate(new):
            print(f"row {row}: " + ",".join(str(int(t)) for t in ids))


def run_plan(args, tokens: np.ndarray) -> None:
    """`einpage run plan.json --checkpoint DIR --tokens ...`: execute a saved plan."""
    from einpage.compiler import validate
    from einpage.ir.memgraph import MemGraph
    from einpage.models.checkpoint import Checkpoint
    from einpage.runtime.executor import run
    if not args.checkpoint:
        raise InputError("running a plan file needs --checkpoint DIR with its weights")
    mg = MemGraph.load(args.model)
    validate(mg)
    want = {t.name: t for t in mg.inputs}
    if "tokens" not in want or tuple(want["tokens"].shape) != tuple(tokens.shape):
        shape = tuple(want["tokens"].shape) if "tokens" in want else None
        raise InputError(f"{args.model}: the plan was compiled for tokens of shape {shape}, "
                         f"got {tuple(tokens.shape)}")
    ckpt = Checkpoint(args.checkpoint)
    vocab = ckpt.config.vocab
    if tokens.min() < 0 or tokens.max() >= vocab:
        raise InputError(f"token id out of range for a vocabulary of {vocab}")
    by_source = {t.source.input: t.source.checkpoint for t in mg.tensors
                 if t.source is not None and t.source.checkpoint}
    shapes = {t.source.input: t.source.full_shape for t in mg.tensors if t.source is not None}

    def weights(name: str) -> np.ndarray:
        return ckpt.array(by_source[name]).reshape(shapes[name])

    out = run(mg, {"tokens": tokens}, weights)
    report_logits(out["logits"], args.out)


HANDLERS = {"run": cmd_run, "generate": cmd_generate}
