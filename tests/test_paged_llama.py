"""LLaMA under budgets that force streaming and offloading: logits and greedy tokens equal the
unconstrained run; the compile/run/inspect command line and its error paths."""
from __future__ import annotations

import json

import numpy as np
import pytest
from checkpoints import write_checkpoint

from einpage import cli
from einpage.compiler import CompileOptions, compile_graph
from einpage.errors import BudgetError
from einpage.ir.memgraph import MemGraph
from einpage.models import llama, resolve
from einpage.models.generation import greedy, prefill
from einpage.runners import run_paged
from einpage.runtime import evaluate, executor


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("ck"), hidden=32, layers=2, heads=4,
                            kv_heads=2, intermediate=48, vocab=64, seed=7)


def _weights_bytes(cfg):
    return cfg.weight_bytes()


@pytest.mark.parametrize("fraction", [4, 8])
@pytest.mark.parametrize("policy", ["reuse-distance", "lru"])
def test_prefill_under_a_fraction_of_the_weights(ckpt, fraction, policy):
    cfg, weights = resolve(str(ckpt))
    tokens = np.array([[1, 5, 9, 2, 33, 7], [3, 3, 60, 0, 12, 4]])
    want = prefill(cfg, tokens, lambda g, i: evaluate(g, i, weights))
    budget = _weights_bytes(cfg) // fraction
    options = CompileOptions(budget, policy=policy)
    graph = llama.prefill_graph(cfg).bind(B=2, S=6)
    compiled = compile_graph(graph, options)
    assert compiled.report.peak_bytes <= budget
    assert compiled.report.traffic.reload_bytes > 0  # it really streams
    for order in ("sequential", 11):
        got = run_paged(graph, {"tokens": tokens}, weights, options, order=order)
        np.testing.assert_allclose(got["logits"], want["logits"], rtol=1e-5, atol=1e-5)
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-5)


def test_layerwise_streams_whole_layers_or_says_it_cannot(ckpt):
    cfg, weights = resolve(str(ckpt))
    tokens = np.array([[1, 5, 9, 2]])
    graph = llama.prefill_graph(cfg).bind(B=1, S=4)
    with pytest.raises(BudgetError, match="layerwise"):
        compile_graph(graph, CompileOptions(_weights_bytes(cfg) // 8, policy="layerwise"))
    options = CompileOptions(_weights_bytes(cfg) * 3 // 4, policy="layerwise")
    assert compile_graph(graph, options).report.traffic.reload_bytes > 0
    want = evaluate(graph, {"tokens": tokens}, weights)
    got = run_paged(graph, {"tokens": tokens}, weights, options, order=2)
    np.testing.assert_allclose(got["logits"], want["logits"], rtol=1e-5, atol=1e-5)


def test_greedy_decoding_under_an_eighth_of_the_weights(ckpt):
    cfg, weights = resolve(str(ckpt))
    prompt = np.array([[4, 8, 15, 16], [23, 42, 1, 2]])
    want = greedy(cfg, prompt, 5, lambda g, i: evaluate(g, i, weights))
    options = CompileOptions(_weights_bytes(cfg) // 8)
    got = greedy(cfg, prompt, 5, lambda g, i: run_paged(g, i, weights, options, order=3))
    np.testing.assert_array_equal(got, want)


def test_tiny_activation_budget_forces_offloads():
    cfg, weights = resolve("small", random_weights=True, seed=1)
    tokens = np.arange(32).reshape(2, 16) % cfg.vocab
    graph = llama.prefill_graph(cfg).bind(B=2, S=16)
    options = CompileOptions(60_000)
    compiled = compile_graph(graph, options)
    assert compiled.report.traffic.offload_count > 0
    want = evaluate(graph, {"tokens": tokens}, weights)
    got = executor.run(compiled.memgraph, {"tokens": tokens}, weights, order=5)
    np.testing.assert_allclose(got["logits"], want["logits"], rtol=1e-4, atol=1e-5)


def _main(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_compile_json_report(capsys):
    code, out, err = _main(capsys, "compile", "llama-7b", "--gpu-mem", "16GB", "--json")
    assert code == 0, err
    report = json.loads(out)
    for key in ("device_bytes", "peak_bytes", "tasks", "nodes", "reload_bytes", "offload_bytes",
                "reload_count", "offload_count", "compile_seconds"):
        assert key in report
    assert report["device_bytes"] == 16 * 10**9
    assert report["peak_bytes"] <= report["device_bytes"]
    assert report["offload_bytes"] == 0
    # each weight that does not stay resident is loaded once
    assert report["reload_bytes"] <= 1.01 * report["streamed_weight_bytes"] + 10**6


def test_compile_fits_with_zero_transfers(capsys):
    code, out, _ = _main(capsys, "compile", "small", "--gpu-mem", "1GB", "--seq", "16", "--json")
    report = json.loads(out)
    assert code == 0 and report["reload_count"] == 0 and report["offload_count"] == 0


def test_plan_file_round_trip_runs(ckpt, tmp_path, capsys):
    plan = tmp_path / "plan.json"
    cfg, weights = resolve(str(ckpt))
    code, _, err = _main(capsys, "compile", str(ckpt), "--gpu-mem", str(cfg.weight_bytes() // 4),
                         "--batch", "1", "--seq", "3", "-o", str(plan))
    assert code == 0, err
    code, out, err = _main(capsys, "run", str(plan), "--checkpoint", str(ckpt), "--tokens", "1,2,3",
                           "--out", str(tmp_path / "l.npy"))
    assert code == 0, err
    want = prefill(cfg, np.array([[1, 2, 3]]), lambda g, i: evaluate(g, i, weights))["logits"]
    np.testing.assert_allclose(np.load(tmp_path / "l.npy"), want, rtol=1e-5, atol=1e-5)
    code, out, err = _main(capsys, "inspect", str(plan), "--json")
    assert code == 0 and json.loads(out)["reload_count"] > 0


def test_run_and_generate_with_gpu_mem(ckpt, tmp_path, capsys):
    ids = tmp_path / "ids.npy"
    np.save(ids, np.array([[1, 2, 3, 4]]))
    code, out, err = _main(capsys, "generate", str(ckpt), "--tokens-file", str(ids),
                           "--max-new-tokens", "3", "--gpu-mem", "20KB", "--out",
                           str(tmp_path / "paged.npy"))
    assert code == 0, err
    _main(capsys, "generate", str(ckpt), "--tokens-file", str(ids), "--max-new-tokens", "3",
          "--out", str(tmp_path / "dense.npy"))
    np.testing.assert_array_equal(np.load(tmp_path / "paged.npy"), np.load(tmp_path / "dense.npy"))


@pytest.mark.parametrize("argv, needle", [
    (["compile", "llama-7b", "--gpu-mem", "4MB"], "too large to plan"),
    (["compile", "tiny", "--gpu-mem", "300", "--seq", "4"], "at least"),
    (["compile", "llama-7b", "--gpu-mem", "lots"], "bad --gpu-mem 'lots'"),
    (["compile", "llama-7b", "--gpu-mem", "1e400"], "bad --gpu-mem '1e400': too large"),
    (["compile", "llama-7b", "--gpu-mem", "16GB", "--policy", "fifo"], "unknown policy"),
    (["compile", "nosuch", "--gpu-mem", "16GB"], "unknown model"),
    (["compile", "llama-7b", "--gpu-mem", "16GB", "--batch", "0"], "--batch"),
    (["compile", "llama-65b", "--gpu-mem", "16GB", "--policy", "none"], "resident weights"),
])
def test_compile_errors_exit_2_with_one_line(capsys, argv, needle):
    code, out, err = _main(capsys, *argv)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and needle in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("content", ["not json", '{"format": "other"}',
                                     '{"format": "einpage.memgraph", "version": 9}',
                                     '{"format": "einpage.memgraph", "version": 1}'])
def test_corrupt_plan_exits_2(tmp_path, capsys, content, ckpt):
    plan = tmp_path / "bad.json"
    plan.write_text(content)
    for argv in (["inspect", str(plan)],
                 ["run", str(plan), "--checkpoint", str(ckpt), "--tokens", "1"]):
        code, _, err = _main(capsys, *argv)
        assert code == 2 and len(err.strip().splitlines()) == 1, err


def test_plan_json_is_the_documented_format(tmp_path, capsys):
    plan = tmp_path / "p.json"
    _main(capsys, "compile", "tiny", "--gpu-mem", "8KB", "--seq", "4", "-o", str(plan))
    data = json.loads(plan.read_text())
    assert data["format"] == "einpage.memgraph" and data["version"] == 2
    kinds = {n["kind"] for n in data["nodes"]}
    assert {"input", "reload", "apply", "free"} <= kinds
    for k, n in enumerate(data["nodes"]):
        assert n["id"] == k and all(d < k for d in n["deps"])
    # provenance (version 2): the graph with its hash; each tensor its block, each apply its
    # task (and no op of its own), every task once
    graph = data["graph"]
    assert graph["hash"].startswith("sha256:") and len(graph["hash"]) == 7 + 64
    assert sorted(t["block"] for t in data["tensors"]) == list(range(len(graph["blocks"])))
    applies = [n for n in data["nodes"] if n["kind"] == "apply"]
    assert all("op" not in n for n in applies)
    assert sorted(n["task"] for n in applies) == list(range(len(graph["tasks"])))
    assert MemGraph.from_json(data).to_json()["nodes"] == data["nodes"]


@pytest.mark.parametrize("family", ["tiny-llama-f32", "tiny-llama-bf16", "tiny-mixtral"])
def test_a_generations_prefill_computes_each_rows_last_logits_alone(hf_fixture, family):
    """`prefill(last=True)` (what generate, a draft model and the server run): the final norm
    and the vocabulary projection at each row's last real position only, picked by a one-hot
    input: the same logits there as the whole prefill's (to the rounding of a projection of one
    row rather than S: the BLAS blocks them otherwise), on the reference and on a paged plan
    in a random order, rows of different lengths; the KV rows are the whole prefill's."""
    from einpage.models.generation import last_position
    cfg, weights = resolve(str(hf_fixture(family)))
    tokens = np.array([[1, 5, 9, 2, 33, 7, 8], [3, 3, 60, 0, 12, 4, 0]])
    lengths = np.array([7, 5])
    reference = lambda g, i: evaluate(g, i, weights)  # noqa: E731
    every = prefill(cfg, tokens, reference, lengths)
    whole = every["logits"]
    want = whole[np.arange(2), lengths - 1]
    got = prefill(cfg, tokens, reference, lengths, last=True)
    assert got["logits"].shape == (2, cfg.vocab) and got["logits"].dtype == want.dtype
    tol = 1e-5 if cfg.dtype.value == "f32" else 2e-2  # one bf16 rounding of the logits

    def close(a, b):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol * float(np.abs(b).max()))
        assert (np.argmax(a, axis=-1) == np.argmax(b, axis=-1)).all()

    close(got["logits"], want)
    budget = cfg.weight_bytes() // 4
    paged = prefill(cfg, tokens, lambda g, i: run_paged(g, i, weights, CompileOptions(budget),
                                                        order=3), lengths, last=True)
    close(paged["logits"], want)
    for name in got:
        if name.startswith("cache."):
            np.testing.assert_array_equal(got[name], every[name])
    pick = last_position(lengths, 7, np.float32)
    assert pick.shape == (2, 7, 1) and pick.sum() == 2 and pick[1, 4, 0] == 1
    graph = llama.prefill_graph(cfg, last=True).bind(B=2, S=7)
    (logits,) = [n for n in graph.outputs if n.op.name == "logits"]
    assert tuple(logits.shape) == (2, 1, cfg.vocab)


def test_reads_reserved_ahead_let_go_for_the_write_at_the_horizon_still_give_the_logits(
        ckpt, monkeypatch):
    """With no room claimed for the writes deferred (`lowering.CLAIM_SHARE` 0) and each placed
    only at the execution horizon, the prefetch fills the budget and the write at the horizon
    finds no room: the reads reserved for later tasks are let go (`unreserve`) and evicted or
    kept as the policy says. The plans stay valid and give the unconstrained logits in random
    orders."""
    from einpage.compiler import lowering
    monkeypatch.setattr(lowering, "FINALIZE_AHEAD", 1)
    monkeypatch.setattr(lowering, "CLAIM_SHARE", 0.0)
    released = []
    unreserve = lowering._Lowering.unreserve
    monkeypatch.setattr(lowering._Lowering, "unreserve",
                        lambda self, a, b: (released.append(b - a), unreserve(self, a, b)))
    cfg, weights = resolve(str(ckpt))
    tokens = np.array([[1, 5, 9, 2, 33, 7], [3, 3, 60, 0, 12, 4]])
    graph = llama.prefill_graph(cfg).bind(B=2, S=6)
    want = evaluate(graph, {"tokens": tokens}, weights)
    options = CompileOptions(_weights_bytes(cfg) // 8)
    for order in (4, 9):
        got = run_paged(graph, {"tokens": tokens}, weights, options, order=order)
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-5)
    assert any(n > 0 for n in released)


def test_the_room_claimed_for_deferred_writes_is_each_unplaced_write_once(ckpt, monkeypatch):
    """`_Lowering.deferred`, the bytes the allocation horizon keeps free for the writes it
    left to `finalize`, is the sum of `later` and equals the bytes of the fresh writes reserved
    and not yet placed, each counted once (a read made by a deferred writer is its writer's
    claim, not its reader's: counted twice, the claim held back the prefetch), at every
    reservation, finalize and release of a llama prefill at an eighth of its weights."""
    from einpage.compiler import lowering
    checked = []

    def check(self):
        claimed = {self.tg.tasks[self.order[p]].write for p, n in self.later.items() if n}
        unplaced = sum(self.blocks[b].size for b in claimed if self.blocks[b].offset is None)
        assert self.deferred == sum(self.later.values()) == unplaced
        assert all(self.blocks[b].offset is None for b in claimed)
        checked.append(self.deferred)

    for name in ("reserve", "finalize", "unreserve"):
        step = getattr(lowering._Lowering, name)
        monkeypatch.setattr(lowering._Lowering, name,
                            lambda self, *a, _step=step, **k: (_step(self, *a, **k), check(self))[0])
    cfg, _ = resolve(str(ckpt))
    graph = llama.prefill_graph(cfg).bind(B=2, S=6)
    compile_graph(graph, CompileOptions(_weights_bytes(cfg) // 8))
    assert checked and max(checked) > 0
