"""Chrome trace-event files (open in Perfetto or chrome://tracing): one track per queue, one
slice per node. `einpage run --trace` writes the measured passes, `einpage compile --trace` and
`einpage inspect --trace` the predicted one, in the same format so the two lie side by side.
A plan of several devices gets one process per rank: its queues, the link to its peers
(`send`) and its messages in flight (`recv`: from the peer's send starting to the message being
there), every pass of the rank on the same time axis.

Format: the JSON object form, `{"traceEvents": [...], "displayTimeUnit": "ms"}`; complete
events (`"ph": "X"`) with `ts` and `dur` in microseconds; `"M"` metadata events name the
process (measured or predicted, and the pass) and the threads (the queues)."""
from __future__ import annotations

import json
import math
from typing import Iterable

from einpage.ir.memgraph import MemGraph
from einpage.predict.simulator import COPY_ENGINES
from einpage.runtime.streams import QUEUES

_TID = {q: k + 1 for k, q in enumerate(QUEUES)}


def node_label(mg: MemGraph, nid: int) -> str:
    n = mg.nodes[nid]
    if n.kind == "apply":
        return f"%{nid} apply {mg.tensors[n.write.tensor].name}"
    if n.kind == "recv":
        return f"%{nid} recv {n.input} from rank {n.peer}"
    if n.kind == "send":
        return f"%{nid} send {mg.tensors[n.tensor].name} to rank {n.peer}"
    return f"%{nid} {n.kind} {mg.tensors[n.tensor].name}"


def _recv_bytes(mg: MemGraph, n) -> int:
    """The bytes of a recv's box of its input."""
    whole = next(t for t in mg.inputs if t.name == n.input)
    return whole.dtype.itemsize * math.prod(n.shape)


def pass_events(mg: MemGraph, spans: Iterable[tuple[int, str, float, float, int]], pid: int,
                process: str | None, offset_s: float = 0.0, prefix: str = "") -> list[dict]:
    """Events of one pass: `spans` are (node, queue, start s, end s, bytes); `process` None:
    the process's names were given by an earlier pass; `prefix` starts each slice's name."""
    events: list[dict] = [] if process is None else _process(pid, process)
    for node, queue, start, end, nbytes in spans:
        event = {"ph": "X", "pid": pid, "tid": _TID[queue], "name": prefix + node_label(mg, node),
                 "cat": mg.nodes[node].kind, "ts": round((offset_s + start) * 1e6, 3),
                 "dur": round(max(end - start, 0.0) * 1e6, 3)}
        if nbytes:
            event["args"] = {"bytes": nbytes}
        events.append(event)
    return events


def _process(pid: int, name: str) -> list[dict]:
    """The metadata naming a process and its queues."""
    events: list[dict] = [{"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}},
                          {"ph": "M", "pid": pid, "name": "process_sort_index",
                           "args": {"sort_index": pid}}]
    for q, tid in _TID.items():
        events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name",
                       "args": {"name": q}})
        events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_sort_index",
                       "args": {"sort_index": tid}})
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
              mg.tensors[n.tensor].bytes if sim.engine[n.id] in COPY_ENGINES else 0)
             for n in mg.nodes if sim.engine[n.id] is not None]
    return pass_events(mg, spans, 1, f"predicted ({sim.device})")


def _queue(engine: str) -> str:
    return "send" if engine == "peer" else engine


def ranks_predicted_events(programs, sim) -> list[dict]:
    """The joint simulation of the programs of several ranks (a `RankedSimulation`): rank r is
    process r + 1, each of its passes (micro-batches) on the one time axis; a recv's slice
    runs from its message's send starting on the peer to the message being there."""
    from einpage.ir.memgraph import RecvNode, SendNode
    sent: dict[tuple[int, int, int, int], float] = {}  # (src, dst, tag, pass) -> send start
    for q, mg in enumerate(programs):
        for m, p in enumerate(sim.passes[q]):
            for n in mg.nodes:
                if isinstance(n, SendNode):
                    sent[(q, n.peer, n.tag, m)] = p.start[n.id]
    events: list[dict] = []
    several = max(len(p) for p in sim.passes) > 1
    for r, mg in enumerate(programs):
        for m, p in enumerate(sim.passes[r]):
            spans = []
            for n in mg.nodes:
                engine = p.engine[n.id]
                if isinstance(n, RecvNode):
                    start = min(sent.get((n.peer, r, n.tag, m), p.end[n.id]), p.end[n.id])
                    spans.append((n.id, "recv", start, p.end[n.id], _recv_bytes(mg, n)))
                elif engine is not None:
                    moved = engine in (*COPY_ENGINES, "peer")
                    spans.append((n.id, _queue(engine), p.start[n.id], p.end[n.id],
                                  mg.tensors[n.tensor].bytes if moved else 0))
            events += pass_events(mg, spans, r + 1,
                                  f"rank {r} predicted ({p.device})" if m == 0 else None,
                                  prefix=f"mb{m} " if several else "")
    return events


def ranks_measured_events(passes, label: str = "measured") -> list[dict]:
    """Passes of several ranks (`runners.RanksPass`, or anything with `programs` and
    `measured`: rank -> Measured), laid one after another on the time axis (each the length of
    its slowest rank); rank r is process r + 1, each rank's clock from its own pass's start."""
    events, offset = [], 0.0
    for k, p in enumerate(passes):
        for r in sorted(p.measured):
            m = p.measured[r]
            spans = [(s.node, s.queue, s.start, s.end, s.nbytes) for s in m.spans]
            events += pass_events(p.programs[r], spans, r + 1,
                                  f"rank {r} {label} ({m.backend})" if k == 0 else None, offset,
                                  prefix=f"pass {k + 1} " if len(passes) > 1 else "")
        offset += max(m.wall_s for m in p.measured.values())
    return events


def trace_text(events: list[dict]) -> str:
    return json.dumps({"traceEvents": events, "displayTimeUnit": "ms"})
