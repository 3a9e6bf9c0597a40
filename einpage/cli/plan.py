"""`einpage compile` and `einpage inspect`: plans for a budget, and their predictions."""
from __future__ import annotations

import json
import re
import sys

from einpage.cli.common import (POLICY_HELP, add_device_args, add_host_args, add_parallel_arg,
                                add_quantize_arg, check_budget, host_budget, host_options,
                                load_plan, profile_from_args, write_text)
from einpage.cli.outputs import Deferred, OutputPath
from einpage.cli.report import print_report
from einpage.errors import EinpageError, InputError
from einpage.ir.dtypes import as_dtype
from einpage.units import format_size, parse_seconds, parse_size

#: tokens per row of a prefill, and the position of a decode step, unless told
DEFAULT_SEQ = 2048


def add_commands(sub) -> None:
    c = sub.add_parser("compile", help="compile a model for a device budget (no weights, no GPU)")
    c.add_argument("model", help="preset name or checkpoint directory")
    c.add_argument("--gpu-mem", required=True,
                   help="device budget: 16GB (10^9), 16GiB (2^30), ...; at most the --device's "
                        "memory unless --force")
    c.add_argument("--force", action="store_true",
                   help="plan for a --gpu-mem above the --device's memory (a warning, not an "
                        "error)")
    c.add_argument("--batch", type=int, default=1, help="rows per pass (default 1)")
    c.add_argument("--seq", type=int, help=f"prefill: tokens per row (default {DEFAULT_SEQ}); "
                                           "a decode step takes --past instead")
    c.add_argument("--phase", choices=["prefill", "decode"], default="prefill",
                   help="prefill (the prompt; default) or decode (one step of a generation)")
    c.add_argument("--past", type=int, help="decode: the step's position, i.e. the rows already "
                                            f"in the KV store (default {DEFAULT_SEQ}: the step "
                                            "after the default prefill)")
    c.add_argument("--capacity", type=int, help="decode: slots of the KV store the plan reads "
                                                "(default: the bucket that holds --past + 1)")
    c.add_argument("--max-new-tokens", type=int,
                   help="report the whole generation: the prefill of --seq tokens, then the "
                        "decode steps, one plan per KV bucket")
    c.add_argument("--concurrent",
                   help="with --max-new-tokens: a served load (einpage serve), for each count "
                        "of concurrent requests (1,8,32,64): requests that join together are "
                        "prefilled together, then decoded in one batch; aggregate and "
                        "per-request tokens/s, time to first token")
    c.add_argument("--draft",
                   help="decode: forecast speculative decoding (verify passes of 1..8 "
                        "proposals, or --draft-tokens K) against the plain step, and pick k: "
                        "'ngram' (prompt lookup, free) or a draft model (a preset or "
                        "checkpoint of the same vocabulary, its steps priced too)")
    c.add_argument("--draft-gpu-mem",
                   help="with a draft model: its part of --gpu-mem (default 1.25x its weights "
                        "and KV store); the model plans for the rest")
    c.add_argument("--draft-tokens", type=int,
                   help="with --draft: forecast this k only (default: 1 to 8)")
    c.add_argument("--acceptance", type=float,
                   help="with --draft: the chance each proposal is accepted (default 0.7)")
    c.add_argument("--dtype", choices=["f16", "bf16", "f32"],
                   help="dtype of the weights and activations the plan holds (default: the "
                        "model's; a bf16 checkpoint is planned in f32, as run computes it)")
    add_quantize_arg(c)
    c.add_argument("--policy", default="reuse-distance", help=POLICY_HELP)
    c.add_argument("--block-bytes", help="target working set of one task (default: budget/8)")
    c.add_argument("--lookahead", help="how far prefetch runs ahead of execution: bytes (2GB), "
                                       "predicted compute (30ms, 0.5s), or auto (search the "
                                       "window of least simulated makespan); default: as far "
                                       "as memory allows")
    c.add_argument("-o", "--output", action=OutputPath,
                   help="write the plan (JSON memgraph) here; a name ending in .gz is written "
                        "gzip-compressed (every reader takes both)")
    c.add_argument("--json", action="store_true", help="print the report as one JSON object")
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    c.add_argument("--trace", action=OutputPath,
                   help="write the predicted pass as a Chrome trace (Perfetto)")
    add_host_args(c)
    add_device_args(c)
    c.add_argument("--host-compute", choices=("auto", "off"), default="auto",
                   help="auto (default): place applies on the host where the simulated pass is "
                        "faster (a decode step's attention over a KV store in host memory, "
                        "experts whose weights stay there); off: every apply on the device")
    c.add_argument("--devices", type=int, default=1,
                   help="plan for this many devices of --gpu-mem each: consecutive layers per "
                        "device (pipeline parallelism), run by `einpage run` or "
                        "`mpiexec -n N einpage run`")
    add_parallel_arg(c)
    c.add_argument("--micro-batches", default="1",
                   help="with --devices: split --batch into this many passes that follow each "
                        "other through the devices (default 1), or auto: the count (a divisor "
                        "of --batch, at most 8) of the least predicted time")
    c.add_argument("--peer-link", default="pcie",
                   help="with --devices: the link between devices: pcie (a peer copy at the "
                        "host link's rate; default), nvlink, net-100g, net-400g, or a rate "
                        "(25GB/s)")
    c.add_argument("--group-link",
                   help="with --parallel hybrid (or auto): the link among the devices of one "
                        "tensor-parallel group (one machine's GPUs: nvlink), where --peer-link "
                        "joins the groups (net-100g); default: --peer-link")
    i = sub.add_parser("inspect", help="report on a saved plan (validated and simulated)")
    i.add_argument("plan", help="a plan file (einpage compile -o)")
    i.add_argument("--json", action="store_true", help="print the report as one JSON object")
    i.add_argument("--dot", action=OutputPath,
                   help="write the memgraph as Graphviz dot (small plans)")
    i.add_argument("--trace", action=OutputPath,
                   help="write the predicted pass as a Chrome trace (Perfetto)")
    add_device_args(i)



def lookahead_options(text: str | None) -> dict:
    """`--lookahead`: bytes, seconds of predicted compute, or auto."""
    if text is None:
        return {}
    if text.strip().lower() == "auto":
        return {"auto_lookahead": True}
    if re.fullmatch(r"\s*[0-9.eE+-]+\s*(us|ms|s)\s*", text):
        return {"lookahead_seconds": parse_seconds(text, "--lookahead")}
    try:
        return {"lookahead_bytes": parse_size(text, "--lookahead")}
    except EinpageError:
        raise InputError(f"bad --lookahead {text!r}: use bytes (2GB), predicted compute "
                         "(30ms, 0.5s) or auto") from None


def graph_from_args(args):
    """(config, bound graph, checkpoint sources, tokens per pass, workload) of the plan asked
    for."""
    from einpage.models import llama, resolve, schema
    from einpage.models.kvstore import capacity_for
    cfg, checkpoint = resolve(args.model, dtype=as_dtype(args.dtype) if args.dtype else None,
                              quantize=args.quantize, kv_dtype=args.kv_dtype)
    seq = DEFAULT_SEQ if args.seq is None else args.seq
    for name, value in (("--batch", args.batch), ("--seq", seq)):
        if value < 1:
            raise InputError(f"{name} must be at least 1, got {value}")
    workload = {"model": cfg.name, "phase": args.phase, "batch": args.batch,
                "dtype": cfg.dtype.value}
    if args.quantize:
        workload["quantize"] = args.quantize
    if args.kv_dtype:
        workload["kv_dtype"] = args.kv_dtype
    if args.phase == "prefill":
        if args.past is not None or args.capacity is not None:
            raise InputError("--past and --capacity describe a decode step: add --phase decode")
        if args.kv_dtype:
            raise InputError("--kv-dtype is the KV store a decode step reads; a prefill reads "
                             "none: add --phase decode (or --max-new-tokens)")
        graph = llama.prefill_graph(cfg).bind(B=args.batch, S=seq)
        tokens = args.batch * seq
        workload.update(seq=seq, tokens=tokens)
    else:
        if args.seq is not None:
            raise InputError("--seq is the prompt of a prefill; a decode step reads --past rows "
                             f"of the KV store (default {DEFAULT_SEQ}): drop --seq, give --past")
        past = DEFAULT_SEQ if args.past is None else args.past
        if past < 0:
            raise InputError(f"--past must be non-negative, got {past}")
        ring = cfg.kv_ring  # every layer windowed: the store holds the window's rows only
        capacity = capacity_for(past + 1) if args.capacity is None else args.capacity
        capacity = min(capacity, ring) if ring else capacity
        if capacity < past + 1 and not (ring and capacity == ring):
            raise InputError(f"--capacity {capacity} cannot hold position {past}: the step "
                             f"writes its row there (at least {past + 1})")
        graph = llama.decode_graph(cfg).bind(B=args.batch, C=capacity)
        tokens = args.batch
        workload.update(seq=1, past=past, capacity=capacity, tokens=tokens)
    sources = {name: schema.hf_tensor(name) for name in schema.weight_shapes(cfg)}
    files = getattr(checkpoint, "checkpoint", None)  # a safetensors checkpoint (not GGUF)
    if files is not None:  # the dtype its files hold: `run plan --checkpoint` checks it
        stored = {files.tensors[hf].dtype.value for hf in sources.values()
                  if hf in files.tensors}  # (an AWQ/GPTQ projection has no `weight`)
        if len(stored) == 1:
            workload["weights_dtype"] = stored.pop()
    return cfg, graph, sources, tokens, workload


def cmd_compile(args) -> None:
    from einpage.cli.progress import Progress
    from einpage.compiler import CompileOptions, compile_graph
    profile = profile_from_args(args)
    device_bytes = parse_size(args.gpu_mem, "--gpu-mem")
    over = check_budget(device_bytes, profile, args.force)
    if args.devices != 1 or args.micro_batches != "1" or args.parallel != "pipeline":
        from einpage.cli.ranks import compile_ranks
        return compile_ranks(args, profile, device_bytes, over)
    for flag, given in (("--peer-link", args.peer_link != "pcie"),
                        ("--group-link", args.group_link is not None)):
        if given:
            raise InputError(f"{flag} is the link between devices: add --devices N")
    if args.max_new_tokens is not None:
        if over:
            print(f"einpage: warning: {over}", file=sys.stderr)
        return _generation_report(args, profile, device_bytes)
    if args.concurrent is not None:
        raise InputError("--concurrent forecasts a served load: add --max-new-tokens N")
    if args.draft is not None:
        return speculation_report(args, profile, device_bytes, over)
    for flag, value in (("--draft-tokens", args.draft_tokens),
                        ("--acceptance", args.acceptance),
                        ("--draft-gpu-mem", args.draft_gpu_mem)):
        if value is not None:
            raise InputError(f"{flag} is an option of --draft: add --draft ngram (or a draft "
                             "model)")
    cfg, graph, sources, tokens, workload = graph_from_args(args)
    progress = Progress(enabled=False if args.quiet else None)
    host_bytes, host_source = host_budget(args)
    options = CompileOptions(
        device_bytes=device_bytes, policy=args.policy, device=profile,
        block_bytes=parse_size(args.block_bytes, "--block-bytes") if args.block_bytes else None,
        sources=sources, workload={**workload, "host_budget": host_source},
        progress=progress, host_bytes=host_bytes, **host_options(args),
        **lookahead_options(args.lookahead))
    try:
        compiled = compile_graph(graph, options)
    finally:
        progress.close()
    report = compiled.report
    if over:
        report = report.with_notes(warning=over)
    report, written = _write_outputs(args, compiled.memgraph, compiled.simulation, report,
                                     plan=args.output)
    _show(report, args.json)
    written.finish()  # a failed output: the report above, then one line and exit 2


def speculation_report(args, profile, device_bytes: int, over: str | None,
                        devices: int = 1) -> None:
    """`compile --phase decode --draft ngram`: the plain decode step and verify passes of
    k = 1..8 proposals (or --draft-tokens), predicted, at --acceptance; the k it picks. On
    `devices` > 1 (`--devices N`) every step is planned for them, spread as --parallel says."""
    from einpage.compiler import CompileOptions
    from einpage.forecast import forecast_speculation, search_draft_split
    if args.phase != "decode":
        raise InputError("--draft forecasts decode steps: add --phase decode")
    for flag, value in (("-o", args.output), ("--plot", args.plot), ("--trace", args.trace)):
        if value:
            raise InputError(f"{flag} writes one plan: --draft compiles several (drop --draft "
                             "to write the plain step's)")
    if args.draft_tokens is not None and not 1 <= args.draft_tokens <= 64:
        raise InputError(f"--draft-tokens must be between 1 and 64, got {args.draft_tokens}")
    acceptance = 0.7 if args.acceptance is None else args.acceptance
    ks = (args.draft_tokens,) if args.draft_tokens is not None else tuple(range(1, 9))
    cfg, _, _, _, workload = graph_from_args(args)
    draft, draft_bytes = None, 0
    if args.draft != "ngram":
        from einpage.models import resolve
        from einpage.models.speculative import check_vocabulary
        draft, _ = resolve(args.draft, dtype=as_dtype(args.dtype) if args.dtype else None)
        check_vocabulary(draft, cfg, args.draft, args.model)
        if args.draft_gpu_mem:  # else searched below
            draft_bytes = parse_size(args.draft_gpu_mem, "--draft-gpu-mem")
    elif args.draft_gpu_mem is not None:
        raise InputError("--draft-gpu-mem is the budget of a draft model; ngram has none")
    host_bytes, _ = host_budget(args)
    options = CompileOptions(
        device_bytes=device_bytes, policy=args.policy, device=profile, host_bytes=host_bytes,
        **host_options(args),
        block_bytes=parse_size(args.block_bytes, "--block-bytes") if args.block_bytes else None,
        **lookahead_options(args.lookahead))
    tried = []
    spread = {"devices": devices, "parallel": getattr(args, "parallel", "pipeline")}
    if draft is not None and args.draft_gpu_mem is None:  # the split by simulated step time
        f, tried = search_draft_split(cfg, args.batch, workload["capacity"], acceptance, ks,
                                      options, {"past": workload["past"]}, draft, **spread)
        draft_bytes = f.draft_bytes  # (a smaller share that won was tried at its k only)
    else:
        f = forecast_speculation(cfg, args.batch, workload["capacity"], acceptance, ks,
                                 options, {"past": workload["past"]}, draft, draft_bytes,
                                 **spread)
    if over:
        print(f"einpage: warning: {over}", file=sys.stderr)
    if args.json:
        out = f.to_json()
        if tried:
            out["draft_splits"] = [{"draft_bytes": b, "tokens_per_s": r} for b, r in tried]
        print(json.dumps(out, sort_keys=True))
        return
    plain = f.plain.seconds
    each = " each" if devices > 1 else ""
    what = ("ngram drafts (no draft pass)" if draft is None else
            f"draft model {draft.name} ({format_size(draft_bytes)} of the budget{each}, the "
            f"model the rest)")
    where = "" if devices == 1 else f" on {devices} devices ({f.parallel} parallel),"
    print(f"einpage speculative decoding: {cfg.name} decode, batch {f.batch}, position "
          f"{workload['past']} (KV store of {f.capacity} slots), {cfg.dtype.value},{where} "
          f"budget {format_size(device_bytes)}{each}; {what}, acceptance {f.acceptance:.2f} per "
          "proposal  (GB = 10^9 bytes)")
    print(f"  predicted on {profile.name}: plain decode step {_s(plain)} "
          f"({f.plain_tokens_per_s:.3g} tokens/s), {format_size(f.plain.h2d_bytes)} "
          "host->device")
    if draft is not None:
        print(f"  draft step {_s(f.draft_step_s)} "
              f"({format_size(f.draft.h2d_bytes)} host->device); a pass is k + 1 "
              "draft steps, then the verify pass")
    print("  k | pass | tokens per pass | tokens/s | vs plain")
    for v in f.verify:
        rate = f.tokens_per_s(v)
        print(f"  {v.k} | {_s(f.pass_s(v))} | {v.tokens_per_pass:.2f} | {rate:.3g} | "
              f"{rate / f.plain_tokens_per_s:.2f}x")
    if len(tried) > 1:
        print("  draft share of the budget, by simulated step time: " + ", ".join(
            f"{format_size(b)} {r:.3g} tokens/s" for b, r in tried)
              + f"; keeps {format_size(f.draft_bytes)}")
    best = f.best
    split = f" --draft-gpu-mem {f.draft_bytes}" if draft is not None else ""
    if devices > 1:
        split += f" --devices {devices} --parallel {f.parallel}"
    print(f"  picks k = {best.k}: {f.tokens_per_s(best):.3g} tokens/s, "
          f"{f.tokens_per_s(best) / f.plain_tokens_per_s:.2f}x plain decode (einpage generate "
          f"--draft {args.draft} --draft-tokens {best.k}{split})")


def _generation_report(args, profile, device_bytes: int) -> None:
    """`compile --max-new-tokens N`: the prefill of --seq tokens and every decode bucket,
    predicted."""
    from einpage.compiler import CompileOptions
    from einpage.forecast import forecast_generation
    from einpage.models import resolve
    if args.phase != "prefill" or args.past is not None or args.capacity is not None:
        raise InputError("--max-new-tokens reports a whole generation from a prompt of --seq "
                         "tokens: drop --phase decode, --past and --capacity")
    if args.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    for flag, value in (("-o", args.output), ("--plot", args.plot), ("--trace", args.trace)):
        if value:
            raise InputError(f"{flag} writes one plan: compile --phase prefill or --phase "
                             "decode for it (--max-new-tokens compiles several)")
    cfg, _ = resolve(args.model, dtype=as_dtype(args.dtype) if args.dtype else None,
                     quantize=args.quantize, kv_dtype=args.kv_dtype)
    host_bytes, _ = host_budget(args)
    options = CompileOptions(
        device_bytes=device_bytes, policy=args.policy, device=profile, host_bytes=host_bytes,
        **host_options(args),
        block_bytes=parse_size(args.block_bytes, "--block-bytes") if args.block_bytes else None,
        **lookahead_options(args.lookahead))
    seq = DEFAULT_SEQ if args.seq is None else args.seq
    if args.concurrent is not None:
        return _served_load(args, cfg, seq, options, profile, device_bytes)
    f = forecast_generation(cfg, args.batch, seq, args.max_new_tokens, options)
    if args.json:
        print(json.dumps(f.to_json(), sort_keys=True))
        return
    print(f"einpage generation: {cfg.name} batch={f.batch} prompt={f.prompt} "
          f"new tokens={f.new_tokens} {cfg.dtype.value} policy={args.policy} budget "
          f"{format_size(device_bytes)}  (sizes in GB = 10^9 bytes)")
    print(f"  predicted on {profile.name}: {_s(f.total_s)} in all, {f.tokens_per_s:.3g} "
          f"generated tokens/s; {f.plans} plans (1 prefill, {len(f.buckets)} decode)")
    print(f"  prefill: {_s(f.prefill_s)} ({f.batch * f.prompt / f.prefill_s:.4g} tokens/s)"
          if f.prefill_s > 0 else "  prefill: 0 s")
    for b in f.buckets:
        c = b.compiled.report.compiled
        print(f"  decode, KV capacity {b.capacity}: {b.steps} steps of {_s(b.step_s)}; "
              f"{format_size(b.step_bytes)} moved per step (at least "
              f"{format_size(c.min_stream_bytes)}); KV {format_size(c.kv_bytes)}, "
              f"{format_size(c.kv_resident_bytes)} resident; efficiency {b.efficiency:.3f}")


def _served_load(args, cfg, seq: int, options, profile, device_bytes: int) -> None:
    """`--concurrent 1,8,...`: each count c of requests as one cohort of a served load (the
    server prefills the requests that join together, then decodes them in one batch): a
    generation of batch c, its tokens/s over all requests and per request."""
    from einpage.forecast import forecast_generation
    try:
        counts = [int(v) for v in args.concurrent.split(",")]
    except ValueError:
        raise InputError(f"--concurrent {args.concurrent!r}: counts such as 1,8,32,64") from None
    if not counts or min(counts) < 1:
        raise InputError(f"--concurrent {args.concurrent!r}: every count at least 1")
    if args.batch != 1:
        raise InputError("--concurrent sets the batch: drop --batch")
    rows = []
    for c in counts:
        f = forecast_generation(cfg, c, seq, args.max_new_tokens, options)
        rows.append({"concurrent": c, "tokens_per_s": f.tokens_per_s,
                     "per_request_tokens_per_s": f.tokens_per_s / c, "first_token_s": f.prefill_s,
                     "decode_tokens_per_s": f.decode_tokens_per_s, "total_s": f.total_s,
                     "step_s": [b.step_s for b in f.buckets]})
    if args.json:
        print(json.dumps({"model": cfg.name, "prompt": seq, "new_tokens": args.max_new_tokens,
                          "device": profile.name, "device_bytes": device_bytes,
                          "loads": rows}, sort_keys=True))
        return
    print(f"einpage served load: {cfg.name}, prompts of {seq} tokens, {args.max_new_tokens} new "
          f"tokens a request, budget {format_size(device_bytes)}, predicted on {profile.name}")
    print(f"  {'requests':>8}  {'tokens/s':>10}  {'per request':>11}  {'first token':>11}  "
          f"{'all done':>10}")
    for r in rows:
        print(f"  {r['concurrent']:>8}  {r['tokens_per_s']:>10.2f}  "
              f"{r['per_request_tokens_per_s']:>11.3f}  {_s(r['first_token_s']):>11}  "
              f"{_s(r['total_s']):>10}")


def _s(seconds: float) -> str:
    return f"{seconds:.3f} s" if seconds >= 0.01 else f"{seconds * 1e3:.3f} ms"


def cmd_inspect(args) -> None:
    from einpage.compiler import PlanReport
    from einpage.ir.peers import load_programs
    from einpage.predict import PROFILES, simulate
    programs, meta = load_programs(args.plan)
    if len(programs) > 1:
        from einpage.cli.ranks import inspect_ranks
        return inspect_ranks(args, programs, meta)
    mg, valid = load_plan(args.plan, programs[0])
    saved = mg.meta.get("device")  # the plan's profile, when it is a registered one
    profile = profile_from_args(args, default=saved if saved in PROFILES else None)
    sim = simulate(mg, profile)
    report = PlanReport.of_plan(mg, valid, sim, profile=profile)
    report, written = _write_outputs(args, mg, sim, report)
    _show(report, args.json, source=args.plan)
    written.finish()


def _write_outputs(args, mg, sim, report, plan: str | None = None):
    """The files asked for, most costly to make again first: the plan (`-o`), the predicted
    trace, the dot graph, the timeline plot. Each is written whole or not at all; a failed one
    does not stop the others. Returns the report noting each file written, and the `Deferred`
    whose `finish()` raises the first failure (after the report is shown)."""
    written = Deferred()
    if plan and written.write(mg.save, plan):
        report = report.with_notes(plan=plan)
    if getattr(args, "trace", None):
        from einpage.cli.trace import predicted_events, trace_text
        if written.write(lambda: write_text(args.trace, trace_text(predicted_events(mg, sim)))):
            report = report.with_notes(trace=args.trace)
    if getattr(args, "dot", None):
        from einpage.cli.dot import to_dot
        if written.write(lambda: write_text(args.dot, to_dot(mg))):
            report = report.with_notes(dot=args.dot)
    if getattr(args, "plot", None):
        from einpage.cli.plot import plot_timeline
        if written.write(plot_timeline, mg, sim, args.plot):
            report = report.with_notes(plot=args.plot)
    return report, written


def _show(report, as_json: bool, source: str | None = None) -> None:
    if as_json:
        print(json.dumps(report.to_json(), sort_keys=True))
    else:
        print_report(report, source)


HANDLERS = {"compile": cmd_compile, "inspect": cmd_inspect}
