"""Pictures of a simulated plan: device memory over time by role, and the three streams.

`memory_timeline` turns a memgraph and its `einpage.predict.simulator.Simulation` into a step function of
live device bytes per role; `plot_timeline` draws it above a Gantt chart of the compute, h2d and
d2h streams into one PNG (needs matplotlib: `pip install 'einpage[plot]'`), with the report's two
memory figures as lines: the live peak (what the plan needs) and the arena (what it reserves).
`timeline_figures` returns the numbers drawn (`TimelineFigures`), so they can be checked against
the report without reading the image.

Instances (`MemGraph.instances`), in simulated time: an instance created by an `input` at device
is live from time 0, one created by a `reload` or an `apply` from that node's start; it ends at
the end of the `free`, or of the `apply` listing it in `frees`, that ends it; an instance never
ended stays live until the makespan. Where an apply writes its output over bytes of an instance it
frees (consumed in place), those overlapping bytes end at the apply's start so that no byte is
counted twice. Roles: `weight`, `activation` and `cache` (the KV cache); `temp` and any other role
count as `activation`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from einpage.errors import InputError
from einpage.ir.memgraph import ApplyNode, InputNode, MemGraph
from einpage.units import format_size

ROLES = ("weight", "activation", "cache")
_ROLE_ROW = {"weight": 0, "activation": 1, "cache": 2}  # anything else (temp) -> activation
_COLORS = {"weight": "#4c72b0", "activation": "#dd8452", "cache": "#55a868"}
_BAR_COLORS = {"compute": "#4c72b0", "h2d": "#dd8452", "h2d_host": "#c44e52",
               "d2h": "#8172b3", "disk": "#937860"}
_BAR_LABELS = {"compute": "compute (apply)", "h2d": "h2d (reload)",
               "h2d_host": "h2d (a host apply's block)", "d2h": "d2h (offload)",
               "disk": "disk (read)"}


def memory_timeline(mg: MemGraph, sim) -> tuple[np.ndarray, list[str], np.ndarray]:
    """`(times, roles, bytes_by_role)`: live device bytes per role as a step function.

    `times` is sorted, starts at 0 and ends at the makespan; `bytes_by_role[r, k]` is the bytes of
    role `roles[r]` live from `times[k]` until `times[k + 1]` (the value after every event at
    `times[k]`). The last column is what stays live at the end.
    """
    tensors = mg.tensors
    start = np.asarray(sim.start, dtype=np.float64)
    end = np.asarray(sim.end, dtype=np.float64)
    ev_time, ev_row, ev_delta = [], [], []
    for inst in mg.instances:  # the one replay of device instances (MemGraph.instances)
        row = _ROLE_ROW.get(tensors[inst.tensor].role, 1)
        creator = mg.nodes[inst.start]
        ev_time.append(0.0 if isinstance(creator, InputNode) else start[inst.start])
        ev_row.append(row)
        ev_delta.append(inst.bytes)
        if inst.end is None:
            continue
        ender = mg.nodes[inst.end]
        overlap = 0
        if isinstance(ender, ApplyNode) and not ender.accumulate:
            # consumed in place: the bytes the output takes over end when the apply starts
            lo, hi = ender.write.offset, ender.write.offset + tensors[ender.write.tensor].bytes
            overlap = max(0, min(hi, inst.offset + inst.bytes) - max(lo, inst.offset))
        ev_time += [start[inst.end], end[inst.end]]
        ev_row += [row, row]
        ev_delta += [-overlap, overlap - inst.bytes]
    ev_time = np.asarray(ev_time, dtype=np.float64)
    ev_row = np.asarray(ev_row, dtype=np.int64)
    ev_delta = np.asarray(ev_delta, dtype=np.int64)

    makespan = float(sim.makespan_s)
    times = np.unique(np.concatenate([[0.0, makespan], ev_time]))
    out = np.zeros((len(ROLES), len(times)), dtype=np.int64)
    slot = np.searchsorted(times, ev_time)  # every event time is in `times`
    np.add.at(out, (ev_row, slot), ev_delta)
    np.cumsum(out, axis=1, out=out)
    return times, list(ROLES), out


def _unit(nbytes: int) -> tuple[str, float]:
    """GB for real budgets; MB or KB for toy plans, so the axis does not read 1e-5."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= scale:
            return unit, scale
    return "B", 1.0


def _time_unit(makespan_s: float) -> tuple[str, float]:
    """Milliseconds for passes under a second, seconds above."""
    return ("s", 1.0) if makespan_s >= 1.0 else ("ms", 1e3)


def _spans(sim, engine: str, merge_below: float | None = None) -> list[tuple[float, float]]:
    """`(start, duration)` of the engine's nodes, in seconds; spans no further apart than
    `merge_below` are drawn as one (a gap narrower than a pixel, or the seam between two bars
    that touch, would only show as a white stripe)."""
    start = np.asarray(sim.start, dtype=np.float64)
    end = np.asarray(sim.end, dtype=np.float64)
    mask = np.fromiter((e == engine for e in sim.engine), dtype=bool, count=len(sim.engine))
    out: list[list[float]] = []
    for s, e in sorted(zip(start[mask].tolist(), end[mask].tolist())):
        if out and merge_below is not None and s - out[-1][1] <= merge_below:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e - s) for s, e in out]


@dataclass(frozen=True)
class TimelineFigures:
    """The numbers a timeline plot draws, the same as the report's (`PlanReport.to_json`):
    `budget_bytes` (`device_bytes`), `arena_bytes` (what the plan reserves: the highest byte it
    addresses), `live_peak_bytes` (what it needs: the most bytes live at once in its node order),
    and `occupied_peak_bytes`, the top of the stacked areas: the most bytes holding data at one
    instant of the predicted run. That one is often below the live peak: the order counts a block
    from the node that creates it to the node that frees it, as if the nodes ran one at a time,
    while in the predicted run the engines overlap and a block holds data only from the start of
    its copy (or compute) to the end of its last use; a reload queued behind other copies starts
    after compute has finished with blocks freed later in the order. It never exceeds the
    arena (the blocks it counts at one instant lie in disjoint bytes)."""
    title: str
    subtitle: str
    budget_bytes: int
    arena_bytes: int
    live_peak_bytes: int
    occupied_peak_bytes: int
    makespan_s: float
    memory_unit: str
    time_unit: str


def timeline_figures(mg: MemGraph, sim, title: str | None = None) -> TimelineFigures:
    """What `plot_timeline` draws for `mg` and its simulation, without drawing it."""
    _, _, by_role = memory_timeline(mg, sim)
    arena, live = mg.high_water(), mg.live_peak()
    unit, _ = _unit(mg.device_bytes)
    return TimelineFigures(
        title=title or plan_title(mg),
        subtitle=(f"predicted on {sim.device}: {_secs(sim.makespan_s)} per pass; needs "
                  f"{format_size(live)} (live peak), reserves {format_size(arena)} (arena); "
                  f"{len(mg.nodes)} nodes"),
        budget_bytes=mg.device_bytes, arena_bytes=arena, live_peak_bytes=live,
        occupied_peak_bytes=int(by_role.sum(axis=0).max(initial=0)),
        makespan_s=float(sim.makespan_s), memory_unit=unit,
        time_unit=_time_unit(float(sim.makespan_s))[0])


def plan_title(mg: MemGraph) -> str:
    """Model, phase, batch, length, policy and budget, from the plan's workload (`meta`)."""
    w = mg.meta
    parts = [f"{w['model']} {w.get('phase', '')}".strip()] if w.get("model") else ["einpage plan"]
    if w.get("batch") is not None:
        parts.append(f"batch {w['batch']}")
    if w.get("phase") == "decode":
        parts.append(f"position {w.get('past')} of a {w.get('capacity')}-slot KV store")
    elif w.get("seq") is not None:
        parts.append(f"{w['seq']} tokens per row")
    if w.get("policy"):
        parts.append(f"policy {w['policy']}")
    parts.append(f"budget {format_size(mg.device_bytes)}")
    return ", ".join(parts)


def plot_timeline(mg: MemGraph, sim, path, title: str | None = None) -> TimelineFigures:
    """Write one PNG to `path`: memory by role over the predicted pass, with the budget, the
    arena and the live peak as lines, over a Gantt chart of the compute, h2d and d2h streams (and
    the disk reader, where the plan reads from disk); a shared time axis in ms (or s for passes
    of a second or more). The memory axis is in GB, or MB or KB for toy budgets. The title names
    the model, batch, length, policy and budget (`title` overrides it). Renders with the Agg
    canvas on its own figure, so the caller's pyplot backend and state are left alone. Returns
    the figures drawn."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise InputError("plotting needs matplotlib: pip install 'einpage[plot]'") from None

    figures = timeline_figures(mg, sim, title)
    times, roles, by_role = memory_timeline(mg, sim)
    unit, scale = _unit(mg.device_bytes)
    tunit, tscale = _time_unit(figures.makespan_s)
    right = figures.makespan_s * tscale if figures.makespan_s > 0 else 1.0
    fig = Figure(figsize=(12, 7), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)  # render off-screen, leaving the global pyplot backend alone
    mem, gantt = fig.subplots(2, 1, sharex=True, height_ratios=(3, 1))

    low = np.zeros(len(times))
    for r, role in enumerate(roles):
        high = low + by_role[r] / scale
        mem.fill_between(times * tscale, low, high, step="post", color=_COLORS[role],
                         linewidth=0, antialiased=False,
                         label="KV cache" if role == "cache" else f"{role}s")
        low = high
    for value, color, style, label in (
            (figures.budget_bytes, "#c44e52", "--", "budget"),
            (figures.arena_bytes, "#555555", "-.", "arena (reserved: highest byte addressed)"),
            (figures.live_peak_bytes, "#000000", ":", "live peak (needed: most bytes live at "
                                                      "once, plan order)")):
        mem.axhline(value / scale, color=color, linestyle=style, linewidth=1.2,
                    label=f"{label} {format_size(value)}")
    top = max(figures.budget_bytes, figures.arena_bytes, figures.occupied_peak_bytes)
    mem.set_ylim(0, top / scale * 1.3)  # the legend sits above the lines
    mem.set_ylabel(f"device memory ({unit})")
    mem.set_title(f"areas: bytes holding data at each instant of the predicted run (peak "
                  f"{format_size(figures.occupied_peak_bytes)})", fontsize="small")
    mem.legend(loc="upper center", ncols=2, fontsize="small")
    mem.set_axisbelow(True)
    mem.grid(True, alpha=0.3)

    rows = [e for e in ("compute", "h2d", "h2d_host", "d2h", "disk")
            if e not in ("disk", "h2d_host") or e in sim.engine]
    pixel = right / tscale / 2000  # narrower gaps than this draw as one bar
    for y, engine in enumerate(rows):
        spans = [(s * tscale, d * tscale) for s, d in _spans(sim, engine, pixel)]
        if spans:
            gantt.broken_barh(spans, (y - 0.4, 0.8), facecolors=_BAR_COLORS[engine],
                              linewidth=0, antialiased=False, label=_BAR_LABELS[engine])
    gantt.set_yticks(range(len(rows)), [_BAR_LABELS[e] for e in rows])
    gantt.set_ylim(len(rows) - 0.5, -0.5)
    gantt.set_xlim(0, right)
    gantt.set_xlabel(f"time ({tunit})")
    gantt.set_axisbelow(True)  # grid lines under the bars: no stripes across busy stretches
    gantt.grid(True, axis="x", alpha=0.3)

    fig.suptitle(f"{figures.title}\n{figures.subtitle}")
    from einpage.outputs import atomic_open
    with atomic_open(path, "wb") as fh:  # whole or not at all; OutputError names the file
        fig.savefig(fh, format="png")
    return figures


def _secs(s: float) -> str:
    if s == 0:
        return "0 s"
    return f"{s:.3f} s" if s >= 0.01 else f"{s * 1e3:.3f} ms"
