"""The NumPy executor on hand-built memgraphs, checked against NumPy: every node kind, every block
op, accumulation, offload/free/reload, outputs in both tiers, random topological orders, the
poison that exposes a missing edge, and the errors for bad plans and bad inputs."""
from __future__ import annotations

import math

import numpy as np
import pytest
import sympy

from einpage.errors import CheckpointError, InputError, PlanError
from einpage.ir import scalar
from einpage.ir.dtypes import DType, as_dtype
from einpage.ir.memgraph import (Access, ApplyNode, FreeNode, InputNode, MemGraph, OffloadNode,
                                 OutputRef, ReloadNode, Source, TensorInfo)
from einpage.ir.ops import CopyOp, EinsumOp, FillOp, GatherOp, Piece
from einpage.ir.spec import EinsumSpec
from einpage.ir.tensors import LogicalTensor
from einpage.runtime.executor import NumpyExecutor, node_order, random_topological_order

SEEDS = range(8)


# ------------------------------------------------------------------ helpers

class Plan:
    """A memgraph built by hand: node ids are assigned in call order."""

    def __init__(self, device_bytes: int = 1 << 14):
        self.device_bytes = device_bytes
        self.tensors: list[TensorInfo] = []
        self.nodes: list = []
        self.outputs: list[OutputRef] = []
        self.inputs: dict[str, LogicalTensor] = {}
        self.results: dict[str, LogicalTensor] = {}

    def tensor(self, shape, dtype="f32", role="temp", source=None) -> int:
        dtype = as_dtype(dtype)
        tid = len(self.tensors)
        self.tensors.append(TensorInfo(tid, math.prod(shape) * dtype.itemsize, dtype,
                                       tuple(shape), f"t{tid}", role, source))
        return tid

    def block(self, name, full_shape, origin, shape, dtype="f32", role="activation") -> int:
        """A block of logical input `name` (declared in `inputs` on first use)."""
        self.inputs.setdefault(name, LogicalTensor(name, role, tuple(full_shape), as_dtype(dtype)))
        return self.tensor(shape, dtype, role, Source(name, tuple(origin), tuple(full_shape)))

    def _add(self, cls, *args, **kwargs) -> int:
        nid = len(self.nodes)
        self.nodes.append(cls(nid, *args, **kwargs))
        return nid

    def input(self, t, at="device", offset=None, deps=()) -> int:
        return self._add(InputNode, t, at, offset, tuple(deps))

    def reload(self, t, offset, deps) -> int:
        return self._add(ReloadNode, t, offset, tuple(deps))

    def offload(self, t, offset, deps) -> int:
        return self._add(OffloadNode, t, offset, tuple(deps))

    def free(self, t, offset, deps) -> int:
        return self._add(FreeNode, t, offset, tuple(deps))

    def apply(self, op, reads, write, deps, accumulate=False, frees=()) -> int:
        return self._add(ApplyNode, tuple(Access(*a) for a in reads), Access(*write), accumulate,
                         op, tuple(deps), tuple(Access(*a) for a in frees))

    def output(self, t, at="device", offset=None, name=None, origin=None) -> None:
        info = self.tensors[t]
        name = name or info.name
        origin = tuple(origin) if origin is not None else (0,) * len(info.shape)
        self.outputs.append(OutputRef(t, at, offset, name, origin))

    def result(self, name, shape, dtype="f32") -> None:
        self.results[name] = LogicalTensor(name, "activation", tuple(shape), as_dtype(dtype))

    def build(self) -> MemGraph:
        return MemGraph(self.device_bytes, tuple(self.tensors), tuple(self.nodes),
                        tuple(self.outputs), tuple(self.inputs.values()),
                        tuple(self.results.values()))


def einsum(spec, join=None, agg=None, dtype="f32") -> EinsumOp:
    parsed = EinsumSpec.parse(spec)
    return EinsumOp(parsed, scalar.product(len(parsed.inputs)) if join is None else join, agg,
                    as_dtype(dtype))


def run(mg, inputs=None, weights=None, order="sequential", poison_freed=True):
    return NumpyExecutor().run(mg, inputs or {}, weights, order, poison_freed, check=False)


def whole_input(p: Plan, name: str, shape, offset: int, dtype="f32", role="activation"):
    """One block covering all of input `name`, input at device at `offset`: (tensor, node)."""
    t = p.block(name, shape, (0,) * len(shape), shape, dtype, role)
    return t, p.input(t, "device", offset)


def is_topological(mg: MemGraph, order) -> bool:
    pos = {nid: k for k, nid in enumerate(order)}
    return sorted(order) == list(range(len(mg.nodes))) and all(
        pos[d] < pos[n.id] for n in mg.nodes for d in n.deps)


rng = np.random.default_rng(0)


def rand(*shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


# ------------------------------------------------------------------ inputs and outputs

def test_input_at_device_is_an_output():
    p = Plan()
    t, _ = whole_input(p, "x", (2, 3), 0)
    p.output(t, "device", 0, "y")
    x = rand(2, 3)
    out = run(p.build(), {"x": x})
    assert set(out) == {"y"} and out["y"].dtype == np.float32
    np.testing.assert_array_equal(out["y"], x)


def test_input_at_host_reloads_a_weight_block():
    p = Plan()
    w = p.block("w", (4, 3), (2, 0), (2, 3), role="weight")
    n0 = p.input(w, "host")
    n1 = p.reload(w, 256, [n0])
    y = p.tensor((2, 3))
    p.apply(einsum("ij->ij", 2 * scalar.x(0)), [(w, 256)], (y, 512), [n1])
    p.output(y, "device", 512, "y")
    full = rand(4, 3)
    out = run(p.build(), weights={"w": full}.__getitem__)
    np.testing.assert_array_equal(out["y"], 2 * full[2:])


def test_weight_blocks_are_sliced_before_conversion():
    """Only the block is read from a lazy weight, and converted to the storage dtype after."""
    class Lazy:
        def __init__(self, data):
            self.data, self.shape, self.keys = data, data.shape, []

        def __getitem__(self, key):
            self.keys.append(key)
            return self.data[key]

    p = Plan()
    w = p.block("w", (6, 2), (4, 0), (2, 2), dtype="f16", role="weight")
    p.reload(w, 0, [p.input(w, "host")])
    p.output(w, "device", 0, "w")
    lazy = Lazy(rand(6, 2, dtype=np.float64))
    out = run(p.build(), weights=lambda name: lazy)
    assert lazy.keys == [(slice(4, 6), slice(0, 2))]
    assert out["w"].dtype == np.float16
    np.testing.assert_array_equal(out["w"], lazy.data[4:].astype(np.float16))


def test_weights_from_a_memory_map(tmp_path):
    data = rand(8, 4)
    np.save(tmp_path / "w.npy", data)
    p = Plan()
    w0 = p.block("w", (8, 4), (0, 0), (4, 4), role="weight")
    w1 = p.block("w", (8, 4), (4, 0), (4, 4), role="weight")
    p.reload(w0, 0, [p.input(w0, "host")])
    p.reload(w1, 256, [p.input(w1, "host")])
    p.output(w0, "device", 0, "w", (0, 0))
    p.output(w1, "device", 256, "w", (4, 0))
    p.result("w", (8, 4))
    out = run(p.build(), weights=lambda name: np.load(tmp_path / f"{name}.npy", mmap_mode="r"))
    np.testing.assert_array_equal(out["w"], data)


def test_output_assembled_from_blocks_at_device_and_at_host():
    p = Plan()
    x, n0 = whole_input(p, "x", (4, 3), 0)
    top, bottom = p.tensor((2, 3)), p.tensor((2, 3))
    take = lambda r0: CopyOp((Piece(0, ((r0, r0 + 2), (0, 3)), ((0, 2), (0, 3))),))
    p.apply(take(0), [(x, 0)], (top, 256), [n0])
    n2 = p.apply(take(2), [(x, 0)], (bottom, 512), [n0])
    n3 = p.offload(bottom, 512, [n2])
    p.free(bottom, 512, [n3])
    p.output(top, "device", 256, "y", (0, 0))
    p.output(bottom, "host", None, "y", (2, 0))
    p.result("y", (4, 3))
    x_val = rand(4, 3)
    out = run(p.build(), {"x": x_val})
    np.testing.assert_array_equal(out["y"], x_val)


# ------------------------------------------------------------------ einsum

def test_matmul():
    p = Plan()
    a, na = whole_input(p, "a", (2, 3), 0)
    b, nb = whole_input(p, "b", (3, 4), 256)
    c = p.tensor((2, 4))
    p.apply(einsum("ij,jk->ik", agg="sum"), [(a, 0), (b, 256)], (c, 512), [na, nb])
    p.output(c, "device", 512, "c")
    av, bv = rand(2, 3), rand(3, 4)
    np.testing.assert_allclose(run(p.build(), {"a": av, "b": bv})["c"], av @ bv, rtol=1e-6)


def test_matmul_f16_computes_in_f32_and_stores_f16():
    p = Plan()
    a, na = whole_input(p, "a", (4, 8), 0, "f16")
    b, nb = whole_input(p, "b", (8, 4), 256, "f16")
    c = p.tensor((4, 4), "f16")
    p.apply(einsum("ij,jk->ik", agg="sum", dtype="f16"), [(a, 0), (b, 256)], (c, 512), [na, nb])
    p.output(c, "device", 512, "c")
    av, bv = rand(4, 8, dtype=np.float16), rand(8, 4, dtype=np.float16)
    out = run(p.build(), {"a": av, "b": bv})["c"]
    assert out.dtype == np.float16
    want = (av.astype(np.float32) @ bv.astype(np.float32)).astype(np.float16)
    np.testing.assert_allclose(out.astype(np.float32), want.astype(np.float32), rtol=1e-3)


def test_elementwise_custom_join():
    x0, x1 = scalar.x(0), scalar.x(1)
    p = Plan()
    a, na = whole_input(p, "a", (2, 3), 0)
    b, nb = whole_input(p, "b", (3,), 256)
    c = p.tensor((2, 3))
    p.apply(einsum("ij,j->ij", scalar.silu(x0) * scalar.exp(x1)), [(a, 0), (b, 256)], (c, 512),
            [na, nb])
    p.output(c, "device", 512, "c")
    av, bv = rand(2, 3), rand(3)
    want = av / (1 + np.exp(-av)) * np.exp(bv)
    np.testing.assert_allclose(run(p.build(), {"a": av, "b": bv})["c"], want, rtol=1e-6)


def test_max_aggregation():
    p = Plan()
    a, na = whole_input(p, "a", (3, 5), 0)
    m = p.tensor((3,))
    p.apply(einsum("ij->i", agg="max"), [(a, 0)], (m, 256), [na])
    p.output(m, "device", 256, "m")
    av = rand(3, 5)
    np.testing.assert_array_equal(run(p.build(), {"a": av})["m"], av.max(axis=1))


# ------------------------------------------------------------------ accumulation

def accumulating_matmul(p: Plan, base: int = 0):
    """c = a @ b with the contracted index cut in two: two partial matmuls summed into c, at
    `base + 1024`. Returns (c, the last apply)."""
    a0 = p.block("a", (2, 4), (0, 0), (2, 2))
    a1 = p.block("a", (2, 4), (0, 2), (2, 2))
    b0 = p.block("b", (4, 3), (0, 0), (2, 3), role="weight")
    b1 = p.block("b", (4, 3), (2, 0), (2, 3), role="weight")
    n_a0, n_a1 = p.input(a0, "device", base), p.input(a1, "device", base + 256)
    h0, h1 = p.input(b0, "host"), p.input(b1, "host")
    r0, r1 = p.reload(b0, base + 512, [h0]), p.reload(b1, base + 768, [h1])
    c = p.tensor((2, 3))
    mm = einsum("ik,kj->ij", agg="sum")
    first = p.apply(mm, [(a0, base), (b0, base + 512)], (c, base + 1024), [n_a0, r0])
    second = p.apply(mm, [(a1, base + 256), (b1, base + 768)], (c, base + 1024),
                     [first, n_a1, r1], accumulate=True)
    return c, second


def test_accumulate_partial_matmuls():
    p = Plan()
    c, _ = accumulating_matmul(p)
    p.output(c, "device", 1024, "c")
    av, bv = rand(2, 4), rand(4, 3)
    out = run(p.build(), {"a": av}, {"b": bv}.__getitem__)
    np.testing.assert_allclose(out["c"], av @ bv, rtol=1e-6, atol=1e-6)


def test_accumulate_max():
    p = Plan()
    a0 = p.block("a", (3, 6), (0, 0), (3, 4))
    a1 = p.block("a", (3, 6), (0, 4), (3, 2))
    n0, n1 = p.input(a0, "device", 0), p.input(a1, "device", 256)
    m = p.tensor((3,))
    op = einsum("ij->i", agg="max")
    first = p.apply(op, [(a0, 0)], (m, 512), [n0])
    p.apply(op, [(a1, 256)], (m, 512), [first, n1], accumulate=True)
    p.output(m, "device", 512, "m")
    av = rand(3, 6)
    np.testing.assert_array_equal(run(p.build(), {"a": av})["m"], av.max(axis=1))


# ------------------------------------------------------------------ fill, gather, copy

def test_fill_at_an_origin():
    i0, i1 = scalar.index(0), scalar.index(1)
    causal = sympy.Piecewise((0.0, i1 <= i0), (-sympy.oo, True))
    p = Plan()
    ramp, mask = p.tensor((2, 3)), p.tensor((2, 4))
    p.apply(FillOp(10 * i0 + i1, (1, 2)), [], (ramp, 0), [])
    p.apply(FillOp(causal, (2, 0)), [], (mask, 256), [])
    p.output(ramp, "device", 0, "ramp")
    p.output(mask, "device", 256, "mask")
    out = run(p.build())
    np.testing.assert_array_equal(out["ramp"], [[12, 13, 14], [22, 23, 24]])
    rows, cols = np.arange(2, 4)[:, None], np.arange(4)[None, :]
    np.testing.assert_array_equal(out["mask"], np.where(cols <= rows, 0.0, -np.inf))


def test_gather_over_two_row_blocks():
    p = Plan()
    ids, n_ids = whole_input(p, "ids", (2, 3), 0, "i64")
    t0 = p.block("table", (6, 4), (0, 0), (3, 4), role="weight")
    t1 = p.block("table", (6, 4), (3, 0), (3, 4), role="weight")
    r0 = p.reload(t0, 256, [p.input(t0, "host")])
    r1 = p.reload(t1, 512, [p.input(t1, "host")])
    e = p.tensor((2, 3, 4))
    g0 = p.apply(GatherOp(0), [(t0, 256), (ids, 0)], (e, 1024), [r0, n_ids])
    p.apply(GatherOp(3), [(t1, 512), (ids, 0)], (e, 1024), [g0, r1], accumulate=True)
    p.output(e, "device", 1024, "e")
    table, idv = rand(6, 4), np.array([[0, 5, 3], [2, 2, 4]])
    out = run(p.build(), {"ids": idv}, {"table": table}.__getitem__)
    np.testing.assert_array_equal(out["e"], table[idv])


def test_gather_from_a_whole_table_checks_the_ids():
    p = Plan()
    ids, n_ids = whole_input(p, "ids", (1, 2), 0, "i64")
    table = p.block("table", (3, 4), (0, 0), (3, 4), role="weight")
    r = p.reload(table, 256, [p.input(table, "host")])
    e = p.tensor((1, 2, 4))
    p.apply(GatherOp(0), [(table, 256), (ids, 0)], (e, 512), [r, n_ids])
    with pytest.raises(InputError, match=r"node %3 \(apply\).*index 7 out of range"):
        run(p.build(), {"ids": np.array([[1, 7]])}, {"table": rand(3, 4)}.__getitem__)


def test_copy_pieces_concat_and_slice():
    p = Plan()
    x, nx = whole_input(p, "x", (2, 2), 0)
    y, ny = whole_input(p, "y", (2, 3), 256)
    cat, mid = p.tensor((2, 5)), p.tensor((2, 2))
    n_cat = p.apply(CopyOp((Piece(0, ((0, 2), (0, 2)), ((0, 2), (0, 2))),
                            Piece(1, ((0, 2), (0, 3)), ((0, 2), (2, 5))))),
                    [(x, 0), (y, 256)], (cat, 512), [nx, ny])
    p.apply(CopyOp((Piece(0, ((0, 2), (1, 3)), ((0, 2), (0, 2))),)), [(cat, 512)], (mid, 768),
            [n_cat])
    p.output(cat, "device", 512, "cat")
    p.output(mid, "device", 768, "mid")
    xv, yv = rand(2, 2), rand(2, 3)
    out = run(p.build(), {"x": xv, "y": yv})
    np.testing.assert_array_equal(out["cat"], np.concatenate([xv, yv], axis=1))
    np.testing.assert_array_equal(out["mid"], np.concatenate([xv, yv], axis=1)[:, 1:3])


def test_copy_with_a_view_and_a_reshaped_piece():
    p = Plan()
    x, nx = whole_input(p, "x", (2, 6), 0)
    split, merged = p.tensor((2, 2, 3)), p.tensor((4, 3))
    # split the last dim: the (2, 2, 3) write viewed as (2, 6)
    p.apply(CopyOp((Piece(0, ((0, 2), (0, 6)), ((0, 2), (0, 6))),), view=(2, 6)), [(x, 0)],
            (split, 256), [nx])
    # a (1, 6) row becomes a (2, 3) box of the write: the piece is reshaped
    p.apply(CopyOp((Piece(0, ((1, 2), (0, 6)), ((0, 2), (0, 3))),
                    Piece(0, ((0, 1), (0, 6)), ((2, 4), (0, 3))))), [(x, 0)], (merged, 512), [nx])
    p.output(split, "device", 256, "split")
    p.output(merged, "device", 512, "merged")
    xv = rand(2, 6)
    out = run(p.build(), {"x": xv})
    np.testing.assert_array_equal(out["split"], xv.reshape(2, 2, 3))
    np.testing.assert_array_equal(out["merged"], np.concatenate([xv[1], xv[0]]).reshape(4, 3))


def test_apply_may_write_into_the_bytes_it_frees():
    p = Plan()
    x, nx = whole_input(p, "x", (2, 3), 0)
    y = p.tensor((2, 3))
    p.apply(einsum("ij->ij"), [(x, 0)], (y, 0), [nx], frees=[(x, 0)])
    p.output(y, "device", 0, "y")
    xv = rand(2, 3)
    np.testing.assert_array_equal(run(p.build(), {"x": xv})["y"], xv)


# ------------------------------------------------------------------ transfers and orders

def round_trip(p: Plan):
    """y = 2x is offloaded and freed; z = 3x takes its bytes; y comes back elsewhere; w = y + z.
    Returns the tensors (y, z, w)."""
    x, nx = whole_input(p, "x", (4, 4), 0)
    y, z, w = p.tensor((4, 4)), p.tensor((4, 4)), p.tensor((4, 4))
    ny = p.apply(einsum("ij->ij", 2 * scalar.x(0)), [(x, 0)], (y, 256), [nx])
    off = p.offload(y, 256, [ny])
    free = p.free(y, 256, [off])
    nz = p.apply(einsum("ij->ij", 3 * scalar.x(0)), [(x, 0)], (z, 256), [nx, free])
    back = p.reload(y, 512, [off])
    p.apply(einsum("ij,ij->ij", scalar.x(0) + scalar.x(1)), [(y, 512), (z, 256)], (w, 768),
            [back, nz])
    return y, z, w


def test_offload_free_reload_round_trip():
    p = Plan()
    y, _, w = round_trip(p)
    p.output(w, "device", 768, "w")
    p.output(y, "host", None, "y")
    xv = rand(4, 4)
    for order in ["sequential", *SEEDS]:
        out = run(p.build(), {"x": xv}, order=order)
        np.testing.assert_array_equal(out["y"], 2 * xv)
        np.testing.assert_allclose(out["w"], 5 * xv, rtol=1e-6)


def test_random_orders_are_topological_deterministic_and_agree():
    p = Plan()
    c, _ = accumulating_matmul(p, base=4096)
    _, _, w = round_trip(p)
    p.output(c, "device", 4096 + 1024, "c")
    p.output(w, "device", 768, "w")
    mg = p.build()
    orders = [random_topological_order(mg, s) for s in SEEDS]
    assert all(is_topological(mg, o) for o in orders)
    assert orders[3] == random_topological_order(mg, 3)
    assert len({tuple(o) for o in orders}) > 1
    args = ({"a": rand(2, 4), "x": rand(4, 4)}, {"b": rand(4, 3)}.__getitem__)
    want = run(mg, *args)
    for seed in SEEDS:
        got = run(mg, *args, order=seed)
        assert all(np.array_equal(got[k], want[k]) for k in want), seed


def test_plans_read_back_from_json_run_the_same():
    p = Plan()
    round_trip(p)
    i0 = scalar.index(0)
    f = p.tensor((3,))
    p.apply(FillOp(i0 * i0, (0,)), [], (f, 2048), [])
    p.output(3, "device", 768, "w")
    p.output(f, "device", 2048, "f")
    mg = p.build()
    xv = rand(4, 4)
    want = run(mg, {"x": xv})
    got = run(MemGraph.from_json(mg.to_json()), {"x": xv})
    assert all(np.array_equal(got[k], want[k]) for k in want)


def poison_plan(free_waits_for_reader: bool) -> MemGraph:
    """b = 2a; c = 3b; b is freed after c reads it -- unless that edge is dropped."""
    p = Plan()
    a, na = whole_input(p, "a", (4,), 0)
    b, c = p.tensor((4,)), p.tensor((4,))
    nb = p.apply(einsum("i->i", 2 * scalar.x(0)), [(a, 0)], (b, 256), [na])
    nc = p.apply(einsum("i->i", 3 * scalar.x(0)), [(b, 256)], (c, 512), [nb])
    p.free(b, 256, [nb, nc] if free_waits_for_reader else [nb])
    p.output(c, "device", 512, "c")
    return p.build()


def test_poison_exposes_a_free_missing_an_edge():
    av = np.arange(4, dtype=np.float32)
    broken = poison_plan(free_waits_for_reader=False)
    np.testing.assert_array_equal(run(broken, {"a": av})["c"], 6 * av)  # the list order is fine
    outcomes = {s: run(broken, {"a": av}, order=s)["c"] for s in range(16)}
    wrong = [s for s, c in outcomes.items() if np.isnan(c).any()]
    assert wrong and len(wrong) < 16  # some orders free b before c reads it, some do not
    for s in wrong:  # without the poison the stale bytes hide the bug
        np.testing.assert_array_equal(run(broken, {"a": av}, order=s, poison_freed=False)["c"],
                                      6 * av)
    fixed = poison_plan(free_waits_for_reader=True)
    for s in range(16):
        np.testing.assert_array_equal(run(fixed, {"a": av}, order=s)["c"], 6 * av)


def test_free_poisons_its_bytes():
    ex = NumpyExecutor()
    ex.run(poison_plan(free_waits_for_reader=True), {"a": np.ones(4, np.float32)})
    assert (ex.arena[256:272] == 0xFF).all()
    assert np.isnan(ex.arena[256:272].view(np.float32)).all()
    assert (ex.arena[512:528].view(np.float32) == 6).all()


def test_bf16_poison_reads_as_nan():
    p = Plan()
    a = p.tensor((4,), "bf16")
    p.output(a, "device", 0, "a")  # never written
    out = run(p.build())
    assert out["a"].dtype == DType.bf16.numpy
    assert np.isnan(out["a"].astype(np.float32)).all()


# ------------------------------------------------------------------ errors

def test_input_offset_outside_the_arena():
    p = Plan(device_bytes=1024)
    t, _ = whole_input(p, "x", (8,), 1024 - 16)
    p.output(t, "device", 1024 - 16, "x")
    with pytest.raises(PlanError, match=r"node %0 \(input\).*outside the arena of 1024 bytes"):
        run(p.build(), {"x": rand(8)})


def test_apply_write_outside_the_arena():
    p = Plan(device_bytes=1024)
    x, nx = whole_input(p, "x", (4,), 0)
    y = p.tensor((4,))
    p.apply(einsum("i->i"), [(x, 0)], (y, 1020), [nx])
    with pytest.raises(PlanError, match=r"node %1 \(apply\).*%t1 \(16 bytes\) at offset 1020"):
        run(p.build(), {"x": rand(4)})


def test_reload_without_a_host_copy():
    p = Plan()
    t = p.tensor((4,))
    p.reload(t, 0, [])
    with pytest.raises(PlanError, match=r"node %0 \(reload\).*%t0 has no host copy"):
        run(p.build())


def test_op_result_shape_must_match_the_write():
    p = Plan()
    x, nx = whole_input(p, "x", (1, 4), 0)
    y = p.tensor((3, 4))
    p.apply(einsum("ij->ij"), [(x, 0)], (y, 256), [nx])
    with pytest.raises(PlanError, match=r"produced shape \(1, 4\).*f32\[3, 4\]"):
        run(p.build(), {"x": rand(1, 4)})


def test_missing_and_misshaped_inputs():
    p = Plan()
    t, _ = whole_input(p, "tokens", (1, 5), 0, "i64")
    p.output(t, "device", 0, "tokens")
    mg = p.build()
    with pytest.raises(InputError, match=r"missing input 'tokens' \(activation, shape \(1, 5\)\)"):
        run(mg, {})
    with pytest.raises(InputError, match=r"input 'tokens': expected shape \(1, 5\), got \(5,\)"):
        run(mg, {"tokens": np.zeros(5, np.int64)})


def test_misshaped_weight_names_the_node():
    p = Plan()
    w = p.block("w", (4, 4), (0, 0), (2, 4), role="weight")
    p.reload(w, 0, [p.input(w, "host")])
    with pytest.raises(CheckpointError, match=r"node %1 \(reload\).*weight 'w': expected shape"):
        run(p.build(), weights=lambda name: np.zeros((4, 3), np.float32))
    with pytest.raises(InputError, match="no weights given for weight input 'w'"):
        run(p.build())


def test_order_and_edge_checks():
    mg = poison_plan(True)
    with pytest.raises(ValueError, match="order must be 'sequential' or an integer seed"):
        node_order(mg, "random")
    late = Plan()
    t = late.tensor((4,))
    late.free(t, 0, [1])
    late.free(t, 0, [])
    with pytest.raises(PlanError, match=r"node %0 \(free\): dep 1 is not an earlier node"):
        run(late.build())
