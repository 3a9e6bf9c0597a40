"""The compiler driver: the passes in order, and running a compiled plan.

    Graph --partition--> TaskGraph --order--> [task ids] --resident--> --lower--> MemGraph
          --validate--> report
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np

from einpage.allocator import aligned
from einpage.errors import BudgetError
from einpage.ir.graph import Graph
from einpage.ir.memgraph import MemGraph
from einpage.ir.taskgraph import TaskGraph
from einpage.lower import LowerOptions, lower
from einpage.order import memory_aware_order
from einpage.partition import PartitionOptions, partition
from einpage.policies import get_policy
from einpage.resident import choose_resident, everything_fits, pass_needs, pass_reserve
from einpage.sizes import format_size


@dataclass(frozen=True)
class CompileOptions:
    device_bytes: int
    policy: str = "reuse-distance"
    block_fraction: float = 1 / 8       # target working set of a task, as a share of the budget
    block_bytes: int | None = None      # ... or in bytes
    lookahead_bytes: int | None = None  # cap on bytes prefetched ahead of execution
    cuts: Mapping[int, Mapping[str, int]] = field(default_factory=dict)
    sources: Mapping[str, str] = field(default_factory=dict)
    validate: bool = True


@dataclass(frozen=True)
class Compiled:
    memgraph: MemGraph
    taskgraph: TaskGraph
    order: tuple[int, ...]
    report: dict


def compile_graph(graph: Graph, options: CompileOptions) -> Compiled:
    """Partition, order, choose resident weights, lower and validate `graph` for the budget."""
    t0 = time.perf_counter()
    policy = get_policy(options.policy)
    block = options.block_bytes or max(4096, int(options.device_bytes * options.block_fraction))
    tg = partition(graph, PartitionOptions(block, options.cuts, options.sources))
    order = memory_aware_order(tg)
    needs = pass_needs(tg, order)
    if needs.max_working_set > options.device_bytes:
        raise BudgetError(f"budget {format_size(options.device_bytes)} is too small: one task "
                          f"needs {format_size(needs.max_working_set)} at once; the smallest budget "
                          f"that would work is {format_size(needs.max_working_set)}",
                          needs.max_working_set, options.device_bytes)
    fits = everything_fits(needs, options.device_bytes)
    if fits or not policy.evicts:
        resident = frozenset(b.id for b in tg.input_blocks if b.role == "weight")
    else:
        resident = choose_resident(tg, order, options.device_bytes - pass_reserve(needs))
    mg = None
    while mg is None:
        try:
            mg = lower(tg, order, LowerOptions(options.device_bytes, policy, resident,
                                               inputs_at_device=fits and policy.evicts,
                                               lookahead_bytes=options.lookahead_bytes))
        except BudgetError:
            if not resident or not policy.evicts:
                raise
            keep = len(resident) // 2  # give the pass more room and try again
            resident = frozenset(sorted(resident)[:keep])
    report_valid = None
    if options.validate:
        from einpage.validate import validate
        report_valid = validate(mg)
    seconds = time.perf_counter() - t0
    report = summarize(mg, tg, needs, resident, seconds, report_valid)
    mg = MemGraph(mg.device_bytes, mg.tensors, mg.nodes, mg.outputs, mg.inputs, mg.results,
                  {"policy": options.policy, **{k: report[k] for k in
                                                ("tasks", "resident_bytes", "weight_bytes")}})
    return Compiled(mg, tg, tuple(order), report)


def summarize(mg: MemGraph, tg: TaskGraph, needs, resident, seconds, valid) -> dict:
    resident_bytes = sum(aligned(tg.blocks[b].bytes) for b in resident)
    streamed = needs.weight_bytes - resident_bytes
    return {
        "device_bytes": mg.device_bytes,
        "peak_bytes": valid.peak_bytes if valid else mg.high_water(),
        "live_peak_bytes": valid.live_peak_bytes if valid else None,
        "lower_bound_bytes": resident_bytes + needs.max_working_set,
        "min_budget_bytes": needs.max_working_set,
        "tasks": len(tg.tasks),
        "blocks": len(tg.blocks),
        "nodes": len(mg.nodes),
        "weight_bytes": needs.weight_bytes,
        "resident_bytes": resident_bytes,
        "streamed_weight_bytes": streamed,
        "reload_count": mg.count("reload"),
        "reload_bytes": mg.moved_bytes("reload"),
        "offload_count": mg.count("offload"),
        "offload_bytes": mg.moved_bytes("offload"),
        "activation_peak_bytes": needs.activation_peak,
        "compile_seconds": round(seconds, 3),
        "tasks_per_second": round(len(tg.tasks) / seconds, 1) if seconds > 0 else None,
    }


def run_paged(graph: Graph, inputs: Mapping[str, np.ndarray],
              weights: Callable, options: CompileOptions, order="sequential") -> dict:
    """Compile `graph` for the budget and run the plan on the NumPy executor."""
    from einpage.runtime.executor import run
    compiled = compile_graph(graph, options)
    return run(compiled.memgraph, inputs, _by_name(weights), order=order)


def _by_name(weights) -> Callable[[str], np.ndarray]:
    """Executor weight source (name -> array) from a model weight source."""
    if hasattr(weights, "array"):
        return weights.array
    return weights
