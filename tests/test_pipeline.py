"""Plans over several devices (`einpage.compiler.pipeline`): the stage cut, the rank graphs, the
programs joined by sends and recvs, run together in random orders against the reference, checked
together (`einpage.ir.peers`), priced together (`simulate_ranks`), and the validator's rules for
sends and recvs shown rejecting broken programs."""
from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from einpage.compiler import CompileOptions
from einpage.compiler.pipeline import (compile_pipeline, model_cut, node_ranks, split,
                                       stage_costs)
from einpage.errors import BudgetError, InputError, PlanError
from einpage.ir.dtypes import DType
from einpage.ir.graph import Input, Output, Role
from einpage.ir.memgraph import InputNode, MemGraph, RecvNode, SendNode
from einpage.ir.peers import is_boundary, validate_ranks
from einpage.ir.validator import validate
from einpage.models import config, llama
from einpage.models.checkpoint import RandomWeights
from einpage.predict.devices import get_device
from einpage.predict.simulator import simulate_ranks
from einpage.runtime import evaluate
from einpage.runtime.ranks import run_ranks

SMALL = config.preset("small").with_dtype(DType.f32)  # 4 layers, hidden 128
H100 = get_device("h100-pcie")


def _tokens(b=1, s=12):
    return (np.arange(b * s).reshape(b, s) * 7 + 3) % SMALL.vocab


@pytest.fixture(scope="module")
def weights():
    return RandomWeights(SMALL, 0)


@pytest.fixture(scope="module")
def prefill():
    return llama.prefill_graph(SMALL).bind(B=1, S=12)


@pytest.fixture(scope="module")
def two(prefill):
    """Two ranks at a third of the weights each: streaming, the hidden state cut in blocks."""
    return compile_pipeline(prefill, 2, CompileOptions(SMALL.weight_bytes() // 6,
                                                       block_bytes=8192))


def test_split_runs_each_layer_once_and_replicates_what_needs_no_weights(prefill):
    s = split(prefill, (3,))
    ranks = node_ranks(prefill, (3,))
    weighted = [False] * len(prefill.nodes)  # depends on a weight
    for n in prefill.nodes:
        weighted[n.id] = (isinstance(n.op, Input) and n.op.role == Role.weight) or any(
            weighted[i] for i in n.inputs)
    for n in prefill.nodes:
        if isinstance(n.op, Input):
            assert ranks[n.id], f"input {n.op.name} is read on some rank"
        elif weighted[n.id] and not isinstance(n.op, Output):  # once, on its stage's rank
            assert ranks[n.id] == {0 if n.stage < 3 else 1}, n
        else:
            assert ranks[n.id], n
    stateless = [n.id for n in prefill.nodes if len(ranks[n.id]) == 2
                 and not isinstance(n.op, Input)]
    assert stateless, "the rotary tables and the mask are computed on both ranks"
    assert s.boundaries and all(b.src < b.dst for b in s.boundaries)
    assert all(b.node not in stateless for b in s.boundaries)
    outputs = [{n.op.name for n in g.nodes if isinstance(n.op, Output)} for g in s.graphs]
    inputs = [{n.op.name for n in g.nodes if isinstance(n.op, Input)} for g in s.graphs]
    assert {b.name for b in s.boundaries} <= outputs[0] and {b.name for b in s.boundaries} \
        <= inputs[1]
    assert "logits" in outputs[1] and "logits" not in outputs[0]
    assert "layers.0.w_up" in inputs[0] and "layers.0.w_up" not in inputs[1]


def test_the_model_cut_balances_equal_layers_and_refuses_more_devices_than_stages(prefill):
    costs = stage_costs(prefill)
    assert len(costs.flops) == SMALL.layers + 2
    assert model_cut(costs, 2, 1 << 40, H100) in ((3,), (2,))
    cut = model_cut(costs, 4, 1 << 40, H100)
    assert len(cut) == 3 and list(cut) == sorted(set(cut))
    with pytest.raises(BudgetError, match="at most one device per stage"):
        model_cut(costs, 7, 1 << 40, H100)


@pytest.mark.parametrize("world", [2, 3])
def test_a_pipelined_prefill_computes_the_model_in_any_order(prefill, weights, world):
    pp = compile_pipeline(prefill, world, CompileOptions(SMALL.weight_bytes() // 6,
                                                         block_bytes=8192))
    assert pp.world == world
    sends = sum(mg.count("send") for mg in pp.programs)
    assert sends == sum(mg.count("recv") for mg in pp.programs) >= world
    want = evaluate(prefill, {"tokens": _tokens()}, weights)
    for order in ("sequential", 0, 5):
        got = run_ranks(pp.programs, {"tokens": _tokens()}, weights, order=order)
        assert set(got) == set(want) and not any(is_boundary(k) for k in got)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5,
                                       atol=1e-5 * float(np.abs(want[name]).max()))


def test_a_pipelined_decode_step_reads_each_layers_kv_store_on_its_rank(weights):
    graph = llama.decode_graph(SMALL).bind(B=2, C=16)
    rng = np.random.default_rng(3)
    inputs = {"tokens": rng.integers(0, SMALL.vocab, (2, 1)), "pos": np.array([5, 9])}
    for t in graph.inputs:
        if t.op.role == Role.cache:
            inputs[t.op.name] = rng.standard_normal(tuple(t.shape)).astype(np.float32)
    pp = compile_pipeline(graph, 2, CompileOptions(SMALL.weight_bytes() // 4))
    caches = [{t.name for t in mg.inputs if t.role == "cache"} for mg in pp.programs]
    assert caches[0] and caches[1] and not caches[0] & caches[1]
    want = evaluate(graph, inputs, weights)
    got = run_ranks(pp.programs, inputs, weights, order=2)
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5,
                                   atol=1e-5 * float(np.abs(want[name]).max()))


def test_programs_round_trip_through_json(two):
    loaded = [MemGraph.from_json(json.loads(json.dumps(mg.to_json()))) for mg in two.programs]
    for a, b in zip(two.programs, loaded):
        assert (b.rank, b.world) == (a.rank, a.world) and b.to_json() == a.to_json()
    validate_ranks(loaded)
    data = two.programs[1].to_json()
    data["version"] = 1
    with pytest.raises(PlanError, match="version 1"):
        MemGraph.from_json(data)


@pytest.mark.parametrize("backend", [None, "threads"], ids=["numpy", "threads"])
def test_a_failing_rank_stops_every_rank_and_is_named(two, weights, backend):
    """Rank 1 cannot read a weight: both ranks stop, the error names rank 1 and its cause."""
    def broken(name):
        if name.startswith("layers.3.w_down"):
            raise InputError(f"cannot read {name}")
        return weights(name)
    with pytest.raises(InputError, match="rank 1: .*cannot read layers.3.w_down"):
        run_ranks(two.programs, {"tokens": _tokens()}, broken, backend=backend, timeout=20)


def test_priced_together_the_bubble_shrinks_with_micro_batches(two):
    one = simulate_ranks(two.programs, [H100, H100], 1)
    four = simulate_ranks(two.programs, [H100, H100], 4)
    assert 0.3 < one.bubble < 0.6 and four.bubble < one.bubble
    assert four.makespan_s < 4 * one.makespan_s
    # rank 1 computes nothing before its first message arrives
    sent = min(one.passes[0][0].end[n.id] for n in two.programs[0].nodes
               if isinstance(n, SendNode))
    first = min(one.passes[1][0].start[n.id] for n in two.programs[1].nodes
                if n.kind == "apply" and any(is_boundary(two.programs[1].tensors[a.tensor].name)
                                             for a in n.reads))
    assert first >= sent - 1e-12


# ------------------------------------------------------------------ the rules, broken

def _rank1(two) -> MemGraph:
    return two.programs[1]


def test_an_input_read_before_its_recv_is_refused(two):
    mg = _rank1(two)
    k = next(n.id for n in mg.nodes if isinstance(n, InputNode) and n.deps
             and isinstance(mg.nodes[n.deps[0]], RecvNode))
    nodes = list(mg.nodes)
    nodes[k] = replace(nodes[k], deps=())
    with pytest.raises(PlanError, match="that recv is not an ancestor"):
        validate(replace(mg, nodes=tuple(nodes)))


def test_recvs_must_tile_their_input(two):
    mg = _rank1(two)
    recvs = [n for n in mg.nodes if isinstance(n, RecvNode)]
    assert len(recvs) >= 2, "the fixture's boundary comes in several blocks"
    nodes = list(mg.nodes)
    half = recvs[1].shape[:-1] + (recvs[1].shape[-1] // 2,)
    nodes[recvs[1].id] = replace(recvs[1], shape=half)  # the other half never arrives
    with pytest.raises(PlanError, match=r"the recvs of 'pipe\.\d+' fill \d+ of its"):
        validate(replace(mg, nodes=tuple(nodes)))


def test_a_send_of_an_unfinished_or_unknown_tensor_is_refused(two):
    mg = two.programs[0]
    send = next(n for n in mg.nodes if isinstance(n, SendNode))
    nodes = list(mg.nodes)
    weight = next(n for n in mg.nodes if isinstance(n, InputNode) and n.at == "host"
                  and mg.tensors[n.tensor].role == "weight")
    nodes[send.id] = replace(send, tensor=weight.tensor, offset=None, deps=(weight.id,))
    with pytest.raises(PlanError, match="which is no output of the plan"):
        validate(replace(mg, nodes=tuple(nodes)))
    nodes = list(mg.nodes)
    nodes[send.id] = replace(send, deps=())  # not after the write-back: maybe unfinished
    with pytest.raises(PlanError, match=r"sends .* but no host copy of it .* is an ancestor"):
        validate(replace(mg, nodes=tuple(nodes)))


@pytest.mark.parametrize("break_it,message", [
    (lambda n: replace(n, tag=n.tag + 100), "waits for tag .* which sends no such message"),
    (lambda n: replace(n, shape=tuple(v + 1 for v in n.shape)), "lies outside input"),
])
def test_sends_and_recvs_must_pair_across_ranks(two, break_it, message):
    mg = _rank1(two)
    recv = next(n for n in mg.nodes if isinstance(n, RecvNode))
    nodes = list(mg.nodes)
    nodes[recv.id] = break_it(recv)
    with pytest.raises(PlanError, match=message):
        validate_ranks([two.programs[0], replace(mg, nodes=tuple(nodes))])


def test_ranks_must_be_whole_and_send_forward(two):
    a, b = two.programs
    with pytest.raises(PlanError, match="expected rank 0 of 2"):
        validate_ranks([b, a])
    with pytest.raises(PlanError, match="not another rank"):
        replace(a, rank=1).verify()
    send = next(n for n in a.nodes if isinstance(n, SendNode))
    with pytest.raises(PlanError, match="peer 0 is not another rank"):
        nodes = list(a.nodes)
        nodes[send.id] = replace(send, peer=0)
        replace(a, nodes=tuple(nodes)).verify()


@pytest.mark.parametrize("delays", [None, 4])
def test_ranks_on_the_threads_backend_with_random_delays(prefill, weights, two, delays):
    want = evaluate(prefill, {"tokens": _tokens()}, weights)["logits"]
    got = run_ranks(two.programs, {"tokens": _tokens()}, weights, backend="threads",
                    delays=delays)["logits"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


def test_received_blocks_reload_just_before_their_first_user(two):
    """The copy queue runs in list order: a reload that waits for a message sits right before
    the node that needs it, so the weight reloads listed before that node go first."""
    mg = two.programs[1]
    received = {n.input for n in mg.nodes if isinstance(n, RecvNode)}
    reloads = [n for n in mg.nodes if n.kind == "reload"
               and mg.tensors[n.tensor].source is not None
               and mg.tensors[n.tensor].source.input in received]
    assert reloads
    for r in reloads:
        first = min(n.id for n in mg.nodes if r.id in n.deps)
        between = mg.nodes[r.id + 1:first]
        assert all(n.kind == "reload" and n.id in {x.id for x in reloads} for n in between)
    sim = simulate_ranks(two.programs, [H100, H100]).passes[1][0]
    arrival = max(sim.end[n.id] for n in mg.nodes if isinstance(n, RecvNode))
    weights = [sim.start[n.id] for n in mg.nodes if n.kind == "reload"
               and mg.tensors[n.tensor].role == "weight"]
    assert min(weights) < arrival, "rank 1 prefetches weights while rank 0 works"


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_generation_over_ranks_picks_the_one_device_tokens(weights, temperature):
    """Rows of different lengths, greedy and sampled: the same tokens as one device; the KV rows
    of a layer stay on its rank (every plan of the runner takes the first plan's cut)."""
    from einpage.models.generation import generate
    from einpage.runners import PlanRunner, RanksRunner
    prompt = (np.arange(16).reshape(2, 8) * 7 + 3) % SMALL.vocab
    lengths = np.array([8, 5])
    options = CompileOptions(SMALL.weight_bytes() // 4)
    kw = dict(lengths=lengths, temperature=temperature, seed=11 if temperature else None)
    want = generate(SMALL, prompt, 10, PlanRunner(weights, options, "threads"), **kw)
    runner = RanksRunner(weights, options, 2)
    got = generate(SMALL, prompt, 10, runner, **kw)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    assert runner.plans_compiled >= 2 and len({p.split.cut for p in runner._plans.values()}) == 1


#: a decode step of this one is bound by the link: its chain decides the bound
WIDE = replace(config.preset("small").with_dtype(DType.f16), name="wide", layers=4, hidden=1024,
               intermediate=4096, heads=8, kv_heads=8, head_dim=128, vocab=1024)
MOE = replace(config.preset("small").with_dtype(DType.f16), name="mid-moe", family="mixtral",
              experts=8, experts_per_token=2, layers=4, hidden=512, intermediate=1792, heads=8,
              kv_heads=2, head_dim=64, vocab=1024)


@pytest.mark.parametrize("model,phase,world,fraction,m", [
    (SMALL, "prefill", 2, 3, 1), (SMALL, "prefill", 2, 8, 2), (SMALL, "prefill", 3, 6, 1),
    (SMALL, "decode", 2, 4, 1), (SMALL, "decode", 3, 10, 2),
    (WIDE, "decode", 2, 8, 1), (WIDE, "decode", 3, 12, 1), (WIDE, "decode", 2, 4, 2),
    (MOE, "decode", 2, 8, 1), (MOE, "decode", 2, 3, 1), (MOE, "prefill", 2, 6, 1),
])
def test_no_pipeline_beats_its_bound(model, phase, world, fraction, m):
    """The chain counts only weights that every run must read after its rank's first message
    (an expert under a guard may never be copied): no predicted pass falls below the bound.
    (WIDE on a link without copy latency: the chain counts bytes only, and the ranks' own
    stream terms, which count each copy's latency too, would bind a pipeline of two passes.)"""
    from einpage.compiler.pipeline import ranks_report
    batch = 1 if model is WIDE else 2
    graph = (llama.prefill_graph(model).bind(B=batch, S=8) if phase == "prefill"
             else llama.decode_graph(model).bind(B=batch, C=32))
    budget = model.weight_bytes() // fraction
    device = replace(H100, copy_latency=0.0) if model is WIDE else H100
    pipeline = compile_pipeline(graph, world, CompileOptions(budget, device=device))
    report = ranks_report(pipeline, device, m, 0.0)
    assert report.bound_s <= report.makespan_s * (1 + 1e-9), report
    assert report.chain_s <= report.makespan_s * (1 + 1e-9)
    if model is WIDE:
        assert report.chain_s >= 0.99 * report.bound_s  # the chain is what binds here
    on_host = compile_pipeline(graph, world, CompileOptions(budget, device=H100,
                                                            host_compute=True))
    assert ranks_report(on_host, H100, m, 0.0).chain_s == 0  # a weight may be read on the host
