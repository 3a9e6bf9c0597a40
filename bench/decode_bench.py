"""Generation under a memory budget (issue 12), predicted by the compiler and simulator (no GPU):

1. FlexGen's setting — prompt 512, 32 new tokens, 16 GB budget, batch 1..64 — for the llama-7b,
   -13b, -30b and -65b shapes on the `t4` and `h100-pcie` profiles: generated tokens/s over
   prefill + decode (FlexGen's throughput), bytes moved per decode step against the bytes no
   plan can avoid (weights + KV - budget), efficiency against the per-step lower bound
   (max(compute, unavoidable bytes / h2d bandwidth)), plans compiled, compile seconds.
2. llama-7b, 16 GB, B=16, a KV store of 2048 rows (the step at position 2047): bytes per step
   against weights + KV - budget.

    python bench/decode_bench.py [--part flexgen|7b|all] [--models llama-7b,...]
                                 [--batches 1,2,...] [--devices t4,h100-pcie] [--json out.json]
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

GB = 1e9


def flexgen(models, batches, devices, budget: int) -> list[dict]:
    rows = []
    for device in devices:
        profile = get_device(device)
        for model in models:
            cfg = preset(model)
            for batch in batches:
                t0 = time.perf_counter()
                f = forecast_generation(cfg, batch, 512, 32, CompileOptions(budget,
                                                                            device=profile))
                wall = time.perf_counter() - t0
                (b,) = f.buckets  # 512 + 31 positions: one bucket (capacity 543)
                c = b.compiled.report.compiled
                row = dict(device=device, model=model, batch=batch,
                           tokens_per_s=f.tokens_per_s, prefill_s=f.prefill_s,
                           step_s=b.step_s, step_bytes=b.step_bytes,
                           min_stream_bytes=c.min_stream_bytes,
                           bytes_ratio=b.step_bytes / c.min_stream_bytes
                           if c.min_stream_bytes else None,
                           step_efficiency=b.efficiency, plans=f.plans,
                           kv_bytes=c.kv_bytes, kv_resident_bytes=c.kv_resident_bytes,
                           compile_s=wall)
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def llama7b_b16(budget: int) -> dict:
    cfg = preset("llama-7b")
    graph = llama.decode_graph(cfg).bind(B=16, C=2048)
    sources = {name: schema.hf_tensor(name) for name in schema.weight_shapes(cfg)}
    t0 = time.perf_counter()
    compiled = compile_graph(graph, CompileOptions(budget, sources=sources))
    wall = time.perf_counter() - t0
    c, sim = compiled.report.compiled, compiled.simulation
    row = dict(case="llama-7b 16GB B=16 C=2048", weight_bytes=c.weight_bytes,
               kv_bytes=c.kv_bytes, min_stream_bytes=c.min_stream_bytes,
               h2d_bytes=sim.h2d_bytes, d2h_bytes=sim.d2h_bytes,
               ratio=(sim.h2d_bytes + sim.d2h_bytes) / c.min_stream_bytes,
               kv_resident_bytes=c.kv_resident_bytes, weight_resident_bytes=c.resident_bytes,
               step_s=sim.makespan_s, compile_s=wall)
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("flexgen", "7b", "all"), default="all")
    ap.add_argument("--models", default="llama-7b,llama-13b,llama-30b,llama-65b")
    ap.add_argument("--batches", default="1,2,4,8,16,32,64")
    ap.add_argument("--devices", default="t4,h100-pcie")
    ap.add_argument("--budget", type=float, default=16e9)
    ap.add_argument("--json", help="write every row here")
    args = ap.parse_args()
    out: dict = {}
    if args.part in ("7b", "all"):
        out["llama7b_b16"] = llama7b_b16(int(args.budget))
    if args.part in ("flexgen", "all"):
        out["flexgen"] = flexgen(args.models.split(","), [int(b) for b in args.batches.split(",")],
                                 args.devices.split(","), int(args.budget))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
