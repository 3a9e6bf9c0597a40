"""The disk tier (issue 14): weights that do not fit in host memory read from the checkpoint
files every pass.

`predict`: llama-65b and llama3.1-70b, prefill (B=1, S=2048) and FlexGen's generation setting
(prompt 512, 32 new tokens, batch 8), a 16 GB GPU, host budgets of 32/64/128/256 GB, NVMe drives
of 3 and 7 GB/s, on the h100-pcie and rtx4090 profiles: seconds per pass, bytes per tier
(resident on the GPU, pinned in host memory, read from disk), and efficiency against the
plan's bound (compute, link, disk).

`measure`: on this machine, a LLaMA-shaped checkpoint of 1.08 GB (random f32 weights) run on the
threads backend with `--cpu-mem` a quarter of it, every disk read's pages dropped from the page
cache so each pass reads the drive: achieved read GB/s of the disk queue against
`einpage calibrate --disk` on the same directory, the measured pass against the predicted one
(on a profile calibrated here, disk included), and against the same plan with unlimited host
memory, side by side (medians of `--reps` passes, alternating).

    python bench/disk_bench.py predict [--json out.json]
    python bench/disk_bench.py measure [--reps 5] [--seq 128] [--workdir /tmp/einpage-disk]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from einpage.compiler import CompileOptions, compile_graph
from einpage.forecast import forecast_generation
from einpage.models import llama, resolve, schema
from einpage.models.config import preset
from einpage.predict import get_device, with_overrides

GB = 10**9
MODELS = ("llama-65b", "llama3.1-70b")
HOSTS = (32, 64, 128, 256)
DISKS = (3, 7)
DEVICES = ("h100-pcie", "rtx4090")


def tiers(report) -> dict:
    w = report.workload
    return dict(resident_gb=(report.compiled.resident_bytes if report.compiled else 0) / GB,
                pinned_gb=w.get("pinned_bytes", 0) / GB,
                disk_weights_gb=w.get("disk_weight_bytes", 0) / GB,
                host_peak_gb=w.get("host_peak_bytes", 0) / GB)


def predict_rows(models, hosts, disks, devices, gpu: int):
    for model in models:
        cfg = preset(model)
        sources = {name: schema.hf_tensor(name) for name in schema.weight_shapes(cfg)}
        graph = llama.prefill_graph(cfg).bind(B=1, S=2048)
        for device in devices:
            for host in hosts:
                for disk in disks:
                    profile = with_overrides(get_device(device), disk_bandwidth=disk * GB)
                    options = CompileOptions(gpu, device=profile, host_bytes=host * GB,
                                             sources=sources)
                    t0 = time.perf_counter()
                    c = compile_graph(graph, options)
                    sim = c.simulation
                    yield dict(model=model, device=device, host_gb=host, disk_gbps=disk,
                               workload="prefill B=1 S=2048", pass_s=sim.makespan_s,
                               compute_s=sim.compute_s, h2d_gb=sim.h2d_bytes / GB,
                               disk_gb=sim.disk_bytes / GB, disk_s=sim.disk_s,
                               bound_s=sim.lower_bound_s, efficiency=sim.efficiency,
                               tokens_per_s=2048 / sim.makespan_s,
                               compile_s=time.perf_counter() - t0, **tiers(c.report))
                    t0 = time.perf_counter()
                    f = forecast_generation(cfg, 8, 512, 32, options)
                    pre = f.prefill.simulation
                    steps = [(b.steps, b.compiled) for b in f.buckets]
                    disk_gb = (pre.disk_bytes + sum(n * c.simulation.disk_bytes
                                                    for n, c in steps)) / GB
                    bound = pre.lower_bound_s + sum(n * c.simulation.lower_bound_s
                                                    for n, c in steps)
                    step = steps[-1][1]
                    yield dict(model=model, device=device, host_gb=host, disk_gbps=disk,
                               workload="FlexGen: prompt 512, 32 new, batch 8",
                               pass_s=f.total_s, step_s=step.simulation.makespan_s,
                               disk_gb=disk_gb, bound_s=bound, efficiency=bound / f.total_s,
                               tokens_per_s=f.tokens_per_s,
                               compile_s=time.perf_counter() - t0, **tiers(step.report))


def cmd_predict(args) -> None:
    rows = []
    for row in predict_rows(MODELS, HOSTS, DISKS, DEVICES, 16 * GB):
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


# ------------------------------------------------------------------ measured on this machine
SHAPE = dict(hidden=1024, layers=16, heads=16, kv_heads=16, intermediate=2816, vocab=32000)


def write_model(directory: Path) -> Path:
    """A LLaMA checkpoint of SHAPE, random f32 weights (kept between runs)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from stream_cpu_bench import write_model as write
    return write(directory, SHAPE)


def cmd_measure(args) -> None:
    from einpage.calibrate import calibrate, measure_disk
    from einpage.runtime.backends.threads import ThreadsBackend
    from einpage.runtime.stream_executor import StreamSession
    ckpt = write_model(Path(args.workdir) / "llama-271m")
    cfg, weights = resolve(str(ckpt))
    file_bytes = (ckpt / "model.safetensors").stat().st_size
    weight_bytes = cfg.weight_bytes(cfg.dtype)
    print(f"model: {cfg.parameters / 1e6:.0f}M parameters, {file_bytes / 1e9:.3f} GB file; "
          f"prefill B=1 S={args.seq}", flush=True)
    rate, latency, how = measure_disk(args.workdir)
    print(f"calibrate --disk {args.workdir}: {rate / 1e9:.3f} GB/s, {latency * 1e3:.3f} ms "
          f"per 4 KB read ({how})", flush=True)
    profile = calibrate("threads", disk=args.workdir)
    print("calibrated:", json.dumps({k: v for k, v in profile.to_json().items()
                                     if k != "source"}), flush=True)
    graph = llama.prefill_graph(cfg).bind(B=1, S=args.seq)
    inputs = {"tokens": np.random.default_rng(1).integers(0, cfg.vocab, (1, args.seq))}
    budget, host = weight_bytes // 4, file_bytes // 4
    base = CompileOptions(budget, device=profile)
    plans = {"host 1/4": compile_graph(graph, dataclasses.replace(base, host_bytes=host)),
             "host unlimited": compile_graph(graph, base)}
    for label, c in plans.items():
        w, sim = c.memgraph.meta, c.simulation
        print(f"{label}: reads {c.memgraph.count('read')} blocks, {sim.disk_bytes / 1e9:.3f} GB "
              f"from disk per pass; pinned {w.get('pinned_bytes', 0) / 1e9:.3f} GB, staging "
              f"{w.get('staging_bytes', 0) / 1e9:.3f} GB, host peak "
              f"{w.get('host_peak_bytes', 0) / 1e9:.3f} GB of {host / 1e9:.3f}; predicted "
              f"{sim.makespan_s:.3f} s (compute {sim.compute_s:.3f}, h2d {sim.h2d_s:.3f}, disk "
              f"{sim.disk_s:.3f})", flush=True)
    walls = {k: [] for k in plans}
    runs = {k: [] for k in plans}
    sessions = {k: StreamSession(c.memgraph, weights, ThreadsBackend(drop_cache=True))
                for k, c in plans.items()}
    outs = {}
    try:
        for k, s in sessions.items():  # first pass: loads resident weights, warms pinned ones
            outs[k] = s.run(inputs).outputs["logits"]
        same = float(np.abs(outs["host 1/4"] - outs["host unlimited"]).max())
        print(f"logits: max |host 1/4 - unlimited| = {same:.3g}", flush=True)
        for _ in range(args.reps):
            for k, s in sessions.items():
                m = s.run(inputs).measured
                walls[k].append(m.wall_s)
                runs[k].append(m)
    finally:
        for s in sessions.values():
            s.close()
    for k, c in plans.items():
        ms = runs[k]
        wall = statistics.median(walls[k])
        disk_rate = statistics.median(m.rate("disk") for m in ms)
        disk_gb = statistics.median(m.bytes("disk") for m in ms) / 1e9
        print(json.dumps(dict(
            plan=k, measured_s=wall, predicted_s=c.simulation.makespan_s,
            measured_over_predicted=wall / c.simulation.makespan_s,
            disk_gb=disk_gb, disk_read_gbps=disk_rate / 1e9,
            disk_over_calibrated=disk_rate / rate if rate else None,
            disk_busy_s=statistics.median(m.busy_s("disk") for m in ms),
            compute_busy_s=statistics.median(m.busy_s("compute") for m in ms),
            h2d_busy_s=statistics.median(m.busy_s("h2d") for m in ms),
            walls=[round(x, 3) for x in walls[k]])), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("predict")
    p.add_argument("--json")
    m = sub.add_parser("measure")
    m.add_argument("--reps", type=int, default=5)
    m.add_argument("--seq", type=int, default=128)
    m.add_argument("--workdir", default="/tmp/einpage-disk")
    args = ap.parse_args()
    {"predict": cmd_predict, "measure": cmd_measure}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
