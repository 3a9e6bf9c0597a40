"""Planner efficiency over a grid of cases (issue: the planner's weak rows). Efficiency is the
problem's lower bound (`PlanReport.bound`: the least compute time, the bytes no plan can avoid
copying host->device over the link, and those a host budget cannot hold over the disk, whichever
is most) over the predicted pass (`simulation.makespan_s`), exactly as `einpage compile --json`
reports it: each case is the flags of an `einpage compile` command, parsed by the CLI's own
parser and built into a graph, sources, workload and host budget by the CLI's own helpers.
The device profile is h100-pcie (the default); the host budget is unlimited unless a case names
a `--cpu-mem`; applies may be placed on the host (`--host-compute auto`, the CLI's default, on
the default host profile): where a placement wins, the row is its plan, and the bound is that
placement's (a device-only bound does not hold for it: `driver.compile_graph`). The rows a
placement wins are listed again with `--host-compute off`: the device-only planner's plans. Prints a markdown table sorted by efficiency, weakest row last, with the
efficiency the issue quoted where it quoted one; cases that do not fit their budget
(`BudgetError`) are listed below it.

    python bench/planner_grid.py                  # the full grid (a few minutes on 2 cores)
    python bench/planner_grid.py --quick          # 8 cases
    python bench/planner_grid.py --only decode    # cases whose flags contain the text
    python bench/planner_grid.py --json rows.json # also write the rows as JSON

Columns: case (model, batch, tokens or KV capacity and position), phase, budget, host budget,
efficiency, predicted pass (ms), bound (ms), what bounds it (the bound's largest term: compute,
h2d, disk, front (the first bytes before their tasks) or tail (the outputs after theirs);
"a ~ b" where another term is within 5%), streamed GB (host->device bytes per pass / the least
any plan must copy), compile s (the compiler's own figure), and the issue's figure.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from einpage.cli.common import check_budget, host_budget, host_options, profile_from_args
from einpage.cli.main import build_parser
from einpage.cli.plan import graph_from_args, lookahead_options
from einpage.compiler import CompileOptions, compile_graph
from einpage.errors import BudgetError
from einpage.units import format_size, parse_size

GB = 1e9
ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Case:
    """The flags of one `einpage compile` (without `--cpu-mem` it runs with an unlimited host
    budget), the efficiency the issue quoted for it, and whether `--quick` runs it."""
    flags: str
    issue: float | None = None
    quick: bool = False

    @property
    def argv(self) -> list[str]:
        flags = shlex.split(self.flags)
        return ["compile", *flags, *([] if "--cpu-mem" in flags else ["--cpu-mem", "unlimited"])]


DECODE = "--phase decode --batch"
#: the cases whose plan places applies on the host (on the default host profile)
PLACED = (
    f"llama-7b {DECODE} 16 --past 2047 --capacity 2048 --gpu-mem 16GB --cpu-mem 20GB",
    f"llama-7b {DECODE} 4 --past 4095 --capacity 4096 --gpu-mem 3.4GB",
    f"llama-7b {DECODE} 16 --past 511 --capacity 512 --gpu-mem 1.7GB",
    f"llama3.2-3b {DECODE} 4 --past 8191 --gpu-mem 1.6GB",
    f"llama3.1-8b {DECODE} 1 --past 2048 --gpu-mem 8GB",
    f"llama3.1-70b {DECODE} 1 --past 2048 --gpu-mem 36GB",
    f"mistral-7b {DECODE} 4 --past 8191 --gpu-mem 7GB",
    f"qwen2.5-72b {DECODE} 16 --past 2047 --capacity 2048 --gpu-mem 36GB",
    f"qwen3-8b {DECODE} 8 --past 1023 --gpu-mem 4GB",
    f"mixtral-8x7b {DECODE} 16 --past 2047 --gpu-mem 24GB",
    f"llama3.1-8b {DECODE} 16 --past 4095 --capacity 4096 --gpu-mem 8GB --cpu-mem 24GB",
)
CASES = (
    # the issue's rows, with the efficiency it quotes
    Case("llama3.1-8b --gpu-mem 16GB", 0.850, quick=True),
    Case("llama3.1-8b --gpu-mem 12GB", 0.802),
    Case("llama3.1-8b --gpu-mem 8GB", 0.785),
    Case("qwen2.5-7b --gpu-mem 16GB", 0.788, quick=True),
    Case("qwen3-8b --gpu-mem 16GB", 0.818),
    Case("llama-7b --gpu-mem 4GB", 0.824, quick=True),
    Case("llama-13b --gpu-mem 12GB", 0.869),
    Case("llama3.1-70b --gpu-mem 24GB", 0.938),
    Case(f"llama-7b {DECODE} 8 --past 767 --capacity 768 --gpu-mem 16GB", 0.756, quick=True),
    Case("llama-65b --gpu-mem 16GB --cpu-mem 64GB", 0.853, quick=True),
    Case(f"llama-7b {DECODE} 16 --past 2047 --capacity 2048 --gpu-mem 16GB --cpu-mem 20GB",
         0.230, quick=True),
    # llama: budgets from just over the weights (13.5, 26.0, 65.1, 130.6, 138.0 GB) to 1/8
    Case("llama-7b --gpu-mem 14GB"),
    Case("llama-7b --batch 4 --gpu-mem 7GB"),
    Case("llama-7b --batch 16 --gpu-mem 8GB"),
    Case("llama-7b --gpu-mem 1.7GB"),
    Case("llama2-13b --batch 4 --gpu-mem 28GB"),
    Case("llama2-13b --gpu-mem 6.5GB"),
    Case("llama2-13b --batch 16 --gpu-mem 3.3GB"),
    Case("llama-30b --gpu-mem 70GB"),
    Case("llama-30b --batch 4 --gpu-mem 16GB"),
    Case("llama-65b --gpu-mem 33GB"),
    Case("llama-65b --batch 4 --gpu-mem 16.3GB"),
    Case("llama2-70b --gpu-mem 35GB"),
    Case(f"llama-7b {DECODE} 1 --past 2048 --gpu-mem 14GB"),
    Case(f"llama-7b {DECODE} 4 --past 4095 --capacity 4096 --gpu-mem 3.4GB"),
    Case(f"llama-7b {DECODE} 16 --past 511 --capacity 512 --gpu-mem 1.7GB"),
    # llama3.x (16.1 GB the 8B, 2.5 GB the 1B, 6.4 GB the 3B, 141 GB the 70B)
    Case("llama3-8b --batch 16 --gpu-mem 17GB"),
    Case("llama3-8b --gpu-mem 4GB"),
    Case("llama3-8b --gpu-mem 2GB"),
    Case("llama3.2-1b --batch 16 --gpu-mem 2.6GB"),
    Case("llama3.2-1b --gpu-mem 0.31GB"),
    Case("llama3.2-3b --batch 4 --gpu-mem 3.3GB"),
    Case(f"llama3.2-3b {DECODE} 4 --past 8191 --gpu-mem 1.6GB"),
    Case("llama3.1-70b --batch 4 --gpu-mem 18GB"),
    Case(f"llama3.1-8b {DECODE} 1 --past 2048 --gpu-mem 8GB"),
    Case(f"llama3.1-70b {DECODE} 1 --past 2048 --gpu-mem 36GB"),
    # mistral (14.5 GB; a 4096-row sliding window)
    Case("mistral-7b --gpu-mem 15GB", quick=True),
    Case("mistral-7b --batch 4 --gpu-mem 3.6GB"),
    Case("mistral-7b --seq 8192 --gpu-mem 7.3GB"),
    Case(f"mistral-7b {DECODE} 4 --past 8191 --gpu-mem 7GB"),
    # qwen2 (15.2 GB, 145 GB) and qwen3 (16.4 GB, 65.5 GB)
    Case("qwen2.5-7b --batch 4 --gpu-mem 16GB"),
    Case("qwen2.5-7b --gpu-mem 3.8GB"),
    Case("qwen2.5-7b --batch 16 --gpu-mem 1.9GB"),
    Case("qwen2.5-72b --gpu-mem 18.2GB"),
    Case(f"qwen2.5-72b {DECODE} 16 --past 2047 --capacity 2048 --gpu-mem 36GB"),
    Case("qwen3-8b --gpu-mem 17GB"),
    Case("qwen3-8b --batch 16 --gpu-mem 8GB"),
    Case("qwen3-8b --gpu-mem 2GB"),
    Case(f"qwen3-8b {DECODE} 8 --past 1023 --gpu-mem 4GB"),
    Case("qwen3-32b --gpu-mem 33GB"),
    Case("qwen3-32b --batch 4 --gpu-mem 8.2GB"),
    # mixtral (93.4 GB, 281 GB; top-2 of 8 experts)
    Case("mixtral-8x7b --gpu-mem 47GB", quick=True),
    Case("mixtral-8x7b --batch 4 --gpu-mem 12GB"),
    Case(f"mixtral-8x7b {DECODE} 16 --past 2047 --gpu-mem 24GB"),
    Case("mixtral-8x22b --gpu-mem 36GB"),
    # host budgets below what streams: the disk tier
    Case("llama-7b --gpu-mem 4GB --cpu-mem 8GB"),
    Case("llama-30b --gpu-mem 8GB --cpu-mem 32GB"),
    Case("llama3.1-70b --gpu-mem 24GB --cpu-mem 64GB"),
    Case("mixtral-8x7b --gpu-mem 12GB --cpu-mem 48GB"),
    Case(f"llama3.1-8b {DECODE} 16 --past 4095 --capacity 4096 --gpu-mem 8GB --cpu-mem 24GB"),
    Case(f"qwen2.5-72b {DECODE} 4 --past 2047 --gpu-mem 18GB --cpu-mem 96GB"),
    # a decode step whose KV store (9.7 GB) and streamed weights the host cannot both hold
    Case(f"llama-7b {DECODE} 8 --past 2048 --gpu-mem 8GB --cpu-mem 14GB"),
    # the rows a host placement wins (attention over the KV store, or experts, on the host),
    # device-only
    *(Case(f"{flags} --host-compute off") for flags in PLACED),
)


def bound_terms(bound) -> str:
    """The bound's largest term, and any other within 5% of it ("h2d ~ compute")."""
    terms = {"compute": bound.compute_s, "h2d": bound.stream_s, "disk": bound.disk_s,
             "front": bound.front_s, "tail": bound.tail_s}
    top = max(terms.values())
    return " ~ ".join(k for k, v in sorted(terms.items(), key=lambda kv: -kv[1])
                      if v > 0 and v >= 0.95 * top)


def run_case(case: Case) -> dict:
    """Compile `case` as `einpage compile` does (cmd_compile) and return its row."""
    args = build_parser().parse_args(case.argv)
    profile = profile_from_args(args)
    device_bytes = parse_size(args.gpu_mem, "--gpu-mem")
    check_budget(device_bytes, profile, args.force)
    _, graph, sources, _, workload = graph_from_args(args)
    host_bytes, host_source = host_budget(args)
    options = CompileOptions(
        device_bytes=device_bytes, policy=args.policy, device=profile,
        block_bytes=parse_size(args.block_bytes, "--block-bytes") if args.block_bytes else None,
        sources=sources, workload={**workload, "host_budget": host_source},
        host_bytes=host_bytes, **host_options(args), **lookahead_options(args.lookahead))
    shape = (f"S={workload['seq']}" if workload["phase"] == "prefill"
             else f"C={workload['capacity']} past={workload['past']}")
    device_only = " device-only" if args.host_compute == "off" else ""
    row = {"case": f"{workload['model']} B={workload['batch']} {shape}{device_only}",
           "command": shlex.join(["einpage", *case.argv]), "phase": workload["phase"],
           "budget": format_size(device_bytes),
           "host": "unlimited" if host_bytes is None else format_size(host_bytes),
           "issue": case.issue}
    try:
        report = compile_graph(graph, options).report
    except BudgetError as exc:
        return {**row, "error": str(exc).splitlines()[0]}
    sim = report.simulation
    return {**row, "efficiency": report.efficiency, "makespan_s": sim.makespan_s,
            "lower_bound_s": report.bound.seconds, "bound_by": bound_terms(report.bound),
            "h2d_bytes": sim.h2d_bytes, "min_stream_bytes": report.bound.stream_bytes,
            "compile_s": report.compiled.compile_seconds}


def header(argv: list[str]) -> list[str]:
    """The machine, the date, the commit and the exact command, as bench/RESULTS.md records."""
    def git(*a):
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = " (with uncommitted changes)" if git("status", "--porcelain", "-uno") else ""
    return [f"- machine: {platform.platform()}, {os.cpu_count()} CPUs, Python "
            f"{platform.python_version()}",
            f"- date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
            f"- commit: {git('rev-parse', '--short', 'HEAD')}{dirty}",
            f"- command: `{shlex.join(['python', 'bench/planner_grid.py', *argv])}`",
            "- device profile: h100-pcie; sizes in GB = 10^9 bytes"]


def table(rows: list[dict]) -> list[str]:
    """The compiled rows, efficiency descending (the weakest last)."""
    out = ["| case | phase | budget | host budget | efficiency | predicted pass ms | bound ms | "
           "bound by | streamed GB / least | compile s | issue said |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: -r["efficiency"]):
        issue = "" if r["issue"] is None else f"{r['issue']:.3f}"
        out.append(f"| {r['case']} | {r['phase']} | {r['budget']} | {r['host']} | "
                   f"{r['efficiency']:.3f} | {r['makespan_s'] * 1e3:.2f} | "
                   f"{r['lower_bound_s'] * 1e3:.2f} | {r['bound_by']} | "
                   f"{r['h2d_bytes'] / GB:.2f} / {r['min_stream_bytes'] / GB:.2f} | "
                   f"{r['compile_s']:.2f} | {issue} |")
    return out


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the 8 cases marked quick")
    ap.add_argument("--only", help="only the cases whose flags contain this text")
    ap.add_argument("--json", help="also write the rows (failed cases too) here")
    args = ap.parse_args(argv)
    cases = [c for c in CASES if (c.quick or not args.quick)
             and (args.only is None or args.only in c.flags)]
    t0 = time.perf_counter()
    rows = []
    for k, case in enumerate(cases, 1):
        rows.append(run_case(case))
        r = rows[-1]
        print(f"[{k}/{len(cases)}] {case.flags}: "
              f"{r.get('error') or format(r['efficiency'], '.3f')}", file=sys.stderr, flush=True)
    wall = time.perf_counter() - t0
    done = [r for r in rows if "error" not in r]
    failed = [r for r in rows if "error" in r]
    lines = header(argv) + [f"- {len(rows)} cases, {len(done)} compiled, {wall:.0f} s wall", ""]
    lines += table(done)
    if failed:
        lines += ["", "Did not fit their budget (BudgetError):", ""]
        lines += [f"- {r['case']} {r['phase']} at {r['budget']}: {r['error']}" for r in failed]
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
