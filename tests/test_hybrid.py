"""A pipeline of tensor-parallel groups (`einpage.compiler.hybrid`): 4 ranks as 2 stages of 2;
all-reduces only within a group, the boundaries between the t-th members of the groups; the
validator's rule for both together (shown refusing a group that takes its exchanges in another
order, a pipeline message back to an earlier group, and a recv that does not wait for its own
send); the ranks in random orders and with random delays against the reference; and the CLI:
compile, inspect, run a saved plan, generate (transformers' greedy tokens), in one process and
under mpiexec."""
from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from mpi_launch import mpiexec, needs_mpi
from test_cli import assert_one_line_error as one_line
from test_cli import cli
from test_pipeline import SMALL, _tokens

from einpage.compiler import CompileOptions
from einpage.compiler import tensor_parallel
from einpage.compiler.hybrid import compile_hybrid, group_sizes
from einpage.compiler.parallel import compile_parallel
from einpage.errors import PlanError
from einpage.ir.memgraph import RecvNode, SendNode
from einpage.ir.peers import BOUNDARY_PREFIX, validate_ranks
from einpage.models import llama
from einpage.models.checkpoint import RandomWeights
from einpage.predict.devices import get_device
from einpage.predict.simulator import simulate_ranks
from einpage.runtime import evaluate
from einpage.runtime.ranks import run_ranks

H100 = get_device("h100-pcie")
EINPAGE = Path(sys.executable).parent / "einpage"


@pytest.fixture(scope="module")
def weights():
    return RandomWeights(SMALL, 0)


@pytest.fixture(scope="module")
def prefill():
    return llama.prefill_graph(SMALL).bind(B=1, S=12)


@pytest.fixture(scope="module")
def hybrid(prefill):
    """4 ranks, 2 groups of 2, each device a twelfth of the weights: every rank streams."""
    return compile_hybrid(prefill, 4, 2, CompileOptions(SMALL.weight_bytes() // 12,
                                                        block_bytes=8192))


def _close(got, want):
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=2e-5, atol=2e-5, err_msg=name)


def _messages(mg):
    """(peer, pipeline message?) of each send and recv of a program."""
    outputs = {o.tensor: o.name for o in mg.outputs}
    for n in mg.nodes:
        if isinstance(n, RecvNode):
            yield n, n.input.startswith(BOUNDARY_PREFIX)
        elif isinstance(n, SendNode):
            yield n, outputs[n.tensor].startswith(BOUNDARY_PREFIX)


def test_group_sizes_keep_two_stages_at_least():
    assert group_sizes(2) == [] and group_sizes(4) == [2] and group_sizes(8) == [2, 4]
    assert group_sizes(6) == [2, 3] and group_sizes(7) == []


def test_all_reduces_stay_in_a_group_and_boundaries_go_member_to_member(hybrid):
    s = hybrid.split
    assert s.group == 2 and len(s.cut) == 1
    assert [s.stage_range(r) for r in range(4)] == [s.stage_range(0)] * 2 + [s.stage_range(2)] * 2
    pipe = exchanges = 0
    for mg in hybrid.programs:
        assert mg.world == 4 and mg.meta["parallel"] == "hybrid" and mg.meta["group"] == 2
        assert mg.meta["shards"]  # each member holds a slice of its stage's weights
        for n, is_pipe in _messages(mg):
            if is_pipe:  # member t of group 0 to member t of group 1
                pipe += 1
                assert n.peer % 2 == mg.rank % 2 and n.peer // 2 != mg.rank // 2
                assert (n.peer > mg.rank) == isinstance(n, SendNode)
            else:
                exchanges += 1
                assert n.peer // 2 == mg.rank // 2 and n.peer != mg.rank
    assert pipe >= 4 and exchanges >= 4 * 2 * 2  # two all-reduces a layer, both ways
    validate_ranks(hybrid.programs)


def test_a_hybrid_prefill_computes_the_model_in_any_order(prefill, hybrid, weights):
    inputs = {"tokens": _tokens()}
    want = evaluate(prefill, inputs, weights)
    for order in ("sequential", 3):
        _close(run_ranks(hybrid.programs, inputs, weights, order=order), want)
    _close(run_ranks(hybrid.programs, inputs, weights, backend="threads", delays=5), want)
    sim = simulate_ranks(hybrid.programs, [H100] * 4)
    assert sim.makespan_s >= max(p.makespan_s for p in sim.alone) * (1 - 1e-9)


def test_micro_batches_and_decode_steps(weights):
    graph = llama.prefill_graph(SMALL).bind(B=1, S=6)
    plan = compile_hybrid(graph, 4, 2, CompileOptions(SMALL.weight_bytes() // 8))
    batches = [{"tokens": _tokens(1, 6)}, {"tokens": (_tokens(1, 6) + 5) % SMALL.vocab}]
    got = run_ranks(plan.programs, batches, weights, backend="threads")
    for m, given in enumerate(batches):
        want = evaluate(graph, given, weights)
        _close({k: v[m:m + 1] for k, v in got.items()}, want)
    step = llama.decode_graph(SMALL).bind(B=2, C=16)
    dec = compile_hybrid(step, 4, 2, CompileOptions(SMALL.weight_bytes() // 8), plan.split.cut)
    assert dec.split.cut == plan.split.cut  # a layer's KV rows stay on the group that made them
    rng = np.random.default_rng(3)
    inputs = {"tokens": rng.integers(0, SMALL.vocab, (2, 1)), "pos": np.array([5, 9])}
    for t in step.inputs:
        if t.op.role.value == "cache":
            inputs[t.op.name] = rng.standard_normal(tuple(t.shape)).astype(np.float32)
    _close(run_ranks(dec.programs, inputs, weights, order=1), evaluate(step, inputs, weights))


def test_the_validator_refuses_broken_hybrid_programs(prefill, hybrid, monkeypatch):
    a, b, c, d = hybrid.programs
    # a recv of an exchange that does not wait for this rank's own send of it
    recv = next(n for n, is_pipe in _messages(c) if isinstance(n, RecvNode) and not is_pipe)
    nodes = list(c.nodes)
    nodes[recv.id] = replace(recv, deps=tuple(x for x in recv.deps
                                              if not isinstance(c.nodes[x], SendNode)))
    with pytest.raises(PlanError, match=r"does not wait for node %\d+ \(this rank.s send of it\)"):
        validate_ranks([a, b, replace(c, nodes=tuple(nodes)), d])
    # the groups' places swapped: the pipeline's messages now go to an earlier group
    swap = {0: 2, 1: 3, 2: 0, 3: 1}

    def moved(mg):
        return replace(mg, rank=swap[mg.rank], nodes=tuple(
            replace(n, peer=swap[n.peer]) if isinstance(n, (SendNode, RecvNode)) else n
            for n in mg.nodes))

    with pytest.raises(PlanError, match="goes back to rank .* of a group before its own"):
        validate_ranks([moved(c), moved(d), moved(a), moved(b)])
    # one group's second member takes two exchanges in the other order than its first
    made = tensor_parallel.exchange_order

    def swapped(makers):
        order = made(makers)
        return [order[1], order[0], *order[2:]]

    options = CompileOptions(SMALL.weight_bytes() // 12, block_bytes=8192)
    monkeypatch.setattr(tensor_parallel, "exchange_order", swapped)
    other = compile_hybrid(prefill, 4, 2, replace(options, validate=False))
    with pytest.raises(PlanError, match="rank 3 takes part in the exchanges in another order "
                                        "than rank 2"):
        validate_ranks([a, b, c, other.programs[3]])


def _messages_only(rank: int, world: int, items):
    """A program of sends and recvs alone (the cross-rank rules under test; each program's own
    validation stubbed out): items ('send', output name, peer, tag, deps) or ('recv', input
    name, peer, tag, deps), one element of f32 each."""
    from einpage.ir.dtypes import DType
    from einpage.ir.memgraph import MemGraph, OutputRef, TensorInfo
    from einpage.ir.tensors import LogicalTensor
    tensors, nodes, outputs, inputs = [], [], [], {}
    for i, (kind, name, peer, tag, deps) in enumerate(items):
        if kind == "send":
            tensors.append(TensorInfo(len(tensors), 4, DType.f32, (1,), name))
            outputs.append(OutputRef(tensors[-1].id, "host", None, name, (0,)))
            nodes.append(SendNode(i, tensors[-1].id, None, peer, tag, tuple(deps)))
        else:
            inputs[name] = LogicalTensor(name, "activation", (1,), DType.f32)
            nodes.append(RecvNode(i, name, (0,), (1,), peer, tag, tuple(deps)))
    return MemGraph(1024, tuple(tensors), tuple(nodes), tuple(outputs), tuple(inputs.values()),
                    rank=rank, world=world)


def test_a_send_after_an_exchange_this_rank_only_sends_in_waits_for_those_sends(monkeypatch):
    """Rank 0 sends in exchange 1 and receives nothing of it: its send of exchange 2 must
    still wait for that send, or rank 0 could block at its recv of exchange 2 before posting
    the message of exchange 1 that rank 1 waits for (a deadlock the review found the rule let
    through)."""
    import einpage.ir.peers as peers
    monkeypatch.setattr(peers, "checked", lambda mg: None)

    def rank0(deps):
        return _messages_only(0, 3, [("send", "tp.1", 1, 0, ()), ("send", "tp.2", 1, 1, deps),
                                     ("recv", "tp.2.1", 1, 1, (1,))])

    r1 = _messages_only(1, 3, [("send", "tp.1", 2, 0, ()), ("recv", "tp.1.0", 0, 0, (0,)),
                               ("recv", "tp.1.2", 2, 0, (0,)), ("send", "tp.2", 0, 1, (1, 2)),
                               ("send", "tp.2", 2, 1, (1, 2)), ("recv", "tp.2.0", 0, 1, (3, 4)),
                               ("recv", "tp.2.2", 2, 1, (3, 4))])
    r2 = _messages_only(2, 3, [("send", "tp.1", 1, 0, ()), ("recv", "tp.1.1", 1, 0, (0,)),
                               ("send", "tp.2", 1, 1, (1,)), ("recv", "tp.2.1", 1, 1, (2,))])
    with pytest.raises(PlanError, match=r"node %1 \(send of exchange 2 .* does not wait for "
                                        r"node %0 \(send of the exchange before\)"):
        validate_ranks([rank0(()), r1, r2])
    validate_ranks([rank0((0,)), r1, r2])


def test_a_pipeline_message_within_a_group_is_refused(monkeypatch):
    import einpage.ir.peers as peers
    monkeypatch.setattr(peers, "checked", lambda mg: None)
    a = _messages_only(0, 2, [("send", "tp.1", 1, 0, ()), ("recv", "tp.1.1", 1, 0, (0,)),
                              ("send", "pipe.7", 1, 1, (1,))])
    b = _messages_only(1, 2, [("send", "tp.1", 0, 0, ()), ("recv", "tp.1.0", 0, 0, (0,)),
                              ("recv", "pipe.7", 0, 1, ())])
    with pytest.raises(PlanError, match="goes back to rank 1, a rank of its own group"):
        validate_ranks([a, b])


def test_auto_keeps_the_fastest_of_pipeline_tensor_and_hybrid():
    prefill = llama.prefill_graph(SMALL).bind(B=1, S=4)
    options = CompileOptions(SMALL.weight_bytes() // 8, block_bytes=32768)

    def seconds(plan):
        return simulate_ranks(plan.programs, [H100] * 4).makespan_s

    each = {kind: seconds(compile_parallel(prefill, 4, options, kind))
            for kind in ("pipeline", "tensor", "hybrid")}
    auto = compile_parallel(prefill, 4, options, "auto")
    assert seconds(auto) == pytest.approx(min(each.values()), rel=1e-9)
    with pytest.raises(PlanError, match="needs two groups of two devices or more"):
        compile_parallel(prefill, 2, options, "hybrid")
    with pytest.raises(PlanError, match="groups of 4 needs a multiple of 4 devices, at least 8"):
        compile_hybrid(prefill, 6, 4, options)


def test_messages_within_a_group_cross_the_group_link(hybrid):
    """Exchanges are priced at the group's link (NVLink within a machine), the boundaries at
    the peer link (a network between machines)."""
    from einpage.predict.simulator import node_seconds
    profile = replace(H100, peer_bandwidth=12.5e9, group_bandwidth=450e9)
    mg = hybrid.programs[0]
    seconds = node_seconds(mg, profile)
    for n, is_pipe in _messages(mg):
        if isinstance(n, SendNode):
            rate = profile.peer_bandwidth if is_pipe else profile.group_bandwidth
            want = mg.tensors[n.tensor].bytes / rate + profile.copy_latency
            assert seconds[n.id] == pytest.approx(want, rel=1e-12)
    assert replace(H100, peer_bandwidth=7e9).group_rate == 7e9  # default: the peer link


# ------------------------------------------------------------------ the command line

def test_compile_inspect_run_and_generate_on_four_devices(hf_fixture, tmp_path, capsys):
    f32 = hf_fixture("tiny-llama-f32")
    for name, extra in (("one.json", ()), ("hy.json", ("--devices", 4, "--parallel", "hybrid"))):
        assert cli("compile", f32, "--gpu-mem", "200KB", "--seq", 5, "--quiet", "-o",
                   tmp_path / name, *extra) == 0
    assert "pipeline of tensor-parallel groups of 2" in capsys.readouterr().out
    assert cli("inspect", tmp_path / "hy.json", "--json") == 0
    r = json.loads(capsys.readouterr().out)
    assert r["devices"] == 4 and r["parallel"] == "hybrid" and r["group"] == 2
    assert r["ranks"][0]["stages"] == r["ranks"][1]["stages"] != r["ranks"][2]["stages"]
    for plan in ("one", "hy"):
        assert cli("run", tmp_path / f"{plan}.json", "--checkpoint", f32, "--tokens",
                   "1,2,3,4,5", "--out", tmp_path / f"{plan}.npy") == 0
    np.testing.assert_allclose(np.load(tmp_path / "hy.npy"), np.load(tmp_path / "one.npy"),
                               rtol=1e-5, atol=1e-6)
    assert cli("generate", f32, "--tokens-file", f32 / "greedy_prompt.npy", "--max-new-tokens",
               5, "--ignore-eos", "--gpu-mem", "200KB", "--devices", 4, "--parallel", "hybrid",
               "--out", tmp_path / "new.npy") == 0
    np.testing.assert_array_equal(np.load(tmp_path / "new.npy"), np.load(f32 / "greedy_out.npy"))
    one_line(capsys, cli("compile", f32, "--gpu-mem", "200KB", "--devices", 2, "--parallel",
                         "hybrid"), "needs two groups of two devices or more")
    one_line(capsys, cli("compile", f32, "--gpu-mem", "200KB", "--devices", 4, "--group-link",
                         "nvlink"), "--group-link is the link within a tensor-parallel group")
    # more devices than the 4 stages: auto keeps what can be made (the pipeline cannot)
    assert cli("compile", f32, "--gpu-mem", "1MB", "--seq", 5, "--devices", 8, "--parallel",
               "auto", "--quiet", "--json") == 0
    r = json.loads(capsys.readouterr().out)
    (note,) = [n for n in r["notes"] if n.startswith("tried: ")]
    assert "pipeline" not in note and "tensor x 1" in note and "hybrid " in note
    one_line(capsys, cli("compile", f32, "--gpu-mem", "200KB", "--group-link", "nvlink"),
             "--group-link is the link between devices: add --devices N")
    assert cli("compile", f32, "--gpu-mem", "200KB", "--seq", 5, "--devices", 4, "--parallel",
               "hybrid", "--peer-link", "net-100g", "--group-link", "nvlink", "--quiet", "-o",
               tmp_path / "links.json") == 0
    assert "(peer link 12.50 GB/s, within a group 450.00 GB/s)" in capsys.readouterr().out
    assert cli("inspect", tmp_path / "links.json", "--json") == 0
    r = json.loads(capsys.readouterr().out)
    assert r["peer_bandwidth"] == 12.5e9 and r["group_bandwidth"] == 450e9


@needs_mpi
def test_one_process_per_device_under_mpiexec(hf_fixture, tmp_path):
    """A generation, and a saved plan of two micro-batches (each rank's results joined along
    the batch before they are gathered)."""
    f32 = hf_fixture("tiny-llama-f32")
    tokens = tmp_path / "ids.npy"
    np.save(tokens, np.array([[1, 2, 3, 4, 5], [9, 8, 7, 6, 5]]))
    for name, extra in (("one.json", ()), ("mb.json", ("--devices", 4, "--parallel", "hybrid",
                                                        "--micro-batches", 2))):
        assert cli("compile", f32, "--gpu-mem", "200KB", "--seq", 5, "--batch", 2, "--quiet",
                   "-o", tmp_path / name, *extra) == 0
    assert cli("run", tmp_path / "one.json", "--checkpoint", f32, "--tokens-file", tokens,
               "--out", tmp_path / "one.npy") == 0
    rc, output, _ = mpiexec(4, [EINPAGE, "run", tmp_path / "mb.json", "--checkpoint", f32,
                                "--tokens-file", tokens, "--out", tmp_path / "mb.npy"],
                            timeout=120)
    assert rc == 0, output
    np.testing.assert_allclose(np.load(tmp_path / "mb.npy"), np.load(tmp_path / "one.npy"),
                               rtol=1e-5, atol=1e-6)
    rc, output, _ = mpiexec(4, [EINPAGE, "generate", f32, "--tokens-file",
                                f32 / "greedy_prompt.npy", "--max-new-tokens", 5, "--ignore-eos",
                                "--gpu-mem", "200KB", "--devices", 4, "--parallel", "hybrid",
                                "--out", tmp_path / "new.npy"], timeout=120)
    assert rc == 0, output
    assert output.count("saved new tokens") == 1, output
    np.testing.assert_array_equal(np.load(tmp_path / "new.npy"), np.load(f32 / "greedy_out.npy"))
