"""Programs of several ranks, checked together: every send meets exactly one recv and the two
agree, and no order of any rank's program can deadlock.

Each program is first validated alone (`einpage.ir.validator.validate`: its memory, its sends
and recvs, and that it computes its rank graph). Across ranks:

- ranks 0..N-1 appear once each, every program saying `world` N;
- a send from q to r under tag t and a recv on r from q under tag t pair one to one (a send
  with no recv, a recv with no send, or a tag used twice, is refused); the pair agrees on the
  value (the sender's output name is the receiver's input name), the box (the output block's
  origin and shape are the recv's), the dtype and the bytes;
- every send goes to a higher rank.

A file holds the programs of every rank (`save_programs`, `load_programs`): `{"format":
"einpage.ranks", "version": 2, "world": N, "meta": {...}, "programs": [plan, ...]}`, each plan
the JSON of one rank's `MemGraph` (version 2, with its `rank` and `world`). Each process of a
run reads the one file and runs its own rank's program.

Why the last rule is enough for deadlock freedom, whatever order each rank runs its nodes in and
however long its sends wait to be matched: rank 0 receives nothing, so it runs to the end; by
induction, when ranks 0..r-1 run to the end, every send to rank r is posted, so each recv of
rank r is eventually matched and rank r runs to the end too. A pipeline's stages send only
forward, so this costs nothing; a plan that needs messages both ways (tensor parallelism's
all-reduces) needs a stronger rule than this one.
"""
from __future__ import annotations

import math
from pathlib import Path
from types import MappingProxyType
from typing import Mapping, Sequence

from einpage.errors import PlanError
from einpage.ir.memgraph import VERSION, MemGraph, RecvNode, SendNode
from einpage.ir.planfile import MALFORMED, RANKS_FORMAT, read_plan_json, write_plan_json
from einpage.ir.validator import ValidationReport, checked

#: the name a value crossing ranks has on both sides: the sender's output, the receiver's input
BOUNDARY_PREFIX = "pipe."


def boundary_name(node: int) -> str:
    """The name of graph node `node`'s value where it crosses ranks."""
    return f"{BOUNDARY_PREFIX}{node}"


def is_boundary(name: str) -> bool:
    return name.startswith(BOUNDARY_PREFIX)


def validate_ranks(programs: Sequence[MemGraph]) -> tuple[ValidationReport, ...]:
    """Validate each program, then the rules across ranks (the module's docstring); raise
    `PlanError` naming the rank and node at the first broken one."""
    world = len(programs)
    if world == 0:
        raise PlanError("no programs")
    for k, mg in enumerate(programs):
        if mg.world != world or mg.rank != k:
            raise PlanError(f"program {k} says rank {mg.rank} of {mg.world}; expected rank {k} "
                            f"of {world}")
    reports = []
    for k, mg in enumerate(programs):
        try:
            reports.append(checked(mg))
        except PlanError as exc:
            raise PlanError(f"rank {k}: {exc}") from None
    sends: dict[tuple[int, int, int], tuple[int, SendNode]] = {}
    for q, mg in enumerate(programs):
        for n in mg.nodes:
            if isinstance(n, SendNode):
                key = (q, n.peer, n.tag)
                if key in sends:
                    raise PlanError(f"rank {q}: node %{n.id} (send) and node %{sends[key][1].id} "
                                    f"both send to rank {n.peer} under tag {n.tag}")
                if n.peer <= q:
                    raise PlanError(f"rank {q}: node %{n.id} (send) sends to rank {n.peer}; a "
                                    "pipeline sends only to later ranks (freedom from deadlock "
                                    "rests on it)")
                sends[key] = (q, n)
    for r, mg in enumerate(programs):
        inputs = {t.name: t for t in mg.inputs}
        for n in mg.nodes:
            if not isinstance(n, RecvNode):
                continue
            key = (n.peer, r, n.tag)
            if key not in sends:
                raise PlanError(f"rank {r}: node %{n.id} (recv) waits for tag {n.tag} from rank "
                                f"{n.peer}, which sends no such message")
            q, s = sends.pop(key)
            _check_pair(programs[q], q, s, mg, r, n, inputs[n.input])
    for (q, r, tag), (_, s) in sorted(sends.items()):
        raise PlanError(f"rank {q}: node %{s.id} (send) sends tag {tag} to rank {r}, which "
                        "receives no such message")
    return tuple(reports)


def _check_pair(sender: MemGraph, q: int, s: SendNode, receiver: MemGraph, r: int,
                n: RecvNode, whole) -> None:
    t = sender.tensors[s.tensor]
    out = next((o for o in sender.outputs if o.tensor == s.tensor), None)
    where = f"rank {q} node %{s.id} (send) and rank {r} node %{n.id} (recv), tag {n.tag}"
    if out is None or out.name != n.input:
        raise PlanError(f"{where}: rank {q} sends {out.name if out else t.name!r}, rank {r} "
                        f"receives {n.input!r}")
    if tuple(out.origin) != tuple(n.origin) or tuple(t.shape) != tuple(n.shape):
        raise PlanError(f"{where}: the block sent is {list(t.shape)} at {list(out.origin)}, the "
                        f"box received {list(n.shape)} at {list(n.origin)}")
    if t.dtype != whole.dtype or t.storage is not None:
        raise PlanError(f"{where}: {t.dtype} sent, {whole.dtype} received")
    expected = whole.dtype.itemsize * math.prod(n.shape)
    if t.bytes != expected:
        raise PlanError(f"{where}: {t.bytes} bytes sent, {expected} received")


def messages_digest(programs: Sequence[MemGraph]) -> str:
    """SHA-256 over every rank's sends and recvs (peer, tag, box or bytes): equal on two
    processes exactly where their programs exchange the same messages."""
    import hashlib
    h = hashlib.sha256(str(len(programs)).encode())
    for r, mg in enumerate(programs):
        for n in mg.nodes:
            if isinstance(n, SendNode):
                h.update(f"{r} send {n.peer} {n.tag} {mg.tensors[n.tensor].bytes};".encode())
            elif isinstance(n, RecvNode):
                h.update(f"{r} recv {n.peer} {n.tag} {n.input} {n.origin} {n.shape};".encode())
    return h.hexdigest()


def save_programs(programs: Sequence[MemGraph], path: str | Path,
                  meta: Mapping[str, object] | None = None) -> None:
    """Write every rank's program to one file (the module's docstring), `.gz` compressed by
    name, whole or not at all."""
    write_plan_json(path, lambda: {"format": RANKS_FORMAT, "version": VERSION,
                                   "world": len(programs), "meta": dict(meta or {}),
                                   "programs": [mg.to_json() for mg in programs]})


def load_programs(path: str | Path) -> tuple[tuple[MemGraph, ...], Mapping[str, object]]:
    """The programs of a file `save_programs` wrote, and its meta; a plan for one device is one
    program. Every failure is one `PlanError` naming the file."""
    data = read_plan_json(path)
    if isinstance(data, dict) and data.get("format") != RANKS_FORMAT:
        return (MemGraph.load(path),), {}
    try:
        if data.get("version") != VERSION:
            raise PlanError(f"version {data.get('version')!r} of a plan for several ranks is not "
                            f"supported (this einpage reads version {VERSION})")
        world = int(data["world"])
        programs = data["programs"]
        if not isinstance(programs, list) or len(programs) != world:
            raise PlanError(f"world is {world} but the file holds "
                            f"{len(programs) if isinstance(programs, list) else 'no list of'} "
                            "programs")
        out = []
        for k, p in enumerate(programs):
            try:
                out.append(MemGraph.from_json(p))
            except PlanError as exc:
                raise PlanError(f"rank {k}: {exc}") from None
        return tuple(out), MappingProxyType(dict(data.get("meta", {})))
    except PlanError as exc:
        raise PlanError(f"{path}: {exc}") from None
    except MALFORMED as exc:
        raise PlanError(f"{path}: malformed ({type(exc).__name__}: {exc})") from None
