"""Plan files, version 1 against version 2: the same plan written without its graph (version 1)
and with it (version 2, provenance), each as JSON and as .gz; size, save, load and validate
(medians of `--repeat` runs in one process). Results are in bench/RESULTS.md.

    einpage compile llama-7b --gpu-mem 200MB --quiet -o /tmp/big.json   # or any plan
    python bench/planfile_versions.py /tmp/big.json [--repeat 3]
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import tempfile
import time
from pathlib import Path

from einpage.ir import MemGraph, validate


def _median_s(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        gc.collect()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plan")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    v2 = MemGraph.load(args.plan)
    if v2.graph is None:
        raise SystemExit(f"{args.plan} carries no graph: compile it again for a version 2 plan")
    v1 = dataclasses.replace(v2, graph=None, tensors=tuple(
        dataclasses.replace(t, block=None) for t in v2.tensors))
    print(f"{args.plan}: {len(v2.nodes)} nodes, {len(v2.graph.tasks)} tasks\n")
    print("| format | file | size | save | load | validate |\n| --- | --- | ---: | ---: | ---: | ---: |")
    with tempfile.TemporaryDirectory() as tmp:
        for name, plan in (("v1", v1), ("v2", v2)):
            for suffix in (".json", ".json.gz"):
                path = Path(tmp) / f"{name}{suffix}"
                save = _median_s(lambda: plan.save(path), args.repeat)
                load = _median_s(lambda: MemGraph.load(path), args.repeat)
                back = MemGraph.load(path)
                check = _median_s(lambda: validate(dataclasses.replace(back)), args.repeat)
                print(f"| {name} | {suffix} | {path.stat().st_size / 1e6:.1f} MB | {save:.2f} s "
                      f"| {load:.2f} s | {check:.2f} s |")


if __name__ == "__main__":
    main()
