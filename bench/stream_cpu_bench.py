"""The stream runtime on a CPU (issue 10's measurements), side by side in one process:

1. `threads` against the sequential executor on the same plan, for a LLaMA-shaped model of
   134M parameters read from a safetensors file (random weights, f32, 537 MB), prefill B=1 S=256,
   under budgets of 1/2, 1/4 and 1/8 of its weights (and unconstrained): wall-time ratio, the
   achieved read rate of the h2d queue (memory-mapped checkpoint -> arena) and the share of the
   h2d queue's time hidden behind compute.
2. Measured against predicted on a profile calibrated here (`einpage calibrate`), per row.
3. The floor of this path: the plan's contractions alone through BLAS (every matmul apply of the
   unconstrained plan on arrays of its shapes), against the unconstrained and the 1/4 passes.

Every figure is the median of `--reps` runs, the two executors alternating.

    python bench/stream_cpu_bench.py [--reps 5] [--seq 256] [--workdir /tmp/einpage-bench]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from einpage.calibrate import calibrate
from einpage.compiler import CompileOptions, compile_graph
from einpage.ir import scalar
from einpage.ir.memgraph import ApplyNode
from einpage.ir.ops import EinsumOp
from einpage.models import llama, resolve
from einpage.runtime import kernels
from einpage.runtime.executor import run
from einpage.runtime.stream_executor import run_streams

SHAPE = dict(hidden=768, layers=12, heads=12, kv_heads=12, intermediate=2048, vocab=32000)


def write_model(directory: Path, shape: dict = SHAPE) -> Path:
    """A LLaMA checkpoint of `shape` with random f32 weights (kept between runs)."""
    if (directory / "model.safetensors").exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    SHAPE = shape  # noqa: N806 - the layout below reads it
    h, f, v = SHAPE["hidden"], SHAPE["intermediate"], SHAPE["vocab"]
    rng = np.random.default_rng(0)

    def mat(*shape):
        return (0.02 * rng.standard_normal(shape)).astype(np.float32)

    w = {"model.embed_tokens.weight": mat(v, h), "model.norm.weight": np.ones(h, np.float32),
         "lm_head.weight": mat(v, h)}
    for i in range(SHAPE["layers"]):
        p = f"model.layers.{i}."
        w.update({p + "input_layernorm.weight": np.ones(h, np.float32),
                  p + "post_attention_layernorm.weight": np.ones(h, np.float32),
                  p + "self_attn.q_proj.weight": mat(h, h), p + "self_attn.k_proj.weight": mat(h, h),
                  p + "self_attn.v_proj.weight": mat(h, h), p + "self_attn.o_proj.weight": mat(h, h),
                  p + "mlp.gate_proj.weight": mat(f, h), p + "mlp.up_proj.weight": mat(f, h),
                  p + "mlp.down_proj.weight": mat(h, f)})
    save_file(w, str(directory / "model.safetensors"))
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
              "hidden_size": h, "intermediate_size": f, "num_attention_heads": SHAPE["heads"],
              "num_key_value_heads": SHAPE["kv_heads"], "num_hidden_layers": SHAPE["layers"],
              "vocab_size": v, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "max_position_embeddings": 2048, "tie_word_embeddings": False,
              "hidden_act": "silu", "torch_dtype": "float32"}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def blas_work(mg) -> list:
    """The plan's contractions: (op, random arrays of its read shapes) for every matmul apply."""
    rng = np.random.default_rng(0)
    work = []
    for n in mg.nodes:
        if isinstance(n, ApplyNode) and isinstance(n.op, EinsumOp):
            op = n.op
            k = len(op.spec.inputs)
            if (k == 2 and op.agg in (None, "sum") and op.spec.contracted
                    and scalar.scaled_product_factor(op.join, k) is not None):
                arrays = [rng.standard_normal(mg.tensors[a.tensor].shape).astype(np.float32)
                          for a in n.reads]
                out = np.empty(mg.tensors[n.write.tensor].shape, np.float32)
                work.append((op, arrays, out))
    return work


def blas_seconds(work) -> float:
    """Seconds the contractions of `blas_work` take through BLAS alone, one after another: one
    (batched) matmul into a preallocated output where the spec is one, else NumPy's einsum."""
    t0 = time.perf_counter()
    for op, arrays, out in work:
        if not kernels.einsum_into(op.spec, op.join, op.agg, arrays, out):
            kernels.einsum(op.spec, op.join, op.agg, arrays, np.dtype(np.float32))
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--workdir", default="/tmp/einpage-bench")
    args = ap.parse_args()
    ckpt = write_model(Path(args.workdir) / "llama-134m")
    cfg, weights = resolve(str(ckpt))
    weight_bytes = cfg.weight_bytes(cfg.dtype)
    print(f"model: {cfg.parameters / 1e6:.0f}M parameters, {weight_bytes / 1e6:.0f} MB f32 "
          f"weights in {ckpt / 'model.safetensors'}; prefill B=1 S={args.seq}")
    profile = calibrate("threads")
    print("calibrated:", json.dumps({k: v for k, v in profile.to_json().items()
                                     if k != "source"}))
    graph = llama.prefill_graph(cfg).bind(B=1, S=args.seq)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab, (1, args.seq))
    inputs = {"tokens": tokens}
    rows, work = [], None
    for label, budget in (("unconstrained", 4 * weight_bytes), ("1/2", weight_bytes // 2),
                          ("1/4", weight_bytes // 4), ("1/8", weight_bytes // 8)):
        compiled = compile_graph(graph, CompileOptions(budget, device=profile))
        mg = compiled.memgraph
        work = work if work is not None else blas_work(mg)  # the unconstrained plan's
        seq, thr, floor = [], [], []
        for _ in range(args.reps):  # the three side by side, alternating
            t0 = time.perf_counter()
            run(mg, inputs, weights, poison_freed=False)
            seq.append(time.perf_counter() - t0)
            thr.append(run_streams(mg, inputs, weights, "threads").measured)
            floor.append(blas_seconds(work))
        m = sorted(thr, key=lambda x: x.wall_s)[len(thr) // 2]
        wall = statistics.median(x.wall_s for x in thr)
        sim = compiled.simulation
        rows.append(dict(
            budget=label, budget_mb=budget / 1e6, nodes=len(mg.nodes),
            reload_mb=mg.moved_bytes("reload") / 1e6, offload_mb=mg.moved_bytes("offload") / 1e6,
            sequential_s=statistics.median(seq), threads_s=wall,
            ratio=statistics.median(seq) / wall, load_s=m.load_s,
            read_gbps=statistics.median(x.rate("h2d") for x in thr) / 1e9,
            hidden=statistics.median(x.hidden_fraction("h2d") for x in thr),
            compute_busy_s=statistics.median(x.busy_s("compute") for x in thr),
            predicted_s=sim.makespan_s, measured_over_predicted=wall / sim.makespan_s,
            predicted_compute_s=sim.compute_s, predicted_h2d_s=sim.h2d_s,
            blas_floor_s=statistics.median(floor),
            over_floor=statistics.median(x.wall_s / f for x, f in zip(thr, floor))))
    cols = ["budget", "budget_mb", "nodes", "reload_mb", "offload_mb", "sequential_s",
            "threads_s", "ratio", "read_gbps", "hidden", "compute_busy_s", "predicted_s",
            "measured_over_predicted", "predicted_compute_s", "predicted_h2d_s", "load_s",
            "blas_floor_s", "over_floor"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c])
                                for c in cols) + " |")
    by = {r["budget"]: r for r in rows}
    print(f"\nthreads pass / BLAS floor (median of per-rep ratios): unconstrained "
          f"{by['unconstrained']['over_floor']:.2f}x (goal <= 1.3x); 1/4 budget "
          f"{by['1/4']['over_floor']:.2f}x (goal <= 2x)")


if __name__ == "__main__":
    main()
