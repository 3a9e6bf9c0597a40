"""The printed plan report: one function for `compile` (a plan just made, with the compiler's
figures) and `inspect` (a plan read from a file), both from a `PlanReport`.

First what bounds the pass, in plain words; then the time, the memory and the traffic, each
figure with its unit and what it means. Every figure is one of `PlanReport.to_json`'s."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from einpage.units import format_size

if TYPE_CHECKING:  # the report module pulls in the compiler: only when a report is printed
    from einpage.compiler import PlanReport

NOTES = (("plan", "plan written to"), ("plot", "timeline written to"),
         ("dot", "graph written to"), ("trace", "predicted trace written to"),
         ("warning", "warning:"))

_LINK = {"h2d": "host->device", "d2h": "device->host"}


def print_report(r: PlanReport, source: str | None = None) -> None:
    """The text report; `source` names the plan file of an `inspect`."""
    for line in report_lines(r, source):
        print(line)


def report_lines(r: PlanReport, source: str | None = None) -> list[str]:
    w, c = r.workload, r.compiled
    lines = [_headline(r, source), "  " + bound_sentence(r)]
    lines += _time_lines(r)
    lines += _memory_lines(r)
    if c is not None:
        formats = (" (" + ", ".join(f"{name} {_gb(n)}" for name, n in c.weight_formats) + ")"
                   if c.weight_formats else "")
        gathered = (f", {_gb(c.host_read_bytes)} of embedding tables read on the host (only "
                    "the rows a pass gathers cross the link)" if c.host_read_bytes else "")
        lines.append(f"  weights {_gb(c.weight_bytes)}{formats}: resident {_gb(c.resident_bytes)} "
                     f"(loaded once, kept on the device), streamed {_gb(c.streamed_weight_bytes)} "
                     f"each pass{gathered}")
        if c.kv_bytes:
            lines.append(f"  KV store {_gb(c.kv_bytes)}: resident {_gb(c.kv_resident_bytes)}, "
                         f"streamed {_gb(c.kv_streamed_bytes)} each step")
    lines += _host_lines(r)
    t = r.traffic
    lines.append(f"  traffic per pass: {t.reload_count} reloads ({_gb(t.reload_bytes)} "
                 f"host->device), {t.offload_count} activation spills ({_gb(t.offload_bytes)} "
                 f"device->host, reloaded later), {t.writeback_count} outputs written back "
                 f"({_gb(t.writeback_bytes)})")
    if r.routing is not None:
        lines.append("  " + routing_sentence(r.routing))
    if c is not None:
        lines.append(f"  tasks {c.tasks}, memgraph nodes {r.nodes}; compiled in "
                     f"{c.compile_seconds:.2f} s")
        lines.append("  " + lookahead_sentence(c))
    elif w.get("lookahead") is not None:
        lines.append(f"  look-ahead: {w['lookahead']}")
    for key, label in NOTES:
        if key in r.notes:
            lines.append(f"  {label} {r.notes[key]}")
    return lines


def routing_sentence(g) -> str:
    """The guarded applies (experts run only where the router picks them) and what that makes
    of the prediction: an expectation."""
    share = (f"{g.share_min:.3f}" if g.share_min == g.share_max
             else f"{g.share_min:.3f} to {g.share_max:.3f}")
    where = f", {g.on_host} of them on the host" if g.on_host else ""
    copies = (f"; {g.reloads} reloads ({_gb(g.reload_bytes)}) copy an expert only when it is "
              f"picked: {_gb(g.expected_reload_bytes)} expected" if g.reloads else "")
    return (f"routing: {g.applies} guarded applies{where} (experts, each run only where the "
            f"router picks it){copies}, priced at the expected share {share} of a pass: the "
            "predicted time is an expectation; a pass whose tokens pick more experts takes "
            "longer")


def _headline(r: PlanReport, source: str | None) -> str:
    w = r.workload
    if r.compiled is None:
        made = ", ".join(f"{k}={w[k]}" for k in sorted(w))
        proof = (f"\n  proven to compute its graph {r.graph_hash}" if r.proven else
                 "\n  not proven to compute a graph: the plan carries none (version 1); its "
                 "memory and order were checked")
        return (f"einpage plan {source}: {r.nodes} nodes, {r.tensors} tensors, valid; budget "
                f"{_gb(r.device_bytes)}  (GB = 10^9 bytes)" + (f"\n  made for: {made}"
                                                                if made else "") + proof)
    if w.get("phase") == "decode":
        where = (f"one decode step at position {w.get('past')} (KV store of "
                 f"{w.get('capacity')} slots)")
    else:
        where = f"{w.get('seq', '?')} tokens per row"
    return (f"einpage plan: {w.get('model', '?')} {w.get('phase', '')}, batch {w.get('batch', '?')}, "
            f"{where}, {w.get('dtype', '?')}, policy {w.get('policy', '?')}, budget "
            f"{_gb(r.device_bytes)}  (GB = 10^9 bytes)")


def bound_sentence(r: PlanReport) -> str:
    """What bounds the pass, in plain words: the busiest engine and what it carries."""
    sim, t = r.simulation, r.traffic
    kind = r.bound_by
    whole = f"of the {_secs(sim.makespan_s)} pass"
    if kind == "compute":
        moved = (f"; the host->device link is busy {_secs(sim.h2d_s)} carrying "
                 f"{_gb(sim.h2d_bytes)}" if sim.h2d_bytes else "; nothing crosses the host link")
        return f"compute-bound: compute busy {_secs(sim.compute_s)} {whole}{moved}"
    if kind == "h2d":
        parts = [(t.reload_weight_bytes, "weights"), (t.reload_kv_bytes, "KV cache"),
                 (t.reload_activation_bytes, "activations and inputs")]
        what = ", ".join(f"{label} {_gb(n)}" for n, label in parts if n)
        return (f"transfer-bound: {_gb(sim.h2d_bytes)} cross the host->device link each pass "
                f"({what}); the link is busy {_secs(sim.h2d_s)}, compute "
                f"{_secs(sim.compute_s)} {whole}")
    if kind == "host":
        return (f"host-bound: the host's CPU computes its applies for {_secs(sim.host_s)} "
                f"{whole}; compute {_secs(sim.compute_s)}, the host->device link "
                f"{_secs(sim.h2d_s)}")
    if kind == "d2h":
        return (f"write-back-bound: {_gb(sim.d2h_bytes)} cross the device->host link each pass; "
                f"the link is busy {_secs(sim.d2h_s)}, compute {_secs(sim.compute_s)} {whole}")
    disk_bytes = getattr(sim, "disk_bytes", 0)
    return (f"disk-bound: {_gb(disk_bytes)} are read from disk each pass; the disk is busy "
            f"{_secs(getattr(sim, 'disk_s', 0.0))}, compute {_secs(sim.compute_s)} {whole}")


def _time_lines(r: PlanReport) -> list[str]:
    sim, tps = r.simulation, r.tokens_per_s
    rate = (f" ({tps:,.0f} tokens/s)" if tps >= 100 else f" ({tps:.3g} tokens/s)") if tps else ""
    host = f", host CPU {_secs(sim.host_s)}" if sim.host_s else ""
    lines = [f"  predicted on {sim.device}: {_secs(sim.makespan_s)} per pass{rate}; busy: "
             f"compute {_secs(sim.compute_s)}, host->device {_secs(sim.h2d_s)}, device->host "
             f"{_secs(sim.d2h_s)}{host}; compute waits {_secs(sim.stall_s)} for data"]
    b = r.bound
    if b is not None:
        staged = (f" beside a staging block of {_gb(b.disk_staging)}, in at least "
                  f"{b.disk_reads} reads" if b.disk_reads else "")
        disk = (f"; {_gb(b.disk_bytes)} that the device and the host budget cannot hold, read "
                f"from disk{staged}: {_secs(b.disk_s)}" if b.disk_bytes else "")
        copies = (f" in at least {math.floor(b.stream_copies)} copies" if b.stream_copies >= 1
                  else "")
        if b.front_s > b.steady_s:
            disk += (f"; the first bytes its tasks read, over the link before them, then the "
                     f"compute after them: {_secs(b.front_s)}")
        if b.tail_s > max(b.steady_s, b.front_s):
            disk += (f"; its first bytes over the link, the compute to its outputs' last "
                     f"tasks, then their write-back over the device->host link: "
                     f"{_secs(b.tail_s)}")
        lines.append(f"  lower bound for any plan at this budget: {_secs(b.seconds)} (the most of "
                     f"compute {_secs(b.compute_s)}; {_gb(b.stream_bytes)} that no plan can keep "
                     f"on the device, over the host->device link{copies}: {_secs(b.stream_s)}"
                     f"{disk}); "
                     f"efficiency {r.efficiency:.3f} (bound / predicted time)")
    else:
        lines.append("  lower bound for any plan at this budget: unknown (the plan file does not "
                     "record the bytes no plan can avoid; compile it again)")
    disk = getattr(sim, "disk_min_bytes", 0)
    front = ("; here the problem's " + ("tail" if r.bound is not None and r.bound.tail_s
                                         > r.bound.front_s else "front") + " term, which is more"
             if r.plan_bound_s > sim.lower_bound_s else "")
    lines.append(f"  this plan's own bound: {_secs(r.plan_bound_s)} (its compute, and each "
                 f"block it streams moved once, a copy each: {_gb(sim.h2d_min_bytes)} "
                 f"host->device"
                 + (f", {_gb(disk)} from disk" if disk else "") + front
                 + f"); plan efficiency {r.plan_efficiency:.3f}")
    return lines


def _memory_lines(r: PlanReport) -> list[str]:
    c = r.compiled
    least = (f"; no placement of it fits in less than {_gb(c.lower_bound_bytes)} (resident "
             "blocks + the largest task's other blocks)" if c is not None else "")
    lines = [f"  device memory: needs {_gb(r.live_peak_bytes)} (live peak: the most bytes live at "
             f"once, in plan order){least}; reserves {_gb(r.arena_bytes)} (arena: the highest "
             f"byte it addresses) of the {_gb(r.device_bytes)} budget"]
    if c is not None:
        lines.append(f"  largest task: {_gb(c.largest_task_bytes)} at once, with blocks cut for "
                     f"{_gb(c.block_bytes)} working sets; not the smallest workable budget: a "
                     "smaller budget cuts finer blocks")
    return lines


def _host_lines(r: PlanReport) -> list[str]:
    """The host tier (compiler.tiers): the budget, what it holds, what is read from disk."""
    w = r.workload
    if "host_peak_bytes" not in w:
        return []
    budget = w.get("host_bytes")
    where = f" ({w['host_budget']})" if w.get("host_budget") else ""
    limit = f"budget {_gb(budget)}{where}" if budget else f"no budget{where}"
    line = (f"  host memory: {limit}; holds {_gb(w['host_peak_bytes'])}: streamed weights "
            f"pinned {_gb(w.get('pinned_bytes', 0))}, offloaded blocks, outputs, KV store and "
            f"inputs {_gb(w.get('host_fixed_bytes', 0))}")
    if not w.get("disk_blocks"):
        return [line]
    sim = r.simulation
    return [line + f", staging buffers {_gb(w.get('staging_bytes', 0))}",
            f"  disk: {w['disk_blocks']} weight blocks ({_gb(w.get('disk_weight_bytes', 0))}) "
            f"are read from the checkpoint each pass: {_gb(sim.disk_bytes)} in "
            f"{_secs(sim.disk_s)} of disk time"]


def lookahead_sentence(c) -> str:
    """The look-ahead used, and what it changed against the default (as far as memory allows)."""
    default, ours = c.default_lookahead_makespan_s, c.lookahead_makespan_s
    if default is None or ours is None:
        return f"look-ahead: {c.lookahead} (the default: prefetch as far as memory allows)"
    how = "chosen by --lookahead auto" if c.lookahead.startswith("auto") else "set by --lookahead"
    change = (ours - default) / default if default > 0 else 0.0
    verdict = (f"{-change:.1%} faster" if change < -5e-4 else
               f"{change:.1%} slower" if change > 5e-4 else "the same")
    return (f"look-ahead: {c.lookahead} ({how}): {_secs(ours)} per pass against "
            f"{_secs(default)} with the default (as far as memory allows), {verdict}")


def _gb(n) -> str:
    return format_size(n) if n is not None else "-"


def _secs(s: float) -> str:
    if s == 0:
        return "0 s"
    return f"{s:.3f} s" if s >= 0.01 else f"{s * 1e3:.3f} ms"
