"""Host compute (issue "The host computes too", first step): predicted decode steps with applies
placed on the host against the device-only plan, per host profile (`--host`).

    python bench/host_bench.py [--json out.json]

Each row compiles one decode step twice on h100-pcie, `--host-compute off` and `auto`, and prints
the predicted step, the host's and the link's busy time, and how many applies the placement put
on the host. Sizes in GB = 10^9 bytes."""
from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import time

from einpage.compiler import CompileOptions, compile_graph
from einpage.ir.memgraph import ApplyNode
from einpage.models import llama, resolve
from einpage.predict.devices import get_device
from einpage.predict.hosts import HOSTS

CASES = (  # model, batch, capacity, budget GB
    ("llama-7b", 16, 8192, 16.0),
    ("mixtral-8x7b", 1, 2048, 24.0),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json")
    ap.add_argument("--hosts", default=",".join(HOSTS))
    args = ap.parse_args()
    rows = []
    for model, batch, capacity, gb in CASES:
        cfg, _ = resolve(model)
        graph = llama.decode_graph(cfg).bind(B=batch, C=capacity)
        for host in args.hosts.split(","):
            profile = dataclasses.replace(get_device("h100-pcie"), host=HOSTS[host])
            out = {"model": model, "batch": batch, "capacity": capacity, "budget_gb": gb,
                   "host": host}
            for mode in ("off", "auto"):
                t0 = time.perf_counter()
                c = compile_graph(graph, CompileOptions(int(gb * 1e9), device=profile,
                                                        host_compute=mode == "auto"))
                s = c.simulation
                out[mode] = {"step_ms": s.makespan_s * 1e3, "host_ms": s.host_s * 1e3,
                             "h2d_ms": s.h2d_s * 1e3, "compute_ms": s.compute_s * 1e3,
                             "h2d_gb": s.h2d_bytes / 1e9,
                             "host_applies": sum(1 for n in c.memgraph.nodes
                                                 if isinstance(n, ApplyNode) and n.on_host),
                             "efficiency": c.report.efficiency,
                             "compile_s": time.perf_counter() - t0}
            out["speedup"] = out["off"]["step_ms"] / out["auto"]["step_ms"]
            rows.append(out)
            a, o = out["auto"], out["off"]
            print(f"| {model} B={batch} C={capacity} | {gb:g} GB | {host} | {o['step_ms']:.1f} "
                  f"| {a['step_ms']:.1f} | {out['speedup']:.2f}x | {a['host_ms']:.1f} | "
                  f"{a['h2d_ms']:.1f} | {a['h2d_gb']:.2f} | {a['host_applies']} | "
                  f"{a['compile_s']:.1f} |", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"machine": platform.platform(), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
