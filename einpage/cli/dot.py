"""A memgraph as Graphviz dot text, for looking at small plans (`dot -Tsvg plan.dot`).

One dot node per memgraph node, named `n<id>` and labelled `%<id> <kind>`, the tensor's name
(the written tensor's for an apply) and, for an apply, its op; the kind picks shape and colour.
One edge per dependency, `n<dep> -> n<id>`, in node order. The text is deterministic.
"""
from __future__ import annotations

from einpage.errors import InputError
from einpage.ir.memgraph import ApplyNode, MemGraph
from einpage.ir.ops import op_text

MAX_DOT_NODES = 5000

_STYLE = {
    "input": 'shape=ellipse, style=filled, fillcolor="#e5e5e5"',
    "reload": 'shape=box, style=filled, fillcolor="#f4c28f"',
    "offload": 'shape=box, style=filled, fillcolor="#a9d8b0"',
    "free": 'shape=octagon, style=filled, fillcolor="#ffffff"',
    "apply": 'shape=box, style="rounded,filled", fillcolor="#a8c1e6"',
}


def _quote(text: str) -> str:
    """A dot string literal; real line breaks become dot's centred `\\n`."""
    text = text.replace("\\", "\\\\").replace('"', '\\"')
    return text.replace("\r", "").replace("\n", "\\n")


def to_dot(mg: MemGraph) -> str:
    if len(mg.nodes) > MAX_DOT_NODES:
        raise InputError(f"plan has {len(mg.nodes)} nodes; --dot is for plans of at most "
                         f"{MAX_DOT_NODES} nodes")
    lines = ["digraph memgraph {", '  node [fontname="Helvetica", fontsize=10];']
    edges = []
    for n in mg.nodes:
        if isinstance(n, ApplyNode):
            t = n.write.tensor
            parts = [f"%{n.id} apply", mg.tensors[t].name or f"%t{t}", op_text(n.op)]
        else:
            t = n.tensor
            parts = [f"%{n.id} {n.kind}", mg.tensors[t].name or f"%t{t}"]
        label = "\\n".join(_quote(p) for p in parts)
        lines.append(f'  n{n.id} [label="{label}", {_STYLE[n.kind]}];')
        edges += [f"  n{d} -> n{n.id};" for d in dict.fromkeys(n.deps)]
    return "\n".join(lines + edges + ["}"]) + "\n"
