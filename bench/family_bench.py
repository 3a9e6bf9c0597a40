"""The family presets (issue 13) predicted by the compiler and simulator (no GPU): for each,
the prefill of `--seq` tokens (batch 1) and FlexGen's generation setting (prompt 512, 32 new
tokens, batch 8) under a device budget, on one device profile: seconds per pass, bytes moved
against the bytes no plan can avoid (weights + KV - budget), efficiency against the lower bound,
and for Mixtral what running every expert costs against a top-k runtime.

    python bench/family_bench.py [--models llama3.1-8b,...] [--gpu-mem 16e9] [--device h100-pcie]
                                 [--seq 2048] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import time

from einpage.compiler import CompileOptions, compile_graph
from einpage.forecast import forecast_generation
from einpage.models import llama, schema
from einpage.models.config import preset
from einpage.predict import get_device

FAMILY_PRESETS = ("llama3.1-8b", "llama3.1-70b", "llama3.2-1b", "llama3.2-3b", "mistral-7b",
                  "qwen2.5-7b", "qwen2.5-72b", "qwen3-8b", "qwen3-32b", "mixtral-8x7b",
                  "mixtral-8x22b")


def prefill_row(model: str, budget: int, seq: int, profile) -> dict:
    cfg = preset(model)
    graph = llama.prefill_graph(cfg).bind(B=1, S=seq)
    sources = {name: schema.hf_tensor(name) for name in schema.weight_shapes(cfg)}
    t0 = time.perf_counter()
    c = compile_graph(graph, CompileOptions(budget, device=profile, sources=sources))
    wall = time.perf_counter() - t0
    sim, rep = c.simulation, c.report.compiled
    return dict(model=model, family=cfg.family, weights_gb=cfg.weight_bytes() / 1e9,
                tasks=len(c.taskgraph.tasks), pass_s=sim.makespan_s, compute_s=sim.compute_s,
                h2d_gb=sim.h2d_bytes / 1e9, min_stream_gb=rep.min_stream_bytes / 1e9,
                efficiency=sim.efficiency, tokens_per_s=seq / sim.makespan_s, compile_s=wall)


def generation_row(model: str, budget: int, profile) -> dict:
    cfg = preset(model)
    f = forecast_generation(cfg, 8, 512, 32, CompileOptions(budget, device=profile))
    b = f.buckets[-1]
    return dict(model=model, gen_tokens_per_s=f.tokens_per_s, step_s=b.step_s,
                step_gb=b.step_bytes / 1e9, step_efficiency=b.efficiency, plans=f.plans)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(FAMILY_PRESETS))
    ap.add_argument("--gpu-mem", type=float, default=16e9)
    ap.add_argument("--device", default="h100-pcie")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--json")
    args = ap.parse_args()
    profile = get_device(args.device)
    rows = []
    for model in args.models.split(","):
        row = prefill_row(model, int(args.gpu_mem), args.seq, profile)
        row.update(generation_row(model, int(args.gpu_mem), profile))
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\n| model | weights GB | prefill s | compute s | h2d GB (min) | eff. | "
          "gen tok/s (B=8) | step s | step GB | step eff. | compile s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['weights_gb']:.1f} | {r['pass_s']:.3f} | "
              f"{r['compute_s']:.3f} | {r['h2d_gb']:.1f} ({r['min_stream_gb']:.1f}) | "
              f"{r['efficiency']:.3f} | {r['gen_tokens_per_s']:.2f} | {r['step_s']:.3f} | "
              f"{r['step_gb']:.1f} | {r['step_efficiency']:.3f} | {r['compile_s']:.1f} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
