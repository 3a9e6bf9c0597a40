"""Plan files: save and load time and size, JSON and gzip (`.gz`), against the load and save
einpage had before (issue 16). Prints a markdown table; results are in bench/RESULTS.md.

    einpage compile llama-65b --gpu-mem 300MB --quiet -o /tmp/big.json   # or any plan
    python bench/planfile_bench.py /tmp/big.json [--repeat 3] [--before-rev e794194]

Rows: `before` is the earlier `MemGraph.save` / `MemGraph.load`: with `--before-rev REV`, the
memgraph module of that commit itself (read with `git show`); else rebuilt here (`json.loads` of
the text with the garbage collector running, every node's op parsed anew, `to_json` printing
every op anew, one `write_text`). `json` and `json.gz` are `MemGraph.save` / `MemGraph.load` as
they are now. Times are the median of `--repeat` runs in one process, each after a full garbage
collection (the collection a load defers to its caller is counted in the load).
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import einpage.ir.planfile as planfile
from einpage.ir.memgraph import MemGraph
from einpage.ir.ops import op_from_json


def _timed(fn, repeat: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeat):
        out = None
        gc.collect()
        t0 = time.perf_counter()
        out = fn()
        gc.collect(0)  # the youngest generation: where a deferred collection would start
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def _module_at(rev: str, directory: str):
    """einpage/ir/memgraph.py as it was at commit `rev`, imported under another name."""
    root = Path(__file__).resolve().parent.parent
    text = subprocess.run(["git", "show", f"{rev}:einpage/ir/memgraph.py"], cwd=root,
                          check=True, capture_output=True, text=True).stdout
    path = Path(directory) / f"memgraph_{rev}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(f"memgraph_{rev}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _before_load(path: Path) -> MemGraph:
    """The load einpage had before: text, json.loads with the collector on, ops parsed anew."""
    saved = planfile._op_from
    planfile._op_from = op_from_json
    try:
        return MemGraph.from_json(json.loads(path.read_text()))
    finally:
        planfile._op_from = saved


def _before_save(mg: MemGraph, path: Path) -> None:
    """The save einpage had before: to_json printing every op anew, one write_text."""
    path.write_text(json.dumps(mg.to_json(), separators=(",", ":")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan", help="a plan file (einpage compile -o)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--before-rev", help="the commit whose memgraph module is the before row")
    args = ap.parse_args()
    mg = MemGraph.load(args.plan)
    nodes = len(mg.nodes)
    print(f"plan {args.plan}: {nodes} nodes, {len(mg.tensors)} tensors; median of "
          f"{args.repeat}")
    print()
    print("| form | save s | file MB | load s | load nodes/s | same plan |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(args.plan))) as tmp:
        before_save, before_load, label = _before_save, _before_load, "before (json, rebuilt)"
        if args.before_rev:
            old = _module_at(args.before_rev, tmp)
            old_mg = old.MemGraph.from_json(mg.to_json())
            label = f"before (json, {args.before_rev})"

            def before_save(_, path):
                old_mg.save(path)

            before_load = old.MemGraph.load
        rows = ((label, Path(tmp) / "before.json", before_save, before_load),
                ("json", Path(tmp) / "plan.json", MemGraph.save, MemGraph.load),
                ("json.gz", Path(tmp) / "plan.json.gz", MemGraph.save, MemGraph.load))
        for label, path, save, load in rows:
            save_s, _ = _timed(lambda: save(mg, path), args.repeat)
            load_s, back = _timed(lambda: load(path), args.repeat)
            same = MemGraph.from_json(back.to_json()) == mg  # the old module's class too
            size = path.stat().st_size / 1e6
            print(f"| {label} | {save_s:.2f} | {size:.1f} | {load_s:.2f} | "
                  f"{nodes / load_s:,.0f} | {same} |", flush=True)


if __name__ == "__main__":
    main()
