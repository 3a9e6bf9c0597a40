"""Chrome trace-event files (open in Perfetto or chrome://tracing): one track per queue, one
slice per node. `einpage run --trace` writes the measured passes, `einpage compile --trace` and
`einpage inspect --trace` the predicted one, in the same format so the two lie side by side.

Format: the JSON object form, `{"traceEvents": [...], "displayTimeUnit": "ms"}`; complete
events (`"ph": "X"`) with `ts` and `dur` in microseconds; `"M"` metadata events name the
process (measured or predicted, and the pass) and the threads (the queues)."""
from __future__ import annotations

import json
from typing import Iterable

from einpage.ir.memgraph import MemGraph
from einpage.runtime.streams import QUEUES

_TID = {q: k + 1 for k, q in enumerate(QUEUES)}


def node_label(mg: MemGraph, nid: int) -> str:
    n = mg.nodes[nid]
    if n.kind == "apply":
        return f"%{nid} apply {mg.tensors[n.write.tensor].name}"
    return f"%{nid} {n.kind} {mg.tensors[n.tensor].name}"


def pass_events(mg: MemGraph, spans: Iterable[tuple[int, str, float, float, int]], pid: int,
                process: str, offset_s: float = 0.0) -> list[dict]:
    """Events of one pass: `spans` are (node, queue, start s, end s, bytes)."""
    events: list[dict] = [{"ph": "M", "pid": pid, "name": "process_name",
                           "args": {"name": process}}]
    for q, tid in _TID.items():
        events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name",
                       "args": {"name": q}})
        events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_sort_index",
                       "args": {"sort_index": tid}})
    for node, queue, start, end, nbytes in spans:
        event = {"ph": "X", "pid": pid, "tid": _TID[queue], "name": node_label(mg, node),
                 "cat": mg.nodes[node].kind, "ts": round((offset_s + start) * 1e6, 3),
                 "dur": round(max(end - start, 0.0) * 1e6, 3)}
        if nbytes:
            event["args"] = {"bytes": nbytes}
        events.append(event)
    return events


def measured_events(passes, label: str = "measured") -> list[dict]:
    """`passes`: (memgraph, Measured) pairs, laid one after another on the time axis."""
    events, offset = [], 0.0
    for k, (mg, measured) in enumerate(passes):
        spans = [(s.node, s.queue, s.start, s.end, s.nbytes) for s in measured.spans]
        name = f"{label} pass {k} ({measured.backend})" if len(passes) > 1 else \
            f"{label} ({measured.backend})"
        events += pass_events(mg, spans, k + 1, name, offset)
        offset += measured.wall_s
    return events


def predicted_events(mg: MemGraph, sim) -> list[dict]:
    """The simulator's timeline of `mg` (a `Simulation`)."""
    spans = [(n.id, sim.engine[n.id], sim.start[n.id], sim.end[n.id],
              mg.tensors[n.tensor].bytes if sim.engine[n.id] in ("h2d", "d2h", "disk") else 0)
             for n in mg.nodes if sim.engine[n.id] is not None]
    return pass_events(mg, spans, 1, f"predicted ({sim.device})")


def trace_text(events: list[dict]) -> str:
    return json.dumps({"traceEvents": events, "displayTimeUnit": "ms"})
