"""A pipeline of tensor-parallel groups: N = P x T devices, the model's layers cut into P
stages (`einpage.compiler.pipeline`), each stage split over a group of T devices by tensor
parallelism (`einpage.compiler.tensor_parallel`). Megatron-LM's two dimensions: the all-reduces,
two per layer, stay among the T devices of a group (the devices of one machine, over NVLink),
and only the hidden state crosses between groups, once per stage boundary (between machines).

Rank p x T + t is member t of group p (stage p). Each stage's rank graph is split over its
group as a whole graph would be; its boundary values (the residual stream at a stage cut, the
masks and rotary tables every stage computes for itself) are replicated there, so member t of
group p sends its copy of a boundary to member t of each later group that reads it: T messages
per boundary block, each over its own pair of devices. A boundary value the split would leave
sharded cannot cross that way and is refused.

The programs speak to their peers in both ways of version 2 of the plan format: each group's
all-reduces are exchanges among its members (`tensor_parallel.join_exchanges`), and the
boundaries are a pipeline's messages among the t-th members of the groups
(`pipeline.join`). The validator proves every order of them free of deadlock with the rule for
both together (`einpage.ir.peers`): pipeline messages only to later groups, and each group
keeping one order of its exchanges.

The stage cut is the pipeline's stage model (`pipeline.model_cut`) for P devices of T times the
budget each: a stage's weights and work are spread over its T devices, which scales every
stage's modelled time alike and so leaves the balance where it is. It is not refined with the
compiler (a pipeline's `_refine` compiles neighbouring cuts; here each would be T compiles).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from einpage.compiler.pipeline import (ParallelPlan, RankPlan, Split, join, model_cut, split,
                                       stage_costs)
from einpage.compiler.tensor_parallel import (TensorSplit, compile_ranks,
                                              shard_graph, with_shards)
from einpage.errors import PlanError
from einpage.ir.graph import Graph
from einpage.ir.memgraph import MemGraph, RecvNode, SendNode
from einpage.ir.peers import BOUNDARY_PREFIX
from einpage.predict.devices import DEFAULT_DEVICE, get_device


@dataclass(frozen=True)
class HybridSplit:
    """The stages (`pipeline`: one rank graph per group) and each stage's tensor-parallel split
    over its group of `group` ranks."""
    pipeline: Split
    groups: tuple[TensorSplit, ...]
    group: int

    @property
    def cut(self) -> tuple[int, ...]:
        return self.pipeline.cut

    @property
    def stages(self) -> int:
        return self.pipeline.stages

    def stage_range(self, rank: int) -> tuple[int, int]:
        return self.pipeline.stage_range(rank // self.group)


def group_sizes(world: int) -> list[int]:
    """The group sizes a pipeline of tensor-parallel groups can take on `world` devices: every
    divisor T with 2 <= T and 2 <= world / T."""
    return [t for t in range(2, world // 2 + 1) if world % t == 0]


def compile_hybrid(graph: Graph, world: int, group: int, options,
                   cut: tuple[int, ...] | None = None,
                   compile_fn: Callable | None = None) -> ParallelPlan:
    """Compile `graph` for `world` devices of `options.device_bytes` each as `world / group`
    stages of `group` tensor-parallel devices (the module's docstring); `cut`: the stage cut,
    where given (a generation's later graphs take its prefill's, so a layer's KV rows stay on
    the group that made them)."""
    from einpage.compiler.driver import compile_graph
    compile_fn = compile_fn or compile_graph
    if group < 2 or world % group or world // group < 2:
        raise PlanError(f"a pipeline of tensor-parallel groups of {group} needs a multiple of "
                        f"{group} devices, at least {2 * group}; got {world}")
    if options.cuts:
        raise PlanError("per-node cuts name the whole graph's nodes; the ranks of a pipeline "
                        "of tensor-parallel groups take none")
    stages = world // group
    if cut is None:
        profile = options.device or get_device(DEFAULT_DEVICE)
        cut = model_cut(stage_costs(graph), stages, options.device_bytes * group, profile)
    s = split(graph, tuple(cut))
    groups = tuple(shard_graph(g, group) for g in s.graphs)
    for b in s.boundaries:
        if b.name in groups[b.src].gathered:
            raise PlanError(f"node %{b.node} crosses from stage {b.src} to stage {b.dst} split "
                            "over the tensor-parallel group: only a value every member holds "
                            "whole can cross (cut the stages elsewhere, or --parallel pipeline)")
    compiled, programs = [], []
    for p, ts in enumerate(groups):  # the all-reduces among the members of each group
        members, joined = compile_ranks(ts, options, compile_fn)
        compiled.append(members)
        programs.append([_peers(mg, lambda q, p=p: p * group + q) for mg in joined])
    for t in range(group):  # the boundaries among the t-th members of the groups
        column = join(s, [programs[p][t] for p in range(stages)])
        for p, mg in enumerate(column):
            programs[p][t] = _peers(mg, lambda q, t=t: q * group + t, pipeline_only=True)
    out = []
    for p, ts in enumerate(groups):
        for t, mg in enumerate(programs[p]):
            mg = replace(mg, rank=p * group + t, world=world)
            out.append(with_shards(mg, ts, t, parallel="hybrid", group=group))
    if options.validate:
        from einpage.ir.peers import validate_ranks
        validate_ranks(out)
    ranks = tuple(RankPlan(r, mg, compiled[r // group][r % group]) for r, mg in enumerate(out))
    return ParallelPlan(HybridSplit(s, groups, group), ranks, options.host_compute)


def _peers(mg: MemGraph, rank_of: Callable[[int], int], pipeline_only: bool = False) -> MemGraph:
    """`mg` with the peer of each send and recv (a pipeline's alone, with `pipeline_only`)
    renumbered by `rank_of`."""
    outputs = {o.tensor: o.name for o in mg.outputs}

    def moved(n) -> bool:
        if not pipeline_only:
            return True
        name = n.input if isinstance(n, RecvNode) else outputs.get(n.tensor, "")
        return name.startswith(BOUNDARY_PREFIX)

    nodes = tuple(replace(n, peer=rank_of(n.peer))
                  if isinstance(n, (SendNode, RecvNode)) and moved(n) else n for n in mg.nodes)
    return replace(mg, nodes=nodes)
