"""Graph runners: what turns a concrete graph and its inputs into outputs. The dense reference,
or a plan compiled for a device budget and executed. This module joins the compiler and the
runtime (which never import each other); the command line and user code build runners here."""
from __future__ import annotations

from typing import Callable, Mapping

import numpy as np

from einpage.compiler import CompileOptions, compile_graph
from einpage.ir.graph import Graph
from einpage.ir.tensors import WeightSource
from einpage.runtime.executor import run

#: runs a concrete graph: (graph, inputs by name) -> outputs by name
Runner = Callable[[Graph, Mapping[str, np.ndarray]], Mapping[str, np.ndarray]]


def run_paged(graph: Graph, inputs: Mapping[str, np.ndarray],
              weights: WeightSource, options: CompileOptions, order="sequential") -> dict:
    """Compile `graph` for the budget and run the plan on the NumPy executor."""
    compiled = compile_graph(graph, options)
    return run(compiled.memgraph, inputs, weights, order=order)


def dense_runner(weights: WeightSource) -> Runner:
    """The dense reference on whole tensors."""
    from einpage.runtime.reference import evaluate
    return lambda graph, inputs: evaluate(graph, inputs, weights)


def paged_runner(weights: WeightSource, options: CompileOptions) -> Runner:
    """Compile every graph for `options.device_bytes` and execute the plan."""
    return lambda graph, inputs: run_paged(graph, inputs, weights, options)
