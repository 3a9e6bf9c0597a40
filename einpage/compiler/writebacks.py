"""Write-backs undone where their room went unused: a pass that streams writes each output back
to the host as soon as it is final (`LowerOptions.outputs_to_host`), to make room; where no later
node took that room, the output stays on the device instead (a post-pass of the lowering)."""
from __future__ import annotations

from collections import Counter
from itertools import chain

from einpage.ir.memgraph import renumbered


def keep_idle_outputs(nodes: list, written_back: dict[int, int]) -> tuple[list, dict[int, int]]:
    """Undo the write-backs that freed bytes no later node took: an output written back as soon
    as it was final (`outputs_to_host`) to make room, where the room was never used (no node
    depends on the free that followed its offload), stays on the device to the end instead, as
    outputs do in a pass that fits, and the pass ends without copying it. Returns the nodes
    (renumbered) and where each output kept this way lies."""
    drop: set[int] = set()
    at: dict[int, int] = {}
    if not written_back:
        return nodes, at
    users = Counter(chain.from_iterable(n.deps for n in nodes))
    for b, fid in written_back.items():
        # the lowering's _evict emits the offload right before the free, which alone waits on it
        oid = fid - 1
        if users[fid] == 0 and nodes[oid].kind == "offload" and users[oid] == 1:
            drop.update((oid, fid))
            at[b] = nodes[fid].offset
    if not drop:
        return nodes, at
    cut = min(drop)  # the nodes before the first one dropped keep their ids and deps
    new_id = {k: k for k in range(cut)}
    out = nodes[:cut]
    for n in nodes[cut:]:
        if n.id in drop:
            continue
        new_id[n.id] = len(out)
        out.append(renumbered(n, len(out), tuple(new_id[d] for d in n.deps)))
    return out, at
