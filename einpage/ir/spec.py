"""Einsum specs: `"bhqd,bhkd->bhqk"`. One letter per index; an index repeated inside one operand
(a diagonal) is not supported; every output index appears in some input. An empty term is a
scalar operand (`"->"`, `",a->a"`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from einpage.errors import SpecError


@dataclass(frozen=True, slots=True)
class EinsumSpec:
    inputs: tuple[str, ...]
    output: str

    @staticmethod
    def parse(text: str) -> "EinsumSpec":
        if text.count("->") != 1:
            raise SpecError(f"einsum spec {text!r}: expected exactly one '->'")
        lhs, out = text.replace(" ", "").split("->")
        ins = tuple(lhs.split(","))  # "->" is one scalar operand, as in np.einsum
        for k, term in enumerate((*ins, out)):
            where = f"operand {k}" if k < len(ins) else "output"
            bad = [c for c in term if not c.isalpha()]
            if bad:
                raise SpecError(f"einsum spec {text!r}: {where} {term!r} has non-letter {bad[0]!r}")
            if len(set(term)) != len(term):
                raise SpecError(f"einsum spec {text!r}: {where} {term!r} repeats an index")
        used = set("".join(ins))
        missing = [c for c in out if c not in used]
        if missing:
            raise SpecError(f"einsum spec {text!r}: output index {missing[0]!r} is in no operand")
        return EinsumSpec(ins, out)

    @property
    def contracted(self) -> str:
        """Indices aggregated away, in order of first appearance."""
        seen = []
        for term in self.inputs:
            for c in term:
                if c not in self.output and c not in seen:
                    seen.append(c)
        return "".join(seen)

    @property
    def join_indices(self) -> str:
        """The whole index space: output indices, then contracted ones."""
        return self.output + self.contracted

    def sizes(self, shapes: Sequence[Sequence[object]], where: str = "") -> dict[str, object]:
        """Size of every index, checked for agreement across operands."""
        if len(shapes) != len(self.inputs):
            raise SpecError(f"{where}einsum {self}: {len(self.inputs)} operands in the spec, "
                            f"{len(shapes)} given")
        sizes: dict[str, object] = {}
        first: dict[str, int] = {}
        for k, (term, shape) in enumerate(zip(self.inputs, shapes)):
            if len(term) != len(shape):
                raise SpecError(f"{where}einsum {self}: operand {k} {term!r} has rank {len(term)} "
                                f"but shape {tuple(shape)}")
            for c, n in zip(term, shape):
                if c in sizes and sizes[c] != n:
                    raise SpecError(f"{where}einsum {self}: index {c!r} is {sizes[c]} in operand "
                                    f"{first[c]} but {n} in operand {k}")
                sizes.setdefault(c, n)
                first.setdefault(c, k)
        return sizes

    def output_shape(self, shapes: Sequence[Sequence[object]], where: str = "") -> tuple:
        sizes = self.sizes(shapes, where)
        return tuple(sizes[c] for c in self.output)

    def __str__(self) -> str:
        return ",".join(self.inputs) + "->" + self.output
