"""Which plan for several devices: a pipeline (`einpage.compiler.pipeline`), tensor
parallelism (`einpage.compiler.tensor_parallel`), a pipeline of tensor-parallel groups
(`einpage.compiler.hybrid`), or whichever of them the simulator predicts fastest."""
from __future__ import annotations

from einpage.errors import BudgetError, PlanError
from einpage.ir.graph import Graph

#: how a model is spread over several devices (`RanksRunner`, `compile --parallel`)
PARALLEL = ("pipeline", "tensor", "hybrid", "auto")


def compile_parallel(graph: Graph, world: int, options, parallel: str,
                     cut: tuple[int, ...] | None = None, group: int | None = None):
    """`graph` compiled for `world` devices: a pipeline (`cut` fixed, where given), a
    tensor-parallel plan, a pipeline of tensor-parallel groups (of `group` devices, or of each
    size `hybrid.group_sizes` allows, the fastest kept), or (`auto`) whichever of them the
    simulator predicts fastest."""
    from einpage.compiler.hybrid import compile_hybrid, group_sizes
    from einpage.compiler.pipeline import compile_pipeline, ranks_report
    from einpage.compiler.tensor_parallel import compile_tensor_parallel
    from einpage.predict.devices import DEFAULT_DEVICE, get_device
    if parallel == "pipeline":
        return compile_pipeline(graph, world, options, cut=cut)
    if parallel == "tensor":
        return compile_tensor_parallel(graph, world, options)
    profile = options.device or get_device(DEFAULT_DEVICE)

    def fastest(plans):
        return min(plans, key=lambda p: ranks_report(p, profile, 1, 0.0).makespan_s)

    if parallel == "hybrid":
        if group is not None:
            return compile_hybrid(graph, world, group, options, cut)
        sizes = group_sizes(world)
        if not sizes:
            raise PlanError(f"a pipeline of tensor-parallel groups needs two groups of two "
                            f"devices or more, all of one size (4, 6, 8, 9, ... devices); got "
                            f"{world}")
        plans, refused = [], None
        for t in sizes:
            try:
                plans.append(compile_hybrid(graph, world, t, options, cut))
            except PlanError as exc:  # a group size the heads do not divide: the others
                refused = refused or exc
        if not plans:
            raise refused
        return fastest(plans)
    tried, refused = [], None
    for kind in ["pipeline", "tensor", *group_sizes(world)]:
        try:  # more devices than stages, heads the devices do not divide: the others
            tried.append(compile_pipeline(graph, world, options, cut=cut) if kind == "pipeline"
                         else compile_tensor_parallel(graph, world, options) if kind == "tensor"
                         else compile_hybrid(graph, world, kind, options))
        except (PlanError, BudgetError) as exc:
            refused = refused or exc
    if not tried:
        raise refused
    return fastest(tried)
