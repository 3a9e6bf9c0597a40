"""What every runtime of a memgraph shares, whatever runs its nodes: instances as views of a byte
arena, the inputs a plan reads (activations by name, weights from a `WeightSource`), the blocks of
input tensors sliced from them, and the whole outputs assembled from their blocks."""
from __future__ import annotations

import math
import threading
from typing import Any, Callable, Mapping

import numpy as np

from einpage.errors import CheckpointError, InputError, PlanError
from einpage.ir.memgraph import InputNode, MemGraph, OutputRef, RecvNode, TensorInfo
from einpage.ir.tensors import WeightSource
from einpage.ir.quant import dequantize_box, quantize
from einpage.ir.storage import Storage


def tensor_info(mg: MemGraph, tid: int) -> TensorInfo:
    if not 0 <= tid < len(mg.tensors):
        raise PlanError(f"no tensor %t{tid} (the plan has {len(mg.tensors)})")
    return mg.tensors[tid]


def stored(t: TensorInfo) -> tuple[np.dtype, tuple[int, ...]]:
    """The NumPy dtype and shape a tensor's bytes are held in: its own, or for a packed weight
    block (`einpage.ir.storage`) `uint8` in its packed shape."""
    if t.storage is not None:
        return np.dtype(np.uint8), t.storage.packed_shape(t.shape)
    return t.dtype.numpy, tuple(t.shape)


def typed_view(buffer: np.ndarray, start: int, t: TensorInfo) -> np.ndarray:
    """Tensor `t` held in a `uint8` buffer from byte `start` (`stored`): a view."""
    dtype, shape = stored(t)
    nbytes = math.prod(shape) * dtype.itemsize
    return buffer[start:start + nbytes].view(dtype).reshape(shape)


def instance_bytes(mg: MemGraph, tid: int, offset: int | None) -> tuple[int, int]:
    """`(offset, nbytes)` of the instance of `tid` at `offset`, checked against the arena: the
    bytes its shape and dtype (or its packed shape) take (at most the tensor's `bytes`)."""
    t = tensor_info(mg, tid)
    if offset is None or offset < 0 or offset + t.bytes > mg.device_bytes:
        raise PlanError(f"%t{tid} ({t.bytes} bytes) at offset {offset} lies outside the "
                        f"arena of {mg.device_bytes} bytes")
    dtype, shape = stored(t)
    need = math.prod(shape) * dtype.itemsize
    if need > t.bytes:
        raise PlanError(f"%t{tid} is {t.dtype}{list(t.shape)}, {need} bytes, but has only "
                        f"{t.bytes} bytes")
    return offset, need


def arena_view(arena: np.ndarray, mg: MemGraph, tid: int, offset: int | None) -> np.ndarray:
    """The instance of `tid` at `offset`: a typed view of the `uint8` arena."""
    start, _ = instance_bytes(mg, tid, offset)
    return typed_view(arena, start, mg.tensors[tid])


def received_inputs(mg: MemGraph, poison: bool = True) -> dict[str, np.ndarray]:
    """A host buffer for each input of a rank's program that its recvs fill, in the input's
    logical shape and dtype (poisoned, 0xFF bytes: a block read before its recv shows NaN)."""
    names = {n.input for n in mg.nodes if isinstance(n, RecvNode)}
    out = {}
    for t in mg.inputs:
        if t.name in names:
            buf = np.empty(t.shape, t.dtype.numpy)
            if poison:
                buf.view(np.uint8)[...] = 0xFF
            out[t.name] = buf
    return out


def receive_into(whole: np.ndarray, n: RecvNode, comm) -> None:
    """Recv `n`'s box of its input, from its peer, into `whole` (that input's host buffer)."""
    box = np.empty(n.shape, whole.dtype)
    comm.recv(box, n.peer, n.tag)
    whole[tuple(slice(o, o + e) for o, e in zip(n.origin, n.shape))] = box


def held_storage(weights, name: str) -> Storage | None:
    """The storage a weight source holds weight `name` in (None: unpacked, in a float dtype).
    A source that holds packed weights (a GGUF file) says so with `storage(name)`."""
    ask = getattr(weights, "storage", None)
    return ask(name) if callable(ask) else None


class PlanIO:
    """A plan's traffic with its caller. Checks on construction (and at `set_inputs`, for the
    next pass of a plan held open) that every activation or cache input the plan reads is given
    with its logical shape; reads weights lazily, each whole weight once (`weights(name)` may
    return a memory map: only the blocks the plan reads are touched). Safe to use from several
    threads."""

    def __init__(self, mg: MemGraph, inputs: Mapping[str, np.ndarray] | None = None,
                 weights: WeightSource | None = None):
        self.mg = mg
        self.inputs = {name: np.asarray(value) for name, value in (inputs or {}).items()}
        self.weights = weights
        self._roles = {t.name: t.role for t in mg.inputs}
        self._whole: dict[str, Any] = {}
        self._lock = threading.Lock()
        #: non-weight inputs the plan holds packed (a quantized KV store): the caller gives them
        #: in their packed layout (`einpage.ir.storage`)
        self._packed_inputs = {t.source.input: t.storage for t in mg.tensors
                               if t.storage is not None and t.source is not None
                               and t.role != "weight"}
        self._check_inputs()

    def set_inputs(self, inputs: Mapping[str, np.ndarray]) -> None:
        """The inputs of the next pass (between passes: no node is running)."""
        fresh = {name: np.asarray(value) for name, value in inputs.items()}
        saved = self.inputs
        self.inputs = fresh
        try:
            self._check_inputs()
        except InputError:
            self.inputs = saved
            raise
        with self._lock:
            self._whole = {name: whole for name, whole in self._whole.items()
                           if self._roles.get(name) == "weight"}

    def _check_inputs(self) -> None:
        expected = {t.name: (t.role, tuple(t.shape)) for t in self.mg.inputs}
        for n in self.mg.nodes:
            if isinstance(n, InputNode) and 0 <= n.tensor < len(self.mg.tensors):
                t = self.mg.tensors[n.tensor]
                if t.source is not None and t.source.input not in expected:
                    expected[t.source.input] = (t.role, tuple(t.source.full_shape))
        for name, st in self._packed_inputs.items():  # a packed KV store is given packed
            role, shape = expected[name]
            expected[name] = (role, st.packed_shape(shape))
        for name, (role, shape) in expected.items():
            if role == "weight":
                continue
            if name not in self.inputs:
                raise InputError(f"missing input {name!r} ({role}, shape {shape})")
            if self.inputs[name].shape != shape:
                raise InputError(f"input {name!r}: expected shape {shape}, got "
                                 f"{self.inputs[name].shape}")

    def _whole_input(self, name: str, role: str, full_shape: tuple[int, ...]) -> Any:
        with self._lock:
            if name in self._whole:
                return self._whole[name]
            if role == "weight":
                if self.weights is None:
                    raise InputError(f"no weights given for weight input {name!r}")
                whole = self.weights(name)
                held = held_storage(self.weights, name)
                if held is not None:
                    full_shape = held.packed_shape(full_shape)
                if tuple(np.shape(whole)) != full_shape:
                    raise CheckpointError(f"weight {name!r}: expected shape {full_shape}, got "
                                          f"{tuple(np.shape(whole))}")
            else:
                whole = self.inputs.get(name)
                if name in self._packed_inputs:
                    full_shape = self._packed_inputs[name].packed_shape(full_shape)
                if whole is None:
                    raise InputError(f"missing input {name!r} ({role}, shape {full_shape})")
                if whole.shape != full_shape:
                    raise InputError(f"input {name!r}: expected shape {full_shape}, got "
                                     f"{whole.shape}")
            self._whole[name] = whole
            return whole

    def source(self, tid: int) -> np.ndarray:
        """The block of input tensor `tid` as its source holds it: a slice of the whole input,
        in the source's dtype (a view of a memory-mapped checkpoint reads nothing yet)."""
        t = tensor_info(self.mg, tid)
        s = t.source
        if s is None:
            raise PlanError(f"%t{tid} ({t.name}) is an input block without a source")
        full = tuple(s.full_shape)
        if not len(s.origin) == len(full) == len(t.shape) or any(
                o < 0 or o + n > f for o, n, f in zip(s.origin, t.shape, full)):
            raise PlanError(f"%t{tid} ({t.name}): block {list(t.shape)} at {list(s.origin)} "
                            f"lies outside input {s.input!r} of shape {list(full)}")
        role = self._roles.get(s.input, t.role)
        whole = self._whole_input(s.input, role, full)
        held = (held_storage(self.weights, s.input) if role == "weight"
                else self._packed_inputs.get(s.input))
        if held is None and t.storage is None:
            return whole[tuple(slice(o, o + n) for o, n in zip(s.origin, t.shape))]
        return self._repacked(t, whole, held)

    def _repacked(self, t: TensorInfo, whole: Any, held) -> np.ndarray:
        """Weight block `t` as the plan stores it, from a source holding the weight unpacked
        (`held` None: quantized block by block as the plan reads it) or packed (sliced, or
        dequantized where the plan keeps it unpacked)."""
        s = t.source
        if held is None:
            if not t.storage.spec.writable:
                raise CheckpointError(f"weight {s.input!r}: the plan reads it as "
                                      f"{t.storage.format}, which only a file can hold (einpage "
                                      "does not quantize to it), but the weights hold it unpacked")
            box = tuple(slice(o, o + n) for o, n in zip(s.origin, t.shape))
            return quantize(np.asarray(whole[box]), t.storage)
        if t.storage is not None and held.format != t.storage.format:
            raise CheckpointError(f"weight {s.input!r} is stored as {held.format}, but the plan "
                                  f"reads it as {t.storage.format}")
        full = tuple(s.full_shape)
        if t.storage is not None:
            origin, shape = held.packed_box(tuple(s.origin), tuple(t.shape), full)
            return whole[tuple(slice(o, o + n) for o, n in zip(origin, shape))]
        # planned unpacked: the whole groups around the block, dequantized, then cut
        return dequantize_box(whole, held, tuple(s.origin), tuple(t.shape), full, t.dtype.numpy)

    def source_block(self, tid: int) -> np.ndarray:
        """`source(tid)` read into memory in the plan's storage dtype."""
        return np.asarray(self.source(tid)).astype(stored(self.mg.tensors[tid])[0], copy=False)

    def read_into(self, tid: int, out: np.ndarray) -> None:
        """Read the block of input tensor `tid` straight into `out` (converting its dtype in the
        same pass): the copy a reload of a weight block is."""
        np.copyto(out, self.source(tid), casting="unsafe")

    def results(self, block: Callable[[OutputRef], np.ndarray]) -> dict[str, np.ndarray]:
        """Whole outputs from their blocks (`block(ref)` gives one on the host); a name missing
        from `mg.results` takes the blocks' extent and dtype."""
        blocks: dict[str, list[tuple[tuple[int, ...], np.ndarray]]] = {}
        for o in self.mg.outputs:
            blocks.setdefault(o.name, []).append((tuple(o.origin), block(o)))
        declared = {r.name: (tuple(r.shape), r.dtype.numpy) for r in self.mg.results}
        for name in declared:
            if name not in blocks:
                raise PlanError(f"result {name!r} has no output blocks")
        out = {}
        for name, parts in blocks.items():
            shape, dtype = declared.get(name) or (_extent(parts), parts[0][1].dtype)
            out[name] = _assemble(name, shape, dtype, parts)
        return out


def _extent(parts) -> tuple[int, ...]:
    origin, block = parts[0]
    return tuple(max(o[k] + b.shape[k] for o, b in parts) for k in range(block.ndim))


def _assemble(name: str, shape: tuple[int, ...], dtype: np.dtype, parts) -> np.ndarray:
    """The whole output `name` from its blocks, each exactly once."""
    whole = np.empty(shape, dtype=dtype)
    seen = np.zeros(shape, dtype=bool)
    for origin, block in parts:
        if len(origin) != len(shape) or block.ndim != len(shape) or any(
                o < 0 or o + n > s for o, n, s in zip(origin, block.shape, shape)):
            raise PlanError(f"result {name!r}: block {list(block.shape)} at {list(origin)} lies "
                            f"outside its shape {list(shape)}")
        index = tuple(slice(o, o + n) for o, n in zip(origin, block.shape))
        if seen[index].any():
            raise PlanError(f"result {name!r}: blocks overlap at {list(origin)}")
        whole[index] = block
        seen[index] = True
    if not seen.all():
        raise PlanError(f"result {name!r}: blocks cover {int(seen.sum())} of {seen.size} "
                        f"elements")
    return whole
