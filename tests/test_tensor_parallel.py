"""Tensor parallelism (`einpage.compiler.tensor_parallel`): the split of every layer's heads and
FFN columns found by propagating shardings through the einsum graph, the all-reduces made of
sends and recvs both ways, the exchange rule that keeps them free of deadlock (shown rejecting
broken programs), the ranks run together in random orders against the reference, and the CLI:
compile, run, generate (transformers' greedy tokens on every fixture family), in one process
and under mpiexec."""
from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import sympy
from mpi_launch import mpiexec, needs_mpi
from test_cli import assert_one_line_error as one_line
from test_cli import cli

from test_pipeline import SMALL, _tokens

from einpage.compiler import CompileOptions
from einpage.compiler.tensor_parallel import (_linear_in, compile_tensor_parallel, shard_graph,
                                              split_letters)
from einpage.errors import PlanError
from einpage.ir import scalar
from einpage.ir.dtypes import DType
from einpage.ir.graph import Einsum, Input, Output, Role, Slice
from einpage.ir.memgraph import RecvNode, SendNode
from einpage.ir.peers import validate_ranks
from einpage.models import config, llama
from einpage.models.checkpoint import RandomWeights
from einpage.predict.devices import get_device
from einpage.predict.simulator import simulate, simulate_ranks
from einpage.runtime import evaluate
from einpage.runtime.ranks import run_ranks
from einpage.runtime.shards import ShardedWeights

H100 = get_device("h100-pcie")
EINPAGE = Path(sys.executable).parent / "einpage"
TOKENS = "1,2,3,4,5"
FAMILIES = ["tiny-llama-f32", "tiny-llama-bf16", "tiny-llama31", "tiny-mistral", "tiny-qwen2",
            "tiny-qwen3", "tiny-mixtral"]


@pytest.fixture(scope="module")
def weights():
    return RandomWeights(SMALL, 0)


@pytest.fixture(scope="module")
def prefill():
    return llama.prefill_graph(SMALL).bind(B=1, S=12)


def _options(world):
    """A sixth of the weights over all ranks: every rank streams, its blocks small."""
    return CompileOptions(SMALL.weight_bytes() // 6 // world, block_bytes=8192)


@pytest.fixture(scope="module")
def two(prefill):
    return compile_tensor_parallel(prefill, 2, _options(2))


def _close(got, want):
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5,
                                   atol=1e-5 * float(np.abs(want[name]).max()))


# ------------------------------------------------------------------ the split

def test_heads_ffn_columns_and_vocabulary_split_and_two_all_reduces_a_layer(prefill):
    s = shard_graph(prefill, 2)
    assert s.letters == ("n", "f", "v")
    shards = s.shards[1]
    assert shards["layers.0.wq"] == (0, 1, 2) and shards["layers.0.wo"] == (1, 1, 2)
    assert shards["layers.3.w_up"] == (0, 176, 352) and shards["layers.3.w_down"] == (1, 176, 352)
    assert shards["lm_head"] == (0, 128, 256)
    assert "embed" not in shards and "layers.0.attn_norm" not in shards  # gathered, scaled
    assert len(s.exchanges) == 2 * SMALL.layers  # after attention, after the FFN
    assert s.gathered["logits"] == 2 and s.gathered["cache.0.k"] == 2  # vocabulary, kv heads
    for r, g in enumerate(s.graphs):
        names = {n.op.name for n in g.nodes if isinstance(n.op, Input)}
        outs = {n.op.name for n in g.nodes if isinstance(n.op, Output)}
        assert {f"tp.{k}" for k in s.exchanges} <= outs
        assert {f"tp.{k}.{1 - r}" for k in s.exchanges} <= names
        assert not {f"tp.{k}.{r}" for k in s.exchanges} & names
        partial = {n.op.name: n.inputs[0] for n in g.nodes if isinstance(n.op, Output)
                   and n.op.name.startswith("tp.")}
        assert all(g.nodes[p].dtype == DType.f32 and g.nodes[p].shape == (1, 12, SMALL.hidden)
                   for p in partial.values())
        for n in g.nodes:  # the addends in rank order, this rank's own at its place: the
            if isinstance(n.op, Einsum) and any(  # same sum, to the bit, on every rank
                    isinstance(g.nodes[i].op, Input) and g.nodes[i].op.name.startswith("tp.")
                    for i in n.inputs):
                (k,) = {g.nodes[i].op.name.split(".")[1] for i in n.inputs
                        if isinstance(g.nodes[i].op, Input)}
                assert n.inputs[r] == partial[f"tp.{k}"]
                assert g.nodes[n.inputs[1 - r]].op.name == f"tp.{k}.{1 - r}"
                assert n.op.join == scalar.x(0) + scalar.x(1)


def test_query_heads_of_a_group_split_where_the_kv_heads_do_not_divide(prefill):
    assert split_letters(prefill, 4) == ("g", "f", "v")  # 2 kv heads, 4 query heads each
    s = shard_graph(prefill, 4)
    assert s.shards[3]["layers.0.wq"] == (1, 3, 4)
    assert "layers.0.wk" not in s.shards[3] and "cache.0.k" not in s.gathered


def test_a_tied_embedding_is_sliced_on_the_rank_for_the_logits():
    cfg = config.preset("tiny-tied").with_dtype(DType.f32)
    graph = llama.prefill_graph(cfg).bind(B=1, S=6)
    s = shard_graph(graph, 2)
    assert "embed" not in s.shards[0]
    slices = [n for n in s.graphs[1].nodes if isinstance(n.op, Slice)]
    assert any(n.op.start == cfg.vocab // 2 and n.op.stop == cfg.vocab for n in slices)
    tp = compile_tensor_parallel(graph, 2, CompileOptions(cfg.weight_bytes() // 3))
    w = RandomWeights(cfg, 1)
    inputs = {"tokens": np.arange(6).reshape(1, 6) % cfg.vocab}
    _close(run_ranks(tp.programs, inputs, w, order=4), evaluate(graph, inputs, w))


def test_linearity_decides_what_stays_a_partial_sum():
    x0, x1, x2 = (scalar.x(k) for k in range(3))
    assert _linear_in(x0 + x1 * x2, [0, 1], 3)     # out + y * w: both addends, w replicated
    assert _linear_in(x0 * x1, [0], 2)             # y * w
    assert not _linear_in(x0 * x1, [0, 1], 2)      # a product of two partial sums
    assert not _linear_in(x0 + x1, [0], 2)         # h + y adds h once per rank
    assert not _linear_in(sympy.exp(x0), [0], 1)


def test_a_partial_sum_read_reduced_elsewhere_is_not_summed_again():
    """X = 2 P is linear in the partial sum P, so it would stay partial; but exp(P) reads P
    reduced, which makes X a function of the reduced P: X must not be all-reduced too (the
    ranks would add N copies of it)."""
    from einpage.ir.builder import GraphBuilder
    g = GraphBuilder()
    x = g.input("x", (4, 8), "f32")
    up = g.input("up", (8, 8), "f32", role="weight")
    down = g.input("down", (8, 8), "f32", role="weight")
    h = g.einsum("sm,fm->sf", x, up)
    p = g.einsum("sf,mf->sm", h, down)
    two_p = g.einsum("sm->sm", p, join=lambda a: 2 * a)
    g.output("y", g.einsum("sm->sm", two_p, join=lambda a: sympy.exp(a)))
    g.output("z", g.einsum("sm->sm", p, join=lambda a: sympy.exp(a)))
    graph = g.build()
    s = shard_graph(graph, 2, letters=("f",))
    assert [graph.nodes[k].op.spec for k in s.exchanges] == [graph.nodes[p.id].op.spec]
    rng = np.random.default_rng(0)
    weights = {n: rng.standard_normal((8, 8)).astype(np.float32) * 0.3 for n in ("up", "down")}
    inputs = {"x": rng.standard_normal((4, 8)).astype(np.float32)}
    tp = compile_tensor_parallel(graph, 2, CompileOptions(1 << 20))
    _close(run_ranks(tp.programs, inputs, weights.__getitem__, order=1),
           evaluate(graph, inputs, weights.__getitem__))


def test_nothing_to_split_is_refused(prefill):
    with pytest.raises(PlanError, match="nothing in this graph splits over 3"):
        shard_graph(prefill, 3)  # 2 kv heads, 4 of a group, FFN 352, vocab 256: none by 3


# ------------------------------------------------------------------ running the ranks

@pytest.mark.parametrize("world", [2, 4])
def test_a_tensor_parallel_prefill_computes_the_model_in_any_order(prefill, weights, world):
    tp = compile_tensor_parallel(prefill, world, _options(world))
    sends = sum(mg.count("send") for mg in tp.programs)
    assert sends == sum(mg.count("recv") for mg in tp.programs) >= 2 * SMALL.layers * world
    assert all(any(n.peer < mg.rank for n in mg.nodes if isinstance(n, SendNode))
               for mg in tp.programs[1:])  # messages both ways
    want = evaluate(prefill, {"tokens": _tokens()}, weights)
    for order in ("sequential", 0, 7):
        _close(run_ranks(tp.programs, {"tokens": _tokens()}, weights, order=order), want)
    _close(run_ranks(tp.programs, {"tokens": _tokens()}, weights, backend="threads",
                     delays=3), want)


def test_a_decode_step_reads_each_ranks_slice_of_the_kv_store(weights):
    graph = llama.decode_graph(SMALL).bind(B=2, C=16)
    rng = np.random.default_rng(3)
    inputs = {"tokens": rng.integers(0, SMALL.vocab, (2, 1)), "pos": np.array([5, 9])}
    for t in graph.inputs:
        if t.op.role == Role.cache:
            inputs[t.op.name] = rng.standard_normal(tuple(t.shape)).astype(np.float32)
    tp = compile_tensor_parallel(graph, 2, CompileOptions(SMALL.weight_bytes() // 8))
    caches = [{t.name: t.shape for t in mg.inputs if t.role == "cache"} for mg in tp.programs]
    assert caches[0] == caches[1] and caches[0]["cache.0.k"] == (2, 16, 1, 2, 8)
    _close(run_ranks(tp.programs, inputs, weights, order=2), evaluate(graph, inputs, weights))


def test_a_ranks_weights_are_views_of_its_slices():
    whole = np.arange(24, dtype=np.float32).reshape(4, 6)
    from einpage.ir.tensors import FileTensor
    from einpage.ir.dtypes import DType as D

    class Source:
        def __call__(self, name):
            return whole

        def locate(self, name):
            return FileTensor(Path("w.bin"), 100, D.f32, (4, 6))

    rows = ShardedWeights(Source(), {"a": (0, 2, 4)})
    np.testing.assert_array_equal(rows("a"), whole[2:])
    assert rows("b") is whole
    assert rows.locate("a").offset == 100 + 2 * 6 * 4 and rows.locate("a").shape == (2, 6)
    cols = ShardedWeights(Source(), {"a": (1, 3, 6)})
    np.testing.assert_array_equal(cols("a"), whole[:, 3:])
    assert cols.locate("a") is None  # not one run of bytes: read from the host copy


# ------------------------------------------------------------------ the exchange rule

def _without_deps(mg, kind_test, drop):
    nodes = tuple(replace(n, deps=tuple(d for d in n.deps if not drop(mg.nodes[d])))
                  if kind_test(n) else n for n in mg.nodes)
    return replace(mg, nodes=nodes)


def test_validate_ranks_accepts_the_all_reduces_and_refuses_broken_orders(two):
    validate_ranks(two.programs)
    a, b = two.programs
    early = _without_deps(a, lambda n: isinstance(n, RecvNode),
                          lambda d: isinstance(d, SendNode))
    with pytest.raises(PlanError, match="recv of exchange .* does not wait for .* send of it"):
        validate_ranks([early, b])
    eager = _without_deps(a, lambda n: isinstance(n, SendNode),
                          lambda d: isinstance(d, RecvNode))
    with pytest.raises(PlanError, match="send of exchange .* does not wait for .*recv of the "
                                        "exchange before"):
        validate_ranks([eager, b])


def test_ranks_whose_orders_make_a_cycle_are_compiled_again_by_stamp(prefill, monkeypatch):
    """Where the ranks' programs cannot be joined (their exchanges made in orders no one order
    of messages serves: `PlanError`), `compile_ranks` compiles them again with every block
    placed by stamp and joins those; with stamps already, the error stands."""
    from einpage.compiler import tensor_parallel
    from einpage.compiler.driver import compile_graph
    s = shard_graph(prefill, 2)
    seen, real = [], tensor_parallel.join_exchanges

    def join(split, plans):
        seen.append(len(seen))
        if len(seen) == 1:
            raise PlanError("the messages of the all-reduces make a cycle with the program")
        return real(split, plans)
    monkeypatch.setattr(tensor_parallel, "join_exchanges", join)
    packed = []
    compiled, programs = tensor_parallel.compile_ranks(
        s, _options(2), lambda g, o: packed.append(o.pack_low) or compile_graph(g, o))
    assert packed == [True, True, False, False] and len(programs) == 2
    seen.clear()
    with pytest.raises(PlanError, match="cycle"):
        tensor_parallel.compile_ranks(s, replace(_options(2), pack_low=False), compile_graph)


def test_a_plan_whose_ranks_take_the_exchanges_in_other_orders_is_refused(prefill,
                                                                          monkeypatch):
    """Rank 1 keeps the rule alone, but takes two exchanges in the other order than rank 0:
    each could wait at the one the other sends last."""
    from einpage.compiler import tensor_parallel
    from einpage.compiler.driver import compile_graph
    s = shard_graph(prefill, 2)
    options = CompileOptions(SMALL.weight_bytes(), block_bytes=2048, pack_low=False)
    plans = [compile_graph(g, options).memgraph for g in s.graphs]  # (swapped: no cycle by stamp)
    joined = tensor_parallel.join_exchanges(s, plans)
    validate_ranks(joined)
    made = tensor_parallel.exchange_order

    def swapped(makers):
        order = made(makers)
        return [order[1], order[0], *order[2:]]

    monkeypatch.setattr(tensor_parallel, "exchange_order", swapped)
    other = tensor_parallel.join_exchanges(s, plans)
    with pytest.raises(PlanError, match="rank 1 takes part in the exchanges in another order "
                                        "than rank 0"):
        validate_ranks([joined[0], other[1]])


def test_the_simulator_runs_messages_both_ways_and_finds_a_deadlock(two):
    sim = simulate_ranks(two.programs, [H100, H100])
    alone = [simulate(mg, H100).makespan_s for mg in two.programs]
    assert sim.makespan_s >= max(alone) * (1 - 1e-9)
    a, b = (_recvs_first(mg) for mg in two.programs)
    with pytest.raises(PlanError, match="deadlock"):
        simulate_ranks([a, b], [H100, H100])
    with pytest.raises(PlanError, match="does not wait for"):
        validate_ranks([a, b])


def _recvs_first(mg):
    """`mg` with every recv moved to the top of its list, its deps dropped."""
    order = ([n.id for n in mg.nodes if isinstance(n, RecvNode)]
             + [n.id for n in mg.nodes if not isinstance(n, RecvNode)])
    new = {old: k for k, old in enumerate(order)}
    nodes = tuple(replace(mg.nodes[old], id=k,
                          deps=() if isinstance(mg.nodes[old], RecvNode) else
                          tuple(sorted(new[d] for d in mg.nodes[old].deps)))
                  for k, old in enumerate(order))
    return replace(mg, nodes=nodes)


# ------------------------------------------------------------------ the command line

@pytest.fixture(scope="module")
def tp_plans(tmp_path_factory, hf_fixture):
    f32 = hf_fixture("tiny-llama-f32")
    d = tmp_path_factory.mktemp("tp")
    assert cli("compile", f32, "--gpu-mem", "200KB", "--seq", 5, "--quiet", "-o",
               d / "one.json") == 0
    assert cli("compile", f32, "--gpu-mem", "100KB", "--seq", 5, "--quiet", "--devices", 2,
               "--parallel", "tensor", "-o", d / "tp.json") == 0
    assert cli("run", d / "one.json", "--checkpoint", f32, "--tokens", TOKENS, "--out",
               d / "one.npy") == 0
    return f32, d


@pytest.mark.parametrize("backend", ["threads", "numpy"])
def test_run_of_a_tensor_parallel_plan_gives_the_one_device_logits(tp_plans, backend, capsys):
    f32, d = tp_plans
    assert cli("run", d / "tp.json", "--checkpoint", f32, "--tokens", TOKENS, "--backend",
               backend, "--out", d / "got.npy") == 0
    assert "saved logits (1, 5, 256)" in capsys.readouterr().out
    np.testing.assert_allclose(np.load(d / "got.npy"), np.load(d / "one.npy"), rtol=1e-5,
                               atol=1e-6)


def test_compile_and_inspect_report_a_tensor_parallel_plan(tp_plans, capsys):
    f32, d = tp_plans
    assert cli("compile", f32, "--gpu-mem", "100KB", "--seq", 5, "--devices", 2, "--parallel",
               "tensor", "--json", "--quiet") == 0
    r = json.loads(capsys.readouterr().out)
    assert r["parallel"] == "tensor" and r["devices"] == 2
    assert all(x["sent_bytes"] > 0 and x["stages"] == [0, r["ranks"][0]["stages"][1]]
               for x in r["ranks"])
    assert 0 < r["efficiency"] <= 1
    assert cli("inspect", d / "tp.json", "--json") == 0
    got = json.loads(capsys.readouterr().out)
    assert got["makespan_s"] == pytest.approx(r["makespan_s"]) and got["parallel"] == "tensor"
    assert cli("inspect", d / "tp.json") == 0
    assert "tensor parallel" in capsys.readouterr().out


def test_auto_keeps_whichever_is_predicted_faster(tp_plans, capsys):
    f32, _ = tp_plans
    assert cli("compile", f32, "--gpu-mem", "100KB", "--phase", "decode", "--devices", 2,
               "--parallel", "auto", "--json", "--quiet") == 0
    r = json.loads(capsys.readouterr().out)
    (note,) = [n for n in r["notes"] if n.startswith("tried: ")]
    tried = dict(p.split(": ") for p in note.split("; ")[0][len("tried: "):].split(", "))
    assert set(tried) == {"pipeline x 1", "tensor x 1"}
    ms = {k: float(v.split()[0]) for k, v in tried.items()}
    assert f"kept {min(ms, key=ms.get)}" in note and r["parallel"] in min(ms, key=ms.get)


@pytest.mark.parametrize("family", FAMILIES)
def test_generation_split_over_two_devices_gives_transformers_tokens(hf_fixture, family,
                                                                      tmp_path, capsys):
    path = hf_fixture(family)
    want = np.load(path / "greedy_out.npy")
    assert cli("generate", path, "--tokens-file", path / "greedy_prompt.npy",
               "--max-new-tokens", want.shape[1], "--ignore-eos", "--gpu-mem", "200KB",
               "--devices", 2, "--parallel", "tensor", "--out", tmp_path / "new.npy") == 0
    capsys.readouterr()
    np.testing.assert_array_equal(np.load(tmp_path / "new.npy"), want)


def test_bad_tensor_parallel_flags_are_one_line(tp_plans, capsys):
    f32, _ = tp_plans
    one_line(capsys, cli("compile", f32, "--gpu-mem", "200KB", "--devices", 2, "--parallel",
                         "tensor", "--batch", 2, "--micro-batches", 2),
             "tensor parallelism runs it whole")
    one_line(capsys, cli("compile", f32, "--gpu-mem", "200KB", "--devices", 3, "--parallel",
                         "tensor"), "nothing in this graph splits over 3 devices")
    one_line(capsys, cli("compile", f32, "--gpu-mem", "200KB", "--parallel", "tensor"),
             "--devices must be at least 2")


@needs_mpi
def test_tensor_parallel_ranks_under_mpiexec(tp_plans, tmp_path):
    f32, d = tp_plans
    rc, output, _ = mpiexec(2, [EINPAGE, "run", d / "tp.json", "--checkpoint", f32,
                                "--tokens", TOKENS, "--out", tmp_path / "mpi.npy"])
    assert rc == 0, output
    assert output.count("saved logits") == 1, output  # rank 0 alone reports
    np.testing.assert_allclose(np.load(tmp_path / "mpi.npy"), np.load(d / "one.npy"),
                               rtol=1e-5, atol=1e-6)
    want = np.load(f32 / "greedy_out.npy")
    rc, output, _ = mpiexec(2, [EINPAGE, "generate", f32, "--tokens-file",
                                f32 / "greedy_prompt.npy", "--max-new-tokens", want.shape[1],
                                "--ignore-eos", "--gpu-mem", "200KB", "--devices", 2,
                                "--parallel", "tensor", "--out", tmp_path / "new.npy"])
    assert rc == 0, output
    assert output.count("saved new tokens") == 1, output
    np.testing.assert_array_equal(np.load(tmp_path / "new.npy"), want)
