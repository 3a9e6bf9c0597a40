"""Pipeline against tensor parallelism, predicted (issue 31): each case compiled both ways by
`einpage compile --devices N --parallel pipeline|tensor --json` on h100-pcie, with
`--cpu-mem unlimited --host-compute off` (the bound then counts every byte a rank must stream),
and the per-rank figures, the pass, the bound and the efficiency printed as a Markdown table.

    python bench/parallel_bench.py [--quick]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

EINPAGE = Path(sys.executable).parent / "einpage"
COMMON = ("--cpu-mem", "unlimited", "--host-compute", "off", "--json", "--quiet")

#: (label, model, flags, devices, peer link)
CASES = [
    ("llama-65b prefill B=1 S=2048, 16 GB each", "llama-65b", ("--gpu-mem", "16GB"), 2, "pcie"),
    ("", "llama-65b", ("--gpu-mem", "16GB"), 4, "pcie"),
    ("", "llama-65b", ("--gpu-mem", "16GB"), 4, "nvlink"),
    ("llama3.1-70b decode B=16, 24 GB each", "llama3.1-70b",
     ("--phase", "decode", "--batch", "16", "--gpu-mem", "24GB"), 4, "pcie"),
    ("", "llama3.1-70b", ("--phase", "decode", "--batch", "16", "--gpu-mem", "24GB"), 4,
     "nvlink"),
    ("llama3.1-70b decode B=1, 24 GB each", "llama3.1-70b",
     ("--phase", "decode", "--batch", "1", "--gpu-mem", "24GB"), 4, "pcie"),
    ("llama-7b decode B=1, 4 GB each", "llama-7b",
     ("--phase", "decode", "--batch", "1", "--gpu-mem", "4GB"), 2, "pcie"),
    ("llama-7b prefill B=1 S=2048, 8 GB each", "llama-7b", ("--gpu-mem", "8GB"), 2, "pcie"),
]
QUICK = {"llama-7b"}


def report(model: str, flags, devices: int, link: str, parallel: str) -> dict:
    argv = [str(EINPAGE), "compile", model, *flags, "--devices", str(devices), "--parallel",
            parallel, "--peer-link", link, *COMMON]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode:
        sys.exit(f"{' '.join(argv)} failed:\n{done.stderr}")
    return json.loads(done.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the llama-7b cases only")
    args = ap.parse_args()
    print("| case | devices | link | parallel | streamed a rank | sent a rank | pass | bound | "
          "efficiency | tensor / pipeline |")
    print("|---|---:|---|---|---:|---:|---:|---:|---:|---:|")
    label = ""
    for case, model, flags, devices, link in CASES:
        label = case or label
        if args.quick and model not in QUICK:
            continue
        got = {p: report(model, flags, devices, link, p) for p in ("pipeline", "tensor")}
        for p, r in got.items():
            ranks = r["ranks"]
            ratio = (f"{got['tensor']['makespan_s'] / got['pipeline']['makespan_s']:.2f}x"
                     if p == "tensor" else "")
            print(f"| {case if p == 'pipeline' else ''} | {devices} | {link} | {p} | "
                  f"{max(x['streamed_bytes'] for x in ranks) / 1e9:.2f} GB | "
                  f"{max(x['sent_bytes'] for x in ranks) / 1e9:.3f} GB | "
                  f"{r['makespan_s'] * 1e3:.1f} ms | {r['bound_s'] * 1e3:.1f} ms | "
                  f"{r['efficiency']:.3f} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
