"""The printed plan report: one function for `compile` (a plan just made, with the compiler's
figures) and `inspect` (a plan read from a file), both from a `PlanReport`."""
from __future__ import annotations

from typing import TYPE_CHECKING

from einpage.units import format_size

if TYPE_CHECKING:  # the report module pulls in the compiler: only when a report is printed
    from einpage.compiler import PlanReport

NOTES = (("plan", "plan written to"), ("plot", "timeline written to"),
         ("dot", "graph written to"), ("trace", "predicted trace written to"),
         ("warning", "warning:"))


def print_report(r: PlanReport, source: str | None = None) -> None:
    """The text report; `source` names the plan file of an `inspect`."""
    w, c, t = r.workload, r.compiled, r.traffic
    if c is not None:
        where = (f"past={w.get('past')} capacity={w.get('capacity')}" if w.get("phase") == "decode"
                 else f"seq={w.get('seq', '?')}")
        print(f"einpage plan: {w.get('model', '?')} {w.get('phase', '')} "
              f"batch={w.get('batch', '?')} {where} "
              f"{w.get('dtype', '')} policy={w.get('policy', '?')}  (sizes in GB = 10^9 bytes)")
        print(f"  tasks {c.tasks}, memgraph nodes {r.nodes}, compiled in "
              f"{c.compile_seconds:.2f} s")
        print(f"  peak {_gb(r.peak_bytes)} of budget {_gb(r.device_bytes)}; lower bound "
              f"{_gb(c.lower_bound_bytes)} (resident weights + largest task); smallest workable "
              f"budget {_gb(c.min_budget_bytes)}")
        print(f"  weights {_gb(c.weight_bytes)}: resident {_gb(c.resident_bytes)}, streamed per "
              f"pass {_gb(c.streamed_weight_bytes)}")
        if c.kv_bytes:
            print(f"  KV store {_gb(c.kv_bytes)}: resident {_gb(c.kv_resident_bytes)}, streamed "
                  f"per step {_gb(c.kv_streamed_bytes)}")
        print(f"  a pass must move at least {_gb(c.min_stream_bytes)} (weights + KV - budget)")
    else:
        print(f"einpage plan {source}: {r.nodes} nodes, {r.tensors} tensors, valid")
        print("  made for: " + ", ".join(f"{k}={w[k]}" for k in sorted(w)))
        print(f"  peak {_gb(r.peak_bytes)} of budget {_gb(r.device_bytes)} "
              f"(live bytes peak {_gb(r.live_peak_bytes)})")
    print(f"  reloads {t.reload_count} ({_gb(t.reload_bytes)}), offloads "
          f"{t.offload_count} ({_gb(t.offload_bytes)}), outputs written back "
          f"{t.writeback_count} ({_gb(t.writeback_bytes)})")
    sim, tps = r.simulation, r.tokens_per_s
    rate = (f" ({tps:,.0f} tokens/s)" if tps >= 100 else f" ({tps:.3g} tokens/s)") if tps else ""
    print(f"  predicted on {sim.device}: {_secs(sim.makespan_s)} per pass{rate}; compute "
          f"{_secs(sim.compute_s)}, h2d {_secs(sim.h2d_s)}, d2h {_secs(sim.d2h_s)}, "
          f"compute stalled {_secs(sim.stall_s)}")
    print(f"  lower bound {_secs(sim.lower_bound_s)} (compute, {_gb(sim.h2d_min_bytes)} "
          f"that must cross host->device, d2h); efficiency {sim.efficiency:.3f}")
    lookahead = c.lookahead if c is not None else w.get("lookahead")
    if lookahead is not None:
        print(f"  look-ahead: {lookahead}")
    for key, label in NOTES:
        if key in r.notes:
            print(f"  {label} {r.notes[key]}")


def _gb(n) -> str:
    return format_size(n) if n is not None else "-"


def _secs(s: float) -> str:
    if s == 0:
        return "0 s"
    return f"{s:.3f} s" if s >= 0.01 else f"{s * 1e3:.3f} ms"
