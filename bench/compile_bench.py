"""Compile-time, bytes-moved and feasibility benchmarks for the paging compiler (issue: the paging
compiler). Prints markdown tables; results are recorded in bench/RESULTS.md.

    python bench/compile_bench.py timing      # compile seconds, median of 3, and growth
    python bench/compile_bench.py grid [MODEL ...] [--budgets 16,32] [--policies a,b]
                                              # feasibility grid, reuse-distance and layerwise
    python bench/compile_bench.py small       # budgets where layerwise stops fitting
"""
from __future__ import annotations

import statistics
import sys
import time

from einpage.compiler import CompileOptions, compile_graph
from einpage.errors import BudgetError
from einpage.models import llama
from einpage.models.config import preset

GB = 10**9


def compile_once(model, batch, seq, gpu_gb, policy="reuse-distance"):
    cfg = preset(model)
    graph = llama.prefill_graph(cfg).bind(B=batch, S=seq)
    t0 = time.perf_counter()
    compiled = compile_graph(graph, CompileOptions(int(gpu_gb * GB), policy=policy))
    return time.perf_counter() - t0, compiled.report.to_json()


def timing() -> None:
    """Compile seconds, median of 3 in one process. A compile lowers the graph once, or two to
    five times when it searches the resident set; "lowered tasks/s" counts every lowering."""
    print("| model | B | S | budget | tasks | nodes | lowerings | compile s (median of 3) | "
          "lowered tasks/s | peak GB | reload GB | streamed weights GB | reload / streamed | "
          "spill GB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for model, batch, seq in (("llama-7b", 1, 2048), ("llama-65b", 1, 2048),
                              ("llama-65b", 4, 2048), ("llama-65b", 16, 2048),
                              ("llama-65b", 4, 8192), ("llama-65b", 16, 8192)):
        runs = [compile_once(model, batch, seq, 16) for _ in range(3)]
        secs = statistics.median(r[0] for r in runs)
        r = runs[0][1]
        lowerings = len(r.get("trials", ())) or 1
        ratio = r["reload_bytes"] / r["streamed_weight_bytes"] if r["streamed_weight_bytes"] else 0
        print(f"| {model} | {batch} | {seq} | 16 GB | {r['tasks']} | {r['nodes']} | {lowerings} | "
              f"{secs:.2f} | {r['tasks'] * lowerings / secs:.0f} | {r['peak_bytes'] / GB:.2f} | "
              f"{r['reload_bytes'] / GB:.2f} | {r['streamed_weight_bytes'] / GB:.2f} | "
              f"{ratio:.4f} | {r['offload_bytes'] / GB:.2f} |", flush=True)


def grid(models=("llama-7b", "llama-65b"), budgets=(16, 32),
         policies=("reuse-distance", "layerwise")) -> None:
    """Every cell compiles and validates (compile_graph validates) with peak <= budget, or says
    why not. "spill" is activations offloaded and reloaded; "write-back" is the outputs (KV
    cache, logits) copied to the host as they are final, which a streaming pass always does."""
    print("| model | budget | B | S | policy | feasible | tasks | peak GB | reload GB | spill GB "
          "| write-back GB | makespan s | efficiency | compile s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for model in models:
        for gpu in budgets:
            for batch in (1, 4, 16, 32):
                for seq in (512, 2048, 8192):
                    for policy in policies:
                        head = f"| {model} | {gpu} GB | {batch} | {seq} | {policy} |"
                        try:
                            secs, r = compile_once(model, batch, seq, gpu, policy)
                        except BudgetError as exc:
                            print(f"{head} no: {str(exc)[:100]} | | | | | | | | |", flush=True)
                            continue
                        assert r["peak_bytes"] <= gpu * GB
                        print(f"{head} yes | {r['tasks']} | {r['peak_bytes'] / GB:.2f} | "
                              f"{r['reload_bytes'] / GB:.1f} | {r['offload_bytes'] / GB:.2f} | "
                              f"{r['writeback_bytes'] / GB:.1f} | {r['makespan_s']:.2f} | "
                              f"{r['efficiency']:.3f} | {secs:.1f} |", flush=True)


def small_budgets() -> None:
    """Where whole-layer streaming stops fitting: budgets below one layer's weights plus a
    task's working set (llama-7b: 0.40 GB a layer; llama-65b: 1.61 GB)."""
    print("| model | budget | B | S | policy | feasible | tasks | peak GB | reload GB | spill GB "
          "| makespan s | compile s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for model, budgets in (("llama-7b", (0.5, 1, 2)), ("llama-65b", (1, 2, 4))):
        for gpu in budgets:
            for policy in ("reuse-distance", "layerwise"):
                head = f"| {model} | {gpu} GB | 1 | 2048 | {policy} |"
                try:
                    secs, r = compile_once(model, 1, 2048, gpu, policy)
                except BudgetError as exc:
                    print(f"{head} no: {str(exc)[:120]} | | | | | | |", flush=True)
                    continue
                print(f"{head} yes | {r['tasks']} | {r['peak_bytes'] / GB:.2f} | "
                      f"{r['reload_bytes'] / GB:.1f} | {r['offload_bytes'] / GB:.2f} | "
                      f"{r['makespan_s']:.2f} | {secs:.1f} |", flush=True)


if __name__ == "__main__":
    args = sys.argv[1:] or ["timing"]
    if args[0] == "grid":
        opts = {"--budgets": "16,32", "--policies": "reuse-distance,layerwise"}
        for flag in opts:
            if flag in args:
                k = args.index(flag)
                opts[flag] = args[k + 1]
                del args[k:k + 2]
        grid(tuple(args[1:]) or ("llama-7b", "llama-65b"),
             tuple(int(x) for x in opts["--budgets"].split(",")),
             tuple(opts["--policies"].split(",")))
    elif args[0] == "small":
        small_budgets()
    else:
        timing()
