"""What a block task computes: the `op` of a taskgraph task and of a memgraph `apply` node.
Each op is a frozen record with a JSON form, so a plan file is self-contained."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import sympy

from einpage.ir import scalar
from einpage.ir.dtypes import DType, as_dtype
from einpage.ir.spec import EinsumSpec

Box = tuple[tuple[int, int], ...]  # (start, stop) per dim


@dataclass(frozen=True, slots=True)
class EinsumOp:
    """The einsum on one block; with `accumulate` the result is folded into the output by `agg`."""
    spec: EinsumSpec
    join: sympy.Expr
    agg: str | None
    dtype: DType  # the logical op's dtype (computation as in the reference)

    def to_json(self) -> dict:
        return {"kind": "einsum", "spec": str(self.spec), "join": scalar.to_text(self.join),
                "agg": self.agg, "dtype": self.dtype.value}


@dataclass(frozen=True, slots=True)
class FillOp:
    """A fill block: `expr` of index symbols evaluated at global indices `origin + local`."""
    expr: sympy.Expr
    origin: tuple[int, ...]

    def to_json(self) -> dict:
        return {"kind": "fill", "expr": scalar.to_text(self.expr), "origin": list(self.origin)}


@dataclass(frozen=True, slots=True)
class GatherOp:
    """Rows of a table block (rows `row_offset...`) picked by an ids block; ids outside the block's
    rows give zeros, and the blocks of a table cut by rows accumulate (sum)."""
    row_offset: int

    def to_json(self) -> dict:
        return {"kind": "gather", "row_offset": self.row_offset}


@dataclass(frozen=True, slots=True)
class Piece:
    """Copy `reads[src][src_box]` into `write[dst_box]` (the write viewed as `CopyOp.view`)."""
    src: int
    src_box: Box
    dst_box: Box


@dataclass(frozen=True, slots=True)
class CopyOp:
    """Assemble a block from pieces of other blocks (regrid, concat, slice, reshape). With `view`,
    the write block is viewed with that shape first (a reshape of a whole tensor)."""
    pieces: tuple[Piece, ...]
    view: tuple[int, ...] | None = None

    def to_json(self) -> dict:
        return {"kind": "copy", "view": list(self.view) if self.view is not None else None,
                "pieces": [{"src": p.src, "src_box": [list(b) for b in p.src_box],
                            "dst_box": [list(b) for b in p.dst_box]} for p in self.pieces]}


@dataclass(frozen=True, slots=True)
class GuardedOp:
    """`op` run only where element `index` (flat, C order) of the task's last read, its guard
    block, is nonzero: a mixture-of-experts task runs only where the router chose its expert.
    Skipped, a task that creates its block writes zeros and a partial adds nothing, so every
    block of a guarded node is zero where its guard is off (the graph's meaning of a guard,
    `einpage.ir.graph.Guard`). The other reads are `op`'s operands. `share` is the expected
    fraction of passes the guard is on: prediction prices the op at that share."""
    op: "BlockOp"
    index: int
    share: float = 1.0

    def to_json(self) -> dict:
        return {"kind": "guarded", "index": self.index, "share": self.share,
                "op": self.op.to_json()}


BlockOp = Union[EinsumOp, FillOp, GatherOp, CopyOp, GuardedOp]


def unguarded(op: BlockOp) -> tuple[BlockOp, GuardedOp | None]:
    """(the op a task computes, its guard or None)."""
    return (op.op, op) if isinstance(op, GuardedOp) else (op, None)


def _box(value) -> Box:
    return tuple((int(a), int(b)) for a, b in value)


def op_from_json(data: dict) -> BlockOp:
    """Inverse of `to_json`; raises ValueError/KeyError/TypeError on malformed input."""
    kind = data["kind"]
    if kind == "einsum":
        return EinsumOp(EinsumSpec.parse(data["spec"]), scalar.from_text(data["join"]),
                        data["agg"], as_dtype(data["dtype"]))
    if kind == "fill":
        return FillOp(scalar.from_text(data["expr"]), tuple(int(v) for v in data["origin"]))
    if kind == "gather":
        return GatherOp(int(data["row_offset"]))
    if kind == "copy":
        view = data.get("view")
        return CopyOp(tuple(Piece(int(p["src"]), _box(p["src_box"]), _box(p["dst_box"]))
                            for p in data["pieces"]),
                      tuple(int(v) for v in view) if view is not None else None)
    if kind == "guarded":
        inner = op_from_json(data["op"])
        index, share = int(data["index"]), float(data["share"])
        if isinstance(inner, GuardedOp) or index < 0 or not 0.0 < share <= 1.0:
            raise ValueError("a guarded op holds one unguarded op, an index >= 0 and a share "
                             "in (0, 1]")
        return GuardedOp(inner, index, share)
    raise ValueError(f"unknown op kind {kind!r}")


def op_text(op: BlockOp) -> str:
    if isinstance(op, GuardedOp):
        return f"{op_text(op.op)} if guard[{op.index}]"
    if isinstance(op, EinsumOp):
        extra = "" if op.join == scalar.product(len(op.spec.inputs)) else f" {scalar.to_text(op.join)}"
        return f"einsum[{op.spec}]{extra}" + (f" {op.agg}" if op.agg else "")
    if isinstance(op, FillOp):
        return "fill"
    if isinstance(op, GatherOp):
        return f"gather[rows {op.row_offset}+]"
    return f"copy[{len(op.pieces)}]"
