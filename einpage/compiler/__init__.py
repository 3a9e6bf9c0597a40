"""The paging compiler: a bound `Graph` to a validated `MemGraph` for a device budget.

    partitioner  `partition`: Graph -> TaskGraph (cuts chosen per axis class in `cuts`)
    order        `memory_aware_order`: the task order
    resident     which weights stay on the device
    lowering     `lower`: simulated execution with three horizons -> MemGraph (victims chosen by
                 `policies`, offsets by `allocator`; its options in `lower_options`)
    search       the look-ahead windows and resident sets tried, and the fastest kept
    rooms        the room search on one partition: resident sets leaving the pass a share of
                 the budget, refined, and weighed again by the tiered pass
    host_search  which blocks to keep in host memory, so the tasks reading them run there
    tiers        which streamed blocks the host budget pins and which are read from disk
    tier_room    the resident set weighed again by the tiered pass, where the disk binds
    report       `PlanReport`: what a plan needs, moves and is predicted to take
    driver       `compile_graph`: the passes in order

`compiler` imports `ir` and `predict` (the cost model prices look-ahead windows and trials); it
never imports `runtime` or `cli`."""
from einpage._exports import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "CompileOptions": "driver", "Compiled": "driver", "compile_graph": "driver",
    "PlanReport": "report", "Traffic": "report", "CompileFigures": "report",
    "PartitionOptions": "partitioner", "partition": "partitioner",
    "memory_aware_order": "order",
    "LowerOptions": "lower_options", "lower": "lowering",
    "POLICIES": "policies", "Policy": "policies", "get_policy": "policies",
    "Allocator": "allocator", "aligned": "allocator",
})
