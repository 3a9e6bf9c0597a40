"""The stream program: a memgraph on three in-order queues with waits. For random graphs x
budgets x policies the checker accepts the compiled program, and every random interleaving of
the queues that honours only queue order and waits runs each node after all it depends on (so
the program never deadlocks and needs no other ordering). The checker is trusted because it
rejects broken programs: a dropped wait, a wait on a later node, a node on the wrong queue."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_compile import compile_at, random_graphs

from einpage.compiler import CompileOptions, compile_graph
from einpage.errors import PlanError
from einpage.models import llama
from einpage.models.config import preset
from einpage.runtime.streams import (QUEUES, StreamProgram, check_program, compile_streams,
                                     queue_deps, queue_of)


def interleave(mg, program: StreamProgram, seed: int) -> list[int]:
    """Run the queues with random choices among the steps that may start: the previous step of
    their queue is done, and every node they wait on is done. Returns the order of nodes run."""
    rng = np.random.default_rng(seed)
    pending = {q: [s for s in program.steps if s.queue == q] for q in QUEUES}
    done: set[int] = set()
    out = []
    while any(pending.values()):
        ready = [q for q in QUEUES if pending[q] and set(pending[q][0].waits) <= done]
        assert ready, "deadlock: no queue can start its next step"
        step = pending[ready[int(rng.integers(len(ready)))]].pop(0)
        done.add(step.node)
        out.append(step.node)
    return out


def assert_edges_hold(mg, order: list[int]) -> None:
    position = {n: k for k, n in enumerate(order)}
    for v, deps in enumerate(queue_deps(mg)):
        if queue_of(mg.nodes[v]) is not None:
            for u in deps:
                assert position[u] < position[v], f"%{u} must run before %{v}"


def llama_plan(budget=300_000, policy="reuse-distance"):
    graph = llama.prefill_graph(preset("small")).bind(B=2, S=32)
    return compile_graph(graph, CompileOptions(budget, policy=policy)).memgraph


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=random_graphs(), block=st.sampled_from([256, 1024, 4096]),
       slack=st.sampled_from([1.0, 1.3, 2.0, 100.0]),
       policy=st.sampled_from(["reuse-distance", "lru", "layerwise"]),
       seed=st.integers(0, 1000))
def test_random_plans_compile_to_programs_the_checker_accepts(case, block, slack, policy, seed):
    compiled = compile_at(case[0], block, slack, policy)
    if compiled is None:
        return
    mg = compiled.memgraph
    program = compile_streams(mg)
    check_program(mg, program)
    assert_edges_hold(mg, interleave(mg, program, seed))
    waited = {w for s in program.steps for w in s.waits}
    assert program.events == waited  # events only where something waits
    for s in program.steps:  # at most one wait per other queue
        queues = [queue_of(mg.nodes[w]) for w in s.waits]
        assert len(queues) == len(set(queues)) and s.queue not in queues


@pytest.mark.parametrize("policy", ["reuse-distance", "lru", "layerwise"])
def test_llama_plan_program(policy):
    mg = llama_plan(budget=2_000_000 if policy == "layerwise" else 300_000, policy=policy)
    program = compile_streams(mg)
    check_program(mg, program)
    for seed in range(5):
        assert_edges_hold(mg, interleave(mg, program, seed))
    report = program.report()
    assert report["compute_nodes"] == mg.count("apply")
    assert report["h2d_nodes"] == mg.count("reload") + sum(
        1 for n in mg.nodes if n.kind == "input" and n.at == "device")
    assert report["d2h_nodes"] == mg.count("offload") > 0
    assert 0 < report["events"] <= report["waits"]


def test_waits_implied_by_earlier_waits_are_dropped():
    """A compute step that needs two reloads waits only on the later one: the h2d queue runs
    in order, so the earlier reload is done too."""
    mg = llama_plan()
    program = compile_streams(mg)
    qdeps = queue_deps(mg)
    by_node = {s.node: s for s in program.steps}
    found = False
    for s in program.steps:
        h2d = [d for d in qdeps[s.node] if queue_of(mg.nodes[d]) == "h2d"]
        if s.queue == "compute" and len(h2d) >= 2:
            assert [w for w in s.waits if by_node[w].queue == "h2d"] in ([], [max(h2d)])
            found = True
    assert found


def test_checker_rejects_a_dropped_wait():
    mg = llama_plan()
    program = compile_streams(mg)
    for k, s in enumerate(program.steps):
        if s.waits:
            steps = list(program.steps)
            steps[k] = dataclasses.replace(s, waits=())
            broken = dataclasses.replace(program, steps=tuple(steps))
            with pytest.raises(PlanError, match="is not ordered"):
                check_program(mg, broken)
            return
    pytest.fail("no step waits")


def test_checker_rejects_a_wait_on_a_later_node_and_a_wrong_queue():
    mg = llama_plan()
    program = compile_streams(mg)
    steps = list(program.steps)
    k = next(i for i, s in enumerate(steps) if s.waits)
    later = next(s.node for s in steps[k + 1:] if s.queue != steps[k].queue)
    steps[k] = dataclasses.replace(steps[k], waits=(later,))
    with pytest.raises(PlanError, match="not an earlier node of another queue"):
        check_program(mg, dataclasses.replace(program, steps=tuple(steps)))
    steps = list(program.steps)
    steps[0] = dataclasses.replace(steps[0], queue="d2h" if steps[0].queue != "d2h" else "h2d")
    with pytest.raises(PlanError, match="is on queue"):
        check_program(mg, dataclasses.replace(program, steps=tuple(steps)))
    no_events = dataclasses.replace(program, events=frozenset())
    with pytest.raises(PlanError, match="records no event"):
        check_program(mg, no_events)


def test_program_listing():
    mg = llama_plan()
    text = str(compile_streams(mg))
    assert text.startswith("stream program: ")
    assert any(line.startswith("compute ") and "wait[" in line for line in text.splitlines())


def test_preloaded_weights_fold_out_of_the_pass():
    mg = llama_plan(budget=50_000_000)  # every weight resident
    program = compile_streams(mg, preload=True)
    check_program(mg, program)
    assert program.preloaded and program.report()["preloaded"] == len(program.preloaded)
    assert not any(s.node in program.preloaded for s in program.steps)
    assert not any(w in program.preloaded for s in program.steps for w in s.waits)
    for seed in range(3):
        assert_edges_hold_after_preload(mg, program, interleave(mg, program, seed))


def assert_edges_hold_after_preload(mg, program, order):
    position = {n: k for k, n in enumerate(order)}
    pre = frozenset(program.preloaded)
    for v, deps in enumerate(queue_deps(mg, pre)):
        if v in position:
            for u in deps:
                assert position[u] < position[v]


def test_checker_rejects_preloading_a_node_with_deps():
    mg = llama_plan()
    program = compile_streams(mg, preload=True)
    late = next(s.node for s in program.steps if s.queue == "h2d")
    bad = dataclasses.replace(program, preloaded=program.preloaded + (late,))
    with pytest.raises(PlanError, match="preloads a node"):
        check_program(mg, bad)
