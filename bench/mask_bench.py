"""Masked-out attention blocks dropped at partition time, before and after (prints a markdown
table; results are recorded in bench/RESULTS.md).

    python bench/mask_bench.py                         # llama-7b B=1 S=8192 at 16 GB
    python bench/mask_bench.py llama-7b:1:8192:16 mistral-7b:1:16384:16 --reps 3

Each row compiles the prefill twice, with `CompileOptions(drop_constant_blocks=False)` ("before":
every block gets its tasks) and with the default ("after"), and prints side by side: tasks,
attention FLOPs (tasks of the ops over key positions `t`: QK^T, the mask add, softmax, probs @ V,
and the mask fills), all FLOPs, device-memory bytes of the tasks, host<->device bytes moved,
predicted compute and pass seconds (h100-pcie cost model, stream simulator), and compile seconds
(median of `--reps`, partitioning alone in parentheses). Every figure but the compile seconds is
predicted, not measured.
"""
from __future__ import annotations

import argparse
import statistics
import time

from einpage.compiler import CompileOptions, compile_graph
from einpage.compiler.partitioner import PartitionOptions, partition
from einpage.ir.graph import Einsum, Fill
from einpage.models import llama
from einpage.models.config import preset
from einpage.predict.cost import op_work

GB = 10**9


def attention_nodes(graph) -> set[int]:
    """Ops over key positions: einsums with index `t` and the 2-d mask fills."""
    out = set()
    for n in graph.nodes:
        if isinstance(n.op, Einsum) and "t" in n.op.spec.join_indices:
            out.add(n.id)
        elif isinstance(n.op, Fill) and len(n.shape) == 2:
            out.add(n.id)
    return out


def figures(graph, compiled) -> dict:
    tg = compiled.taskgraph
    attn = attention_nodes(graph)
    flops = attn_flops = hbm = 0.0
    attn_tasks = 0
    for t in tg.tasks:
        reads = [tg.blocks[b] for b in t.reads]
        w = tg.blocks[t.write]
        f, moved, _, _ = op_work(t.op, [b.shape for b in reads], sum(b.bytes for b in reads),
                                 w.shape, w.bytes, w.dtype.value, t.accumulate)
        flops += f
        hbm += moved
        if t.node in attn:
            attn_flops += f
            attn_tasks += 1
    r = compiled.report.to_json()
    return {"tasks": len(tg.tasks), "attention tasks": attn_tasks,
            "attention TFLOP": attn_flops / 1e12, "all TFLOP": flops / 1e12,
            "task HBM GB": hbm / GB, "h2d GB": r["h2d_bytes"] / GB, "d2h GB": r["d2h_bytes"] / GB,
            "compute s": r["compute_s"], "pass s (predicted)": r["makespan_s"],
            "efficiency": r["efficiency"]}


def measure(model: str, batch: int, seq: int, gpu_gb: float, drop: bool, reps: int):
    graph = llama.prefill_graph(preset(model)).bind(B=batch, S=seq)
    options = CompileOptions(int(gpu_gb * GB), drop_constant_blocks=drop)
    secs, part = [], []
    compiled = None
    for _ in range(reps):
        t0 = time.perf_counter()
        compiled = compile_graph(graph, options)
        secs.append(time.perf_counter() - t0)
        block = options.block_bytes or max(4096, int(options.device_bytes * options.block_fraction))
        t0 = time.perf_counter()
        partition(graph, PartitionOptions(block, drop_constant_blocks=drop))
        part.append(time.perf_counter() - t0)
    out = figures(graph, compiled)
    out["compile s"] = statistics.median(secs)
    out["partition s"] = statistics.median(part)
    return out


def fmt(key: str, v) -> str:
    if isinstance(v, int):
        return str(v)
    if key in ("efficiency",):
        return f"{v:.4f}"
    return f"{v:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rows", nargs="*", default=["llama-7b:1:8192:16"],
                    help="model:batch:seq:budget_GB")
    ap.add_argument("--reps", type=int, default=3, help="compiles per figure (median)")
    args = ap.parse_args()
    for row in args.rows:
        model, batch, seq, gpu = row.split(":")
        before = measure(model, int(batch), int(seq), float(gpu), False, args.reps)
        after = measure(model, int(batch), int(seq), float(gpu), True, args.reps)
        print(f"\n{model} B={batch} S={seq} --gpu-mem {gpu}GB (h100-pcie)\n")
        print("| figure | before (no dropping) | after | after / before |")
        print("|---|---|---|---|")
        for key in before:
            b, a = before[key], after[key]
            ratio = f"{a / b:.3f}" if b else "-"
            print(f"| {key} | {fmt(key, b)} | {fmt(key, a)} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
