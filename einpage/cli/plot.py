"""Pictures of a simulated plan: device memory over time by role, and the three streams.

`memory_timeline` turns a memgraph and its `einpage.predict.simulator.Simulation` into a step function of
live device bytes per role; `plot_timeline` draws it above a Gantt chart of the compute, h2d and
d2h streams into one PNG (needs matplotlib: `pip install 'einpage[plot]'`).

Instances, in simulated time: an instance is created by an `input` at device (live from time 0),
a `reload` or a non-accumulating `apply` write (live from that node's start) and ends at the end
of the `free` node, or the `apply` listing it in `frees`, that ends it; an instance never ended
stays live until the makespan. Where an apply writes its output over bytes of an instance it
frees (consumed in place), those overlapping bytes end at the apply's start so that no byte is
counted twice. Roles: `weight`, `activation` and `cache` (the KV cache); `temp` and any other role
count as `activation`.
"""
from __future__ import annotations

import numpy as np

from einpage.errors import InputError
from einpage.ir.memgraph import ApplyNode, MemGraph

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
    row_of = np.fromiter((_ROLE_ROW.get(t.role, 1) for t in tensors), dtype=np.int64,
                         count=len(tensors))
    size_of = np.fromiter((t.bytes for t in tensors), dtype=np.int64, count=len(tensors))
    start = np.asarray(sim.start, dtype=np.float64)
    end = np.asarray(sim.end, dtype=np.float64)

    # One pass to collect events: (node, tensor) of every creation and ending, plus in-place
    # overlaps of apply frees (bytes, role, node).
    make_node, make_t, make_at0 = [], [], []
    end_node, end_t = [], []
    ov_node, ov_row, ov_bytes = [], [], []
    for n in mg.nodes:
        kind = n.kind
        if kind == "free":
            end_node.append(n.id)
            end_t.append(n.tensor)
        elif kind == "reload":
            make_node.append(n.id)
            make_t.append(n.tensor)
            make_at0.append(False)
        elif kind == "apply":
            if not n.accumulate:
                make_node.append(n.id)
                make_t.append(n.write.tensor)
                make_at0.append(False)
            if n.frees:
                _apply_frees(n, tensors, end_node, end_t, ov_node, ov_row, ov_bytes)
        elif kind == "input" and n.at == "device":
            make_node.append(n.id)
            make_t.append(n.tensor)
            make_at0.append(True)

    make_t = np.asarray(make_t, dtype=np.int64)
    end_t = np.asarray(end_t, dtype=np.int64)
    make_time = np.where(np.asarray(make_at0, dtype=bool), 0.0,
                         start[np.asarray(make_node, dtype=np.int64)])
    end_time = end[np.asarray(end_node, dtype=np.int64)]
    ov_node = np.asarray(ov_node, dtype=np.int64)
    ov_row = np.asarray(ov_row, dtype=np.int64)
    ov_bytes = np.asarray(ov_bytes, dtype=np.int64)
    # An overlap moves those bytes' end from the apply's end to its start.
    ev_time = np.concatenate([make_time, end_time, start[ov_node], end[ov_node]])
    ev_row = np.concatenate([row_of[make_t], row_of[end_t], ov_row, ov_row])
    ev_delta = np.concatenate([size_of[make_t], -size_of[end_t], -ov_bytes, ov_bytes])

    makespan = float(sim.makespan_s)
    times = np.unique(np.concatenate([[0.0, makespan], ev_time]))
    out = np.zeros((len(ROLES), len(times)), dtype=np.int64)
    slot = np.searchsorted(times, ev_time)  # every event time is in `times`
    np.add.at(out, (ev_row, slot), ev_delta)
    np.cumsum(out, axis=1, out=out)
    return times, list(ROLES), out


def _apply_frees(n: ApplyNode, tensors, end_node, end_t, ov_node, ov_row, ov_bytes) -> None:
    lo = n.write.offset
    hi = lo + tensors[n.write.tensor].bytes
    for a in n.frees:
        end_node.append(n.id)
        end_t.append(a.tensor)
        overlap = min(hi, a.offset + tensors[a.tensor].bytes) - max(lo, a.offset)
        if overlap > 0 and not n.accumulate:
            ov_node.append(n.id)
            ov_row.append(_ROLE_ROW.get(tensors[a.tensor].role, 1))
            ov_bytes.append(overlap)


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
