"""The dense reference interpreter: a concrete `Graph` on whole NumPy tensors. The truth every
other path is checked against."""
from __future__ import annotations

from typing import Mapping

import numpy as np

from einpage.errors import EinpageError, GraphError, InputError
from einpage.ir import scalar
from einpage.ir.graph import (Concat, Einsum, Fill, Gather, Graph, Input, Node, Output, Reshape,
                              Role, Slice)
from einpage.ir.tensors import WeightSource
from einpage.runtime import kernels
from einpage.ir.quant import dequantize, quantize
from einpage.ir.storage import Storage
from einpage.runtime.planio import held_storage


def evaluate(graph: Graph, inputs: Mapping[str, np.ndarray] | None = None,
             weights: WeightSource | None = None, float64: bool = False) -> dict[str, np.ndarray]:
    """Run `graph`; activation and cache inputs come from `inputs` (by name), weights from
    `weights(name)`. Returns the outputs by name, stored in each node's dtype, or all in
    float64 with `float64=True` (integers stay int64)."""
    if not graph.is_concrete:
        raise GraphError("evaluate: bind the graph's size symbols first: "
                         + ", ".join(sorted(s.name for s in graph.symbols)))
    inputs = dict(inputs or {})
    values: list[np.ndarray | None] = [None] * len(graph.nodes)
    remaining = [len(graph.users(n.id)) for n in graph.nodes]
    results: dict[str, np.ndarray] = {}
    for node in graph.nodes:
        try:
            if node.guard is not None and not values[node.guard.tensor].flat[node.guard.index]:
                value = np.zeros(node.shape, storage_dtype(node, float64))  # off: all zeros
            else:
                value = _run(node, [values[i] for i in node.inputs], inputs, weights, float64)
        except EinpageError:
            raise
        except Exception as exc:  # a kernel failure: say which node
            raise GraphError(f"while evaluating %{node.id} ({node.kind}): {exc}") from exc
        if tuple(value.shape) != tuple(node.shape):
            raise GraphError(f"%{node.id} ({node.kind}) produced shape {value.shape}, "
                             f"expected {tuple(node.shape)}")
        values[node.id] = value
        if isinstance(node.op, Output):
            results[node.op.name] = value
        guard = (node.guard.tensor,) if node.guard is not None else ()
        for i in (*node.inputs, *guard):  # drop what no later node reads
            remaining[i] -= 1
            if remaining[i] == 0:
                values[i] = None
    return results


def storage_dtype(node: Node, float64: bool) -> np.dtype:
    if float64 and node.dtype.is_float:
        return np.dtype(np.float64)
    return node.dtype.numpy


def compute_dtype(node: Node, float64: bool) -> np.dtype:
    if float64 and node.dtype.is_float:
        return np.dtype(np.float64)
    return node.dtype.compute


def _run(node: Node, args, inputs, weights, float64) -> np.ndarray:
    op = node.op
    store = storage_dtype(node, float64)
    if isinstance(op, Input):
        if op.role is Role.weight:
            if weights is None:
                raise InputError(f"no weights given for weight input {op.name!r}")
            value = _logical_weight(weights, op.name, op.storage, tuple(node.shape), store)
        else:
            if op.name not in inputs:
                raise InputError(f"missing input {op.name!r} ({op.role.value}, shape "
                                 f"{tuple(node.shape)})")
            value = np.asarray(inputs[op.name])
            if op.storage is not None:  # a packed KV store, given packed
                packed = op.storage.packed_shape(tuple(node.shape))
                if tuple(value.shape) != packed:
                    raise InputError(f"input {op.name!r} is kept as {op.storage.format}: "
                                     f"expected its packed bytes of shape {packed}, got "
                                     f"{tuple(value.shape)}")
                value = dequantize(value, op.storage, tuple(node.shape), store)
        if tuple(value.shape) != tuple(node.shape):
            raise InputError(f"input {op.name!r}: expected shape {tuple(node.shape)}, got "
                             f"{tuple(value.shape)}")
        return value.astype(store, copy=False)
    if isinstance(op, Einsum):
        out = kernels.einsum(op.spec, op.join, op.agg, args, compute_dtype(node, float64))
        return out.astype(store, copy=False)
    if isinstance(op, Fill):
        return scalar.evaluate_fill(op.expr, (0,) * len(node.shape), node.shape, store)
    if isinstance(op, Gather):
        return kernels.gather(args[0], args[1]).astype(store, copy=False)
    if isinstance(op, Reshape):
        return args[0].reshape(node.shape)
    if isinstance(op, Concat):
        return np.concatenate(args, axis=op.axis)
    if isinstance(op, Slice):
        index = [slice(None)] * len(node.shape)
        index[op.axis] = slice(op.start, op.stop)
        return args[0][tuple(index)]
    if isinstance(op, Output):
        return args[0]
    raise GraphError(f"%{node.id}: unknown node kind {node.kind}")


def _logical_weight(weights, name: str, storage: Storage | None, shape: tuple[int, ...],
                   dtype: np.dtype) -> np.ndarray:
    """The values of weight `name` as a graph that stores it in `storage` computes with them:
    quantized and dequantized again (or dequantized from the file's packed bytes). The dense
    reference runs on these."""
    from einpage.errors import CheckpointError
    held, raw = held_storage(weights, name), weights(name)
    if storage is None and held is None:
        return np.asarray(raw)
    if held is None:
        return dequantize(quantize(np.asarray(raw), storage), storage, shape, dtype)
    if storage is not None and held.format != storage.format:
        raise CheckpointError(f"weight {name!r} is stored as {held.format}, but the graph "
                              f"reads it as {storage.format}")
    return dequantize(np.asarray(raw), held, shape, dtype)
