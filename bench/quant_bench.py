"""Quantized weights on this machine (issue 29): the threads backend's pass with f16 weights and
with the same weights kept as Q8_0 and Q4_0, side by side in one process.

LLaMA-7B shapes (hidden 4096, ffn 11008, 32 heads, vocab 32000) with `--layers` layers, random
weights made once and held in host memory as a GGUF file's reader would hold them: f16 arrays,
and for each format the packed bytes (quantized once, as `einpage.ir.quant.quantize` does
block by block). Every plan is compiled for one budget, `--fraction` of the f16 weights (1/8: even
the Q4_0 weights, 0.28 of f16's, do not fit, so every plan streams), held open
in a `StreamSession`, and run `--reps` times after a warm-up pass; the formats alternate within
each repetition. Printed: the median wall time of a pass, its ratio to f16's, the bytes the pass
moves host->device, and the predicted pass on h100-pcie with the ratio to f16's (the cost model's
view of the same plans).

    python bench/quant_bench.py [--layers 2] [--seq 64] [--reps 5] [--phase prefill|decode]
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import numpy as np

from einpage.compiler import CompileOptions, compile_graph
from einpage.models import config, llama, schema
from einpage.ir.quant import quantize
from einpage.runtime.stream_executor import StreamSession


class HeldWeights:
    """Weights held in host memory, packed where `cfg` stores them packed (a GGUF file's view)."""

    def __init__(self, cfg, dense: dict[str, np.ndarray]):
        self.storages = schema.weight_storage(cfg)
        self.arrays = {name: quantize(value, self.storages[name]) if name in self.storages
                       else value for name, value in dense.items()}

    def storage(self, name):
        return self.storages.get(name)

    def __call__(self, name):
        return self.arrays[name]


def dense_weights(cfg, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in schema.weight_shapes(cfg).items():
        scale = 1.0 if name.endswith("norm") else shape[-1] ** -0.5
        out[name] = (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float16)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--phase", choices=("prefill", "decode"), default="prefill")
    ap.add_argument("--formats", default="f16,q8_0,q4_0")
    ap.add_argument("--fraction", type=float, default=1 / 8,
                    help="the budget, as a share of the f16 weights")
    args = ap.parse_args()
    base = replace(config.preset("llama-7b"), layers=args.layers, name=f"llama-7b-{args.layers}l")
    dense = dense_weights(base)
    rng = np.random.default_rng(1)
    rows = {}
    for fmt in args.formats.split(","):
        cfg = base if fmt == "f16" else schema.quantized(base, fmt)
        weights = HeldWeights(cfg, dense)
        if args.phase == "prefill":
            graph = llama.prefill_graph(cfg).bind(B=args.batch, S=args.seq)
            inputs = {"tokens": rng.integers(0, cfg.vocab, (args.batch, args.seq))}
        else:
            cap = 256
            graph = llama.decode_graph(cfg).bind(B=args.batch, C=cap)
            inputs = {"tokens": rng.integers(0, cfg.vocab, (args.batch, 1)),
                      "pos": np.full(args.batch, args.seq)}
            for node in graph.inputs:
                if node.op.role.value == "cache":
                    inputs[node.op.name] = (0.1 * rng.standard_normal(tuple(node.shape))
                                            ).astype(np.float16)
        compiled = compile_graph(graph, CompileOptions(int(base.weight_bytes() * args.fraction)))
        session = StreamSession(compiled.memgraph, weights, "threads")
        session.run(inputs)  # warm-up: opens the backend, loads the resident blocks
        rows[fmt] = dict(session=session, inputs=inputs, times=[], compiled=compiled,
                         bytes=cfg.weight_bytes())
    for _ in range(args.reps):
        for fmt, row in rows.items():
            start = time.perf_counter()
            row["session"].run(row["inputs"])
            row["times"].append(time.perf_counter() - start)
    base_t = statistics.median(rows["f16"]["times"]) if "f16" in rows else None
    base_p = rows["f16"]["compiled"].report.simulation.makespan_s if "f16" in rows else None
    print(f"llama-7b shapes, {args.layers} layers, {args.phase} B={args.batch} "
          f"{'S' if args.phase == 'prefill' else 'past'}={args.seq}, budget "
          f"{base.weight_bytes() * args.fraction / 1e9:.3f} GB ({args.fraction:g} of f16's), "
          f"threads backend, median of {args.reps}")
    print(f"{'format':<7} {'weights':>9} {'h2d/pass':>9} {'pass s':>8} {'x f16':>6} "
          f"{'predicted s':>11} {'x f16':>6}")
    for fmt, row in rows.items():
        row["session"].close()
        t = statistics.median(row["times"])
        report = row["compiled"].report
        p = report.simulation.makespan_s
        print(f"{fmt:<7} {row['bytes'] / 1e9:>8.2f}G {report.traffic.reload_bytes / 1e9:>8.2f}G "
              f"{t:>8.3f} {t / base_t if base_t else float('nan'):>6.3f} {p:>11.4f} "
              f"{p / base_p if base_p else float('nan'):>6.3f}")


if __name__ == "__main__":
    main()
