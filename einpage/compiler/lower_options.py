"""What a lowering (`einpage.compiler.lowering.lower`) is told: the budget, the policy and the
resident set, where activations start and end, how far the allocation horizon may run ahead,
which tasks run on the host, and the knobs the search varies (`search.Knobs`)."""
from __future__ import annotations

from dataclasses import dataclass

from einpage.compiler.policies import Policy

#: A reload is guarded where its readers' guard is on in at most this share of the passes: it
#: waits for the router, so it is never prefetched ahead of its layer; where most experts run
#: anyway, the prefetch is worth more than the bytes a guard might save.
GUARDED_RELOAD_SHARE = 0.5


@dataclass(frozen=True)
class LowerOptions:
    """The options of one lowering (`einpage.compiler.lowering`: `claim_share` defaults to its
    CLAIM_SHARE, `evict_ahead` lets go of blocks past its FAR_SHARE)."""
    device_bytes: int
    policy: Policy
    resident: frozenset[int] = frozenset()       # persistent blocks kept on the device
    inputs_at_device: bool = False               # activation inputs start on the device
    outputs_to_host: bool = False                # write outputs back as soon as they are final
    lookahead_bytes: int | None = None           # cap on bytes reserved ahead of execution
    lookahead_seconds: float | None = None       # cap on predicted compute ahead of execution
    task_seconds: tuple[float, ...] = ()         # predicted seconds of each task, by task id
    on_host: frozenset[int] = frozenset()        # tasks that run on the host (placement)
    guarded_reload_share: float = GUARDED_RELOAD_SHARE  # guard reloads whose guard's share
                                                        # is at most this
    evict_ahead: bool = False                    # reserving ahead may evict far clean blocks
    claim_share: float | None = None             # room kept for deferred writes (CLAIM_SHARE)
    pack_low: bool = True                        # blocks that stay packed from below (`_allocate`)
    progress: object = None                      # callable(done_tasks, total_tasks) or None


__all__ = ["GUARDED_RELOAD_SHARE", "LowerOptions"]
