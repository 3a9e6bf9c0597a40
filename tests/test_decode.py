"""Generation on reused decode plans (issue 12): one plan per KV-store bucket, positions as an
input, the store written a row at a time and read in place — on the dense reference, the
sequential executor and the stream runtime's held-open sessions, under budgets that stream
weights and KV blocks."""
from __future__ import annotations

import numpy as np
import pytest

from einpage.cli.main import main
from einpage.compiler import CompileOptions, compile_graph
from einpage.errors import InputError
from einpage.models import generation, resolve
from einpage.models.kvstore import (KVStore, bucket_steps, capacity_for, step_capacities,
                                    store_names)
from einpage.runners import PlanRunner, dense_runner

F32_ATOL = 1e-5


# ------------------------------------------------------------------ buckets and the store

def test_capacity_buckets():
    assert [capacity_for(n) for n in (1, 256, 257, 2048, 2049, 4097)] == [
        256, 256, 512, 2048, 2304, 4608]
    assert capacity_for(10_000) == 10_240  # 1/8 of 16384 per step past 2048
    for n in range(1, 20_000, 37):
        c = capacity_for(n)
        assert n <= c and (c - n) <= max(256, c // 8)
    assert capacity_for(10, granule=4) == 12
    with pytest.raises(InputError):
        capacity_for(0)


def test_bucket_steps_cover_every_decode_step():
    assert bucket_steps(512, 32) == [(543, 31)]  # the last bucket: only the rows filled
    assert bucket_steps(250, 20) == [(256, 6), (269, 13)]
    assert bucket_steps(250, 400) == [(256, 6), (512, 256), (649, 137)]
    assert step_capacities(9, 5, granule=2) == (10, 12, 13)
    assert bucket_steps(9, 1) == []  # the prefill gives the only token
    for prompt, new in ((1, 300), (255, 2), (2040, 100)):
        steps = bucket_steps(prompt, new)
        assert sum(s for _, s in steps) == new - 1
        assert all(c >= prompt + 1 for c, _ in steps)


def test_store_fill_write_and_full():
    cfg, _ = resolve("tiny")
    store = KVStore(cfg, 2, 4)
    shape = (2, 3, cfg.kv_heads, 2, cfg.head_dim // 2)
    cache = {name: np.full(shape, k, np.float32) for k, name in enumerate(store_names(cfg))}
    store.fill(cache, lengths=np.array([3, 1]))
    assert store.pos.tolist() == [3, 1]
    assert store.rows("cache.0.v", 1).shape == (1, cfg.kv_heads, 2, cfg.head_dim // 2)
    step = {"new." + n[len("cache."):]: np.full((2, 1, *shape[2:]), 9, np.float32)
            for n in store_names(cfg)}
    written = store.write(step)
    assert store.pos.tolist() == [4, 2] and len(written) == 2 * len(store_names(cfg))
    assert (store.arrays["cache.1.k"][0, 3] == 9).all() and (store.arrays["cache.1.k"][1, 1] == 9).all()
    with pytest.raises(InputError, match="full"):
        store.write(step)
    with pytest.raises(InputError, match="capacity"):
        store.view(5)


# ------------------------------------------------------------------ greedy on reused plans

def _fixture(hf_fixture):
    path = hf_fixture("tiny-llama-f32")
    cfg, weights = resolve(str(path))
    return cfg, weights, np.load(path / "greedy_prompt.npy"), np.load(path / "greedy_out.npy")


def test_a_steps_softmax_stores_no_masked_scores_or_exponentials(hf_fixture):
    """The decode and verify steps' softmax runs in the prefill's passes (max, sum, then the
    probabilities, each reading the scores as the product wrote them): per layer two tensors of
    the scores' size are written (the scores, the probabilities), and a step over an empty past
    (every store row masked) still gives the one-token softmax (its own key alone), no NaN."""
    from einpage.ir.graph import Einsum
    from einpage.models import llama
    cfg, weights = resolve(str(hf_fixture("tiny-llama-f32")))
    for graph, big in ((llama.decode_graph(cfg).bind(B=2, C=8), "bngst"),
                       (llama.verify_graph(cfg).bind(B=2, T=3, C=8), "bngst")):
        wide = [n for n in graph.nodes if isinstance(n.op, Einsum)
                and "".join(n.op.spec.output) == big]
        assert len(wide) == 2 * cfg.layers
    step = generation.decode_step_graph(cfg, 1, 8)
    store = KVStore(cfg, 1, 8)  # nothing in it: position 0
    tokens = np.array([[5]])
    got = dense_runner(weights)(step, {"tokens": tokens, "pos": store.pos.copy(),
                                      **store.view(8)})
    want = generation.prefill(cfg, tokens, dense_runner(weights))["logits"][:, 0]
    assert np.isfinite(got["logits"]).all()
    np.testing.assert_allclose(got["logits"][:, 0], want, rtol=1e-5, atol=F32_ATOL)


@pytest.mark.parametrize("backend", ["threads", "numpy"])
@pytest.mark.parametrize("share", [None, 4])
def test_fixture_greedy_on_reused_plans(hf_fixture, backend, share):
    """transformers' greedy tokens, with a plan per bucket reused across steps (granule 2:
    three buckets in four steps), unconstrained and with a quarter of the weights' bytes."""
    cfg, weights, prompt, want = _fixture(hf_fixture)
    budget = cfg.weight_bytes() // share if share else None
    runner = PlanRunner(weights, CompileOptions(budget), backend)
    got = generation.generate(cfg, prompt, want.shape[1], runner, granule=2)
    np.testing.assert_array_equal(got.tokens, want)
    assert got.capacities == (10, 12, 13)
    assert runner.plans_compiled == 1 + 3  # the prefill, and one per bucket: not per step
    assert len(runner.passes) == want.shape[1]  # one pass each: prefill + 4 steps
    if share:
        decode = [p.compiled for p in runner.passes[1:]]
        assert all(c.report.traffic.reload_bytes > 0 for c in decode)
        assert any(c.report.compiled.kv_streamed_bytes > 0 for c in decode)


def _mixed_budget(cfg, batch, capacity):
    """A budget under which the decode plan keeps some KV blocks on the device and streams
    others (and streams weights)."""
    graph = generation.decode_step_graph(cfg, batch, capacity)
    for divisor in (1, 1.5, 2, 3, 4, 5, 6, 8, 10, 12, 16):
        budget = int(cfg.weight_bytes() / divisor)
        c = compile_graph(graph, CompileOptions(budget)).report.compiled
        if 0 < c.kv_resident_bytes < c.kv_bytes and c.streamed_weight_bytes > 0:
            return budget
    pytest.fail("no budget splits the KV store between the device and the host")


@pytest.mark.parametrize("backend", ["threads", "numpy"])
def test_kv_store_after_steps_equals_the_prefill_of_the_whole_sequence(hf_fixture, backend):
    cfg, weights, prompt, _ = _fixture(hf_fixture)
    batch, length = prompt.shape
    steps = 6
    runner = PlanRunner(weights, CompileOptions(_mixed_budget(cfg, batch, 16)), backend)
    store = KVStore(cfg, batch, 16)
    out = generation.prefill(cfg, prompt, runner)
    store.fill(out)
    first = np.argmax(out["logits"][:, -1], axis=-1)
    new = generation.decode(cfg, store, first, steps, runner, granule=16)
    assert runner.plans_compiled == 2 and store.pos.tolist() == [length + steps] * batch
    whole = np.concatenate([prompt, first[:, None], new[:, :-1]], axis=1)
    want = generation.prefill(cfg, whole, dense_runner(weights))
    for name in store_names(cfg):
        for b in range(batch):
            got = store.rows(name, b)
            assert got.shape == want[name][b].shape
            assert np.abs(got - want[name][b]).max() < F32_ATOL


def test_rows_at_different_positions_share_one_plan(hf_fixture):
    """A ragged batch: each row's tokens equal its own generation."""
    cfg, weights, prompt, _ = _fixture(hf_fixture)
    lengths = np.array([9, 5])
    dense = dense_runner(weights)
    store = KVStore(cfg, 2, 16)
    out = generation.prefill(cfg, prompt, dense)
    store.fill(out, lengths)
    last = np.array([int(np.argmax(out["logits"][b, n - 1])) for b, n in enumerate(lengths)])
    runner = PlanRunner(weights, CompileOptions(_mixed_budget(cfg, 2, 16)), "threads")
    got = generation.decode(cfg, store, last, 4, runner, granule=16)
    for b, n in enumerate(lengths):
        alone = generation.greedy(cfg, prompt[b:b + 1, :n], 5, dense)
        np.testing.assert_array_equal(got[b], alone[0, 1:])


def _two_steps(cfg, weights, prompt, runner):
    """The second decode step's logits, run on a session of `runner` (rows written between)."""
    store = KVStore(cfg, prompt.shape[0], 16)
    out = generation.prefill(cfg, prompt, dense_runner(weights))
    store.fill(out)
    last = np.argmax(out["logits"][:, -1], axis=-1)
    graph = generation.decode_step_graph(cfg, prompt.shape[0], 16)
    with generation.open_session(runner, graph) as session:
        for _ in range(2):
            step = session.run({"tokens": last[:, None], "pos": store.pos.copy(),
                                **store.view(16)})
            for name, lead, row in store.write(step):
                session.write(name, lead, row)
            last = np.argmax(step["logits"][:, -1], axis=-1)
    return step["logits"]


def test_a_session_reads_its_resident_rows_from_the_device(hf_fixture, monkeypatch):
    """With the whole store resident, the rows a step reads are the ones written in place on the
    device: a session that drops those writes answers wrong."""
    cfg, weights, prompt, _ = _fixture(hf_fixture)
    want = _two_steps(cfg, weights, prompt, dense_runner(weights))
    runner = PlanRunner(weights, CompileOptions(None), "threads")
    got = _two_steps(cfg, weights, prompt, runner)
    assert np.abs(got - want).max() < F32_ATOL
    plan = runner.passes[-1].compiled.report.compiled
    assert plan.kv_resident_bytes == plan.kv_bytes > 0
    assert runner.passes[0].measured.load_bytes > 0 and runner.passes[1].measured.load_bytes == 0
    from einpage.runtime.backends.threads import ThreadsBackend
    monkeypatch.setattr(ThreadsBackend, "write_input", lambda *a: None)
    dropped = _two_steps(cfg, weights, prompt, PlanRunner(weights, CompileOptions(None),
                                                          "threads"))
    assert np.abs(dropped - want).max() > 1e-3


def test_one_decode_plan_serves_every_position():
    cfg, weights = resolve("tiny", random_weights=True, seed=2)
    graph = generation.decode_step_graph(cfg, 1, 8)
    assert generation.decode_step_graph(cfg, 1, 8) is graph  # built once per process
    mg = compile_graph(graph, CompileOptions(cfg.weight_bytes() // 3)).memgraph
    names = {t.name for t in mg.inputs}
    assert "pos" in names and not any("P" in str(s) for t in mg.inputs for s in t.shape)


# ------------------------------------------------------------------ command line

def test_generate_json(hf_fixture, capsys):
    cfg, weights, prompt, want = _fixture(hf_fixture)
    path = hf_fixture("tiny-llama-f32")
    assert main(["generate", str(path), "--tokens-file", str(path / "greedy_prompt.npy"),
                 "--max-new-tokens", "5", "--kv-granule", "2", "--gpu-mem", "200KB",
                 "--backend", "threads", "--json"]) in (0, None)
    import json
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == want.tolist() and out["plans_compiled"] == 4
    assert out["decode_steps"] == 4 and out["decode_tokens_per_s"] > 0 and out["prefill_s"] > 0
    assert out["kv_capacities"] == [10, 12, 13]


def test_generate_prints_measured_rates(hf_fixture, capsys):
    path = hf_fixture("tiny-llama-f32")
    main(["generate", str(path), "--tokens-file", str(path / "greedy_prompt.npy"),
          "--max-new-tokens", "3", "--backend", "numpy"])
    text = capsys.readouterr().out
    assert "prefill: 2x9 tokens in" in text and "decode: 2 steps in" in text
    assert "2 plans compiled" in text


@pytest.fixture
def compile_once(monkeypatch):
    """The CLI's compiles kept by workload and budgets: a test that prints one plan as JSON and
    then as text compiles it once."""
    import einpage.compiler as compiler
    made, real = {}, compiler.compile_graph

    def kept(graph, options):
        key = (repr(sorted(options.workload.items())), options.device_bytes,
               options.host_bytes, options.host_compute)
        if key not in made:
            made[key] = real(graph, options)
        return made[key]

    monkeypatch.setattr(compiler, "compile_graph", kept)
    return made


def test_compile_decode_reports_kv(capsys, compile_once):
    import json
    # device-only: with the KV store's attention on the host (the default, --host-compute
    # auto, places it there at this batch) the device streams no KV at all
    main(["compile", "llama-7b", "--gpu-mem", "16GB", "--phase", "decode", "--batch", "16",
          "--past", "2047", "--json", "--quiet", "--host-compute", "off"])
    r = json.loads(capsys.readouterr().out)
    assert r["capacity"] == 2048 and r["kv_bytes"] == 16 * 2048 * 32 * 2 * 4096 * 2
    assert 0 < r["kv_resident_bytes"] < r["kv_bytes"]
    assert r["kv_streamed_bytes"] == r["kv_bytes"] - r["kv_resident_bytes"]
    # no plan keeps more than the budget less the activations at their peak
    assert r["min_stream_bytes"] >= r["weight_bytes"] + r["kv_bytes"] - 16_000_000_000
    assert r["min_stream_bytes"] <= r["h2d_bytes"] <= 1.05 * r["min_stream_bytes"]  # the goal
    main(["compile", "llama-7b", "--gpu-mem", "16GB", "--phase", "decode", "--batch", "16",
          "--past", "2047", "--quiet", "--host-compute", "off"])
    text = capsys.readouterr().out
    assert "KV store 17.18 GB: resident" in text
    assert "14.66 GB that no plan can keep on the device" in text
    assert len(compile_once) == 1


def test_compile_whole_generation(capsys):
    import json
    main(["compile", "llama-7b", "--gpu-mem", "16GB", "--batch", "8", "--seq", "512",
          "--max-new-tokens", "32", "--json"])
    r = json.loads(capsys.readouterr().out)
    assert r["plans"] == 2 and [b["capacity"] for b in r["buckets"]] == [543]
    assert r["buckets"][0]["steps"] == 31
    assert r["total_s"] == pytest.approx(r["prefill_s"] + 31 * r["buckets"][0]["step_s"])
    assert r["tokens_per_s"] == pytest.approx(8 * 32 / r["total_s"])
    main(["compile", "llama-7b", "--gpu-mem", "16GB", "--batch", "8", "--seq", "512",
          "--max-new-tokens", "32"])
    assert "2 plans (1 prefill, 1 decode)" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--past", "3"], "--past and --capacity describe a decode step"),
    (["--phase", "decode", "--past", "10", "--capacity", "8"], "cannot hold position 10"),
    (["--phase", "decode", "--max-new-tokens", "4"], "drop --phase decode"),
    (["--max-new-tokens", "0"], "at least 1"),
    (["--max-new-tokens", "4", "-o", "p.json"], "writes one plan"),
])
def test_compile_decode_option_errors(capsys, argv, message):
    assert main(["compile", "tiny", "--gpu-mem", "1MB", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("order", [0, 1, 2])
def test_a_step_with_its_weights_cut_finer_than_the_rest_gives_the_dense_logits(hf_fixture,
                                                                                order):
    """A decode step partitioned with some weights cut finer than the working sets cut the
    rest (`PartitionOptions.split_weights`: what `driver._split_streamed` tries for the weights
    a plan streams), along the axes they contract: lowered under a quarter of the weights'
    bytes and run in several orders of its tasks, the dense reference's logits."""
    from einpage.compiler.lower_options import LowerOptions
    from einpage.compiler.lowering import lower
    from einpage.compiler.order import memory_aware_order
    from einpage.compiler.partitioner import PartitionOptions, partition
    from einpage.compiler.policies import get_policy
    from einpage.ir.graph import Input
    from einpage.ir.validator import validate
    from einpage.runtime import executor
    cfg, weights, _, _ = _fixture(hf_fixture)
    step = generation.decode_step_graph(cfg, 2, 8)
    layer = [n for n in step.nodes if isinstance(n.op, Input) and n.op.role.value == "weight"
             and n.op.name.startswith("layers.") and len(n.shape) > 1]
    split = frozenset(n.id for n in layer[::2])
    small = min(int(np.prod(n.shape)) * n.dtype.itemsize for n in layer) // 4
    budget = cfg.weight_bytes() // 4
    plain = partition(step, PartitionOptions(budget // 8))
    tg = partition(step, PartitionOptions(budget // 8, split_weights=split, split_bytes=small))
    cut = [b for b in tg.blocks if b.role == "weight" and b.node in split]
    assert cut and max(b.bytes for b in cut) <= small and len(tg.tasks) > len(plain.tasks)
    mg = lower(tg, memory_aware_order(tg), LowerOptions(budget, get_policy("reuse-distance")))
    validate(mg)
    assert mg.count("reload") > 0  # it streams
    rng = np.random.default_rng(1)
    store = KVStore(cfg, 2, 8)
    for array in store.arrays.values():
        array[:] = rng.standard_normal(array.shape).astype(array.dtype)
    store.pos = np.array([3, 6])
    inputs = {"tokens": np.array([[5], [7]]), "pos": store.pos.copy(), **store.view(8)}
    want = dense_runner(weights)(step, inputs)["logits"]
    got = executor.run(mg, inputs, weights, order=order)["logits"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=F32_ATOL)
