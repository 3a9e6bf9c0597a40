"""The paging compiler end to end: every plan validates, and the NumPy executor, in random
topological orders, gives the dense reference's answer, for random graphs, budgets from the
smallest feasible upward, random partitions and every evicting policy."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from einpage.compiler import CompileOptions, compile_graph
from einpage.errors import BudgetError
from einpage.ir import GraphBuilder, scalar
from einpage.runtime import evaluate, run

LETTERS = "abcdefgh"


@st.composite
def random_graphs(draw):
    """A random DAG of einsums (matmuls with weights, elementwise joins, reductions), fills,
    gathers, slices and concats over float64 tensors, plus its inputs."""
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    sizes = {c: draw(st.integers(1, 6)) for c in LETTERS}
    g = GraphBuilder()
    arrays, weights = {}, {}
    x = g.input("x", tuple(sizes[c] for c in "ab"), "f64")
    arrays["x"] = rng.standard_normal(x.shape)
    live = [(x, "ab")]
    fresh = iter("cdefgh")
    for k in range(draw(st.integers(1, 6))):
        t, term = live[draw(st.integers(0, len(live) - 1))]
        kind = draw(st.sampled_from(["matmul", "ewise", "reduce", "fill", "slice", "gather"]))
        if kind == "matmul":
            new = next(fresh, None)
            if new is None:
                continue
            c = term[draw(st.integers(0, len(term) - 1))]
            w = g.input(f"w{k}", (sizes[c], sizes[new]), "f64", role="weight")
            weights[f"w{k}"] = rng.standard_normal(w.shape)
            out = term.replace(c, "") + new
            live.append((g.einsum(f"{term},{c}{new}->{out}", t, w), out))
        elif kind == "ewise":
            u, uterm = live[draw(st.integers(0, len(live) - 1))]
            if not set(uterm) <= set(term):
                continue
            join = draw(st.sampled_from([lambda a, b: a + b, lambda a, b: a * b,
                                         lambda a, b: scalar.exp(a / 4) - b]))
            live.append((g.einsum(f"{term},{uterm}->{term}", t, u, join=join), term))
        elif kind == "reduce" and len(term) >= 2:
            agg = draw(st.sampled_from(["sum", "max", "min"]))
            live.append((g.einsum(f"{term}->{term[1:]}", t, join=lambda a: a, agg=agg), term[1:]))
        elif kind == "fill":
            f = g.fill(t.shape, lambda *idx: sum((i + 1) * v for i, v in enumerate(idx)) / 7,
                       dtype="f64")
            live.append((g.einsum(f"{term},{term}->{term}", t, f, join=lambda a, b: a - b), term))
        elif kind == "slice" and t.shape[0] >= 2:
            half = t.shape[0] // 2
            lo, hi = g.slice(t, 0, 0, half), g.slice(t, 0, half, t.shape[0])
            live.append((g.concat([hi, lo], 0), term))
        elif kind == "gather" and len(term) >= 1:
            ids = g.input(f"ids{k}", (3,), "i64")
            arrays[f"ids{k}"] = rng.integers(0, t.shape[0], 3)
            live.append((g.gather(t, ids), "z" + term[1:] if "z" not in term else term))
            live.pop()  # gathered rows have a new leading index; keep it as an output only
            g.output(f"gather{k}", g.gather(t, ids))
    for k, (t, _) in enumerate(live[-2:]):
        g.output(f"out{k}", t)
    return g.build(), arrays, weights


def compile_at(graph, block: int, slack: float, policy: str):
    """`graph` compiled at `slack` times its smallest workable budget, or None where layerwise
    streaming does not fit there (every other policy must)."""
    probe = compile_graph(graph, CompileOptions(1 << 30, block_bytes=block, validate=False))
    budget = max(4096, int(probe.report.compiled.min_budget_bytes * slack))
    try:
        return compile_graph(graph, CompileOptions(budget, policy=policy, block_bytes=block))
    except BudgetError:
        assume(policy == "layerwise")
        return None


def _reference(graph, arrays, weights):
    return evaluate(graph, arrays, weights.__getitem__, float64=True)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=random_graphs(), block=st.sampled_from([256, 1024, 4096, 1 << 20]),
       slack=st.sampled_from([1.0, 1.3, 2.0, 5.0, 100.0]),
       policy=st.sampled_from(["reuse-distance", "lru", "layerwise"]),
       seed=st.integers(0, 1000))
def test_random_graphs_validate_and_match_reference(case, block, slack, policy, seed):
    graph, arrays, weights = case
    compiled = compile_at(graph, block, slack, policy)
    if compiled is None:
        return
    budget = compiled.memgraph.device_bytes
    assert compiled.report.peak_bytes <= budget
    want = _reference(graph, arrays, weights)
    for order in ("sequential", seed):
        got = run(compiled.memgraph, arrays, weights.__getitem__, order=order)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-10, atol=1e-10,
                                       err_msg=f"{name} ({policy}, budget {budget}, order {order})")


def test_budget_below_a_task_says_what_it_needs():
    g = GraphBuilder()
    x = g.input("x", (64, 64), "f64")
    w = g.input("w", (64, 64), "f64", role="weight")
    g.output("y", g.einsum("ab,bc->ac", x, w))
    graph = g.build()
    with pytest.raises(BudgetError) as err:
        compile_graph(graph, CompileOptions(1000, block_bytes=1 << 20))
    assert err.value.needed > 1000 and "at least" in str(err.value)


@pytest.mark.parametrize("budget", [0, -5, 255])
def test_a_budget_below_one_block_is_a_budget_error(budget):
    g = GraphBuilder()
    g.output("y", g.einsum("a->a", g.input("x", (4,), "f64")))
    with pytest.raises(BudgetError, match="at least 256 bytes"):
        compile_graph(g.build(), CompileOptions(budget))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=random_graphs(), block=st.sampled_from([256, 1024, 4096]),
       share=st.sampled_from([0.25, 0.5, 0.75, 0.9, 0.99]),
       policy=st.sampled_from(["reuse-distance", "lru"]))
def test_the_smallest_budget_is_real(case, block, share, policy):
    """The report's largest task at a block size is a budget that compiles at that block size
    (the smallest workable: below it one task cannot be placed); below it, the error's figure
    is a real lower bound, says "at least", and (where it is the largest task's) compiles."""
    graph = case[0]
    probe = compile_graph(graph, CompileOptions(1 << 30, block_bytes=block, validate=False))
    least = probe.report.compiled.largest_task_bytes
    compile_graph(graph, CompileOptions(max(least, 256), policy=policy, block_bytes=block))
    below = max(256, int(least * share))
    if below >= least:
        return
    with pytest.raises(BudgetError) as err:
        compile_graph(graph, CompileOptions(below, policy=policy, block_bytes=block))
    e = err.value
    assert e.needed > e.available == below and "at least" in str(e), str(e)
    assert e.needed <= least
    compile_graph(graph, CompileOptions(e.needed, policy=policy, block_bytes=block))


def test_policy_none_fails_when_weights_do_not_fit():
    g = GraphBuilder()
    x = g.input("x", (8, 64), "f64")
    h = x
    for k in range(4):
        h = g.einsum("ab,bc->ac", h, g.input(f"w{k}", (64, 64), "f64", role="weight"))
    g.output("y", h)
    with pytest.raises(BudgetError):
        compile_graph(g.build(), CompileOptions(80_000, policy="none", block_bytes=20_000))


def test_everything_fits_means_no_transfers():
    g = GraphBuilder()
    x = g.input("x", (8, 32), "f64")
    w = g.input("w", (32, 32), "f64", role="weight")
    g.output("y", g.einsum("ab,bc->ac", x, w))
    c = compile_graph(g.build(), CompileOptions(1 << 20))
    assert c.report.traffic.reload_count == 0 and c.report.traffic.offload_count == 0
    assert c.report.compiled.resident_bytes == c.report.compiled.weight_bytes


def test_manual_cuts_are_used():
    g = GraphBuilder()
    x = g.input("x", (8, 32), "f64")
    w = g.input("w", (32, 16), "f64", role="weight")
    y = g.einsum("ab,bc->ac", x, w)
    g.output("y", y)
    graph = g.build()
    c = compile_graph(graph, CompileOptions(1 << 20, cuts={y.id: {"a": 2, "b": 4, "c": 2}}))
    assert c.report.compiled.tasks == 2 * 4 * 2
    rng = np.random.default_rng(0)
    xs, ws = rng.standard_normal((8, 32)), rng.standard_normal((32, 16))
    got = run(c.memgraph, {"x": xs}, {"w": ws}.__getitem__, order=3)
    np.testing.assert_allclose(got["y"], xs @ ws, rtol=1e-12)


def _fake_trial(makespan: float, compute: float, spill: int = 0):
    """A Trial whose simulation reports `makespan` with `compute` seconds of compute."""
    from types import SimpleNamespace

    from einpage.compiler.search import Trial
    sim = SimpleNamespace(makespan_s=makespan, compute_s=compute)
    return Trial(None, frozenset(), None, sim, spill, 0)


@pytest.mark.parametrize("makespans, known, probed, best", [
    # falls along the grid: probe the start, walk up while it improves
    ((5.0, 4.5, 4.0, 3.5, 3.6), {}, [2, 3, 4], 3),
    # best at the start: both neighbours are worse
    ((5.0, 4.5, 4.0, 4.2, 4.4), {}, [2, 3, 1], 2),
    # best between a known plan and the start
    ((5.0, 3.5, 4.0, 4.2, 4.4), {}, [2, 3, 1, 0], 1),
    # a known plan (the first one, at 0) beats the start: the best lies towards it
    ((3.0, 3.1, 3.3, 3.6, 4.0), {0}, [2, 1], 0),
])
def test_climb_finds_the_best_point_of_a_unimodal_makespan(makespans, known, probed, best):
    from einpage.compiler.search import climb
    calls = []

    def trial_at(i):
        calls.append(i)
        return _fake_trial(makespans[i], 1.0)

    stop = climb(len(makespans), 2, trial_at,
                 {i: _fake_trial(makespans[i], 1.0) for i in known})
    assert calls == probed
    assert min([*known, *calls], key=lambda i: makespans[i]) == best
    if not known:
        assert stop == best  # the point it returns is the best it probed


@pytest.mark.parametrize("makespans", [
    (5.0, 4.5, 4.0, 3.5, 3.6), (5.0, 4.5, 4.0, 4.2, 4.4), (5.0, 3.5, 4.0, 4.2, 4.4),
    (3.0, 3.1, 3.3, 3.6, 4.0), (4.0, 4.0, 4.0, 4.0, 4.0)])
@pytest.mark.parametrize("slack", [0.0, 0.3, 1.0])
def test_a_lower_bound_skips_probes_but_not_the_path(makespans, slack):
    """`bound_at` is a true lower bound (the makespan less `slack`): a neighbour it rules out
    is not lowered, and the climb stops at the same point as without it."""
    from einpage.compiler.search import climb

    def run(bound_at):
        calls = []

        def trial_at(i):
            calls.append(i)
            return _fake_trial(makespans[i], 1.0)

        return climb(len(makespans), 2, trial_at, bound_at=bound_at), calls

    plain, every = run(None)
    bounded, some = run(lambda i: makespans[i] - slack)
    assert bounded == plain and set(some) <= set(every)
    if slack == 0.0:  # an exact bound: only the points the climb moves to are lowered
        assert all(makespans[j] < makespans[i] for i, j in zip(some, some[1:]))


@pytest.mark.parametrize("makespans, probed, stop", [
    # the better neighbour does not fit: the start is the best
    ((3.0, None, 4.0, 4.2, 4.4), [2, 3, 1], 2),
    # the start does not fit: a neighbour that does beats it
    ((5.0, 4.0, None, 4.5, 4.8), [2, 3, 4], 3),
    # the climb walks until a point does not fit
    ((5.0, 4.5, 4.0, 3.5, None), [2, 3, 4], 3),
])
def test_climb_passes_over_points_that_do_not_fit(makespans, probed, stop):
    """A point whose trial is None (its resident set leaves the pass too little room) counts
    as infinitely slow: never a point to climb to, and a start to leave."""
    from einpage.compiler.search import climb
    calls = []

    def trial_at(i):
        calls.append(i)
        return None if makespans[i] is None else _fake_trial(makespans[i], 1.0)

    assert climb(len(makespans), 2, trial_at) == stop
    assert calls == probed


@pytest.mark.parametrize("makespans, probed, stop", [
    # falls towards less room: the larger room is never lowered
    ((3.5, 3.6, 4.0, 4.5, 5.0), [2, 1, 0], 0),
    # best at the start: the smaller room first, then the larger
    ((5.0, 4.5, 4.0, 4.2, 4.4), [2, 1, 3], 2),
    # better the other way: it turns, as the default order does
    ((5.0, 4.5, 4.0, 3.5, 3.6), [2, 1, 3, 4], 3),
    # the start does not fit: less room will not either, so more room first
    ((None, None, None, 4.5, 4.8), [2, 3, 4], 3),
])
def test_climb_probes_the_side_it_is_told_first(makespans, probed, stop):
    """`first=-1` (the tiered climb: less room keeps more weights off the disk) probes the
    lower neighbour first and climbs on without lowering the other where that improves."""
    from einpage.compiler.search import climb
    calls = []

    def trial_at(i):
        calls.append(i)
        return None if makespans[i] is None else _fake_trial(makespans[i], 1.0)

    assert climb(len(makespans), 2, trial_at, first=-1) == stop
    assert calls == probed


def test_climb_stops_at_compute_time_unless_the_plan_spills():
    from einpage.compiler.search import climb

    def search(makespans, spills):
        calls = []

        def trial_at(i):
            calls.append(i)
            return _fake_trial(makespans[i], 2.0, spills[i])

        climb(len(makespans), 2, trial_at)
        return calls

    # the start runs at its compute time and spills nothing: nothing can beat it by 0.5%
    assert search((5.0, 4.0, 2.001, 2.0, 2.0), (1, 0, 0, 0, 0)) == [2]
    # ... but a plan at compute time that spills is no reason to stop
    assert search((5.0, 4.0, 2.001, 1.99, 1.99), (1, 0, 1, 0, 0)) == [2, 3]


def test_search_room_probes_the_room_grid_from_its_start():
    from einpage.compiler.search import ROOM_SHARES, ROOM_START, search_room
    shares = []

    def trial_at(share):
        shares.append(share)
        return _fake_trial(1.0 + abs(share - 0.2), 1.0)  # best at 0.2 of the budget

    assert search_room(trial_at) == 0.2
    assert shares[0] == ROOM_START and 0.2 in shares and set(shares) <= set(ROOM_SHARES)


def test_a_task_whose_room_the_placement_split_still_fits_at_the_largest_task():
    """Found by test_the_smallest_budget_is_real: at a budget of exactly the largest task, a
    task's three blocks fit in the emptied arena only packed from below (placed by stamp, the
    first went to the middle)."""
    g = GraphBuilder()
    x = g.input("x", (6, 1), "f64")
    a = g.einsum("ab,bc->ac", x, g.input("w0", (1, 1), "f64", role="weight"))
    b = g.einsum("ac,cd->ad", a, g.input("w1", (1, 6), "f64", role="weight"))
    f = g.fill((6, 6), lambda i, j: (i + 1 + 2 * j) / 7, dtype="f64")
    g.output("out0", b)
    g.output("out1", g.einsum("ad,ad->ad", b, f, join=lambda p, q: p - q))
    graph = g.build()
    least = compile_graph(graph, CompileOptions(1 << 30, block_bytes=1024, validate=False)
                          ).report.compiled.largest_task_bytes
    compiled = compile_graph(graph, CompileOptions(least, block_bytes=1024))
    rng = np.random.default_rng(0)
    inputs = {"x": rng.standard_normal((6, 1))}
    weights = {"w0": rng.standard_normal((1, 1)), "w1": rng.standard_normal((1, 6))}
    want = _reference(graph, inputs, weights)
    got = run(compiled.memgraph, inputs, weights.__getitem__, order=3)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-12)


def test_the_collector_is_paused_during_a_compile_and_resumed_after(monkeypatch):
    """The cyclic collector is off while `compile_graph` runs, back on after it (also when it
    raises, and after nested pauses), and left off where it was off before."""
    import gc

    from einpage import collector
    from einpage.compiler import driver
    g = GraphBuilder()
    x = g.input("x", (64, 64))
    for layer in range(4):
        x = g.einsum("ab,bc->ac", x, g.input(f"w{layer}", (64, 64), role="weight"))
    g.output("y", x)
    graph = g.build()
    seen = []
    real = driver._plan
    monkeypatch.setattr(driver, "_plan", lambda *a, **k: seen.append(gc.isenabled())
                        or real(*a, **k))
    assert gc.isenabled()
    compile_graph(graph, CompileOptions(1 << 20))
    assert seen == [False] and gc.isenabled()
    with pytest.raises(BudgetError):
        compile_graph(graph, CompileOptions(16))  # below one aligned block
    assert gc.isenabled()
    with collector.paused():
        with collector.paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        compile_graph(graph, CompileOptions(1 << 20))
        assert not gc.isenabled()
    finally:
        gc.enable()
