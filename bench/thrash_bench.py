"""Activation-thrash benchmark (issue 3): bytes moved per pass for large batch x sequence prefill.

Prints a markdown table; each cell is compiled once (with validation), one at a time. "reload" is
every host->device byte (streamed weights, token ids, spilled activations coming back); "offload"
is activations spilled to the host and, in parentheses, outputs (KV cache, logits) written back
once final, which a pass that cannot keep them on the device must deliver anyway; "makespan" is
the simulator's prediction on the default device profile.

    python bench/thrash_bench.py               # every cell
    python bench/thrash_bench.py llama-7b:32:8192 llama-65b:4:2048   # chosen cells
"""
from __future__ import annotations

import sys
import time

from einpage.compiler import CompileOptions, compile_graph
from einpage.errors import BudgetError
from einpage.models import llama
from einpage.models.config import preset

GB = 10**9

CELLS = (("llama-7b", 1, 2048), ("llama-7b", 16, 2048), ("llama-7b", 32, 2048),
         ("llama-7b", 16, 8192), ("llama-7b", 32, 8192),
         ("llama-65b", 1, 2048), ("llama-65b", 4, 2048), ("llama-65b", 16, 2048))


def measure(model: str, batch: int, seq: int, gpu_gb: float = 16) -> str:
    graph = llama.prefill_graph(preset(model)).bind(B=batch, S=seq)
    t0 = time.perf_counter()
    try:
        r = compile_graph(graph, CompileOptions(int(gpu_gb * GB))).report.to_json()
    except BudgetError as exc:
        return f"| {model} | {batch} | {seq} | {gpu_gb:g} GB | failed: {str(exc)[:80]} |" + " |" * 5
    secs = time.perf_counter() - t0
    makespan = f"{r['makespan_s']:.1f}" if "makespan_s" in r else "-"
    return (f"| {model} | {batch} | {seq} | {gpu_gb:g} GB | {r['tasks']} | "
            f"{r['reload_bytes'] / GB:.2f} | {r['offload_bytes'] / GB:.2f} "
            f"({r.get('writeback_bytes', 0) / GB:.1f}) | {r['streamed_weight_bytes'] / GB:.2f} | "
            f"{makespan} | {secs:.1f} |")


def main(argv: list[str]) -> None:
    cells = [(m, int(b), int(s)) for m, b, s in (a.split(":") for a in argv)] or CELLS
    print("| model | B | S | budget | tasks | reload GB | offload GB (write-back GB) "
          "| streamed weight GB | makespan s | compile s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for model, batch, seq in cells:
        print(measure(model, batch, seq), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
