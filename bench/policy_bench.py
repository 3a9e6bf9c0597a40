"""Policy comparison: the same LLaMA prefill graphs through every eviction policy, priced by the
stream simulator on one device profile. Prints a markdown table; results go to bench/RESULTS.md.

    python bench/policy_bench.py                 # the full table (h100-pcie)
    python bench/policy_bench.py --quick         # B=1 rows only
    python bench/policy_bench.py --device a100-pcie --rows llama-7b:16

Columns: model, budget, B, S, policy, feasible, peak, h2d bytes, minimum h2d bytes (each weight
block that does not stay resident, once), d2h bytes, predicted makespan, efficiency (the problem's
lower bound, the same for every policy of a row, / makespan), and compile seconds. "fastest" marks the policies within 0.5% of the least makespan of
the row (the compiler counts makespans that close as equal).
"""
from __future__ import annotations

import argparse
import sys
import time

from einpage.compiler import POLICIES, CompileOptions, compile_graph
from einpage.errors import BudgetError
from einpage.models import llama
from einpage.models.config import preset
from einpage.predict import get_device

GB = 10**9
ROWS = (("llama-7b", 8), ("llama-7b", 16), ("llama2-13b", 16), ("llama-65b", 16),
        ("llama-65b", 32))
SHAPES = ((1, 2048), (1, 8192), (16, 2048), (16, 8192))


def run_row(model: str, gpu_gb: float, batch: int, seq: int, device) -> list[dict]:
    graph = llama.prefill_graph(preset(model)).bind(B=batch, S=seq)
    out = []
    for policy in POLICIES:
        t0 = time.perf_counter()
        try:
            c = compile_graph(graph, CompileOptions(int(gpu_gb * GB), policy=policy, device=device))
        except BudgetError as exc:
            out.append({"policy": policy, "feasible": False, "why": str(exc),
                        "secs": time.perf_counter() - t0})
            continue
        out.append({"policy": policy, "feasible": True, "secs": time.perf_counter() - t0,
                    **c.report.to_json()})
    return out


def print_rows(model, gpu_gb, batch, seq, rows) -> None:
    feasible = [r for r in rows if r["feasible"]]
    best = min((r["makespan_s"] for r in feasible), default=None)
    for r in rows:
        head = f"| {model} | {gpu_gb:g} GB | {batch} | {seq} | {r['policy']} |"
        if not r["feasible"]:
            why = r["why"].split(";")[0][:70]
            print(f"{head} no: {why} | | | | | | | | |", flush=True)
            continue
        mark = " **fastest**" if best is not None and r["makespan_s"] <= best * 1.005 else ""
        print(f"{head} yes | {r['peak_bytes'] / GB:.2f} | {r['h2d_bytes'] / GB:.1f} | "
              f"{r['plan_h2d_min_bytes'] / GB:.1f} | {r['d2h_bytes'] / GB:.1f} | "
              f"{r['makespan_s']:.3f}{mark} | {r['efficiency']:.3f} | {r['stall_s']:.3f} | "
              f"{r['secs']:.1f} |", flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="h100-pcie")
    ap.add_argument("--quick", action="store_true", help="B=1 only")
    ap.add_argument("--rows", help="comma-separated model:GB pairs (default: the issue's rows)")
    ap.add_argument("--shapes", help="comma-separated BxS (default 1x2048,1x8192,16x2048,16x8192)")
    args = ap.parse_args(argv)
    device = get_device(args.device)
    rows = ROWS if not args.rows else tuple(
        (m, float(g)) for m, g in (item.split(":") for item in args.rows.split(",")))
    shapes = SHAPES if not args.shapes else tuple(
        tuple(int(v) for v in item.split("x")) for item in args.shapes.split(","))
    if args.quick:
        shapes = tuple(s for s in shapes if s[0] == 1)
    print(f"device {device.name}: {device.source}", file=sys.stderr)
    print("| model | budget | B | S | policy | feasible | peak GB | h2d GB | min h2d GB | d2h GB "
          "| makespan s | efficiency | stall s | compile s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for model, gpu_gb in rows:
        for batch, seq in shapes:
            print_rows(model, gpu_gb, batch, seq, run_row(model, gpu_gb, batch, seq, device))


if __name__ == "__main__":
    main()
