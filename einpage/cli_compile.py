"""`einpage compile`, `einpage inspect`, and `einpage run plan.json`."""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np

from einpage.errors import EinpageError, InputError
from einpage.ir.dtypes import as_dtype
from einpage.sizes import format_size, parse_size


def add_commands(sub) -> None:
    c = sub.add_parser("compile", help="compile a model for a device budget (no weights, no GPU)")
    c.add_argument("model", help="preset name or checkpoint directory")
    c.add_argument("--gpu-mem", required=True, help="device budget: 16GB (10^9), 16GiB (2^30), ...")
    c.add_argument("--batch", type=int, default=1)
    c.add_argument("--seq", type=int, default=2048, help="tokens per row (prefill)")
    c.add_argument("--phase", choices=["prefill", "decode"], default="prefill")
    c.add_argument("--past", type=int, default=0, help="KV cache length (decode)")
    c.add_argument("--dtype", choices=["f16", "bf16", "f32"])
    c.add_argument("--policy", default="reuse-distance")
    c.add_argument("--block-bytes", help="target working set of one task (default: budget/8)")
    c.add_argument("--lookahead", help="how far prefetch runs ahead of execution: bytes (2GB), "
                                       "predicted compute (30ms, 0.5s), or auto (search the "
                                       "window of least simulated makespan); default: as far "
                                       "as memory allows")
    c.add_argument("-o", "--output", help="write the plan (JSON memgraph) here")
    c.add_argument("--json", action="store_true", help="print the report as one JSON object")
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_device_args(c)
    i = sub.add_parser("inspect", help="report on a saved plan (validated and simulated)")
    i.add_argument("plan")
    i.add_argument("--json", action="store_true")
    i.add_argument("--dot", help="write the memgraph as Graphviz dot (small plans)")
    _add_device_args(i)
    d = sub.add_parser("devices", help="list the device profiles of the cost model")
    d.add_argument("--json", action="store_true", help="print them as JSON (the --device-file "
                                                       "format)")


def _add_device_args(p) -> None:
    p.add_argument("--device", help="device profile for the cost model (default h100-pcie; "
                                    "see einpage devices)")
    p.add_argument("--device-file", help="device profile as JSON (keys of einpage devices --json)")
    p.add_argument("--h2d-bandwidth", help="override host<->device bandwidth, e.g. 25GB/s")
    p.add_argument("--flops", help="override peak matmul FLOP/s, e.g. 500T")
    p.add_argument("--plot", help="write a timeline picture (PNG): device memory by role and "
                                  "the three streams over predicted time")


def _profile(args, default: str | None = None):
    from einpage.devices import resolve_device
    return resolve_device(args.device or (None if args.device_file else default),
                          args.device_file, args.h2d_bandwidth, args.flops)


def _lookahead(text: str | None) -> dict:
    """`--lookahead`: bytes, seconds of predicted compute, or auto."""
    if text is None:
        return {}
    if text.strip().lower() == "auto":
        return {"auto_lookahead": True}
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*(us|ms|s)\s*", text)
    if match:
        value = float(match.group(1)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[match.group(2)]
        if value <= 0:
            raise InputError(f"bad --lookahead {text!r}: must be positive")
        return {"lookahead_seconds": value}
    try:
        return {"lookahead_bytes": parse_size(text)}
    except EinpageError:
        raise InputError(f"bad --lookahead {text!r}: use bytes (2GB), predicted compute "
                         "(30ms, 0.5s) or auto") from None


def _graph(args):
    from einpage.models import llama, resolve
    cfg, _ = resolve(args.model, dtype=as_dtype(args.dtype) if args.dtype else None)
    for name, value in (("--batch", args.batch), ("--seq", args.seq)):
        if value < 1:
            raise InputError(f"{name} must be at least 1, got {value}")
    if args.past < 0:
        raise InputError(f"--past must be non-negative, got {args.past}")
    if args.phase == "prefill":
        graph = llama.prefill_graph(cfg).bind(B=args.batch, S=args.seq)
        tokens = args.batch * args.seq
    else:
        graph = llama.decode_graph(cfg).bind(B=args.batch, P=args.past)
        tokens = args.batch
    sources = {name: llama.hf_tensor(name) for name in llama.weight_shapes(cfg)}
    return cfg, graph, sources, tokens


def cmd_compile(args) -> None:
    from einpage.compile import CompileOptions, compile_graph
    from einpage.progress import Progress
    profile = _profile(args)
    device_bytes = parse_size(args.gpu_mem)
    cfg, graph, sources, tokens = _graph(args)
    progress = Progress(enabled=False if args.quiet else None)
    options = CompileOptions(
        device_bytes=device_bytes, policy=args.policy, device=profile,
        block_bytes=parse_size(args.block_bytes) if args.block_bytes else None,
        sources=sources, progress=progress, **_lookahead(args.lookahead))
    try:
        compiled = compile_graph(graph, options)
    finally:
        progress.close()
    workload = {"model": cfg.name, "phase": args.phase, "batch": args.batch,
                "seq": args.seq if args.phase == "prefill" else 1, "past": args.past,
                "dtype": cfg.dtype.value, "tokens": tokens}
    mg = dataclasses.replace(compiled.memgraph, meta={**compiled.memgraph.meta, **workload})
    report = dict(compiled.report, **workload, policy=args.policy,
                  **compiled.simulation.report(tokens))
    if device_bytes > profile.memory_bytes:
        report["warning"] = (f"--gpu-mem {format_size(device_bytes)} is more than the "
                             f"{format_size(profile.memory_bytes)} of a {profile.name}")
    if args.output:
        mg.save(args.output)
        report["plan"] = args.output
    if args.plot:
        from einpage.plot import plot_timeline
        plot_timeline(mg, compiled.simulation, args.plot)
        report["plot"] = args.plot
    if args.json:
        print(json.dumps(report, sort_keys=True))
    else:
        print_report(report)


def print_report(r: dict) -> None:
    def gb(n):
        return format_size(n) if n is not None else "-"
    print(f"einpage plan: {r.get('model', '?')} {r.get('phase', '')} batch={r.get('batch', '?')} "
          f"seq={r.get('seq', '?')} past={r.get('past', 0)} {r.get('dtype', '')} "
          f"policy={r.get('policy', '?')}  (sizes in GB = 10^9 bytes)")
    print(f"  tasks {r['tasks']}, memgraph nodes {r['nodes']}, compiled in "
          f"{r['compile_seconds']:.2f} s")
    print(f"  peak {gb(r['peak_bytes'])} of budget {gb(r['device_bytes'])}; lower bound "
          f"{gb(r['lower_bound_bytes'])} (resident weights + largest task); smallest workable "
          f"budget {gb(r['min_budget_bytes'])}")
    print(f"  weights {gb(r['weight_bytes'])}: resident {gb(r['resident_bytes'])}, streamed per "
          f"pass {gb(r['streamed_weight_bytes'])}")
    print(f"  reloads {r['reload_count']} ({gb(r['reload_bytes'])}), offloads "
          f"{r['offload_count']} ({gb(r['offload_bytes'])}), outputs written back "
          f"{r['writeback_count']} ({gb(r['writeback_bytes'])})")
    _print_prediction(r)


def _print_prediction(r: dict) -> None:
    gb = format_size
    if "makespan_s" in r:
        tps = r.get("tokens_per_s")
        rate = (f" ({tps:,.0f} tokens/s)" if tps >= 100 else f" ({tps:.3g} tokens/s)") if tps else ""
        print(f"  predicted on {r['device']}: {_secs(r['makespan_s'])} per pass{rate}; compute "
              f"{_secs(r['compute_s'])}, h2d {_secs(r['h2d_s'])}, d2h {_secs(r['d2h_s'])}, "
              f"compute stalled {_secs(r['stall_s'])}")
        print(f"  lower bound {_secs(r['lower_bound_s'])} (compute, {gb(r['h2d_min_bytes'])} "
              f"that must cross host->device, d2h); efficiency {r['efficiency']:.3f}")
    if "lookahead" in r:
        print(f"  look-ahead: {r['lookahead']}")
    for key, label in (("plan", "plan written to"), ("plot", "timeline written to"),
                       ("dot", "graph written to"), ("warning", "warning:")):
        if key in r:
            print(f"  {label} {r[key]}")


def _secs(s: float) -> str:
    if s == 0:
        return "0 s"
    return f"{s:.3f} s" if s >= 0.01 else f"{s * 1e3:.3f} ms"


def cmd_devices(args) -> None:
    from einpage.devices import PROFILES
    if args.json:
        print(json.dumps({name: p.to_json() for name, p in PROFILES.items()}, indent=1))
        return
    print(f"{'name':<10} {'f16 TFLOP/s':>11} {'f32 TFLOP/s':>11} {'HBM GB/s':>9} "
          f"{'h2d GB/s':>8} {'memory':>9}  source")
    for p in PROFILES.values():
        print(f"{p.name:<10} {p.matmul_flops['f16'] / 1e12:>11.1f} "
              f"{p.matmul_flops['f32'] / 1e12:>11.1f} {p.hbm_bandwidth / 1e9:>9.0f} "
              f"{p.h2d_bandwidth / 1e9:>8.2f} {format_size(p.memory_bytes):>9}  {p.source}")


def cmd_inspect(args) -> None:
    from einpage.compile import offloads
    from einpage.ir.memgraph import MemGraph
    from einpage.simulate import simulate
    from einpage.validate import validate
    mg = MemGraph.load(args.plan)
    from einpage.devices import PROFILES
    saved = mg.meta.get("device")  # the plan's profile, when it is a registered one
    profile = _profile(args, default=saved if saved in PROFILES else None)
    v = validate(mg)
    sim = simulate(mg, profile)
    report = {**mg.meta, "device_bytes": mg.device_bytes, "peak_bytes": v.peak_bytes,
              "live_peak_bytes": v.live_peak_bytes, "nodes": len(mg.nodes),
              "tensors": len(mg.tensors),
              "reload_count": mg.count("reload"), "reload_bytes": mg.moved_bytes("reload"),
              **offloads(mg),
              **sim.report(mg.meta.get("tokens"))}
    if args.dot:
        from einpage.dot import to_dot
        _write_text(args.dot, to_dot(mg))
        report["dot"] = args.dot
    if args.plot:
        from einpage.plot import plot_timeline
        plot_timeline(mg, sim, args.plot)
        report["plot"] = args.plot
    if args.json:
        print(json.dumps(report, sort_keys=True))
        return
    print(f"einpage plan {args.plan}: {len(mg.nodes)} nodes, {len(mg.tensors)} tensors, valid")
    print(f"  made for: " + ", ".join(f"{k}={mg.meta[k]}" for k in sorted(mg.meta)))
    print(f"  peak {format_size(v.peak_bytes)} of budget {format_size(mg.device_bytes)} "
          f"(live bytes peak {format_size(v.live_peak_bytes)})")
    print(f"  reloads {report['reload_count']} ({format_size(report['reload_bytes'])}), "
          f"offloads {report['offload_count']} ({format_size(report['offload_bytes'])}), "
          f"outputs written back {report['writeback_count']} "
          f"({format_size(report['writeback_bytes'])})")
    _print_prediction(report)


def _write_text(path: str, text: str) -> None:
    try:
        Path(path).write_text(text)
    except OSError as exc:
        raise InputError(f"cannot write {path}: {exc.strerror or exc}") from None


def run_plan(args, tokens: np.ndarray) -> None:
    """`einpage run plan.json --checkpoint DIR --tokens ...`: execute a saved plan."""
    from einpage.ir.memgraph import MemGraph
    from einpage.models.checkpoint import Checkpoint
    from einpage.runtime.executor import run
    from einpage.validate import validate
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
    from einpage.cli import report_logits
    report_logits(out["logits"], args.out)


HANDLERS = {"compile": cmd_compile, "inspect": cmd_inspect, "devices": cmd_devices}
