"""What a measured pass of the stream runtime reports: the same figures the simulator predicts —
wall time, busy time per queue, compute stall, bytes and achieved bandwidth each way — and the
span of every node on its queue, for traces."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from einpage.runtime.streams import QUEUES


#: the queues that share a link: the h2d figures count both (`streams.queues_of`)
_LINK = {"h2d": ("h2d", "h2d_host")}


@dataclass(frozen=True, slots=True)
class Span:
    """One node on its queue, in seconds from the start of the pass."""
    node: int
    queue: str
    start: float
    end: float
    nbytes: int   # bytes copied (h2d, d2h) or read from disk; 0 for compute


@dataclass(frozen=True)
class Measured:
    backend: str
    wall_s: float              # the pass: from issuing its first node to every queue drained
    load_s: float              # before the pass: the weights loaded with the model
    load_bytes: int
    spans: tuple[Span, ...]    # every node of the pass (empty when timing was off)
    compile_s: float = 0.0     # before the pass: the kernels compiled when the plan was opened
    replayed: bool = False     # the pass ran as one launch of a captured graph (no spans)
    captured: bool = False     # the pass was issued under capture, then launched (no spans)

    def busy_s(self, queue: str) -> float:
        """Busy time of `queue` ("h2d": the link's, while either queue that copies
        host->device copies, their overlap once)."""
        return sum(b - a for a, b in self._busy(queue))

    def _busy(self, queue: str) -> list[tuple[float, float]]:
        """The intervals `queue` is busy (for "h2d", either of the link's queues), disjoint,
        in order."""
        queues = _LINK.get(queue, (queue,))
        out: list[tuple[float, float]] = []
        for a, b in sorted((s.start, s.end) for s in self.spans if s.queue in queues):
            if out and a <= out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][1], b))
            else:
                out.append((a, b))
        return out

    def bytes(self, queue: str) -> int:
        queues = _LINK.get(queue, (queue,))
        return sum(s.nbytes for s in self.spans if s.queue in queues)

    @property
    def compute_stall_s(self) -> float:
        """Time the compute queue was idle during the pass (waiting on copies or its deps)."""
        return max(0.0, self.wall_s - self.busy_s("compute"))

    def rate(self, queue: str) -> float:
        """Achieved bytes/s of a copy queue while it was busy (0 when it moved nothing)."""
        busy = self.busy_s(queue)
        return self.bytes(queue) / busy if busy > 0 else 0.0

    def hidden_fraction(self, queue: str = "h2d") -> float:
        """Share of a copy queue's busy time that overlapped compute work (1.0: fully hidden)."""
        copies = self._busy(queue)
        busy = sum(b - a for a, b in copies)
        if busy <= 0:
            return 1.0
        return _overlap(copies, self._busy("compute")) / busy

    def to_json(self) -> dict:
        """The pass's figures; those made from spans are None for a pass timed as a whole (a
        captured or replayed one has none)."""
        whole = self.replayed or self.captured
        out = {"backend": self.backend, "replayed": self.replayed, "captured": self.captured,
               "wall_s": self.wall_s, "load_s": self.load_s, "load_bytes": self.load_bytes,
               "compute_stall_s": None if whole else self.compute_stall_s}
        for q in QUEUES:
            out[f"{q}_busy_s"] = None if whole else self.busy_s(q)
        for q in ("h2d", "d2h", "disk"):
            out[f"{q}_bytes"] = None if whole else self.bytes(q)
            out[f"{q}_bytes_per_s"] = None if whole else self.rate(q)
        out["h2d_hidden_fraction"] = None if whole else self.hidden_fraction("h2d")
        return out


def joined(parts: Sequence[tuple[float, Measured]]) -> Measured:
    """Passes run one after another as one (a rank's micro-batches): each `(start, Measured)`
    with its start in seconds on one clock; the spans moved onto the first's clock, the wall
    from the first start to the last end."""
    (t0, first), *_ = parts
    spans = tuple(replace(s, start=s.start + t - t0, end=s.end + t - t0)
                  for t, m in parts for s in m.spans)
    end = max(t - t0 + m.wall_s for t, m in parts)
    return replace(first, wall_s=end, spans=spans,
                   replayed=any(m.replayed for _, m in parts),
                   captured=any(m.captured for _, m in parts))


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two sorted lists of intervals (each list disjoint)."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total
