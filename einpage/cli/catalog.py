"""`einpage models`, `einpage devices` and `einpage calibrate`: the model presets, the cost
model's device profiles, and a profile measured on this machine."""
from __future__ import annotations

import json

from einpage.cli.outputs import OutputPath
from einpage.units import format_size


def add_commands(sub) -> None:
    sub.add_parser("models", help="list the model presets: family, parameters, weight bytes")
    d = sub.add_parser("devices", help="list the device profiles of the cost model")
    d.add_argument("--json", action="store_true", help="print them as JSON (the --device-file "
                                                       "format)")
    c = sub.add_parser("calibrate", help="measure this machine through a backend and write a "
                                         "device profile (for --device-file)")
    c.add_argument("--backend", default="threads", choices=("threads", "cupy"),
                   help="measure the CPU through the threads backend, or the GPU through cupy")
    c.add_argument("-o", "--output", action=OutputPath,
                   help="write the profile here (JSON); default: print it")
    c.add_argument("--host-out", action=OutputPath,
                   help="also measure this machine as a host (what an apply placed on the host "
                        "costs: BLAS, casts, memory over every core) and write that profile "
                        "here (for --host-file)")
    c.add_argument("--disk", help="also measure the read bandwidth and latency of the drive "
                                  "holding this file or directory (1 GB is written there and "
                                  "removed; reads bypass the page cache where the OS allows)")


def cmd_models(args) -> None:
    """The presets: family, parameters (active ones for a mixture of experts), f16 weight bytes
    and shapes."""
    from einpage.ir.dtypes import DType
    from einpage.models.config import PRESETS
    from einpage.models.schema import quantized
    print(f"{'name':<14} {'family':<8} {'params':>9} {'active':>8} {'f16 weights':>12} "
          f"{'q8_0':>10} {'q4_0':>10} {'layers':>6} {'hidden':>6} {'heads':>5} {'kv':>3} "
          f"{'vocab':>7}  notes")
    for cfg in PRESETS.values():
        notes = []
        if cfg.rope_scaling:
            notes.append(f"rope {cfg.rope_scaling.kind} x{cfg.rope_scaling.factor:g}")
        if cfg.sliding_window:
            notes.append(f"window {cfg.sliding_window}")
        if cfg.qkv_bias:
            notes.append("qkv bias")
        if cfg.qk_norm:
            notes.append("q/k norm")
        if cfg.experts:
            notes.append(f"top-{cfg.experts_per_token} of {cfg.experts} experts")
        if cfg.tied:
            notes.append("tied embeddings")
        if cfg.head_dim * cfg.heads != cfg.hidden:
            notes.append(f"head_dim {cfg.head_dim}")
        line = (f"{cfg.name:<14} {cfg.family:<8} {_billions(cfg.parameters):>9} "
              f"{_billions(cfg.active_parameters):>8} "
              f"{format_size(cfg.weight_bytes(DType.f16)):>12} "
              f"{format_size(quantized(cfg, 'q8_0').weight_bytes(DType.f16)):>10} "
              f"{format_size(quantized(cfg, 'q4_0').weight_bytes(DType.f16)):>10} "
              f"{cfg.layers:>6} {cfg.hidden:>6} "
              f"{cfg.heads:>5} {cfg.kv_heads:>3} {cfg.vocab:>7}  {', '.join(notes)}")
        print(line.rstrip())


def _billions(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e7 else f"{n / 1e6:.2f}M"


def cmd_devices(args) -> None:
    from einpage.predict import PROFILES
    if args.json:
        print(json.dumps({name: p.to_json() for name, p in PROFILES.items()}, indent=1))
        return
    print(f"{'name':<10} {'f16 TFLOP/s':>11} {'f32 TFLOP/s':>11} {'HBM GB/s':>9} "
          f"{'h2d GB/s':>8} {'memory':>9}  source")
    for p in PROFILES.values():
        print(f"{p.name:<10} {p.matmul_flops['f16'] / 1e12:>11.1f} "
              f"{p.matmul_flops['f32'] / 1e12:>11.1f} {p.hbm_bandwidth / 1e9:>9.0f} "
              f"{p.h2d_bandwidth / 1e9:>8.2f} {format_size(p.memory_bytes):>9}  {p.source}")
    from einpage.predict.hosts import DEFAULT_HOST, HOSTS
    print(f"\nhosts (--host; default {DEFAULT_HOST}):")
    print(f"{'name':<10} {'cores':>5} {'f32 TFLOP/s':>11} {'memory GB/s':>11} "
          f"{'kernels f16|packed G/s/core':>27}  source")
    for h in HOSTS.values():
        print(f"{h.name:<10} {h.cores:>5} {h.matmul_flops / 1e12:>11.2f} "
              f"{h.memory_bandwidth / 1e9:>11.0f} "
              f"{f'{h.stored_rate / 1e9:.2f} | {h.packed_rate / 1e9:.2f}':>27}  {h.source}")


def cmd_calibrate(args) -> None:
    import sys

    from einpage.calibrate import calibrate
    from einpage.cli.common import write_text  # -o was checked before measuring (main)
    profile = calibrate(args.backend, progress=lambda what: print(f"measuring {what} ...",
                                                                  file=sys.stderr),
                        disk=args.disk)
    text = json.dumps(profile.to_json(), indent=1)
    if not args.output:
        print(text)
        _host_out(args)
        return
    write_text(args.output, text + "\n")
    _host_out(args)
    mm = profile.matmul_flops
    print(f"wrote {args.output}: h2d {profile.h2d_bandwidth / 1e9:.2f} GB/s, d2h "
          f"{profile.d2h_bandwidth / 1e9:.2f} GB/s, matmul f32 {mm['f32'] / 1e9:.1f} GFLOP/s, "
          f"memory {profile.hbm_bandwidth / 1e9:.1f} GB/s, per node "
          f"{profile.launch_overhead * 1e6:.0f} us"
          + (f" issued, {profile.graph_launch_overhead * 1e6:.1f} us in a replayed CUDA graph"
             if profile.graph_launch_overhead is not None else "")
          + (f", disk {profile.disk_bandwidth / 1e9:.2f} GB/s ({profile.disk_latency * 1e3:.2f} ms "
             "per read)" if args.disk else ""))


def _host_out(args) -> None:
    """`--host-out`: measure the host profile and write it."""
    if not args.host_out:
        return
    import sys

    from einpage.calibrate import calibrate_host
    from einpage.cli.common import write_text
    host = calibrate_host(lambda what: print(f"measuring {what} ...", file=sys.stderr))
    write_text(args.host_out, json.dumps(host.to_json(), indent=1) + "\n")
    print(f"wrote {args.host_out}: {host.cores} cores, matmul f32 "
          f"{host.matmul_flops / 1e9:.1f} GFLOP/s, memory {host.memory_bandwidth / 1e9:.1f} "
          f"GB/s ({host.core_bandwidth / 1e9:.1f} on one core), f16->f32 "
          f"{host.convert_rate / 1e9:.2f} G/s per core"
          + (f", kernels f16 {host.stored_rate / 1e9:.2f} and q4_0 {host.packed_rate / 1e9:.2f} "
             "G/s per core" if host.kernels else ", kernels not built"))


HANDLERS = {"models": cmd_models, "devices": cmd_devices, "calibrate": cmd_calibrate}
