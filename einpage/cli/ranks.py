"""Several devices on the command line (pipeline parallelism, `einpage.compiler.pipeline`):
`compile --devices N` (its report, every rank's program in one file with `-o`), `inspect` of
that file, `run` of it (every rank here, or this process's under mpiexec), and the runner that
`run` and `generate` with `--devices N` compile and run through."""
from __future__ import annotations

import json
import sys
import time
from argparse import Namespace
from dataclasses import replace

from einpage.cli.common import host_options
from einpage.cli.outputs import Deferred
from einpage.errors import EinpageError, InputError
from einpage.units import format_size, parse_rate, parse_size


def peer_profile(profile, link: str, group_link: str | None = None):
    """`profile` with the device-to-device link `--peer-link` names (a preset or a rate) and,
    where given, the link among the devices of a tensor-parallel group (`--group-link`)."""
    profile = replace(profile, peer_bandwidth=_link(link, "--peer-link"))
    if group_link is not None:
        profile = replace(profile, group_bandwidth=_link(group_link, "--group-link"))
    return profile


def _link(text: str, flag: str) -> float | None:
    from einpage.predict.devices import PEER_LINKS
    if text in PEER_LINKS:
        return PEER_LINKS[text]
    try:
        return parse_rate(text, flag, "B")
    except InputError:
        raise InputError(f"{flag} {text!r}: use one of {', '.join(PEER_LINKS)} or a rate such "
                         "as 25GB/s") from None


def compile_ranks(args, profile, device_bytes: int, over: str | None) -> None:
    from einpage.cli.plan import graph_from_args
    from einpage.compiler import CompileOptions
    from einpage.compiler.parallel import compile_parallel
    from einpage.compiler.pipeline import ranks_report
    from einpage.ir.peers import save_programs
    devices = args.devices
    if devices < 2:
        raise InputError(f"--devices must be at least 2 for several devices (got {devices}); "
                         "--micro-batches and --parallel need it")
    counts = micro_batch_counts(args.micro_batches, args.batch)
    if args.parallel == "tensor" and counts != [1]:
        raise InputError("--micro-batches pipelines a batch through the devices; tensor "
                         "parallelism runs it whole (drop it, or --parallel pipeline, hybrid "
                         "or auto)")
    for flag, value in (("--lookahead", args.lookahead),
                        ("--block-bytes", args.block_bytes), ("--plot", args.plot),
                        ("--max-new-tokens", args.max_new_tokens)):
        if value:
            raise InputError(f"{flag} is an option of a plan for one device; drop it with "
                             "--devices")
    if args.group_link is not None and args.parallel not in ("hybrid", "auto"):
        raise InputError("--group-link is the link within a tensor-parallel group of a "
                         "pipeline of them: add --parallel hybrid (or auto)")
    profile = peer_profile(profile, args.peer_link, args.group_link)
    if args.draft is not None:
        if counts != [1]:
            raise InputError("--draft forecasts generation steps, each run whole on the "
                             "devices: drop --micro-batches")
        from einpage.cli.plan import speculation_report
        return speculation_report(args, profile, device_bytes, over, devices)
    from einpage.cli.common import host_budget
    host_bytes, host_source = host_budget(args)
    tried, refused = [], None
    for m in counts:  # each count its own graph (B / m rows a pass) and pipeline
        micro = Namespace(**{**vars(args), "batch": args.batch // m})
        cfg, graph, sources, tokens, workload = graph_from_args(micro)
        workload = {**workload, "batch": args.batch, "micro_batches": m, "devices": devices,
                    "host_budget": host_source}
        options = CompileOptions(device_bytes=device_bytes, policy=args.policy,
                                 device=profile, sources=sources, workload=workload,
                                 host_bytes=host_bytes, **host_options(args))
        kinds = [args.parallel] if args.parallel != "auto" else (
            ["pipeline", "tensor", "hybrid"] if m == 1 else ["pipeline", "hybrid"])
        for kind in kinds:
            t0 = time.perf_counter()
            try:
                plan = compile_parallel(graph, devices, options, kind)
            except EinpageError as exc:
                if args.parallel != "auto":
                    raise
                refused = refused or exc  # a kind this graph cannot take: the others
                continue
            kept = {**workload, "parallel": kind}
            if kind == "hybrid":
                kept["group"] = plan.split.group
            report = ranks_report(plan, profile, m, time.perf_counter() - t0, tokens * m,
                                  tuple(kept.items()))
            tried.append((report.makespan_s, m, plan, report, kept))
    if not tried:
        raise refused
    _, m, pipeline, report, workload = min(tried, key=lambda t: (t[0], t[1]))
    notes = []
    if len(tried) > 1:
        notes.append("tried: " + ", ".join(
            f"{_short(w)} x {k}: {_ms(t)}" for t, k, _, _, w in tried)
            + f"; kept {_short(workload)} x {m}")
    if over:
        notes.append(f"warning: {over}")
    written = Deferred()
    if args.output and written.write(
            save_programs, pipeline.programs, args.output,
            {**workload, "cut": list(getattr(pipeline.split, "cut", ())),
             "stages": pipeline.split.stages, "host_compute": pipeline.host_compute,
             "peer_bandwidth": profile.peer_bandwidth,
             "group_bandwidth": profile.group_bandwidth}):
        notes.append(f"plan: {args.output} ({devices} programs, one per rank)")
    if args.trace and written.write(write_ranks_trace, args.trace, pipeline.programs, profile, m):
        notes.append(f"trace: {args.trace} (the ranks simulated together, one process each)")
    if args.json:
        print(json.dumps({**report.to_json(), "notes": notes}, sort_keys=True))
    else:
        print_ranks(report, cfg.name, workload, notes)
    written.finish()


def write_ranks_trace(path: str, programs, profile, micro_batches: int) -> None:
    """The predicted trace of `programs`: their joint simulation on `profile`, `micro_batches`
    passes of each rank."""
    from einpage.cli.common import write_text
    from einpage.cli.trace import ranks_predicted_events, trace_text
    from einpage.predict.simulator import simulate_ranks
    sim = simulate_ranks(programs, [profile] * len(programs), micro_batches)
    write_text(path, trace_text(ranks_predicted_events(programs, sim)))


def inspect_ranks(args, programs, meta) -> None:
    """`einpage inspect` of a file of several programs: validated together, simulated together
    on the profile (the file's, unless --device), the report as `compile --devices` prints it."""
    from einpage.compiler.pipeline import programs_report
    from einpage.ir.peers import validate_ranks
    from einpage.predict import PROFILES
    from einpage.cli.common import profile_from_args
    for flag in ("dot", "plot"):
        if getattr(args, flag, None):
            raise InputError(f"--{flag} shows one plan; {args.plan} holds {len(programs)}")
    validate_ranks(programs)
    saved = programs[0].meta.get("device")
    profile = profile_from_args(args, default=saved if saved in PROFILES else None)
    for link in ("peer_bandwidth", "group_bandwidth"):
        if meta.get(link) is not None:
            profile = replace(profile, **{link: float(meta[link])})
    bounds = (0, *meta.get("cut", ()), int(meta.get("stages", 0)))
    group = int(meta.get("group") or 1)  # ranks per tensor-parallel group of a hybrid plan
    if meta.get("parallel") == "tensor":  # every rank runs every stage
        stages = [(0, int(meta.get("stages", 0)) - 1)] * len(programs)
    elif len(bounds) * group == len(programs) + group:  # a group per stage (of 1: a pipeline)
        stages = [(bounds[r // group], bounds[r // group + 1] - 1) for r in range(len(programs))]
    else:
        stages = [(0, -1)] * len(programs)
    m = int(meta.get("micro_batches", 1))
    tokens = meta.get("tokens")
    report = programs_report(programs, profile, m, stages, bool(meta.get("host_compute", True)),
                             tokens=int(tokens) * m if tokens else None)
    workload = {k: v for k, v in meta.items()
                if k in ("model", "phase", "batch", "parallel", "group")}
    notes = [f"plan: {args.plan} ({len(programs)} programs, validated together)"]
    written = Deferred()
    if args.trace and written.write(write_ranks_trace, args.trace, programs, profile, m):
        notes.append(f"trace: {args.trace} (the ranks simulated together, one process each)")
    if args.json:
        print(json.dumps({**report.to_json(), **workload, "plan": args.plan, "notes": notes},
                         sort_keys=True))
    else:
        print_ranks(report, str(meta.get("model", args.plan)),
                    {"phase": meta.get("phase", "?"), "batch": meta.get("batch", "?"),
                     "parallel": meta.get("parallel", "pipeline"), "group": meta.get("group")},
                    notes)
    written.finish()


def micro_batch_counts(text: str, batch: int) -> list[int]:
    """`--micro-batches`: one count that divides the batch, or `auto`: every divisor of the
    batch up to 8."""
    if text == "auto":
        return [m for m in range(1, min(batch, 8) + 1) if batch % m == 0]
    try:
        m = int(text)
    except ValueError:
        raise InputError(f"--micro-batches {text!r}: a count or auto") from None
    if m < 1 or batch % m:
        raise InputError(f"--micro-batches {m} must divide --batch {batch}")
    return [m]


def print_ranks(r, model: str, workload: dict, notes: list[str], out=None) -> None:
    out = out or sys.stdout  # looked up at the call: a test's capture replaces it
    link = format_size(r.peer_bandwidth) + "/s"
    if r.group_bandwidth is not None and workload.get("parallel") == "hybrid":
        link += f", within a group {format_size(r.group_bandwidth)}/s"
    print(f"{model} {workload['phase']} batch {workload['batch']} on {len(r.ranks)} x "
          f"{format_size(r.device_bytes)} {r.device} (peer link {link}), {_kind(workload)}, "
          f"{r.micro_batches} micro-batch{'es' if r.micro_batches > 1 else ''}", file=out)
    print(f"{'rank':>4}  {'stages':>7}  {'weights':>9}  {'resident':>9}  {'streamed':>9}  "
          f"{'least':>9}  {'sent':>9}  {'pass':>9}  {'bound':>9}", file=out)
    for f in r.ranks:
        print(f"{f.rank:>4}  {f'{f.stages[0]}-{f.stages[1]}':>7}  "
              f"{format_size(f.weight_bytes):>9}  {format_size(f.resident_bytes):>9}  "
              f"{format_size(f.streamed_bytes):>9}  {format_size(f.min_stream_bytes):>9}  "
              f"{format_size(f.sent_bytes):>9}  {_ms(f.pass_s):>9}  {_ms(f.bound_s):>9}",
              file=out)
    rate = f", {r.tokens / r.makespan_s:,.1f} tokens/s" if r.tokens else ""
    compiled = f"; compiled in {r.compile_seconds:.1f} s" if r.compile_seconds else ""
    print(f"predicted: {_ms(r.makespan_s)} for the batch{rate}; bubble {r.bubble:.2f}; bound "
          f"{_ms(r.bound_s)}, efficiency {r.efficiency:.3f}{compiled}", file=out)
    for note in notes:
        print(note, file=out)


def _short(workload: dict) -> str:
    """How a plan spreads the model, in a word (a hybrid's stages x group)."""
    if workload["parallel"] == "hybrid":
        g = workload["group"]
        return f"hybrid {workload['devices'] // g}x{g}"
    return workload["parallel"]


def _kind(workload: dict) -> str:
    """How a plan spreads the model, in words."""
    kind = workload.get("parallel", "pipeline")
    if kind == "hybrid":
        return f"pipeline of tensor-parallel groups of {workload.get('group', '?')}"
    return f"{kind} parallel"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 10 else f"{seconds:.2f} s"


def ranks_runner(args, weights, budget: int | None = None, timed: bool = True,
                 role: str | None = None):
    """`--devices N`: plans for N devices, every rank here or this process's under mpiexec;
    `budget`: each device's bytes for these plans (default --gpu-mem: a draft model's runner
    and the model's take their shares of it); `timed` False: --timing does not keep its passes."""
    from einpage import runners
    from einpage.cli.execute import _profile
    from einpage.compiler import CompileOptions
    from einpage.runtime.comm import MpiCommunicator, mpi_world
    devices = args.devices
    if devices < 1:
        raise InputError(f"--devices must be at least 1, got {devices}")
    parallel = getattr(args, "parallel", "pipeline")
    if parallel != "pipeline" and devices < 2:
        raise InputError(f"--parallel {parallel} spreads a model over several devices: add "
                         "--devices 2 or more")
    if not args.gpu_mem:
        raise InputError("--devices N needs --gpu-mem: the budget of each device"
                         + (" (an --arena is a plan's for one device)" if args.arena else ""))
    if args.backend not in ("auto", "threads", "cupy"):
        raise InputError(f"--backend {args.backend}: plans for several devices run on threads "
                         "or cupy")
    rank, size = mpi_world()
    comm = None
    if size > 1:
        if size != devices:
            raise InputError(f"--devices {devices} but mpiexec started {size} processes")
        comm = MpiCommunicator()
    host_bytes = ranks_host_budget(args, comm)
    options = CompileOptions(device_bytes=budget or parse_size(args.gpu_mem, "--gpu-mem"),
                             policy=args.policy or "reuse-distance", device=_profile(args),
                             host_bytes=host_bytes, **host_options(args))
    return runners.RanksRunner(weights, options, devices, args.backend, comm=comm,
                               parallel=getattr(args, "parallel", "pipeline"),
                               timing=timed and _measures(args), role=role)


def ranks_host_budget(args, comm=None) -> int | None:
    """Each rank's host budget: --cpu-mem, or under mpiexec this machine's measured memory
    shared by its processes, rank 0's measure agreed by all where `comm` is given (the same
    plans on every rank)."""
    from einpage.cli.common import host_budget
    from einpage.runtime.comm import mpi_world
    host_bytes, _ = host_budget(args)
    size = mpi_world()[1]
    if size > 1 and getattr(args, "cpu_mem", None) is None and host_bytes is not None:
        host_bytes //= size
        if comm is not None:
            from einpage.runtime.ranks import agree
            host_bytes = agree(comm, host_bytes)
    return host_bytes


def _measures(args) -> str | None:
    """The flag that has a run on several devices keep each rank's passes, if any."""
    return next((flag for flag in ("--timing", "--trace") if getattr(args, flag[2:], None)),
                None)


def quiet_rank(runner) -> bool:
    """Under mpiexec, every rank but 0 runs quietly (each rank picks the same tokens)."""
    comm = getattr(runner, "comm", None)
    return comm is not None and comm.rank != 0


def run_ranks_plan(args, programs) -> None:
    """A plan for several devices: under `mpiexec -n N`, this process runs its own rank's
    program over MPI; otherwise every rank runs here, one thread each. The rank that makes the
    logits reports them; a rank that fails stops every rank (one line each)."""
    from einpage.cli.common import report_logits
    from einpage.cli.execute import _plan_input
    from einpage.ir.peers import validate_ranks
    from einpage.cli.execute import _passes
    from einpage.runners import RanksPass, plan_weights
    from einpage.runtime.comm import MpiCommunicator, mpi_world
    from einpage.runtime.ranks import gather_results, rank_backend, run_rank, run_ranks
    from einpage.runtime.shards import assemble
    world = len(programs)
    repeat = _passes(args)
    backend = None if args.backend == "numpy" else args.backend
    validate_ranks(programs)
    want = {t.name: t for mg in programs for t in mg.inputs}
    passes = int(programs[0].meta.get("micro_batches", 1))
    if passes > 1 and "tokens" in want:  # the plan runs a batch as passes of its micro-batch
        t = want["tokens"]
        want["tokens"] = replace(t, shape=(t.shape[0] * passes, *t.shape[1:]))
    given, source = _plan_input(args, want)
    per = given.tokens.shape[0] // passes
    batches = [{"tokens": given.tokens[m * per:(m + 1) * per]} for m in range(passes)]
    rank, size = mpi_world()
    if size > 1:
        if size != world:
            raise InputError(f"{args.model} is a plan for {world} devices; mpiexec started "
                             f"{size} processes (use mpiexec -n {world})")
        flag = _measures(args)
        if flag:
            raise InputError(f"{flag} with a plan of several devices measures every rank in "
                             "one process: run it without mpiexec")
        mg = programs[rank]
        with MpiCommunicator() as comm:
            try:
                weights = plan_weights(mg, source)
            except EinpageError as exc:  # the peers would wait for this rank's messages
                comm.abort(str(exc))
                raise
            out = run_rank(mg, comm, batches, weights,
                           backend=rank_backend(backend, rank) if backend else None,
                           repeat=repeat)
            out = assemble(programs, gather_results(comm, programs, out))  # the slices of a
            if rank != _reporter(programs):  # tensor-parallel rank's results, on every process
                return
    else:
        weights = [plan_weights(mg, source) for mg in programs]
        measured = {r: [] for r in range(world)} if _measures(args) else None
        out = run_ranks(programs, batches, weights, backend=backend, repeat=repeat,
                        measured=measured)
        if measured is not None:
            _show_rank_passes(args, [RanksPass(tuple(programs),
                                               {r: measured[r][k] for r in range(world)})
                                     for k in range(repeat)], passes)
    if "logits" in out:
        report_logits(out["logits"], args.out, given.lengths,
                      given.codec if given.text else None)


def _reporter(programs) -> int:
    """The one rank of a run under mpiexec that reports the logits: rank 0 where they are
    gathered from slices (every rank then has them whole), else the lowest that makes them."""
    from einpage.runtime.shards import gathered_of, makers_of
    if "logits" in gathered_of(programs[-1]):
        return 0
    return min(makers_of(programs, "logits"), default=0)


def _show_rank_passes(args, passes, micro_batches: int) -> None:
    """--trace and --timing of a saved plan of several devices run here: each pass (every
    micro-batch of the batch) of each rank, next to the ranks simulated together on --device
    where given."""
    from einpage.cli.common import write_text
    from einpage.cli.execute import _profile
    written = Deferred()
    if args.trace:
        from einpage.cli.trace import ranks_measured_events, trace_text
        if written.write(write_text, args.trace, trace_text(ranks_measured_events(passes))):
            print(f"wrote the measured trace of {len(passes)} pass(es) of {len(passes[0].programs)} "
                  f"ranks to {args.trace}")
    if args.timing:
        from einpage.cli.timing import print_ranks_timing
        print_ranks_timing(passes, _profile(args) if args.device or args.device_file else None,
                           first="pass 1", later="pass", offset=1, micro_batches=micro_batches)
    written.finish()
