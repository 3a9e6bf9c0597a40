"""The plan pictures: `einpage.cli.plot.memory_timeline` on hand-built memgraphs with known numbers,
`plot_timeline` on a compiled plan that streams weights, and `einpage.cli.dot.to_dot`."""
from __future__ import annotations

import re
import sys
from dataclasses import replace

import numpy as np
import pytest
import sympy

from einpage.cli.dot import MAX_DOT_NODES, to_dot
from einpage.cli.plot import memory_timeline
from einpage.compiler import CompileOptions, compile_graph
from einpage.ir import validate
from einpage.errors import InputError
from einpage.ir.dtypes import as_dtype
from einpage.ir.memgraph import (Access, ApplyNode, FreeNode, InputNode, MemGraph, OffloadNode,
                                 OutputRef, ReloadNode, TensorInfo)
from einpage.ir.ops import CopyOp, FillOp
from einpage.models import llama
from einpage.models.config import preset
from einpage.predict import get_device, simulate

F32 = as_dtype("f32")
FILL = FillOp(sympy.Integer(0), (0,))
NOTHING = CopyOp(())  # reads its blocks and writes zeros: an op that fits any reads

# Every apply takes 1 s (launch overhead, work free); a transfer takes bytes / 1000 s.
PROFILE = replace(get_device("h100-pcie"), name="test", h2d_bandwidth=1000.0, d2h_bandwidth=1000.0,
                  copy_latency=0.0, launch_overhead=1.0, hbm_bandwidth=1e30,
                  matmul_flops={"f32": 1e30}, vector_flops={"f32": 1e30})


def _t(i, nbytes, name, role):
    return TensorInfo(i, nbytes, F32, (nbytes // 4,), name, role)


def _apply(i, write, offset, deps, reads=(), frees=(), accumulate=False):
    return ApplyNode(i, tuple(Access(*r) for r in reads), Access(write, offset), accumulate,
                     NOTHING if reads else FILL,
                     tuple(deps), tuple(Access(*f) for f in frees))


def hand_plan() -> MemGraph:
    """A resident weight, a reloaded weight, an activation, a cache block written then offloaded,
    a temp reusing the reloaded weight's bytes. Times in the comments (seconds)."""
    tensors = (_t(0, 1024, "w0", "weight"), _t(1, 512, "w1", "weight"),
               _t(2, 256, "x", "activation"), _t(3, 768, "kv", "cache"), _t(4, 256, "tmp", "temp"))
    nodes = (
        InputNode(0, 0, "device", 0),                        # w0 live from 0
        InputNode(1, 1, "host"),
        ReloadNode(2, 1, 1024, (1,)),                        # h2d [0, 0.512)
        _apply(3, 2, 1536, ()),                              # compute [0, 1): x
        _apply(4, 3, 2048, (2, 3), reads=[(1, 1024), (2, 1536)]),  # compute [1, 2): kv
        FreeNode(5, 1, 1024, (4,)),                          # w1 ends at 2
        FreeNode(6, 2, 1536, (4,)),                          # x ends at 2
        _apply(7, 4, 1024, (5,)),                            # compute [2, 3): tmp over w1's bytes
        OffloadNode(8, 3, 2048, (4,)),                       # d2h [2, 2.768)
        FreeNode(9, 4, 1024, (7,)),                          # tmp ends at 3
        FreeNode(10, 3, 2048, (8,)),                         # kv ends at 2.768
    )
    return MemGraph(4096, tensors, nodes, (OutputRef(3, "host", None, "kv", (0,)),))


def _at(times, values, t):
    """The step function's value at time t."""
    return values[:, np.searchsorted(times, t, side="right") - 1]


def test_memory_timeline_hand_plan():
    mg = hand_plan()
    report = validate(mg)
    sim = simulate(mg, PROFILE)
    assert sim.makespan_s == pytest.approx(3.0)
    assert sim.start[2] == 0.0 and sim.end[2] == pytest.approx(0.512)
    times, roles, by = memory_timeline(mg, sim)
    assert roles == ["weight", "activation", "cache"]
    assert by.shape == (3, len(times)) and by.dtype.kind == "i"
    assert times[0] == 0.0 and times[-1] == pytest.approx(3.0)
    assert np.all(np.diff(times) > 0)
    expect = {0.0: (1536, 256, 0), 0.3: (1536, 256, 0), 0.6: (1536, 256, 0),
              1.0: (1536, 256, 768), 1.5: (1536, 256, 768), 2.0: (1024, 256, 768),
              2.5: (1024, 256, 768), 2.8: (1024, 256, 0), 3.0: (1024, 0, 0)}
    for t, want in expect.items():
        assert tuple(_at(times, by, t)) == want, t
    # Address-disjoint at every instant: never more than the highest byte the plan reaches.
    assert by.sum(axis=0).max() == 2560 <= report.peak_bytes == mg.high_water() == 2816
    assert by.min() >= 0


def test_memory_timeline_in_place_apply_counts_bytes_once():
    """An apply that frees its input and writes over it: the overlap is not counted twice."""
    tensors = (_t(0, 512, "a", "activation"), _t(1, 256, "b", "activation"))
    nodes = (_apply(0, 0, 0, ()),                                              # [0, 1)
             _apply(1, 1, 256, (0,), reads=[(0, 0)], frees=[(0, 0)]),           # [1, 2)
             FreeNode(2, 1, 256, (1,)))
    mg = MemGraph(1024, tensors, nodes, ())
    validate(mg)
    times, _, by = memory_timeline(mg, simulate(mg, PROFILE))
    assert [int(_at(times, by, t)[1]) for t in (0.5, 1.5, 2.0)] == [512, 512, 0]


def test_memory_timeline_empty_and_zero_duration():
    mg = MemGraph(1024, (_t(0, 256, "w", "weight"),), (InputNode(0, 0, "device", 0),), ())
    sim = simulate(mg, PROFILE)
    assert sim.makespan_s == 0.0
    times, _, by = memory_timeline(mg, sim)
    assert times.tolist() == [0.0] and by[:, 0].tolist() == [256, 0, 0]
    times, _, by = memory_timeline(MemGraph(1024, (), (), ()), simulate(MemGraph(1024, (), (), ()),
                                                                          PROFILE))
    assert times.tolist() == [0.0] and by.tolist() == [[0], [0], [0]]


@pytest.fixture(scope="module")
def streamed():
    """The tiny model at half its weight bytes: weights are reloaded."""
    g = llama.prefill_graph(preset("tiny")).bind(B=1, S=8)
    weight_bytes = compile_graph(g, CompileOptions(device_bytes=10**9)).report.compiled.weight_bytes
    c = compile_graph(g, CompileOptions(device_bytes=weight_bytes // 2))
    assert c.memgraph.count("reload") > 0
    return c


def test_memory_timeline_compiled_plan_within_peak(streamed):
    mg = streamed.memgraph
    sim = simulate(mg, get_device("h100-pcie"))
    times, _, by = memory_timeline(mg, sim)
    total = by.sum(axis=0)
    assert by.min() >= 0 and total.max() > 0
    assert total.max() <= streamed.report.peak_bytes <= mg.device_bytes
    assert times[-1] == pytest.approx(sim.makespan_s)


def test_plot_timeline_png(streamed, tmp_path):
    pytest.importorskip("matplotlib")
    from einpage.cli.plot import plot_timeline
    mg = streamed.memgraph
    sim = simulate(mg, get_device("h100-pcie"))
    path = tmp_path / "plan.png"
    plot_timeline(mg, sim, path, title="tiny")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1024


def test_plot_timeline_no_transfers_zero_duration_and_bad_path(tmp_path):
    pytest.importorskip("matplotlib")
    from einpage.cli.plot import plot_timeline
    mg = MemGraph(1024, (_t(0, 256, "w", "weight"),), (InputNode(0, 0, "device", 0),), ())
    sim = simulate(mg, PROFILE)
    plot_timeline(mg, sim, tmp_path / "zero.png")
    assert (tmp_path / "zero.png").read_bytes()[:4] == b"\x89PNG"
    no_moves = MemGraph(1024, (_t(0, 256, "x", "activation"),),
                        (_apply(0, 0, 0, ()), FreeNode(1, 0, 0, (0,))), ())
    plot_timeline(no_moves, simulate(no_moves, PROFILE), tmp_path / "compute.png")
    assert (tmp_path / "compute.png").stat().st_size > 1024
    with pytest.raises(InputError) as err:
        plot_timeline(mg, sim, tmp_path / "missing" / "dir" / "x.png")
    assert "\n" not in str(err.value) and "cannot write" in str(err.value)


_NODE = re.compile(r'  n(\d+) \[label="%(\d+) (\w+)\\n([^"]*)", shape=\w+, .*\];')
_EDGE = re.compile(r"  n(\d+) -> n(\d+);")


def test_to_dot_every_node_and_edge(streamed):
    mg = streamed.memgraph
    text = to_dot(mg)
    assert text == to_dot(mg)  # deterministic
    lines = text.splitlines()
    assert lines[0] == "digraph memgraph {" and lines[-1] == "}"
    nodes, edges = {}, []
    for line in lines[2:-1]:
        m = _NODE.fullmatch(line)
        if m:
            assert m.group(1) == m.group(2)
            nodes[int(m.group(1))] = (m.group(3), m.group(4))
            continue
        m = _EDGE.fullmatch(line)
        assert m, line
        edges.append((int(m.group(1)), int(m.group(2))))
    assert sorted(nodes) == [n.id for n in mg.nodes]
    for n in mg.nodes:
        kind, label = nodes[n.id]
        assert kind == n.kind
        tensor = n.write.tensor if n.kind == "apply" else n.tensor
        assert label.split("\\n")[0] == mg.tensors[tensor].name
    assert edges == [(d, n.id) for n in mg.nodes for d in dict.fromkeys(n.deps)]
    assert any(n.kind == "reload" for n in mg.nodes) and 'n0 [' in text


def test_to_dot_escapes_and_limit():
    mg = MemGraph(1024, (_t(0, 256, 'say "hi"\\', "weight"),), (InputNode(0, 0, "device", 0),), ())
    assert r'label="%0 input\nsay \"hi\"\\"' in to_dot(mg)
    many = tuple(InputNode(i, 0, "host") for i in range(MAX_DOT_NODES + 1))
    with pytest.raises(InputError, match=f"plan has {MAX_DOT_NODES + 1} nodes; --dot is for plans "
                                         f"of at most {MAX_DOT_NODES} nodes"):
        to_dot(MemGraph(1024, (_t(0, 256, "w", "weight"),), many, ()))
    assert to_dot(MemGraph(1024, (_t(0, 256, "w", "weight"),), many[:MAX_DOT_NODES], ()))


def test_plot_timeline_draws_the_budget_line(tmp_path):
    """The budget's dashed line crosses the top panel (in the panel's unit, KB here)."""
    mpl_image = pytest.importorskip("matplotlib.image")
    from einpage.cli.plot import plot_timeline
    mg = hand_plan()
    plot_timeline(mg, simulate(mg, PROFILE), tmp_path / "hand.png")
    rgb = (mpl_image.imread(tmp_path / "hand.png")[..., :3] * 255).round()
    budget = np.all(np.abs(rgb - (0xc4, 0x4e, 0x52)) < 30, axis=-1)
    assert budget.sum(axis=1).max() > rgb.shape[1] // 3


def test_plot_timeline_without_matplotlib(monkeypatch, tmp_path):
    from einpage.cli.plot import plot_timeline
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails as if missing
    mg = hand_plan()
    with pytest.raises(InputError, match=r"pip install 'einpage\[plot\]'"):
        plot_timeline(mg, simulate(mg, PROFILE), tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
