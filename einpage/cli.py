"""The `einpage` command line. Every user error ends with one line on stderr and exit status 2."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from einpage.errors import EinpageError, InputError
from einpage.ir.dtypes import DType, as_dtype
from einpage.sizes import format_size, parse_size


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse prints usage too; keep it to one line)
        self.exit(2, f"einpage: error: {message}\n")


def _add_model_args(p: argparse.ArgumentParser, with_tokens: bool) -> None:
    p.add_argument("model", help="checkpoint directory, preset name (with --random-weights), "
                                 "or a plan file (run)")
    if with_tokens:
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


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="einpage", description="Run einsum tensor programs that do not fit in "
                                                 "GPU memory.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    sub.add_parser("models", help="list the model presets")
    run = sub.add_parser("run", help="prefill: logits or each row's next token")
    _add_model_args(run, with_tokens=True)
    run.add_argument("--checkpoint", help="weights for a plan file")
    gen = sub.add_parser("generate", help="greedy decoding with the KV cache")
    _add_model_args(gen, with_tokens=True)
    gen.add_argument("--max-new-tokens", type=int, required=True)
    from einpage import cli_compile
    cli_compile.add_commands(sub)
    return parser


def _tokens(args) -> np.ndarray:
    if args.tokens is not None:
        try:
            ids = [int(t) for t in args.tokens.split(",") if t.strip()]
        except ValueError:
            raise InputError(f"--tokens {args.tokens!r}: expected comma-separated integers") from None
        if not ids:
            raise InputError("--tokens is empty")
        return np.asarray([ids], dtype=np.int64)
    path = Path(args.tokens_file)
    try:
        ids = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise InputError(f"{path}: no such token file") from None
    except (OSError, ValueError) as exc:
        raise InputError(f"{path}: not a .npy array: {exc}") from None
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise InputError(f"{path}: token ids must be an integer array of shape (batch, length), "
                         f"got {ids.dtype} {ids.shape}")
    return ids.astype(np.int64)


def _runner(args, weights):
    """Graph runner: the dense reference, or compile under --gpu-mem and execute the plan."""
    if args.gpu_mem is None:
        from einpage.runtime.reference import evaluate
        return lambda graph, inputs: evaluate(graph, inputs, weights)
    from einpage.compile import CompileOptions, run_paged
    options = CompileOptions(device_bytes=parse_size(args.gpu_mem), policy=args.policy)
    return lambda graph, inputs: run_paged(graph, inputs, weights, options)


def _resolve(args):
    from einpage.models import resolve
    dtype = as_dtype(args.dtype) if args.dtype else None
    cfg, weights = resolve(args.model, random_weights=args.random_weights, seed=args.seed,
                           dtype=dtype)
    if weights is None:
        raise InputError(f"{args.model}: a preset has no weights; pass --random-weights or a "
                         "checkpoint directory")
    return cfg, weights


def cmd_models(args) -> None:
    from einpage.models.config import PRESETS
    print(f"{'name':<12} {'params':>10} {'f16 weights':>13} {'layers':>6} {'hidden':>6} "
          f"{'heads':>5} {'kv':>3} {'vocab':>7}")
    for cfg in PRESETS.values():
        print(f"{cfg.name:<12} {cfg.parameters / 1e9:>9.2f}B {format_size(cfg.weight_bytes(DType.f16)):>13} "
              f"{cfg.layers:>6} {cfg.hidden:>6} {cfg.heads:>5} {cfg.kv_heads:>3} {cfg.vocab:>7}")


def cmd_run(args) -> None:
    if Path(args.model).is_file():
        from einpage import cli_compile
        return cli_compile.run_plan(args, _tokens(args))
    from einpage.models.generation import prefill
    cfg, weights = _resolve(args)
    out = prefill(cfg, _tokens(args), _runner(args, weights))
    report_logits(out["logits"], args.out)


def report_logits(logits: np.ndarray, out_path: str | None) -> None:
    """Save float32 logits (batch, length, vocab) to `out_path`, or print each row's next token."""
    logits = logits.astype(np.float32)
    if out_path:
        np.save(out_path, logits)
        print(f"saved logits {logits.shape} to {out_path}")
    else:
        for row, token in enumerate(np.argmax(logits[:, -1, :], axis=-1)):
            print(f"row {row}: next token {int(token)}")


def cmd_generate(args) -> None:
    from einpage.models.generation import greedy
    cfg, weights = _resolve(args)
    new = greedy(cfg, _tokens(args), args.max_new_tokens, _runner(args, weights))
    if args.out:
        np.save(args.out, new.astype(np.int64))
        print(f"saved new tokens {new.shape} to {args.out}")
    else:
        for row, ids in enumerate(new):
            print(f"row {row}: " + ",".join(str(int(t)) for t in ids))


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from einpage import cli_compile
    handlers = {"models": cmd_models, "run": cmd_run, "generate": cmd_generate,
                **cli_compile.HANDLERS}
    try:
        handlers[args.command](args)
    except EinpageError as exc:
        print(f"einpage: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("einpage: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
