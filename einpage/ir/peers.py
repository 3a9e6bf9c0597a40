"""Programs of several ranks, checked together: every send meets exactly one recv and the two
agree, and no order of any rank's program can deadlock.

Each program is first validated alone (`einpage.ir.validator.validate`: its memory, its sends
and recvs, and that it computes its rank graph). Across ranks:

- ranks 0..N-1 appear once each, every program saying `world` N;
- a send from q to r under tag t and a recv on r from q under tag t pair one to one (a send
  with no recv, a recv with no send, or a tag used twice, is refused); the pair agrees on the
  value (the sender's output name is the receiver's input name), the box (the output block's
  origin and shape are the recv's), the dtype and the bytes;
- a message is a pipeline's (its value `pipe.<node>`) or belongs to an *exchange* (a
  tensor-parallel all-reduce, `einpage.compiler.tensor_parallel`). The ranks that exchanges
  join form *groups* (every rank alone, where there are none; all of them, for tensor
  parallelism; consecutive ranks of each stage, for a pipeline of tensor-parallel groups,
  `einpage.compiler.hybrid`). Every pipeline message goes to a later group (ordered by their
  lowest ranks; for ranks alone: to a higher rank), and within each group every rank takes part
  in the exchanges in one order and keeps it: a recv of exchange k depends on every send of
  exchange k of its own rank, and a send of exchange k depends on every recv of the exchange
  before k on its rank (where the rank receives nothing of that exchange, on its sends of it and
  on what those depend on, so that the chain below holds).

A file holds the programs of every rank (`save_programs`, `load_programs`): `{"format":
"einpage.ranks", "version": 2, "world": N, "meta": {...}, "programs": [plan, ...]}`, each plan
the JSON of one rank's `MemGraph` (version 2, with its `rank` and `world`). Each process of a
run reads the one file and runs its own rank's program.

Why the last rule is enough for deadlock freedom, whatever order each rank runs its nodes in and
however long its sends wait to be matched: rank 0 receives nothing, so it runs to the end; by
induction, when ranks 0..r-1 run to the end, every send to rank r is posted, so each recv of
rank r is eventually matched and rank r runs to the end too. A pipeline's stages send only
forward, so this costs nothing.

Both together (a pipeline of groups): the first group receives no pipeline message, so the
exchange argument below holds for it alone and it runs to the end; by induction, when the
groups before group g have run to the end, every pipeline message to group g has been posted,
so a rank of group g can wait for good only at a recv of an exchange, and the argument holds for
group g.

Why the exchange rule is enough, when messages go both ways (sends never wait to be matched:
they are posted and the rank goes on). Exchanges are numbered in the order every rank keeps.
Suppose the ranks could stop for good with some recv unmatched; each stopped rank waits at a
recv. Take, among the recvs the ranks wait at, one of the lowest exchange j: rank r waits for
rank q's send of exchange j. Rank q waits at a recv of some exchange i >= j. That recv depends
on q's own sends of exchange i, which depend on q's recvs of exchange i - 1 (or, where q
receives none of it, directly on its sends of i - 1 and what those depend on), which depend on
q's sends of exchange i - 1, and so on down to q's sends of exchange j: q has posted them all,
the one r waits for among them. So r's recv is matched, a contradiction; every run ends. This holds
whatever order each rank runs its nodes in. A stream runtime runs each queue in the order of
the node list: its constraints (the deps, each queue's order, each send before its recv) are a
subset of those of running every rank in list order, one node at a time, which the argument
covers; so they are acyclic and some queue's head can always run.
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

#: the name a value crossing ranks of a pipeline has on both sides: the sender's output, the
#: receiver's input
BOUNDARY_PREFIX = "pipe."
#: the name a partial sum of a tensor-parallel all-reduce leaves its rank under; rank r receives
#: rank q's as `<name>.<q>`, q the sender's place in its group (its rank, where one group holds
#: every rank)
EXCHANGE_PREFIX = "tp."


def boundary_name(node: int) -> str:
    """The name of graph node `node`'s value where it crosses ranks."""
    return f"{BOUNDARY_PREFIX}{node}"


def exchange_name(node: int) -> str:
    """The name graph node `node`'s partial sum leaves each rank under (an all-reduce)."""
    return f"{EXCHANGE_PREFIX}{node}"


def exchange_input(node: int, src: int) -> str:
    """The name rank `src`'s partial sum of graph node `node` has on the ranks it reaches."""
    return f"{EXCHANGE_PREFIX}{node}.{src}"


def exchange_of(name: str) -> tuple[int, int | None] | None:
    """(node, source rank) of an exchange's input name, (node, None) of its output name, None
    for any other name."""
    if not name.startswith(EXCHANGE_PREFIX):
        return None
    parts = name[len(EXCHANGE_PREFIX):].split(".")
    if not all(p.isdigit() for p in parts) or len(parts) not in (1, 2):
        return None
    return int(parts[0]), (int(parts[1]) if len(parts) == 2 else None)


def is_boundary(name: str) -> bool:
    """Whether `name` is a value that crosses ranks (a pipeline's boundary or a partial sum of
    an all-reduce): no result of the model."""
    return name.startswith(BOUNDARY_PREFIX) or name.startswith(EXCHANGE_PREFIX)


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
                sends[key] = (q, n)
    kinds = {key: _exchange(programs[q], s) is not None for key, (q, s) in sends.items()}
    group = _groups(world, [(q, r) for (q, r, _), exchange in kinds.items() if exchange])
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
            _check_pair(programs[q], q, s, mg, r, n, inputs[n.input], q - group[q])
    for (q, r, tag), (_, s) in sorted(sends.items()):
        raise PlanError(f"rank {q}: node %{s.id} (send) sends tag {tag} to rank {r}, which "
                        "receives no such message")
    for (q, r, tag), exchange in sorted(kinds.items()):
        if not exchange and group[r] <= group[q]:
            where = (f"rank {r}, a rank of its own group" if group[r] == group[q] else
                     f"rank {r}, of a group before its own")
            raise PlanError(f"rank {q}: a pipeline's message (tag {tag}) goes back to {where}: "
                            "a pipeline sends only to later ranks, and messages go both ways "
                            "only within all-reduces")
    if any(kinds.values()):
        _check_exchanges(programs, group)
    return tuple(reports)


def _groups(world: int, pairs) -> list[int]:
    """Each rank's group: the ranks that exchange messages join, numbered by their lowest rank
    (a rank alone is a group of its own)."""
    parent = list(range(world))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for q, r in pairs:
        a, b = find(q), find(r)
        parent[max(a, b)] = min(a, b)
    return [find(r) for r in range(world)]


def _exchange(mg: MemGraph, n) -> tuple[int, tuple[int, ...]] | None:
    """The exchange a send or recv belongs to, (graph node, block origin); None for a pipeline's
    message."""
    if isinstance(n, RecvNode):
        found, origin = exchange_of(n.input), tuple(n.origin)
    else:
        out = next((o for o in mg.outputs if o.tensor == n.tensor), None)
        found = exchange_of(out.name) if out is not None else None
        origin = tuple(out.origin) if out is not None else ()
    return (found[0], origin) if found else None


def _check_exchanges(programs: Sequence[MemGraph], group: list[int]) -> None:
    """The exchange rule (the module's docstring): within each group, each rank's exchanges, in
    the order of its first send of each, are the same sequence on every rank, and each rank's
    program keeps it."""
    orders = [_check_exchange_order(mg) for mg in programs]
    for r, got in enumerate(orders):
        first = group[r]
        if got != orders[first]:
            at = next((i for i, (a, b) in enumerate(zip(got, orders[first])) if a != b),
                      min(len(got), len(orders[first])))
            raise PlanError(f"rank {r} takes part in the exchanges in another order than rank "
                            f"{first} (they differ at position {at}): the ranks could deadlock")


def _check_exchange_order(mg: MemGraph) -> list:
    """One rank's exchanges in order, checked: a recv of an exchange waits for every send of
    it on this rank, a send for every recv of the exchange before (a pipeline's messages take
    no part)."""
    from einpage.ir.ancestry import Ancestry
    r = mg.rank
    sends: dict[tuple, list[int]] = {}
    recvs: dict[tuple, list[int]] = {}
    for n in mg.nodes:
        if isinstance(n, (SendNode, RecvNode)):
            e = _exchange(mg, n)
            if e is not None:
                (sends if isinstance(n, SendNode) else recvs).setdefault(e, []).append(n.id)
    for e, ids in recvs.items():
        if e not in sends:
            raise PlanError(f"rank {r}: node %{ids[0]} (recv) is of an exchange this rank sends "
                            "nothing of: the ranks could deadlock")
    order = sorted(sends, key=lambda e: min(sends[e]))
    ancestry = Ancestry(mg.nodes)
    before: list[int] = []
    for e in order:
        for s in sends[e]:
            lost = ancestry.missing(before, s)
            if lost:
                raise PlanError(f"rank {r}: node %{s} (send of exchange {e[0]} at {list(e[1])}) "
                                f"does not wait for node %{lost[0]} ({mg.nodes[lost[0]].kind} "
                                "of the exchange before): the ranks could deadlock")
        for v in recvs.get(e, ()):
            lost = ancestry.missing(sends[e], v)
            if lost:
                raise PlanError(f"rank {r}: node %{v} (recv of exchange {e[0]} at {list(e[1])}) "
                                f"does not wait for node %{lost[0]} (this rank's send of it): "
                                "the ranks could deadlock")
        # the next exchange's sends wait for this one's recvs; where this rank receives none of
        # it, for its sends of it and what they waited for (the chain of the proof holds)
        before = recvs.get(e) or [*before, *sends[e]]
    return order


def _check_pair(sender: MemGraph, q: int, s: SendNode, receiver: MemGraph, r: int,
                n: RecvNode, whole, place: int) -> None:
    """A send and the recv it pairs with agree (`place`: the sender's place in its group, which
    names its addend of an exchange on the receivers)."""
    t = sender.tensors[s.tensor]
    out = next((o for o in sender.outputs if o.tensor == s.tensor), None)
    where = f"rank {q} node %{s.id} (send) and rank {r} node %{n.id} (recv), tag {n.tag}"
    pair = exchange_of(n.input)
    same = out is not None and (out.name == n.input or (
        pair is not None and pair[1] == place and out.name == exchange_name(pair[0])))
    if not same:
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
