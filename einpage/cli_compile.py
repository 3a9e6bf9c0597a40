"""`einpage compile`, `einpage inspect`, and `einpage run plan.json`."""
from __future__ import annotations

import json

import numpy as np

from einpage.errors import InputError
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
    c.add_argument("--lookahead", help="cap on bytes prefetched ahead (default: memory-bound)")
    c.add_argument("-o", "--output", help="write the plan (JSON memgraph) here")
    c.add_argument("--json", action="store_true", help="print the report as one JSON object")
    i = sub.add_parser("inspect", help="report on a saved plan")
    i.add_argument("plan")
    i.add_argument("--json", action="store_true")


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
    cfg, graph, sources, tokens = _graph(args)
    options = CompileOptions(
        device_bytes=parse_size(args.gpu_mem), policy=args.policy,
        block_bytes=parse_size(args.block_bytes) if args.block_bytes else None,
        lookahead_bytes=parse_size(args.lookahead) if args.lookahead else None,
        sources=sources)
    compiled = compile_graph(graph, options)
    report = dict(compiled.report, model=cfg.name, phase=args.phase, batch=args.batch,
                  seq=args.seq if args.phase == "prefill" else 1, past=args.past,
                  dtype=cfg.dtype.value, policy=args.policy, tokens=tokens)
    if args.output:
        compiled.memgraph.save(args.output)
        report["plan"] = args.output
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
          f"{r['offload_count']} ({gb(r['offload_bytes'])})")
    if "plan" in r:
        print(f"  plan written to {r['plan']}")


def cmd_inspect(args) -> None:
    from einpage.ir.memgraph import MemGraph
    from einpage.validate import validate
    mg = MemGraph.load(args.plan)
    v = validate(mg)
    report = {"device_bytes": mg.device_bytes, "peak_bytes": v.peak_bytes,
              "nodes": len(mg.nodes), "tensors": len(mg.tensors),
              "reload_count": mg.count("reload"), "reload_bytes": mg.moved_bytes("reload"),
              "offload_count": mg.count("offload"), "offload_bytes": mg.moved_bytes("offload"),
              **mg.meta}
    if args.json:
        print(json.dumps(report, sort_keys=True))
    else:
        for k, v in report.items():
            print(f"{k}: {v}")


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


HANDLERS = {"compile": cmd_compile, "inspect": cmd_inspect}
