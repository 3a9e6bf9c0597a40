"""`einpage run` and `einpage generate`: run a model (dense, or paged under `--gpu-mem`) or a
saved plan."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TextIO

import numpy as np

from einpage.cli.common import check_context, input_from_args, report_logits, write_text
from einpage.errors import InputError
from einpage.ir.dtypes import DType, as_dtype
from einpage.units import parse_size


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="checkpoint directory, preset name (with --random-weights), "
                                 "or a plan file (run)")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--prompt", action="append",
                       help="text, tokenized with the checkpoint's tokenizer.json (BOS as its "
                            "tokenizer_config.json says); repeat for a batch")
    group.add_argument("--prompt-file", help="UTF-8 text file, one prompt per line (a batch); "
                                             "rows of different lengths are padded and masked")
    group.add_argument("--tokens", help="comma-separated token ids (one row)")
    group.add_argument("--tokens-file", help=".npy integer array of shape (batch, length)")
    p.add_argument("--random-weights", action="store_true",
                   help="make deterministic random weights for a preset")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=[d.value for d in DType if d is not DType.i64],
                   help="computation dtype (default: the checkpoint's; bf16 runs as f32 on NumPy)")
    p.add_argument("--gpu-mem", help="device budget (e.g. 16GB, 512MiB) the plan is compiled "
                                     "for (default: the backend's memory)")
    p.add_argument("--policy", default="reuse-distance", help="eviction policy")
    p.add_argument("--backend", default="auto", choices=("auto", "numpy", "threads", "cupy",
                                                          "reference"),
                   help="what runs the plan: cupy (an NVIDIA GPU), threads (a worker thread per "
                        "queue, any machine), numpy (the sequential executor), reference (the "
                        "dense reference, no plan); auto: cupy where a GPU is usable, else "
                        "threads")
    p.add_argument("--timing", action="store_true",
                   help="print each measured pass next to its prediction")
    p.add_argument("--trace", help="write the measured passes as a Chrome trace (Perfetto)")
    p.add_argument("--device", help="device profile for the prediction --timing prints")
    p.add_argument("--device-file", help="device profile as JSON (einpage calibrate -o)")
    p.add_argument("--out", help="save results to this .npy file (run: float32 logits "
                                 "(batch, longest prompt, vocab), rows padded on the right; "
                                 "generate: the new ids (batch, N))")


def add_commands(sub) -> None:
    run = sub.add_parser("run", help="prefill: logits or each row's next token")
    _add_model_args(run)
    run.add_argument("--checkpoint", help="weights for a plan file")
    gen = sub.add_parser("generate", help="greedy decoding with the KV cache")
    _add_model_args(gen)
    gen.add_argument("--max-new-tokens", type=int, required=True)
    gen.add_argument("--kv-granule", type=int, default=256,
                     help="KV-store capacities come in multiples of this (coarser past 2048: "
                          "at most 1/8 of a bucket is unused); one decode plan per bucket")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object: tokens, text (each row's continuation, where "
                          "the checkpoint has a tokenizer), prompt_lengths, plans_compiled, "
                          "prefill_s, decode_s, decode_tokens_per_s, ...")


def _runner(args, weights):
    """Graph runner: the dense reference, or a plan per graph run on the chosen backend."""
    from einpage import runners
    if args.backend == "reference":
        if args.gpu_mem or args.timing or args.trace:
            raise InputError("--backend reference runs no plan: it takes no --gpu-mem, "
                             "--timing or --trace")
        return runners.dense_runner(weights)
    from einpage.compiler import CompileOptions
    budget = parse_size(args.gpu_mem, "--gpu-mem") if args.gpu_mem else None
    options = CompileOptions(device_bytes=budget, policy=args.policy, device=_profile(args))
    return runners.PlanRunner(weights, options, args.backend,
                              timing=bool(args.timing or args.trace))


def _profile(args):
    """The profile predictions are made with: --device / --device-file, else the default."""
    if args.device or args.device_file:
        from einpage.cli.common import profile_from_args
        return profile_from_args(args)
    return None


def _after(args, runner) -> None:
    """--timing and --trace for the passes `runner` ran."""
    predicted = bool(args.device or args.device_file)
    _show_passes(args, [(p.compiled.memgraph, p.measured,
                         p.compiled.simulation if predicted else None)
                        for p in getattr(runner, "passes", [])])


def _show_passes(args, passes, first: str = "prefill pass") -> None:
    """--trace and --timing for `passes`: (memgraph, Measured, Simulation or None) each."""
    if args.trace:
        from einpage.cli.trace import measured_events, trace_text
        write_text(args.trace, trace_text(measured_events([(mg, m) for mg, m, _ in passes])))
        print(f"wrote the measured trace of {len(passes)} pass(es) to {args.trace}")
    if args.timing:
        from einpage.cli.timing import print_timing
        print_timing(passes, first)


def _resolve(args):
    from einpage.models import resolve
    dtype = as_dtype(args.dtype) if args.dtype else None
    cfg, weights = resolve(args.model, random_weights=args.random_weights, seed=args.seed,
                           dtype=dtype)
    if weights is None:
        raise InputError(f"{args.model}: a preset has no weights; pass --random-weights or a "
                         "checkpoint directory")
    return cfg, weights


def _checkpoint_dir(model: str) -> Path | None:
    """Where a run's tokenizer lives: the checkpoint directory (None for a preset)."""
    return Path(model) if Path(model).is_dir() else None


def cmd_run(args) -> None:
    """The prefill: each row's next token (from its last real position; with its text for
    text input), or the logits saved with --out."""
    if Path(args.model).is_file():
        return run_plan(args)
    from einpage.models.generation import prefill
    cfg, weights = _resolve(args)
    given = input_from_args(args, _checkpoint_dir(args.model))
    check_context(cfg, int(given.lengths.max()))
    runner = _runner(args, weights)
    out = prefill(cfg, given.tokens, runner, given.lengths)
    report_logits(out["logits"], args.out, given.lengths, given.codec if given.text else None)
    _after(args, runner)


class TextPrinter:
    """Prints each row's continuation to `out`: for one row on a terminal, streamed as its
    tokens come (`on_token`; an incomplete character is held back until it completes); else
    every row's text after the generation (`finish`), decoded from all its new ids at once."""

    def __init__(self, codec, batch: int, out: TextIO):
        self.codec, self.out = codec, out
        tty = bool(getattr(out, "isatty", lambda: False)())
        self.stream = codec.stream() if batch == 1 and tty else None

    def on_token(self, ids: np.ndarray) -> None:
        if self.stream is not None:
            self._write(self.stream.push(ids[:1].tolist()))

    def finish(self, texts: list[str]) -> None:
        if self.stream is not None:
            self._write(self.stream.finish() + "\n")
        elif len(texts) == 1:
            self._write(texts[0] + "\n")
        else:
            self._write("".join(f"row {row}: {text}\n" for row, text in enumerate(texts)))

    def _write(self, text: str) -> None:
        if text:
            self.out.write(text)
            self.out.flush()


def cmd_generate(args, out: TextIO | None = None) -> None:
    """Greedy generation: the prefill, then decode steps on one plan per KV bucket, each held
    open on the backend across its steps. Prints each row's text (text input; streamed for one
    row on a terminal) or new ids, then the measured rates; `--json`: one object."""
    from einpage.models.generation import generate
    out = out or sys.stdout
    if args.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.kv_granule < 1:
        raise InputError(f"--kv-granule must be at least 1, got {args.kv_granule}")
    cfg, weights = _resolve(args)
    given = input_from_args(args, _checkpoint_dir(args.model), want_codec=args.json)
    check_context(cfg, int(given.lengths.max()), args.max_new_tokens)
    runner = _runner(args, weights)
    printer = (TextPrinter(given.codec, given.tokens.shape[0], out)
               if given.text and not args.json else None)
    done = generate(cfg, given.tokens, args.max_new_tokens, runner, granule=args.kv_granule,
                    on_token=printer.on_token if printer else None, lengths=given.lengths)
    new = done.tokens
    summary = {"tokens": new.tolist(), "batch": int(new.shape[0]),
               "prompt": int(given.tokens.shape[1]), "prompt_lengths": list(done.lengths),
               "new_tokens": int(new.shape[1]), "plans_compiled": getattr(runner,
                                                                         "plans_compiled", 0),
               "kv_capacities": list(done.capacities), "prefill_s": done.prefill_s,
               "decode_s": done.decode_s, "decode_steps": done.decode_steps, **done.rates(),
               "compile_s": getattr(runner, "compile_s", 0.0), "backend": getattr(
                   runner, "backend", "reference")}
    if given.codec is not None:
        summary["text"] = [given.codec.decode(row) for row in new.tolist()]
    if args.out:
        np.save(args.out, new.astype(np.int64))
        summary["out"] = args.out
    if args.json:
        print(json.dumps(summary, sort_keys=True), file=out)
    else:
        if printer is not None:
            printer.finish(summary["text"])
        elif not args.out:
            for row, ids in enumerate(new):
                print(f"row {row}: " + ",".join(str(int(t)) for t in ids), file=out)
        if args.out:
            print(f"saved new tokens {new.shape} to {args.out}", file=out)
        _print_rates(summary, out)
    _after(args, runner)


def _print_rates(s: dict, out: TextIO | None = None) -> None:
    """The measured generation: prefill and decode tokens/s (plan compiles included in the
    phase that made them; real prompt tokens, pads not counted), and the plans compiled."""
    def rate(key: str) -> str:
        return f"{s[key]:.4g} tokens/s" if s.get(key) else "-"
    lengths = s["prompt_lengths"]
    shape = (f"{s['batch']}x{s['prompt']}" if min(lengths) == max(lengths) else
             f"{sum(lengths)} ({s['batch']} rows of {min(lengths)}..{max(lengths)})")
    print(f"prefill: {shape} tokens in {s['prefill_s']:.3f} s "
          f"({rate('prefill_tokens_per_s')}); decode: {s['decode_steps']} steps in "
          f"{s['decode_s']:.3f} s ({rate('decode_tokens_per_s')}); {s['plans_compiled']} plans "
          f"compiled in {s['compile_s']:.2f} s on {s['backend']}", file=out or sys.stdout)


def run_plan(args) -> None:
    """`einpage run plan.json --checkpoint DIR --tokens ...`: execute a saved plan (text input:
    the prompts, padded to the longest, must have the plan's token shape)."""
    from einpage.compiler import validate
    from einpage.ir.memgraph import MemGraph
    from einpage.models.checkpoint import Checkpoint
    if not args.checkpoint:
        raise InputError("running a plan file needs --checkpoint DIR with its weights")
    given = input_from_args(args, Path(args.checkpoint))
    tokens = given.tokens
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

    out = _run_plan_on_backend(args, mg, {"tokens": tokens}, weights)
    report_logits(out["logits"], args.out, given.lengths, given.codec if given.text else None)


def _run_plan_on_backend(args, mg, inputs, weights) -> dict:
    """A saved plan on --backend (the budget is the plan's; --gpu-mem does not apply)."""
    if args.gpu_mem:
        raise InputError("a plan file was compiled for its budget: drop --gpu-mem")
    if args.backend == "reference":
        raise InputError("--backend reference runs graphs, not plan files")
    from einpage.runners import run_plan
    outputs, measured = run_plan(mg, inputs, weights, args.backend,
                                 timing=bool(args.timing or args.trace))
    sim = None
    if args.device or args.device_file:
        from einpage.predict import simulate
        sim = simulate(mg, _profile(args))
    _show_passes(args, [(mg, measured, sim)], first="pass")
    return outputs


HANDLERS = {"run": cmd_run, "generate": cmd_generate}
