"""Host compute measured on this machine (issue "The host computes too", its measured target): a
Mixtral-shaped decode step on the threads backend with the experts computed where they lie in
host memory against the same step with every expert streamed to the "device".

Mixtral-8x7B shapes (hidden 4096, 8 experts of ffn 14336, top-2 routing, 32 heads, 8 KV heads)
with `--layers` layers, random f16 weights made once and held in host memory (as a checkpoint
reader holds them), a budget of `--fraction` of the weights (so the experts must stream), and
the profiles of this machine: the threads backend's (`einpage calibrate`: the "device" is this
CPU, the "link" a copy between two of its buffers) and its host profile (`calibrate --host-out`).
Three plans of one decode step: `--host-compute off` with every expert's blocks reloaded every
step ("off, all": the router's guards skip the unchosen experts' compute, not their copies;
`CompileOptions.guarded_reload_share=0`), `--host-compute off` with each expert reloaded only
when chosen ("off, chosen": guarded reloads, the default), and `auto` (the planner's placement). Each runs in a `StreamSession`, a warm-up step and then `--reps` steps,
the two alternating; printed: the median step, the ratio, and what each plan moves and places.

    python bench/host_measure.py [--layers 1] [--reps 5] [--fraction 0.25] [--json out.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_bench import HeldWeights, dense_weights  # noqa: E402

from einpage.calibrate import calibrate, calibrate_host  # noqa: E402
from einpage.compiler import CompileOptions, compile_graph  # noqa: E402
from einpage.ir.memgraph import ApplyNode  # noqa: E402
from einpage.models import config, llama  # noqa: E402
from einpage.runtime import storedmm  # noqa: E402
from einpage.runtime.stream_executor import StreamSession  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--fraction", type=float, default=0.25,
                    help="the device budget, as a share of the f16 weights")
    ap.add_argument("--capacity", type=int, default=512)
    ap.add_argument("--json")
    args = ap.parse_args()
    cfg = dataclasses.replace(config.preset("mixtral-8x7b"), layers=args.layers,
                              name=f"mixtral-8x7b-{args.layers}l")
    print("measuring this machine (threads backend, host) ...", file=sys.stderr)
    profile = dataclasses.replace(calibrate("threads"), host=calibrate_host())
    print("making random weights ...", file=sys.stderr)
    weights = HeldWeights(cfg, dense_weights(cfg))
    graph = llama.decode_graph(cfg).bind(B=1, C=args.capacity)
    rng = np.random.default_rng(1)
    inputs = {"tokens": rng.integers(0, cfg.vocab, (1, 1)), "pos": np.full(1, args.capacity // 2)}
    for node in graph.inputs:
        if node.op.role.value == "cache":
            inputs[node.op.name] = (0.1 * rng.standard_normal(tuple(node.shape))
                                    ).astype(np.float16)
    budget = int(cfg.weight_bytes() * args.fraction)
    rows = {}
    modes = {"off, all": dict(host_compute=False, guarded_reload_share=0.0),
             "off, chosen": dict(host_compute=False), "auto": dict(host_compute=True)}
    for mode, how in modes.items():
        start = time.perf_counter()
        c = compile_graph(graph, CompileOptions(budget, device=profile, **how))
        session = StreamSession(c.memgraph, weights, "threads")
        session.run(inputs)  # warm-up: opens the backend, loads the resident blocks
        rows[mode] = {"session": session, "times": [], "compile_s": time.perf_counter() - start,
                      "predicted_s": c.simulation.makespan_s, "h2d_gb": c.simulation.h2d_bytes / 1e9,
                      "host_applies": sum(1 for n in c.memgraph.nodes
                                          if isinstance(n, ApplyNode) and n.on_host)}
    outs = {}
    for _ in range(args.reps):
        for mode, row in rows.items():
            t = time.perf_counter()
            outs[mode] = row["session"].run(inputs).outputs
            row["times"].append(time.perf_counter() - t)
    for row in rows.values():
        row["session"].close()
        del row["session"]
        row["step_s"] = statistics.median(row["times"])
    print(json.dumps({m: {k: v for k, v in r.items()} for m, r in rows.items()}), file=sys.stderr)
    agree = max(float(np.abs(outs[m]["logits"].astype(np.float32)
                             - outs["auto"]["logits"].astype(np.float32)).max()) for m in modes)
    ratio = rows["off, all"]["step_s"] / rows["auto"]["step_s"]
    chosen = rows["off, all"]["step_s"] / rows["off, chosen"]["step_s"]
    print(f"{cfg.name} decode B=1 C={args.capacity}, weights {cfg.weight_bytes() / 1e9:.2f} GB, "
          f"budget {budget / 1e9:.2f} GB ({args.fraction:g}), threads backend, kernels "
          f"{storedmm.isa()}, median of {args.reps}")
    print("| plan | step s | predicted s | h2d GB (expected) | host applies | compile s |")
    print("|---|---:|---:|---:|---:|---:|")
    for mode, row in rows.items():
        print(f"| {mode} | {row['step_s']:.3f} | {row['predicted_s']:.3f} | {row['h2d_gb']:.2f} | "
              f"{row['host_applies']} | {row['compile_s']:.1f} |")
    print(f"experts on the host: {ratio:.2f}x the all-streamed step; experts streamed when "
          f"chosen: {chosen:.2f}x; logits agree to {agree:.2e}")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": platform.platform(), "ratio": ratio,
                                               "chosen_ratio": chosen,
                                               "logits_max_diff": agree, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
