"""The cost model and the stream simulator: hand-built memgraphs with known makespans (serial,
perfectly overlapped, bandwidth-bound), roofline costs of single ops, the lower bound never above
the makespan on random plans, and device profiles from files and flags."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_compile import random_graphs

from einpage.compiler import CompileOptions, compile_graph
from einpage.errors import BudgetError, InputError
from einpage.ir import scalar
from einpage.ir.dtypes import DType
from einpage.ir.memgraph import (Access, ApplyNode, FreeNode, InputNode, MemGraph, OffloadNode,
                                 OutputRef, ReloadNode, TensorInfo)
from einpage.ir.ops import EinsumOp
from einpage.ir.spec import EinsumSpec
from einpage.predict import simulate
from einpage.predict.cost import op_seconds, op_work
from einpage.predict.devices import (PROFILES, DeviceProfile, get_device, load_device_file,
                                     with_overrides)
from einpage.units import parse_rate

MATMUL = EinsumOp(EinsumSpec.parse("ij,jk->ik"), scalar.product(2), "sum", DType.f32)
GB = 10**9
# 1 GB/s links, no latency, no launch overhead: a transfer of n bytes takes n / 1e9 seconds
UNIT = DeviceProfile("unit", {"f32": 1e12}, {"f32": 1e12}, hbm_bandwidth=1e15, h2d_bandwidth=GB,
                     d2h_bandwidth=GB, memory_bytes=GB, copy_latency=0.0, launch_overhead=0.0)


class Plan:
    """Builds a memgraph node by node over f32 tensors of given byte sizes."""

    def __init__(self, sizes):
        self.tensors = [TensorInfo(k, b, DType.f32, (b // 4,), f"t{k}") for k, b in enumerate(sizes)]
        self.nodes = []

    def add(self, cls, *args):
        self.nodes.append(cls(len(self.nodes), *args))
        return len(self.nodes) - 1

    def apply(self, reads, write, deps):
        return self.add(ApplyNode, tuple(Access(t, 0) for t in reads), Access(write, 0), False,
                        MATMUL, tuple(deps))

    def build(self):
        return MemGraph(1 << 40, tuple(self.tensors), tuple(self.nodes),
                        (OutputRef(self.tensors[-1].id, "device", 0, "y", (0, 0)),))


def durations(mg, apply_s, h2d_s, d2h_s):
    return [{"apply": apply_s, "reload": h2d_s, "offload": d2h_s}.get(n.kind, 0.0)
            for n in mg.nodes]


def test_serial_chain_adds_up():
    p = Plan([GB, GB, GB])
    i0 = p.add(InputNode, 0, "host")
    r0 = p.add(ReloadNode, 0, 0, (i0,))
    a = p.apply([0], 2, [r0])
    p.add(OffloadNode, 2, 0, (a,))
    p.add(FreeNode, 0, 0, (a,))
    mg = p.build()
    sim = simulate(mg, UNIT, durations(mg, 2.0, 1.0, 3.0))
    assert sim.makespan_s == pytest.approx(6.0)
    assert (sim.compute_s, sim.h2d_s, sim.d2h_s) == pytest.approx((2.0, 1.0, 3.0))
    assert sim.stall_s == pytest.approx(1.0)  # the apply waits for its reload
    assert sim.stall_h2d_s == pytest.approx(1.0) and sim.late_reloads == 1
    assert sim.start[a] == pytest.approx(1.0) and sim.end[a] == pytest.approx(3.0)
    assert sim.engine[a] == "compute" and sim.engine[i0] is None


def test_perfect_overlap_hides_transfers():
    """Apply k runs while the weight of apply k+1 loads: the makespan is the compute time plus
    the first load, and nothing else stalls."""
    n = 5
    p = Plan([GB] * (n + 1))
    hosts = [p.add(InputNode, k, "host") for k in range(n)]
    reloads = [p.add(ReloadNode, k, 0, (hosts[k],)) for k in range(n)]
    for k in range(n):
        p.apply([k], n, [reloads[k]])
    mg = p.build()
    sim = simulate(mg, UNIT, durations(mg, 1.0, 1.0, 0.0))
    assert sim.makespan_s == pytest.approx(n + 1.0)
    assert sim.stall_s == pytest.approx(1.0)
    assert sim.compute_s == pytest.approx(n)


def test_a_host_apply_s_block_shares_the_link_beside_the_h2d_queue():
    """The reload of a block an apply on the host wrote runs on `h2d_host`, beside the h2d
    queue; the link carries both, so an h2d copy it meets ends its seconds later, once: one
    in flight before it (the next copy starts later) or one that starts while it runs."""
    def plan(weight_first: bool):
        p = Plan([GB, GB, 3 * GB, GB, GB])
        a = p.add(InputNode, 0, "host")
        w = p.add(InputNode, 2, "host")
        v = p.add(InputNode, 3, "host")
        host = p.add(ApplyNode, (Access(0, None),), Access(1, None), False, MATMUL, (a,),
                     (), None, "host")
        copies = [p.add(ReloadNode, 2, 0, (w,))] if weight_first else []
        back = p.add(ReloadNode, 1, 0, (host,))
        copies += [] if weight_first else [p.add(ReloadNode, 2, 0, (w,))]
        copies.append(p.add(ReloadNode, 3, 0, (v,)))
        mg = p.build()
        seconds = [1.0 if n.kind == "apply" else
                   mg.tensors[n.tensor].bytes / GB if n.kind == "reload" else 0.0
                   for n in mg.nodes]
        return simulate(mg, UNIT, seconds, verify=False), back, copies

    for weight_first in (True, False):
        sim, back, (w, v) = plan(weight_first)
        assert sim.engine[back] == "h2d_host" and sim.engine[w] == sim.engine[v] == "h2d"
        assert (sim.start[back], sim.end[back]) == pytest.approx((1.0, 2.0))  # not after w
        assert sim.start[w] == 0.0
        # w's 3 s and back's 1 s share the link: v starts at 4 s, not 3
        assert sim.start[v] == pytest.approx(4.0) and sim.makespan_s == pytest.approx(5.0)
        assert sim.h2d_s == pytest.approx(5.0) and sim.h2d_bytes == 5 * GB
    # ... nor from one queued before it that starts after it ends (waiting on its deps)
    p = Plan([GB, GB, GB, GB, GB])
    a = p.add(InputNode, 0, "host")
    first = p.add(ApplyNode, (Access(0, None),), Access(1, None), False, MATMUL, (a,), (),
                  None, "host")
    late = p.add(ApplyNode, (Access(0, None),), Access(2, None), False, MATMUL, (first,), (),
                 None, "host")
    w = p.add(ReloadNode, 3, 0, (late,))
    back = p.add(ReloadNode, 1, 0, (first,))
    v = p.add(ReloadNode, 4, 0, ())
    mg = p.build()
    sim = simulate(mg, UNIT, [0.0, 1.0, 3.0, 1.0, 1.0, 1.0], verify=False)
    assert (sim.start[back], sim.start[w], sim.start[v]) == pytest.approx((1.0, 4.0, 5.0))
    # a copy back that meets no h2d copy takes nothing from it
    p = Plan([GB, GB, GB])
    a = p.add(InputNode, 0, "host")
    host = p.add(ApplyNode, (Access(0, None),), Access(1, None), False, MATMUL, (a,), (),
                 None, "host")
    back = p.add(ReloadNode, 1, 0, (host,))
    w = p.add(ReloadNode, 2, 0, (back,))
    mg = p.build()
    sim = simulate(mg, UNIT, [0.0, 1.0, 1.0, 1.0], verify=False)
    assert (sim.end[back], sim.start[w], sim.end[w]) == pytest.approx((2.0, 2.0, 3.0))


def test_bandwidth_bound_plan_runs_at_link_speed():
    """Each apply needs a 2 GB reload (2 s at 1 GB/s) and computes for 0.5 s: the link is busy
    throughout, the compute stream stalls, and the lower bound is the link time."""
    n = 4
    p = Plan([2 * GB] * n + [GB])
    hosts = [p.add(InputNode, k, "host") for k in range(n)]
    for k in range(n):
        r = p.add(ReloadNode, k, 0, (hosts[k],))
        p.apply([k], n, [r])
    mg = p.build()
    dur = [0.5 if nd.kind == "apply" else 0.0 for nd in mg.nodes]
    for nd in mg.nodes:
        if nd.kind == "reload":
            dur[nd.id] = 2.0
    sim = simulate(mg, UNIT, dur)
    assert sim.makespan_s == pytest.approx(2.0 * n + 0.5)
    assert sim.h2d_min_bytes == sim.h2d_bytes == 2 * GB * n
    assert sim.lower_bound_s == pytest.approx(2.0 * n)  # 8 GB at 1 GB/s
    assert sim.efficiency == pytest.approx(8.0 / 8.5)
    assert sim.stall_s == pytest.approx(2.0 * n + 0.5 - 0.5 * n)


def test_engine_is_in_order_and_memory_reuse_waits():
    """A reload into bytes an apply still reads waits for that apply's free (the dependency),
    and the copy engine runs reloads in node order even when a later one is ready first."""
    p = Plan([GB, GB, GB, GB])
    h0, h1 = p.add(InputNode, 0, "host"), p.add(InputNode, 1, "host")
    r0 = p.add(ReloadNode, 0, 0, (h0,))
    a0 = p.apply([0], 3, [r0])
    f0 = p.add(FreeNode, 0, 0, (a0,))
    r1 = p.add(ReloadNode, 1, 0, (h1, f0))
    p.apply([1], 3, [r1])
    mg = p.build()
    sim = simulate(mg, UNIT, durations(mg, 5.0, 1.0, 0.0))
    assert sim.start[r1] == pytest.approx(6.0)  # after a0 ends (1 + 5)
    assert sim.makespan_s == pytest.approx(12.0)
    assert sim.stall_s == pytest.approx(2.0) and sim.late_reloads == 2


def test_transfers_are_priced_by_bytes_and_latency():
    prof = dataclasses.replace(UNIT, copy_latency=1e-3)
    p = Plan([3 * GB, GB])
    h = p.add(InputNode, 0, "host")
    r = p.add(ReloadNode, 0, 0, (h,))
    p.add(OffloadNode, 0, 0, (r,))
    mg = p.build()
    sim = simulate(mg, prof)
    assert sim.h2d_s == pytest.approx(3.001) and sim.d2h_s == pytest.approx(3.001)
    assert sim.makespan_s == pytest.approx(6.002)


def test_the_plans_own_bound_pays_each_streamed_tensor_a_copy():
    """The plan's own bound counts one copy per tensor it reloads from the host (reloaded twice
    or not), each at the link's latency beside its bytes (`simulator.min_h2d_copies`)."""
    from einpage.predict.simulator import min_h2d_copies
    prof = dataclasses.replace(UNIT, copy_latency=1e-3)
    p = Plan([GB, GB, GB])
    hosts = [p.add(InputNode, t, "host") for t in range(2)]
    first = [p.add(ReloadNode, t, 0, (h,)) for t, h in zip(range(2), hosts)]
    p.add(ReloadNode, 0, 0, tuple(first))  # the first tensor reloaded again: no copy more
    mg = p.build()
    sim = simulate(mg, prof)
    assert min_h2d_copies(mg) == 2 and sim.h2d_min_bytes == 2 * GB
    assert sim.lower_bound_s == pytest.approx(2.0 + 2e-3)
    assert sim.h2d_s == pytest.approx(3.003) and sim.h2d_s >= sim.lower_bound_s


def test_roofline_of_a_matmul():
    h100 = get_device("h100-pcie")
    spec = EinsumOp(EinsumSpec.parse("sm,nm->sn"), scalar.product(2), "sum", DType.f16)
    s, m, n = 2048, 8192, 8192
    flops, moved, matmul, dtype = op_work(spec, [(s, m), (n, m)], 2 * (s * m + n * m), (s, n),
                                          2 * s * n, "f16", False)
    assert matmul and dtype == "f16"
    assert flops == 2 * s * m * n
    assert moved == 2 * (s * m + n * m + s * n)
    secs = op_seconds(h100, spec, [(s, m), (n, m)], 2 * (s * m + n * m), (s, n), 2 * s * n,
                      "f16", False)
    assert secs == pytest.approx(2 * s * m * n / 756e12 + h100.launch_overhead)
    # a matrix-vector product is bound by memory instead
    secs = op_seconds(h100, spec, [(1, m), (n, m)], 2 * (m + n * m), (1, n), 2 * n, "f16", False)
    assert secs == pytest.approx(2 * (m + n * m + n) / 2.0e12 + h100.launch_overhead)


def test_elementwise_ops_run_on_vector_units():
    silu = EinsumOp(EinsumSpec.parse("ab->ab"), scalar.silu(scalar.x(0)), None, DType.f32)
    flops, moved, matmul, _ = op_work(silu, [(4, 8)], 128, (4, 8), 128, "f32", True)
    assert not matmul and flops == 32 and moved == 128 + 2 * 128


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=random_graphs(), slack=st.sampled_from([1.0, 1.5, 4.0]),
       policy=st.sampled_from(["reuse-distance", "lru", "layerwise"]),
       device=st.sampled_from(sorted(PROFILES)))
def test_lower_bound_never_exceeds_makespan(case, slack, policy, device):
    graph, _, _ = case
    probe = compile_graph(graph, CompileOptions(1 << 30, block_bytes=512, validate=False))
    budget = max(4096, int(probe.report.compiled.min_budget_bytes * slack))
    try:
        c = compile_graph(graph, CompileOptions(budget, policy=policy, block_bytes=512,
                                                device=get_device(device)))
    except BudgetError as exc:  # layerwise may not fit
        assert policy == "layerwise", exc
        return
    sim = c.simulation
    assert c.memgraph.live_peak() == c.report.live_peak_bytes  # the validator's count
    assert 0 <= sim.lower_bound_s <= sim.makespan_s * (1 + 1e-12)
    assert sim.compute_s <= sim.makespan_s * (1 + 1e-12)
    assert sim.h2d_bytes >= sim.h2d_min_bytes
    assert all(s <= e for s, e in zip(sim.start, sim.end))
    for n in c.memgraph.nodes:  # every node starts after its dependencies end
        assert all(sim.end[d] <= sim.start[n.id] + 1e-15 for d in n.deps)


def test_auto_lookahead_reports_its_trials():
    from einpage.models import llama
    from einpage.models.config import preset
    cfg = preset("tiny")
    graph = llama.prefill_graph(cfg).bind(B=1, S=8)
    weights = compile_graph(graph, CompileOptions(1 << 30)).report.compiled.weight_bytes
    c = compile_graph(graph, CompileOptions(weights // 3, auto_lookahead=True))
    trials = c.report.compiled.trials
    assert len(trials) >= 5 and c.report.compiled.lookahead.startswith("auto: ")
    best = min(t.makespan_s for t in trials)
    assert c.report.simulation.makespan_s <= best * 1.005 + 1e-12
    assert c.report.compiled.lookahead in {t.lookahead for t in trials}
    near = [t for t in trials if t.makespan_s <= best * 1.005]
    assert c.report.live_peak_bytes in {t.live_peak_bytes for t in near}


def test_time_lookahead_bounds_prefetch(monkeypatch):
    """A tiny look-ahead window keeps prefetch close to execution: fewer bytes in flight, and no
    faster a pass. (The windows alone: the finer room refinement climbs from each plan, and the
    narrow plan, slower at the coarse search's room, finds a room the wide plan's search never
    needed to look for: 550.97 -> 520.66 us against the wide plan's 530.78 us.)"""
    from einpage.compiler import rooms
    from einpage.models import llama
    from einpage.models.config import preset
    monkeypatch.setattr(rooms, "refine_room", lambda planned, *a: planned)
    graph = llama.prefill_graph(preset("tiny")).bind(B=1, S=8)
    weights = compile_graph(graph, CompileOptions(1 << 30)).report.compiled.weight_bytes
    wide = compile_graph(graph, CompileOptions(weights // 3))
    narrow = compile_graph(graph, CompileOptions(weights // 3, lookahead_seconds=1e-12))
    assert narrow.report.live_peak_bytes <= wide.report.live_peak_bytes
    assert narrow.simulation.makespan_s >= wide.simulation.makespan_s * (1 - 1e-9)


# ------------------------------------------------------------------ profiles


def test_every_profile_is_complete_and_sourced(tmp_path):
    names = {"h100-pcie", "h100-sxm", "h200", "a100-pcie", "a100-sxm", "v100", "p100", "t4",
             "rtx4090"}
    assert names <= set(PROFILES)
    for p in PROFILES.values():
        assert p.source and p.hbm_bandwidth > 0 and p.h2d_bandwidth > 0 and p.memory_bytes > 0
        for dtype in ("f16", "bf16", "f32", "f64"):
            assert p.flops(dtype, True) > 0 and p.flops(dtype, False) > 0
        path = tmp_path / f"{p.name}.json"
        path.write_text(json.dumps(p.to_json()))
        assert load_device_file(path) == p  # the file form round-trips


@pytest.mark.parametrize("text,unit,want", [("25GB/s", "B", 25e9), ("25e9", "B", 25e9),
                                            ("1.5TB/s", "B", 1.5e12), ("756T", "FLOPS", 756e12),
                                            ("756TFLOPS", "FLOPS", 756e12), ("1e15", "FLOPS", 1e15)])
def test_parse_rate(text, unit, want):
    assert parse_rate(text, "x", unit) == pytest.approx(want)


@pytest.mark.parametrize("text", ["", "fast", "-3GB/s", "0", "25XB/s", "nan"])
def test_parse_rate_rejects(text):
    with pytest.raises(InputError):
        parse_rate(text, "--h2d-bandwidth", "B")


def test_overrides_and_bad_files(tmp_path):
    p = with_overrides(get_device("a100-sxm"), h2d_bandwidth=10e9, flops=100e12)
    assert p.h2d_bandwidth == p.d2h_bandwidth == 10e9
    assert p.flops("f16", True) == 100e12 and p.flops("f32", False) == 19.5e12
    with pytest.raises(InputError, match="unknown device"):
        get_device("h100")
    bad = tmp_path / "bad.json"
    for text, message in (("{", "not a JSON"), ("[]", "JSON object"),
                          ('{"matmul_flops": 1e12}', "lacks"),
                          ('{"matmul_flops": 1e12, "hbm_bandwidth": 1e12, "h2d_bandwidth": -1}',
                           "positive"),
                          ('{"matmul_flops": "x", "hbm_bandwidth": 1e12, "h2d_bandwidth": 1}',
                           "number"),
                          ('{"matmul_flops": 1, "hbm_bandwidth": 1, "h2d_bandwidth": 1, "zz": 1}',
                           "unknown")):
        bad.write_text(text)
        with pytest.raises(InputError, match=message):
            load_device_file(bad)
    with pytest.raises(InputError, match="no such"):
        load_device_file(tmp_path / "missing.json")
    good = tmp_path / "good.json"
    good.write_text('{"matmul_flops": 1e14, "hbm_bandwidth": 1e12, "h2d_bandwidth": 2e10}')
    p = load_device_file(good)
    assert p.name == "good" and p.d2h_bandwidth == 2e10 and p.flops("bf16", False) == 1e14
    assert math.isclose(p.copy_latency, 10e-6)
