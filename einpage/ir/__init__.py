"""The IR layers, from the user's graph down to the plan the runtimes execute:

    dtypes, scalar, spec   element types, join/fill expressions (SymPy), einsum specs
    graph, builder         `Graph` (logical einsum ops on whole tensors) and its DSL
    ops                    block-level ops (what a task or a plan node runs)
    taskgraph              `TaskGraph`: every op cut into blocks
    memgraph               `MemGraph`: blocks at byte offsets of one arena, with transfers; JSON
    provenance             the graph a plan was made from (its taskgraph) in the plan file
    validator              `validate`: a plan's memory and order rules, checked on the edges
                           alone, and (`translation`) that it computes the graph it carries

`ir` imports no other einpage subpackage (only `einpage.errors`)."""
from einpage._exports import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "DType": "dtypes", "as_dtype": "dtypes",
    "EinsumSpec": "spec",
    "Graph": "graph",
    "GraphBuilder": "builder", "Tensor": "builder",
    "TaskGraph": "taskgraph",
    "MemGraph": "memgraph",
    "validate": "validator", "ValidationReport": "validator",
})
