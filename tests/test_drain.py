"""Outputs that drain behind compute (`einpage.compiler.drain`): the write-back tail bound
against every plan of small graphs, the row components and the drained order, and a compile
that keeps the drained order where it is faster, still right in random orders."""
from __future__ import annotations

import dataclasses
import numpy as np

from einpage.compiler import CompileOptions, compile_graph, driver
from einpage.compiler.drain import drained_order, row_components, tail_seconds
from einpage.compiler.order import check_order, memory_aware_order
from einpage.compiler.partitioner import PartitionOptions, partition
from einpage.compiler.resident import front_seconds, front_waits, min_stream_bytes, working_set
from einpage.ir import GraphBuilder, validate
from einpage.ir.tensors import PERSISTENT_ROLES
from einpage.models import config, llama
from einpage.models.checkpoint import RandomWeights
from einpage.predict import simulate
from einpage.predict.cost import task_seconds
from einpage.predict.devices import get_device
from einpage.runtime import executor

from test_stream_bound import _every_plan


def _logits(rows: int = 3, seq: int = 64, width: int = 8, vocab: int = 4096):
    """Rows apart through two layers, then logits against a wide table: outputs far larger
    than the compute that makes them."""
    g = GraphBuilder()
    x = g.input("x", (rows, seq, width))
    for k in range(2):
        x = g.einsum("bsm,nm->bsn", x, g.input(f"w{k}", (width, width), role="weight"))
    g.output("logits", g.einsum("bsm,vm->bsv", x, g.input("table", (vocab, width),
                                                          role="weight")))
    return g.build()


def test_no_plan_beats_the_tail_bound():
    """`drain.tail_seconds` against every resident set the lowering can keep, in the stage
    order, the id order and the drained order, at budgets from the largest task's up: no
    simulated pass is shorter than the compute to its outputs' last writers and then their
    write-back; with outputs this large the term is above compute, the stream term and the
    front term in every case."""
    profile = get_device("h100-pcie")
    graph = _logits()
    einsums = [n.id for n in graph.nodes if type(n.op).__name__ == "Einsum"]
    tg = partition(graph, PartitionOptions(1 << 24, cuts={i: {"b": 3} for i in einsums}))
    persistent = [b.id for b in tg.input_blocks if b.role in PERSISTENT_ROLES]
    assert len(persistent) == 3 and len({c for c in row_components(tg) if c is not None}) == 3
    weights = sum(tg.blocks[b].bytes for b in persistent)
    seconds = task_seconds(profile, tg)
    largest = max(working_set(tg, t.id) for t in tg.tasks)
    stage = memory_aware_order(tg)
    drained = drained_order(tg, stage, seconds, profile.d2h_bandwidth)
    assert drained is not None
    check_order(tg, drained)
    lowered = raised = 0
    for order in (stage, list(range(len(tg.tasks))), drained):
        for budget in (largest, largest + weights // 2, largest + weights):
            tail = tail_seconds(tg, order, seconds, budget, profile.d2h_bandwidth)
            raised += tail > 1.01 * max(
                sum(seconds), min_stream_bytes(tg, order, budget) / profile.h2d_bandwidth,
                front_seconds(tg, order, seconds, budget, profile.h2d_bandwidth))
            for kept, mg in _every_plan(tg, order, budget, persistent):
                lowered += 1
                assert simulate(mg, profile).makespan_s >= tail * (1 - 1e-9), (budget, kept)
    assert lowered > 50 and raised == 9


def test_rows_apart_are_components_and_shared_constants_are_none():
    """A batch of a llama prefill: each row is a component of its own (the rows meet only in
    the weights and in constants made from fills, the mask and the rotary tables, which belong
    to none); one row is one component, and nothing to drain behind."""
    cfg = config.preset("small")
    profile = get_device("h100-pcie")
    for rows in (1, 4):
        tg = partition(llama.prefill_graph(cfg).bind(B=rows, S=32), PartitionOptions(1 << 14))
        comp = row_components(tg)
        named = {c for c in comp if c is not None}
        assert len(named) == rows
        shared = [t for t, c in zip(tg.tasks, comp) if c is None]
        assert shared and all(not tg.blocks[t.write].source for t in shared)
        order = memory_aware_order(tg)
        drained = drained_order(tg, order, task_seconds(profile, tg), profile.d2h_bandwidth)
        if rows == 1:
            assert drained is None
            continue
        assert sorted(drained) == sorted(order) and drained != order
        check_order(tg, drained)
        # the first group's last stage runs among the second group's tasks, not after them
        last = max(t.stage for t in tg.tasks)
        first_row = comp[order[0]] if comp[order[0]] is not None else next(
            c for c in comp if c is not None)
        logits_of_first = [k for k, t in enumerate(drained)
                           if tg.tasks[t].stage == last and comp[t] == first_row]
        earlier_stage = [k for k, t in enumerate(drained) if tg.tasks[t].stage < last
                         and comp[t] not in (None, first_row)]
        assert min(logits_of_first) < max(earlier_stage)


def test_the_compile_drains_the_logits_behind_the_next_rows(monkeypatch):
    """A small llama with a wide vocabulary (its logits 65 MB against 4 ms of compute) at B=8
    and half its weights: the stage order drains every row's logits at the end of the pass;
    the compiler keeps the drained order, faster by more than 5%, no faster than its tail
    bound, valid, and giving the unconstrained plan's logits in random orders."""
    cfg = dataclasses.replace(config.preset("small"), vocab=16000)
    graph = llama.prefill_graph(cfg).bind(B=8, S=128)
    options = CompileOptions(cfg.weight_bytes() // 2)
    drained = compile_graph(graph, options)
    monkeypatch.setattr(driver, "_drain_behind", lambda parts, planned, *rest: planned)
    staged = compile_graph(graph, options)
    assert list(staged.order) == memory_aware_order(staged.taskgraph)
    assert list(drained.order) != memory_aware_order(drained.taskgraph)
    check_order(drained.taskgraph, list(drained.order))
    assert drained.simulation.makespan_s < 0.95 * staged.simulation.makespan_s
    bound = drained.report.bound
    assert bound.tail_s <= drained.simulation.makespan_s
    assert staged.report.bound.tail_s > bound.compute_s  # the stage order's tail binds it
    mg = drained.memgraph
    validate(mg)
    weights = RandomWeights(cfg, 0)
    ids = np.random.default_rng(0).integers(0, cfg.vocab, (8, 128))
    free = compile_graph(graph, CompileOptions(4 * cfg.weight_bytes()))
    want = executor.run(free.memgraph, {"tokens": ids}, weights)["logits"]
    for order in ("sequential", 3):
        got = executor.run(mg, {"tokens": ids}, weights, order=order)["logits"]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"order {order}")


def _tied_rows(rows: int = 3, seq: int = 128, width: int = 16, hidden: int = 8192,
               vocab: int = 8192):
    """Rows gathered from a table, a wide feed-forward, logits against the same table (tied
    embeddings, as llama3.2-1b): the pass waits on the link before its last tasks (their
    weights beside the table, more than the room) and on the other link after them (the
    logits)."""
    g = GraphBuilder()
    table = g.input("table", (vocab, width), role="weight")
    x = g.gather(table, g.input("ids", (rows, seq), "i64"))
    h = g.einsum("bsm,nm->bsn", x, g.input("up", (hidden, width), role="weight"))
    x = g.einsum("bsn,mn->bsm", h, g.input("down", (width, hidden), role="weight"))
    g.output("logits", g.einsum("bsm,vm->bsv", x, table))
    return g.build()


def test_no_plan_beats_the_front_and_tail_together():
    """The tail term from the front's waits (`resident.front_waits`): every resident set, in
    the stage, id and drained orders, at budgets from the largest task's up: no pass is shorter
    than the link's first bytes, the compute from there, then the outputs' write-back; that is
    never below the front term nor the tail without waits, and above both somewhere."""
    profile = get_device("h100-pcie")
    graph = _tied_rows()
    einsums = [n.id for n in graph.nodes if type(n.op).__name__ == "Einsum"]
    tg = partition(graph, PartitionOptions(1 << 26, cuts={i: {"b": 3} for i in einsums}))
    persistent = [b.id for b in tg.input_blocks if b.role in PERSISTENT_ROLES]
    assert len(persistent) == 3
    seconds = task_seconds(profile, tg)
    largest = max(working_set(tg, t.id) for t in tg.tasks)
    stage = memory_aware_order(tg)
    orders = [stage, list(range(len(tg.tasks)))]
    drained = drained_order(tg, stage, seconds, profile.d2h_bandwidth)
    orders += [drained] if drained is not None else []
    lowered = raised = 0
    for order in orders:
        for budget in (largest, largest + (1 << 18), largest + (1 << 20)):
            waits = front_waits(tg, order, budget, profile.h2d_bandwidth)
            both = tail_seconds(tg, order, seconds, budget, profile.d2h_bandwidth, waits)
            front = front_seconds(tg, order, seconds, budget, profile.h2d_bandwidth)
            alone = tail_seconds(tg, order, seconds, budget, profile.d2h_bandwidth)
            assert both >= max(front, alone) * (1 - 1e-12)
            raised += both > max(front, alone) * 1.01
            for kept, mg in _every_plan(tg, order, budget, persistent):
                lowered += 1
                assert simulate(mg, profile).makespan_s >= both * (1 - 1e-9), (budget, kept)
    assert lowered >= 20 and raised


def test_no_drained_order_where_a_task_outside_the_stages_reads_the_last_one():
    """Stages are the model's hint: a task built outside every stage (stage 0) that reads the
    last stage's outputs would run before them once the last stage is moved; no drained order
    is offered there (and the compile plans the stage order)."""
    g = GraphBuilder()
    x = g.input("x", (8, 4, 8))
    with g.stage(1):
        x = g.einsum("bsm,nm->bsn", x, g.input("w", (8, 8), role="weight"))
    with g.stage(2):
        logits = g.einsum("bsm,vm->bsv", x, g.input("table", (4096, 8), role="weight"))
    g.output("y", g.einsum("bsv,bsv->bsv", logits, logits))
    graph = g.build()
    einsums = [n.id for n in graph.nodes if type(n.op).__name__ == "Einsum"]
    tg = partition(graph, PartitionOptions(1 << 24, cuts={i: {"b": 8} for i in einsums}))
    profile = get_device("h100-pcie")
    order = memory_aware_order(tg)
    assert len({c for c in row_components(tg) if c is not None}) == 8
    assert drained_order(tg, order, task_seconds(profile, tg), profile.d2h_bandwidth) is None
    budget = max(working_set(tg, t.id) for t in tg.tasks) + sum(
        b.bytes for b in tg.input_blocks if b.role == "weight") // 2
    compiled = compile_graph(graph, CompileOptions(budget, block_bytes=1 << 24,
                                                   cuts={i: {"b": 8} for i in einsums}))
    check_order(compiled.taskgraph, list(compiled.order))


def test_the_report_names_the_tail_term_where_it_binds():
    """A compile whose bound is its outputs' write-back: the report's bound, its JSON and its
    text carry the tail term, and the plan's own bound is never below it. (A link without
    latency: this small plan's few copies would otherwise cost its own bound more than the
    tail.)"""
    from dataclasses import replace
    from einpage.cli.report import report_lines
    graph = _logits()
    cuts = {n.id: {"b": 3} for n in graph.nodes if type(n.op).__name__ == "Einsum"}
    tg = partition(graph, PartitionOptions(1 << 24, cuts=cuts))
    budget = max(working_set(tg, t.id) for t in tg.tasks) + (1 << 16)
    device = replace(get_device("h100-pcie"), copy_latency=0.0)
    report = compile_graph(graph, CompileOptions(budget, block_bytes=1 << 24, cuts=cuts,
                                                 device=device)).report
    bound = report.bound
    assert bound.tail_s > max(bound.steady_s, bound.front_s) and bound.seconds == bound.tail_s
    assert report.to_json()["lower_bound_tail_s"] == bound.tail_s
    assert report.plan_bound_s >= bound.tail_s
    text = "\n".join(report_lines(report))
    assert "then their write-back over the device->host link" in text
    assert "the problem's tail term, which is more" in text
