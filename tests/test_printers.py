"""Golden text of the taskgraph and memgraph printers (the graph printer's is `test_printer_golden`
in `test_ir_graph.py`). The taskgraph and the plans are the partitioner's and the compiler's for
tiny graphs with fixed cuts, so a change in what those passes produce shows here too."""
from __future__ import annotations

from einpage.compiler import CompileOptions, PartitionOptions, compile_graph, partition
from einpage.ir import GraphBuilder
from einpage.ir.memgraph import format_node


def test_taskgraph_printer_golden():
    g = GraphBuilder()
    ids = g.input("ids", (2,), "i64")
    w = g.input("w", (4, 3), role="weight")
    e = g.gather(w, ids)
    m = g.fill((3, 2), lambda i, j: i + j)
    y = g.einsum("ab,bc->ac", e, m)                           # %4, cut along b: accumulates
    g.output("z", g.einsum("ac->a", y, join=lambda v: abs(v), agg="max"))
    g.output("y", g.reshape(y, (4,)))
    tg = partition(g.build(), PartitionOptions(1 << 20, cuts={y.id: {"b": 3}}))
    assert str(tg) == """\
task 0: gather[rows 0+](%b1, %b2) -> %b0 f32[2,3] %2[0,0]
task 1: copy[1](%b0) -> %b4 f32[2,1] %2[0,0]
task 2: copy[1](%b0) -> %b5 f32[2,1] %2[0,1]
task 3: copy[1](%b0) -> %b6 f32[2,1] %2[0,2]
task 4: fill() -> %b7 f32[1,2] %3[0,0]
task 5: fill() -> %b8 f32[1,2] %3[1,0]
task 6: fill() -> %b9 f32[1,2] %3[2,0]
task 7: einsum[ab,bc->ac] sum(%b4, %b7) -> %b3 f32[2,2] %4[0,0]
task 8: einsum[ab,bc->ac] sum(%b5, %b8) -> += %b3 f32[2,2] %4[0,0]
task 9: einsum[ab,bc->ac] sum(%b6, %b9) -> += %b3 f32[2,2] %4[0,0]
task 10: einsum[ac->a] Abs(x0) max(%b3) -> %b10 f32[2] %5[0]
task 11: copy[1](%b3) -> %b11 f32[4] %7[0]"""


def _matmul_cut_in_two():
    """y = x @ w with the contracted index cut in two: x's blocks %t1 %t2, w's %t3 %t4, y %t0."""
    g = GraphBuilder()
    x = g.input("x", (2, 4))
    w = g.input("w", (4, 2), role="weight")
    y = g.einsum("ab,bc->ac", x, w)
    g.output("y", y)
    return g.build(), {y.id: {"b": 2}}


def test_memgraph_printer_golden_paged():
    """At the smallest budget (one task's 768 B) every block is reloaded and freed after its
    task; the output, placed after its task's reads (near the execution horizon), stays where
    it was written, since no later block needs its bytes (a write-back would only add a copy
    at the end of the pass)."""
    graph, cuts = _matmul_cut_in_two()
    mg = compile_graph(graph, CompileOptions(768, block_bytes=64, cuts=cuts)).memgraph
    assert str(mg) == """\
memgraph device_bytes=768 tensors=5 nodes=14
%0 = input %t1 at host
%1 = input %t2 at host
%2 = input %t3 at host
%3 = input %t4 at host
%4 = reload %t1 @0x00000000 deps=[0]
%5 = reload %t3 @0x00000100 deps=[2]
%6 = apply einsum[ab,bc->ac] sum(%t1@0x00000000, %t3@0x00000100) -> %t0 @0x00000200 deps=[4,5]
%7 = free %t1 @0x00000000 deps=[4,6]
%8 = free %t3 @0x00000100 deps=[5,6]
%9 = reload %t2 @0x00000000 deps=[1,7]
%10 = reload %t4 @0x00000100 deps=[3,8]
%11 = apply einsum[ab,bc->ac] sum(%t2@0x00000000, %t4@0x00000100) -> += %t0 @0x00000200 deps=[6,9,10]
%12 = free %t2 @0x00000000 deps=[9,11]
%13 = free %t4 @0x00000100 deps=[10,11]
output y[0, 0] = %t0 at device @0x00000200"""


def test_memgraph_printer_golden_resident():
    """When everything fits, inputs start on the device and the output stays there."""
    graph, cuts = _matmul_cut_in_two()
    mg = compile_graph(graph, CompileOptions(4096, block_bytes=64, cuts=cuts)).memgraph
    assert str(mg) == """\
memgraph device_bytes=4096 tensors=5 nodes=8
%0 = input %t1 at device @0x00000200
%1 = input %t2 at device @0x00000300
%2 = input %t3 at device @0x00000000
%3 = input %t4 at device @0x00000100
%4 = apply einsum[ab,bc->ac] sum(%t1@0x00000200, %t3@0x00000000) -> %t0 @0x00000400 deps=[0,2]
%5 = free %t1 @0x00000200 deps=[0,4]
%6 = apply einsum[ab,bc->ac] sum(%t2@0x00000300, %t4@0x00000100) -> += %t0 @0x00000400 deps=[1,3,4]
%7 = free %t2 @0x00000300 deps=[1,6]
output y[0, 0] = %t0 at device @0x00000400"""
    # the listing is format_node per node, between the header and the outputs
    assert [format_node(mg, n) for n in mg.nodes] == str(mg).splitlines()[1:-1]
