"""Which plan for several devices: a pipeline (`einpage.compiler.pipeline`), tensor
parallelism (`einpage.compiler.tensor_parallel`), or whichever the simulator predicts faster."""
from __future__ import annotations

from einpage.errors import PlanError
from einpage.ir.graph import Graph

#: how a model is spread over several devices (`RanksRunner`, `compile --parallel`)
PARALLEL = ("pipeline", "tensor", "auto")


def compile_parallel(graph: Graph, world: int, options, parallel: str,
                     cut: tuple[int, ...] | None = None):
    """`graph` compiled for `world` devices: a pipeline (`cut` fixed, where given), a
    tensor-parallel plan, or (`auto`) whichever of the two the simulator predicts faster."""
    from einpage.compiler.pipeline import compile_pipeline, ranks_report
    from einpage.compiler.tensor_parallel import compile_tensor_parallel
    if parallel == "pipeline":
        return compile_pipeline(graph, world, options, cut=cut)
    if parallel == "tensor":
        return compile_tensor_parallel(graph, world, options)
    from einpage.predict.devices import DEFAULT_DEVICE, get_device
    profile = options.device or get_device(DEFAULT_DEVICE)
    tried = [compile_pipeline(graph, world, options, cut=cut)]
    try:
        tried.append(compile_tensor_parallel(graph, world, options))
    except PlanError:  # nothing this graph splits over `world`: the pipeline
        pass
    return min(tried, key=lambda p: ranks_report(p, profile, 1, 0.0).makespan_s)


