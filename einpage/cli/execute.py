"""`einpage run` and `einpage generate`: run a model (dense, or paged under `--gpu-mem`) or a
saved plan."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TextIO

import numpy as np

from einpage.cli.common import (POLICY_HELP, add_host_args, add_parallel_arg, add_quantize_arg,
                                check_budget, check_context, host_budget, host_options,
                                input_from_args, load_plan, report_logits, write_text)
from einpage.cli.draft import draft_from_args, draft_tokens
from einpage.cli.outputs import Deferred, OutputPath
from einpage.cli.ranks import quiet_rank
from einpage.errors import InputError
from einpage.ir.dtypes import DType, as_dtype
from einpage.outputs import save_npy
from einpage.units import format_size, parse_size


def _add_model_args(p: argparse.ArgumentParser, prompt: bool = True,
                    host_profile: bool = True):
    """The model and how it runs; with `prompt`, also what it is given: one flag of a group,
    returned (`generate` adds its own to it); without `host_profile`, no --host / --host-file
    (`serve`'s --host is the address it listens on)."""
    p.add_argument("model", help="checkpoint directory, preset name (with --random-weights), "
                                 "or a plan file (run)")
    group = _add_prompt_args(p) if prompt else None
    _add_run_args(p, host_profile)
    return group


def _add_prompt_args(p: argparse.ArgumentParser):
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--prompt", action="append",
                       help="text, tokenized with the checkpoint's tokenizer.json (BOS as its "
                            "tokenizer_config.json says); repeat for a batch")
    group.add_argument("--prompt-file", help="UTF-8 text file, one prompt per line (a batch); "
                                             "rows of different lengths are padded and masked")
    group.add_argument("--tokens", help="comma-separated token ids (one row)")
    group.add_argument("--tokens-file", help=".npy integer array of shape (batch, length)")
    return group


def _add_run_args(p: argparse.ArgumentParser, host_profile: bool = True) -> None:
    p.add_argument("--random-weights", action="store_true",
                   help="make deterministic random weights for a preset")
    p.add_argument("--seed", type=int,
                   help="seed (>= 0) of --random-weights (default 0) and, for generate, of "
                        "sampling (default: a fresh seed, printed so the run can be repeated)")
    p.add_argument("--dtype", choices=[d.value for d in DType if d is not DType.i64],
                   help="dtype the weights and every intermediate result are stored in; each op "
                        "computes in float32 (float64 for f64) and rounds its result to it. "
                        "Default: the checkpoint's, except bf16, which runs as f32 (so --dtype "
                        "bf16 on a bf16 checkpoint rounds every activation to bf16: not the "
                        "default's numbers)")
    p.add_argument("--gpu-mem", help="device budget (e.g. 16GB, 512MiB) the plan is compiled "
                                     "for (default: the backend's memory); on cupy all the "
                                     "process takes of the device, its CUDA context included")
    p.add_argument("--arena", help="the plan's arena itself (e.g. 300KB) in place of --gpu-mem: "
                                   "on cupy the CUDA context and the workspaces come on top "
                                   "(to page a small model on a GPU)")
    p.add_argument("--force", action="store_true",
                   help="allow a --gpu-mem above the memory of --device (a warning)")
    p.add_argument("--devices", type=int, default=1,
                   help="run the model over N devices of --gpu-mem each (threads or cupy "
                        "backend): every rank in this process, or one per process under "
                        "mpiexec -n N")
    add_parallel_arg(p)
    add_host_args(p)
    add_quantize_arg(p)
    p.add_argument("--policy", help=POLICY_HELP + "; needs --gpu-mem")
    p.add_argument("--backend", default="auto", choices=("auto", "numpy", "threads", "cupy",
                                                          "reference"),
                   help="what runs the plan: cupy (an NVIDIA GPU), threads (a worker thread per "
                        "queue, any machine), numpy (the sequential executor), reference (the "
                        "dense reference, no plan); auto: cupy where a GPU is usable, else "
                        "threads")
    p.add_argument("--timing", action="store_true",
                   help="print each measured pass next to its prediction")
    p.add_argument("--trace", action=OutputPath,
                   help="write the measured passes as a Chrome trace (Perfetto); every pass "
                        "is then issued node by node (on cupy: no CUDA graph replays)")
    p.add_argument("--device", help="device profile for the prediction --timing prints (see "
                                    "einpage devices); with --device-file, the one of that name")
    p.add_argument("--device-file", help="device profile(s) as JSON (einpage calibrate -o, "
                                         "einpage devices --json) for --timing")
    if host_profile:
        p.add_argument("--host", help="host profile the plans are priced with (default "
                                      "server-16c; see einpage devices)")
        p.add_argument("--host-file", help="host profile as JSON (einpage calibrate "
                                           "--host-out)")
    else:
        p.set_defaults(host=None, host_file=None)
    p.add_argument("--host-compute", choices=("auto", "off"), default="auto",
                   help="auto (default): run applies on the host where the plan's simulated "
                        "pass is faster; off: every apply on the device")
    p.add_argument("--out", action=OutputPath,
                   help="save results to this .npy file, exactly as named (no .npy is added; "
                        "run: float32 logits (batch, longest prompt, vocab), rows padded on the "
                        "right; generate: the new ids (batch, N))")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """How tokens are picked (`generate`, `chat`)."""
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 (the default): greedy; above 0: sample from softmax(logits / T)")
    p.add_argument("--top-p", type=float,
                   help="sample from the nucleus: the most likely tokens up to mass P, "
                        "0 < P <= 1 (needs --temperature > 0)")
    p.add_argument("--top-k", type=int,
                   help="sample from the K most likely tokens, K >= 1 (needs --temperature > 0)")
    p.add_argument("--kv-granule", type=int, default=256,
                   help="KV-store capacities come in multiples of this (coarser past 2048: "
                        "at most 1/8 of a bucket is unused); one decode plan per bucket")


def add_commands(sub) -> None:
    run = sub.add_parser("run", help="prefill: logits or each row's next token")
    _add_model_args(run)
    run.add_argument("--checkpoint", help="the checkpoint directory whose weights a plan file "
                                          "runs with (plan files only)")
    run.add_argument("--passes", type=int, default=1,
                     help="run the pass N times in one session (the plan held open, resident "
                          "weights loaded once); --timing prints the first and the median of "
                          "the others")
    gen = sub.add_parser("generate", help="decoding with the KV cache: greedy (or sampled on "
                                          "request) until EOS or --max-new-tokens")
    prompts = _add_model_args(gen)
    gen.add_argument("--max-new-tokens", type=int, required=True,
                     help="the most new tokens per row (fewer where a row reaches EOS)")
    gen.add_argument("--ignore-eos", action="store_true",
                     help="do not stop a row at the checkpoint's end-of-sequence id(s) "
                          "(generation_config.json, else config.json, else the tokenizer's)")
    add_sampling_args(gen)
    prompts.add_argument(
        "--chat", help="one exchange with a chat model: this user message, rendered with the "
                       "checkpoint's chat template (with --system); prints the reply")
    prompts.add_argument(
        "--messages", help="one exchange: a JSON file of the conversation so far (a list of "
                           "{role, content}), rendered with the chat template; prints the reply")
    gen.add_argument("--system", help="with --chat: the system message before it")
    gen.add_argument("--draft",
                     help="speculative decoding: 'ngram' proposes each row's next tokens from "
                          "its own text (prompt lookup); a checkpoint directory, a smaller "
                          "model of the same vocabulary, proposes them greedily; one pass of "
                          "the model checks them all. Greedy: the same tokens as without it; "
                          "sampling: the same distribution (the speculative sampling rule)")
    gen.add_argument("--draft-tokens",
                     help="proposals checked per pass (default 4; 1 to 64, at most "
                          "--kv-granule), or auto: chosen before each pass from 1, 2, 4, 8 by "
                          "the predicted pass time and the acceptance measured so far")
    gen.add_argument("--draft-gpu-mem",
                     help="with a draft model and --gpu-mem: the part of the budget the draft "
                          "takes (default: chosen by simulated step time, as compile --draft "
                          "does); the model gets the rest. With --devices N: of each device's "
                          "budget, the draft split over the devices as the model is (the "
                          "default chosen by the steps planned for the devices)")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object: tokens (rows padded after their EOS), "
                          "new_lengths, finish_reason (eos or length), text (each row's "
                          "continuation up to its EOS, where the checkpoint has a tokenizer), "
                          "prompt_lengths, sampling, plans_compiled, prefill_s, decode_s, "
                          "decode_tokens_per_s, ...")


def _runner(args, weights, reserved: int = 0, budget: int | None = None, timed: bool = True,
            role: str | None = None):
    """Graph runner: the dense reference, or a plan per graph run on the chosen backend.
    `reserved`: bytes of --gpu-mem (--arena) another runner takes (a draft model's); `budget`:
    this runner's own instead (the draft's); `timed` False: its passes are not kept for
    --timing / --trace (a draft model's, which they do not show); `role`: what the runner runs,
    where an error of its plans for several devices must say it (the draft model)."""
    from einpage import runners
    if (args.device or args.device_file) and not args.timing:
        raise InputError("--device and --device-file price the passes --timing prints: add "
                         "--timing")
    if args.backend == "reference":
        if args.gpu_mem or args.arena or args.policy or args.timing or args.trace:
            raise InputError("--backend reference runs no plan: it takes no --gpu-mem, --arena, "
                             "--policy, --timing or --trace")
        return runners.dense_runner(weights)
    from einpage.compiler import CompileOptions
    if args.gpu_mem and args.arena:
        raise InputError("--gpu-mem and --arena both size the plan: give one")
    whole = (parse_size(args.gpu_mem, "--gpu-mem") if args.gpu_mem else
             parse_size(args.arena, "--arena") if args.arena else None)
    if budget is None:
        budget = whole
        if reserved and whole is not None:
            if reserved >= whole:
                raise InputError(f"the draft takes {format_size(reserved)} of the "
                                 f"{format_size(whole)} budget: no room is left for the model "
                                 "(a larger --gpu-mem, or a smaller --draft-gpu-mem)")
            budget = whole - reserved
    elif not budget:
        budget = None  # no --gpu-mem: the draft is not constrained either
    if getattr(args, "devices", 1) != 1 or getattr(args, "parallel", "pipeline") != "pipeline":
        from einpage.cli.ranks import ranks_runner
        return ranks_runner(args, weights, budget, timed, role)
    if args.policy and budget is None:
        raise InputError("--policy chooses what a --gpu-mem budget evicts: give --gpu-mem too")
    profile = _profile(args)
    over = check_budget(whole, profile, args.force) if whole and profile else None
    if over:
        print(f"einpage: warning: {over}", file=sys.stderr)
    host_bytes, _ = host_budget(args)
    options = CompileOptions(device_bytes=budget, policy=args.policy or "reuse-distance",
                             device=_profile(args), host_bytes=host_bytes,
                             **host_options(args))
    return runners.PlanRunner(weights, options, args.backend,
                              timing=bool(args.timing or args.trace) and timed,
                              arena=bool(args.arena),
                              graphs=not args.trace)  # a trace shows every node of every pass


def _profile(args):
    """The profile predictions are made with: --device / --device-file, else the default."""
    if args.device or args.device_file or args.host or args.host_file:
        from einpage.cli.common import profile_from_args
        return profile_from_args(args)
    return None


def _passes(args) -> int:
    """`--passes N`: N >= 1, and more than one only where a plan runs."""
    if args.passes < 1:
        raise InputError(f"--passes must be >= 1, got {args.passes}")
    if args.passes > 1 and args.backend == "reference":
        raise InputError("--passes repeats a plan's pass; --backend reference runs no plan")
    return args.passes


def _after(args, runner, repeated: bool = False, later: str = "decode step") -> None:
    """--timing and --trace for the passes `runner` ran (on cupy, --timing first says what the
    budget holds besides the plan); `repeated`: one plan's pass run several times; `later`:
    what the passes after the first are called."""
    predicted = bool(args.device or args.device_file)
    if getattr(runner, "world", 1) > 1:  # several devices: each rank's pass, simulated together
        written = Deferred()
        if args.trace:
            from einpage.cli.trace import ranks_measured_events, trace_text
            events = trace_text(ranks_measured_events(runner.passes))
            if written.write(write_text, args.trace, events):
                print(f"wrote the measured trace of {len(runner.passes)} pass(es) of "
                      f"{runner.world} ranks to {args.trace}")
        if args.timing:
            from einpage.cli.timing import print_ranks_timing
            print_ranks_timing(runner.passes, _profile(args) if predicted else None,
                               first="pass 1" if repeated else "prefill pass",
                               later="pass" if repeated else later, offset=int(repeated))
        written.finish()
        return
    reservation = getattr(runner, "reservation", None)
    if args.timing and reservation is not None:  # cupy: what the budget holds besides the plan
        for line in reservation.lines():
            print(line)
    _show_passes(args, [(p.compiled.memgraph, p.measured,
                         p.compiled.simulation if predicted else None)
                        for p in getattr(runner, "passes", [])], repeated=repeated,
                  later=later)


def _show_passes(args, passes, first: str = "prefill pass", repeated: bool = False,
                 later: str = "decode step") -> None:
    """--trace and --timing for `passes`: (memgraph, Measured, Simulation or None) each. A
    trace that cannot be written still lets the timing print, then fails (one line)."""
    written = Deferred()
    if args.trace:
        from einpage.cli.trace import measured_events, trace_text
        events = trace_text(measured_events([(mg, m) for mg, m, _ in passes]))
        if written.write(write_text, args.trace, events):
            print(f"wrote the measured trace of {len(passes)} pass(es) to {args.trace}")
    if args.timing:
        from einpage.cli.timing import print_repeated, print_timing
        passes = _replay_priced(args, passes)
        if repeated:
            print_repeated(passes)
        else:
            print_timing(passes, first, later)
    written.finish()


def _replay_priced(args, passes):
    """`passes` with each pass replayed as one CUDA graph priced as such
    (`DeviceProfile.replayed`: the graph's launch gap per kernel instead of the host's issue),
    where the profile knows that gap; each plan simulated once."""
    if not any(m.replayed and sim is not None for _, m, sim in passes):
        return passes
    profile = _profile(args)
    if profile.graph_launch_overhead is None:
        return passes  # priced as issued: the same simulation
    profile = profile.replayed()
    sims: dict[int, object] = {}
    out = []
    for mg, m, sim in passes:
        if m.replayed and sim is not None:
            if id(mg) not in sims:
                from einpage.predict import simulate
                sims[id(mg)] = simulate(mg, profile)
            sim = sims[id(mg)]
        out.append((mg, m, sim))
    return out


def _resolve(args):
    from einpage.models import resolve
    dtype = as_dtype(args.dtype) if args.dtype else None
    if args.seed is not None and args.seed < 0:
        raise InputError(f"--seed must be >= 0, got {args.seed}")
    cfg, weights = resolve(args.model, random_weights=args.random_weights,
                           seed=args.seed if args.seed is not None else 0, dtype=dtype,
                           quantize=getattr(args, "quantize", None),
                           kv_dtype=getattr(args, "kv_dtype", None))
    if weights is None:
        raise InputError(f"{args.model}: a preset has no weights; pass --random-weights or a "
                         "checkpoint directory")
    return cfg, weights


def _checkpoint_dir(model: str) -> Path | None:
    """Where a run's tokenizer lives: the checkpoint directory or GGUF file (None for a
    preset)."""
    return Path(model) if Path(model).is_dir() or Path(model).is_file() else None


def cmd_run(args) -> None:
    """The prefill: each row's next token (from its last real position; with its text for
    text input), or the logits saved with --out."""
    if Path(args.model).is_file():
        from einpage.models.gguf import is_gguf
        if not is_gguf(args.model):  # a GGUF file is a model; any other file, a plan
            return run_plan(args)
    if args.kv_dtype:
        raise InputError("--kv-dtype is the KV store decode steps read; run is a prefill, which "
                         "reads none: use it with generate")
    if args.checkpoint:
        raise InputError("--checkpoint gives the weights of a plan file; "
                         f"{args.model} is not a plan file (its weights are its own)")
    from einpage.models.generation import prefill
    passes = _passes(args)
    cfg, weights = _resolve(args)
    given = input_from_args(args, _checkpoint_dir(args.model))
    check_context(cfg, int(given.lengths.max()))
    runner = _runner(args, weights)
    try:
        out = prefill(cfg, given.tokens, runner, given.lengths, passes=passes)
    finally:
        getattr(runner, "close", lambda: None)()
    if quiet_rank(runner):
        return
    report_logits(out["logits"], args.out, given.lengths, given.codec if given.text else None)
    _after(args, runner, repeated=passes > 1)


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


def _sampling_from_args(args):
    """`--temperature`, `--top-p`, `--top-k`, `--seed` as a `Sampling`, each checked with its
    flag's name. Sampling options with temperature 0 (greedy) are refused, not ignored; so is
    `--seed` when it seeds nothing (greedy, no --random-weights)."""
    import math
    from einpage.models.generation import Sampling
    t, p, k, seed = args.temperature, args.top_p, args.top_k, args.seed
    if not math.isfinite(t) or t < 0:
        raise InputError(f"--temperature must be a finite number >= 0 (0: greedy), got {t}")
    if p is not None and not (0 < p <= 1):  # NaN fails too
        raise InputError(f"--top-p must be in (0, 1], got {p}")
    if k is not None and k < 1:
        raise InputError(f"--top-k must be at least 1 (leave it out for no limit), got {k}")
    if seed is not None and seed < 0:
        raise InputError(f"--seed must be >= 0, got {seed}")
    if t == 0:
        given = [flag for flag, value in (("--top-p", p), ("--top-k", k)) if value is not None]
        if given:
            raise InputError(f"{' and '.join(given)} appl{'y' if len(given) > 1 else 'ies'} "
                             "to sampling only, and --temperature 0 (the default) is greedy "
                             "decoding: add --temperature T > 0")
        if seed is not None and not args.random_weights:
            raise InputError("--seed seeds --random-weights and sampling, and this run has "
                             "neither: add --temperature T > 0 to sample")
        return Sampling()
    return Sampling(t, 1.0 if p is None else p, k or 0, seed).resolved()


def cmd_generate(args, out: TextIO | None = None) -> None:
    """Generation: the prefill, then decode steps on one plan per KV bucket, each held open on
    the backend across its steps, until every row has reached its EOS (unless --ignore-eos) or
    --max-new-tokens; greedy, or sampled with --temperature. Prints each row's text (text
    input; streamed for one row on a terminal) or new ids up to its EOS, where rows stopped at
    EOS, the sampling seed, then the measured rates; `--json`: one object."""
    from einpage.errors import CheckpointError
    from einpage.models.generation import check_special, generate
    from einpage.models.text import end_of_sequence
    out = out or sys.stdout
    if args.chat is not None or args.messages is not None:
        from einpage.cli.chat import generate_chat
        return generate_chat(args, out)
    if args.system is not None:
        raise InputError("--system is the system message of --chat")
    if args.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.kv_granule < 1:
        raise InputError(f"--kv-granule must be at least 1, got {args.kv_granule}")
    sampling = _sampling_from_args(args)
    k = draft_tokens(args)
    cfg, weights = _resolve(args)
    eos = end_of_sequence(_checkpoint_dir(args.model))
    try:
        check_special(cfg, eos.ids, eos.pad_id)
    except InputError as exc:
        raise CheckpointError(f"{eos.source or args.model}: {exc}") from None
    given = input_from_args(args, _checkpoint_dir(args.model), want_codec=args.json)
    check_context(cfg, int(given.lengths.max()), args.max_new_tokens)
    draft, draft_bytes = draft_from_args(args, cfg, k, given)
    runner = _runner(args, weights, reserved=draft_bytes)
    quiet = quiet_rank(runner)
    if quiet:
        import io
        out = io.StringIO()  # rank 0 prints and saves the generation; the others compute it
    if isinstance(draft, tuple):  # a draft model: its runner on the same backend, its budget
        from einpage.models.speculative import ModelDraft
        dcfg, dweights = draft
        draft = ModelDraft(dcfg, _runner(args, dweights, budget=draft_bytes, timed=False,
                                         role=f"the draft model {dcfg.name}"), k,
                           args.kv_granule)
    printer = (TextPrinter(given.codec, given.tokens.shape[0], out)
               if given.text and not args.json else None)
    try:
        done = generate(cfg, given.tokens, args.max_new_tokens, runner,
                        granule=args.kv_granule, on_token=printer.on_token if printer else None,
                        lengths=given.lengths, eos_ids=eos.ids, ignore_eos=args.ignore_eos,
                        pad_id=eos.pad_id, temperature=sampling.temperature,
                        top_p=sampling.top_p, top_k=sampling.top_k, seed=sampling.seed,
                        draft=draft, auto_tokens=args.draft_tokens == "auto")
    finally:
        getattr(runner, "close", lambda: None)()
    new = done.tokens
    stops = not args.ignore_eos and bool(eos.ids)
    summary = {"tokens": new.tolist(), "batch": int(new.shape[0]),
               "prompt": int(given.tokens.shape[1]), "prompt_lengths": list(done.lengths),
               "new_tokens": int(new.shape[1]), "new_lengths": list(done.new_lengths),
               "finish_reason": list(done.finish),
               "eos_token_ids": list(eos.ids) if stops else [],
               "pad_token_id": (eos.pad_id if eos.pad_id is not None else eos.ids[0])
               if stops else None,
               "sampling": None if sampling.greedy else {
                   "temperature": sampling.temperature, "top_p": sampling.top_p,
                   "top_k": sampling.top_k or None, "seed": done.seed},
               "plans_compiled": getattr(runner, "plans_compiled", 0),
               "kv_capacities": list(done.capacities), "prefill_s": done.prefill_s,
               "decode_s": done.decode_s, "decode_steps": done.decode_steps, **done.rates(),
               "compile_s": getattr(runner, "compile_s", 0.0), "backend": getattr(
                   runner, "backend", "reference")}
    if done.speculation is not None:
        summary.update(done.speculation.to_json())
        if args.draft != "ngram":
            summary["draft_model"] = args.draft
            summary["draft_bytes"] = draft_bytes
    if given.codec is not None:
        summary["text"] = [given.codec.decode(row) for row in done.rows()]
    written = Deferred()  # a failed --out: the rows print as without it, then one line
    if args.out and not quiet and written.write(save_npy, args.out, new.astype(np.int64)):
        summary["out"] = args.out
    if args.json:
        print(json.dumps(summary, sort_keys=True), file=out)
    else:
        if printer is not None:
            printer.finish(summary["text"])
        elif "out" not in summary:
            for row, ids in enumerate(done.rows()):
                print(f"row {row}: " + ",".join(str(int(t)) for t in ids), file=out)
        if "out" in summary:
            print(f"saved new tokens {new.shape} to {args.out}", file=out)
        _print_stops(summary, out)
        _print_rates(summary, out)
    _after(args, runner, later="verify pass" if draft is not None else "decode step")
    written.finish()


def _print_stops(s: dict, out: TextIO) -> None:
    """Where rows stopped at EOS (nothing when every row ran to --max-new-tokens) and the
    sampling that picked the tokens (nothing for greedy): a line each."""
    if "eos" in s["finish_reason"]:
        at = [(row, n) for row, (n, why) in enumerate(zip(s["new_lengths"], s["finish_reason"]))
              if why == "eos"]
        if s["batch"] == 1:
            where = f"after {at[0][1]} new tokens"
        else:
            where = ", ".join(f"row {row} after {n}" for row, n in at) + " new tokens"
            rest = s["batch"] - len(at)
            if rest:
                where += f"; {rest} other row{'s' if rest > 1 else ''} ran to --max-new-tokens"
        pad = "" if s["batch"] == 1 else f" (padded with id {s['pad_token_id']} after it)"
        print(f"stopped at EOS {where}{pad}", file=out)
    if s["sampling"]:
        x = s["sampling"]
        extra = "".join(f", {name} {x[key]}" for name, key in (("top-p", "top_p"),
                                                              ("top-k", "top_k"))
                        if x[key] not in (None, 1.0))
        print(f"sampled at temperature {x['temperature']:g}{extra}, seed {x['seed']} (--seed "
              "repeats it)", file=out)


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
    if s.get("draft"):
        acceptance = "-" if s["acceptance"] is None else f"{s['acceptance']:.2f}"
        per_pass = "-" if s["tokens_per_pass"] is None else f"{s['tokens_per_pass']:.2f}"
        print(f"speculative: {s['draft']} drafts of {s['draft_tokens']} tokens; "
              f"{s['verify_passes']} verify passes, acceptance {acceptance}, {per_pass} tokens "
              "per row per pass", file=out or sys.stdout)


def run_plan(args) -> None:
    """`einpage run plan.json --checkpoint DIR --tokens ...`: execute a saved plan (text input:
    the prompts, padded to the longest, must have the plan's token shape)."""
    from einpage.runners import plan_weights
    fixed = [flag for flag, given in (("--gpu-mem", args.gpu_mem), ("--arena", args.arena),
                                      ("--policy", args.policy),
                                      ("--dtype", args.dtype), ("--force", args.force),
                                      ("--random-weights", args.random_weights),
                                      ("--seed", args.seed is not None),
                                      ("--quantize", args.quantize),
                                      ("--kv-dtype", args.kv_dtype)) if given]
    if fixed:
        raise InputError(f"{args.model} is a plan file: it runs with the budget, policy and "
                         f"dtype it was compiled for, on the weights of --checkpoint; drop "
                         f"{', '.join(fixed)}")
    if args.backend == "reference":
        raise InputError("--backend reference runs graphs, not plan files")
    if not args.checkpoint:
        raise InputError("running a plan file needs --checkpoint DIR (or a GGUF file) with its "
                         "weights")
    from einpage.ir.peers import load_programs
    programs, _ = load_programs(args.model)
    if programs[0].meta.get("phase") == "decode" or any(
            t.role == "cache" for mg in programs for t in mg.inputs):
        devices = " --devices N" if len(programs) > 1 else ""
        raise InputError(f"{args.model} is a decode step: it runs inside a generation, from "
                         f"the KV store a prefill fills; use einpage generate CHECKPOINT"
                         f"{devices} --max-new-tokens N (it compiles its decode plans itself)")
    if len(programs) > 1:
        from einpage.cli.ranks import run_ranks_plan
        return run_ranks_plan(args, programs)
    mg, _ = load_plan(args.model, programs[0])
    want = {t.name: t for t in mg.inputs}
    given, source = _plan_input(args, want)
    weights = plan_weights(mg, source)
    out = _run_plan_on_backend(args, mg, {"tokens": given.tokens}, weights, _passes(args))
    report_logits(out["logits"], args.out, given.lengths, given.codec if given.text else None)


def _plan_input(args, want: dict):
    """The tokens `run PLAN` was given, checked against the plan's token input, and the weight
    source of --checkpoint."""
    from einpage.models.checkpoint import Checkpoint
    given = input_from_args(args, Path(args.checkpoint))
    tokens = given.tokens
    if "tokens" not in want or tuple(want["tokens"].shape) != tuple(tokens.shape):
        shape = tuple(want["tokens"].shape) if "tokens" in want else None
        raise InputError(f"{args.model}: the plan was compiled for tokens of shape {shape}, "
                         f"got {tuple(tokens.shape)}")
    if Path(args.checkpoint).is_file():  # a GGUF file
        from einpage.models import resolve
        cfg, source = resolve(args.checkpoint)
        vocab = cfg.vocab
    else:
        source = Checkpoint(args.checkpoint)
        vocab = source.config.vocab
    if tokens.min() < 0 or tokens.max() >= vocab:
        raise InputError(f"token id out of range for a vocabulary of {vocab}")
    return given, source


def _run_plan_on_backend(args, mg, inputs, weights, passes: int = 1) -> dict:
    """A saved plan on --backend (the budget is the plan's), `passes` times in one session."""
    from einpage.runners import run_plan_passes
    outputs, measured = run_plan_passes(mg, inputs, weights, args.backend,
                                        timing=bool(args.timing or args.trace), passes=passes,
                                        graphs=not args.trace)
    sim = None
    if args.device or args.device_file:
        from einpage.predict import simulate
        sim = simulate(mg, _profile(args))
    _show_passes(args, [(mg, m, sim) for m in measured], first="pass", repeated=passes > 1)
    return outputs


HANDLERS = {"run": cmd_run, "generate": cmd_generate}
