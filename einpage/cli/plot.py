"""Pictures of a simulated plan: device memory over time by role, and the three streams.

`memory_timeline` turns a memgraph and its `einpage.predict.simulator.Simulation` into a step function of
live device bytes per role; `plot_timeline` draws it above a Gantt chart of the compute, h2d and
d2h streams into one PNG (needs matplotlib: `pip install 'einpage[plot]'`).

Instances (`MemGraph.instances`), in simulated time: an instance created by an `input` at device
is live from time 0, one created by a `reload` or an `apply` from that node's start; it ends at
the end of the `free`, or of the `apply` listing it in `frees`, that ends it; an instance never
ended stays live until the makespan. Where an apply writes its output over bytes of an instance it
frees (consumed in place), those overlapping bytes end at the apply's start so that no byte is
counted twice. Roles: `weight`, `activation` and `cache` (the KV cache); `temp` and any other role
count as `activation`.
"""
from __future__ import annotations

import numpy as np

from einpage.errors import InputError
from einpage.ir.memgraph import ApplyNode, InputNode, MemGraph

ROLES = ("weight", "activation", "cache")
_ROLE_ROW = {"weight": 0, "activation": 1, "cache": 2}  # anything else (temp) -> activation
_COLORS = {"weight": "#4c72b0", "activation": "#dd8452", "cache": "#55a868"}
_BAR_COLORS = {"compute": "#4c72b0", "h2d": "#dd8452", "d2h": "#55a868"}
_BAR_LABELS = {"compute": "compute (apply)", "h2d": "h2d (reload)", "d2h": "d2h (offload)"}


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


def _spans(sim, engine: str) -> list[tuple[float, float]]:
    start = np.asarray(sim.start, dtype=np.float64)
    end = np.asarray(sim.end, dtype=np.float64)
    mask = np.fromiter((e == engine for e in sim.engine), dtype=bool, count=len(sim.engine))
    s = start[mask]
    return list(zip(s.tolist(), (end[mask] - s).tolist()))


def plot_timeline(mg: MemGraph, sim, path, title: str | None = None) -> None:
    """Write one PNG to `path`: memory by role over time with the budget, over a Gantt chart of
    the compute, h2d and d2h streams (shared x axis, seconds). The memory axis is in GB, or MB
    or KB for toy budgets. Renders with the Agg canvas on its own figure, so the caller's pyplot
    backend and state are left alone."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise InputError("plotting needs matplotlib: pip install 'einpage[plot]'") from None

    times, roles, by_role = memory_timeline(mg, sim)
    unit, scale = _unit(mg.device_bytes)
    right = float(sim.makespan_s) if sim.makespan_s > 0 else 1.0
    fig = Figure(figsize=(12, 7), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)  # render off-screen, leaving the global pyplot backend alone
    mem, gantt = fig.subplots(2, 1, sharex=True, height_ratios=(3, 1))

    low = np.zeros(len(times))
    for r, role in enumerate(roles):
        high = low + by_role[r] / scale
        mem.fill_between(times, low, high, step="post", color=_COLORS[role], linewidth=0,
                         label="KV cache" if role == "cache" else f"{role}s")
        low = high
    mem.axhline(mg.device_bytes / scale, color="#c44e52", linestyle="--", linewidth=1.2,
                label=f"budget {mg.device_bytes / scale:.4g} {unit}")
    mem.set_ylim(0, max(mg.device_bytes, int(by_role.sum(axis=0).max(initial=0))) / scale * 1.08)
    mem.set_ylabel(f"device memory ({unit})")
    mem.legend(loc="upper right", fontsize="small")
    mem.grid(True, alpha=0.3)

    rows = ("compute", "h2d", "d2h")
    for y, engine in enumerate(rows):
        spans = _spans(sim, engine)
        if spans:
            gantt.broken_barh(spans, (y - 0.4, 0.8), facecolors=_BAR_COLORS[engine],
                              linewidth=0, label=_BAR_LABELS[engine])
    gantt.set_yticks(range(len(rows)), [_BAR_LABELS[e] for e in rows])
    gantt.set_ylim(len(rows) - 0.5, -0.5)
    gantt.set_xlim(0, right)
    gantt.set_xlabel("time (s)")
    gantt.grid(True, axis="x", alpha=0.3)

    head = title or "einpage plan"
    fig.suptitle(f"{head}: {sim.device}, makespan {sim.makespan_s:.4g} s, "
                 f"efficiency {sim.efficiency:.1%}, {len(mg.nodes)} nodes")
    try:
        fig.savefig(path, format="png")
    except OSError as exc:
        raise InputError(f"{path}: cannot write the plot ({exc.strerror or exc})") from None
