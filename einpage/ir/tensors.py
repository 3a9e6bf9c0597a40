"""Tensor records shared by the block-level IRs (`TaskGraph` and `MemGraph`): where an input
block's data comes from, the whole logical tensors a caller passes in and gets back, and where
weights come from."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from einpage.ir.dtypes import DType
from einpage.ir.storage import Storage


#: Roles of inputs that persist from pass to pass (weights, the KV store): their blocks may stay
#: on the device for every pass (loaded once) or stream in each pass from their host copy, as
#: the plan's resident choice says. Activations are supplied afresh for each pass.
PERSISTENT_ROLES = frozenset({"weight", "cache"})


@dataclass(frozen=True, slots=True)
class Source:
    """Where an input block's data comes from: graph input `input` (a weight's checkpoint tensor
    is `checkpoint`), the box at `origin` of the logical tensor of shape `full_shape`."""
    input: str
    origin: tuple[int, ...]
    full_shape: tuple[int, ...]
    checkpoint: str | None = None


@dataclass(frozen=True, slots=True)
class LogicalTensor:
    """A whole graph input or output, for callers: name, role, shape, dtype."""
    name: str
    role: str
    shape: tuple[int, ...]
    dtype: DType


#: Where weights come from, for every runtime: a weight input's name -> its whole logical array
#: (anything with `.shape` and basic slicing; a memory map is read only where a block is sliced).
WeightSource = Callable[[str], Any]


@dataclass(frozen=True, slots=True)
class FileTensor:
    """Where a whole weight lies in a file, for the disk tier's reader: `path`, the byte `offset`
    of its first element, the file's dtype, and its logical shape (C order); with `storage`, the
    file holds it packed in that format (`einpage.ir.storage`). A `WeightSource` that lies in
    files offers `locate(name) -> FileTensor` (None for a weight not laid out so)."""
    path: Path
    offset: int
    dtype: DType
    shape: tuple[int, ...]
    storage: "Storage | None" = None
