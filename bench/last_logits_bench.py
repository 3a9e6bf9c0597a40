"""The prefill a generation runs computes each row's logits at its last position only
(`llama.prefill_graph(cfg, last=True)`), where `einpage compile` plans the whole prefill's
[B, S, V]: both compiled side by side, predicted on a device profile.

    python bench/last_logits_bench.py [--device h100-pcie]
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from einpage.compiler import CompileOptions, compile_graph  # noqa: E402
from einpage.models import llama  # noqa: E402
from einpage.models.config import preset  # noqa: E402
from einpage.predict.devices import get_device  # noqa: E402
from einpage.units import format_size, parse_size  # noqa: E402

CASES = [("llama-7b", 1, 2048, "4GB"), ("llama3-8b", 1, 2048, "8GB"),
         ("llama3-8b", 16, 2048, "8GB"), ("qwen2.5-7b", 8, 2048, "8GB")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="h100-pcie")
    args = ap.parse_args()
    profile = get_device(args.device)
    print(f"device profile {profile.name}, host budget unlimited")
    print("| model | B x S | budget | logits out: whole -> last | pass s: whole -> last | "
          "speed-up |")
    print("|---|---|---|---|---|---|")
    for name, batch, seq, budget in CASES:
        cfg = preset(name)
        row = []
        for last in (False, True):
            graph = llama.prefill_graph(cfg, last).bind(B=batch, S=seq)
            t0 = time.perf_counter()
            c = compile_graph(graph, CompileOptions(parse_size(budget), device=profile))
            out = sum(math.prod(t.shape) * t.dtype.itemsize for t in c.memgraph.results
                      if t.name == "logits")
            row.append((out, c.simulation.makespan_s, time.perf_counter() - t0))
        (wo, ws, _), (lo, ls, _) = row
        print(f"| {name} | {batch} x {seq} | {budget} | {format_size(wo)} -> {format_size(lo)} "
              f"| {ws:.3f} -> {ls:.3f} | {ws / ls:.3f}x |")


if __name__ == "__main__":
    main()
