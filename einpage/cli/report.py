"""The printed plan report, shared by `compile` and `inspect`."""
from __future__ import annotations

from einpage.units import format_size


def print_report(r: dict) -> None:
    def gb(n):
        return format_size(n) if n is not None else "-"
    print(f"einpage plan: {r.get('model', '?')} {r.get('phase', '')} batch={r.get('batch', '?')} "
          f"seq={r.get('seq', '?')} past={r.get('past', 0)} {r.get('dtype', '')} "
          f"policy={r.get('policy', '?')}  (sizes in GB = 10^9 bytes)")
    print(f"  tasks {r['tasks']}, memgraph nodes {r['nodes']}, compiled in "
          f"{r['compile_seconds']:.2f} s")
    print(f"  peak {gb(r['peak_bytes'])} of budget {gb(r['device_bytes'])}; lower bound "
          f"{gb(r['lower_bound_bytes'])} (resident weights + largest task); smallest workable "
          f"budget {gb(r['min_budget_bytes'])}")
    print(f"  weights {gb(r['weight_bytes'])}: resident {gb(r['resident_bytes'])}, streamed per "
          f"pass {gb(r['streamed_weight_bytes'])}")
    print(f"  reloads {r['reload_count']} ({gb(r['reload_bytes'])}), offloads "
          f"{r['offload_count']} ({gb(r['offload_bytes'])}), outputs written back "
          f"{r['writeback_count']} ({gb(r['writeback_bytes'])})")
    print_prediction(r)


def print_prediction(r: dict) -> None:
    gb = format_size
    if "makespan_s" in r:
        tps = r.get("tokens_per_s")
        rate = (f" ({tps:,.0f} tokens/s)" if tps >= 100 else f" ({tps:.3g} tokens/s)") if tps else ""
        print(f"  predicted on {r['device']}: {_secs(r['makespan_s'])} per pass{rate}; compute "
              f"{_secs(r['compute_s'])}, h2d {_secs(r['h2d_s'])}, d2h {_secs(r['d2h_s'])}, "
              f"compute stalled {_secs(r['stall_s'])}")
        print(f"  lower bound {_secs(r['lower_bound_s'])} (compute, {gb(r['h2d_min_bytes'])} "
              f"that must cross host->device, d2h); efficiency {r['efficiency']:.3f}")
    if "lookahead" in r:
        print(f"  look-ahead: {r['lookahead']}")
    for key, label in (("plan", "plan written to"), ("plot", "timeline written to"),
                       ("dot", "graph written to"), ("warning", "warning:")):
        if key in r:
            print(f"  {label} {r[key]}")


def _secs(s: float) -> str:
    if s == 0:
        return "0 s"
    return f"{s:.3f} s" if s >= 0.01 else f"{s * 1e3:.3f} ms"
