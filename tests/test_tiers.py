"""The disk tier (compiler/tiers.py, runtime/diskread.py): a host budget small enough that some
weight blocks are read from the checkpoint files every pass. The plan is validated like the
device arena (and the validator is shown rejecting broken disk plans), runs in random
topological orders, on the threads backend and on the CuPy stand-in, and gives the logits of the
unconstrained run."""
from __future__ import annotations

import dataclasses
import json

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from einpage.compiler import CompileOptions, compile_graph
from einpage.ir import validate
from einpage.compiler.tiers import (STAGING_BLOCKS, choose_pinned, host_needs, place_tiers,
                                    with_disk_tier)
from einpage.errors import BudgetError, PlanError
from einpage.ir.dtypes import DType
from einpage.ir.memgraph import HOST_ALIGNMENT, InputNode, MemGraph, ReadNode, ReloadNode
from einpage.ir.ops import GatherOp
from einpage.models import llama, resolve
from einpage.predict import get_device, simulate, with_overrides
from einpage.runtime import executor
from einpage.ir.tensors import FileTensor
from einpage.runtime.diskread import DiskReader, block_runs
from einpage.runtime.planio import PlanIO
from einpage.runtime.stream_executor import run_streams
from einpage.runtime.streams import check_program, compile_streams

from test_cli import assert_one_line_error, cli

H100 = get_device("h100-pcie")


# ------------------------------------------------------------------ a tiered plan of a fixture
@pytest.fixture(scope="module")
def tiny(request):
    from conftest import FIXTURES
    path = FIXTURES / "tiny-llama-f32"
    if not (path / "model.safetensors").exists():
        pytest.skip(f"Hugging Face fixture {path} not found")
    cfg, weights = resolve(str(path))
    ids = np.load(path / "input_ids.npy")
    graph = llama.prefill_graph(cfg).bind(B=ids.shape[0], S=ids.shape[1])
    base = CompileOptions(cfg.weight_bytes() // 4)
    free = compile_graph(graph, base)
    needs = host_needs(free.memgraph)
    largest = max(free.memgraph.tensors[t].bytes for t in needs.streamed)
    host = needs.fixed_bytes + STAGING_BLOCKS[0] * -(-largest // HOST_ALIGNMENT) * HOST_ALIGNMENT \
        + needs.streamed_bytes // 3
    tiered = compile_graph(graph, dataclasses.replace(base, host_bytes=host))
    want = executor.run(free.memgraph, {"tokens": ids}, weights)["logits"]
    return dict(cfg=cfg, weights=weights, ids=ids, graph=graph, free=free, tiered=tiered,
                host=host, want=want, path=path)


def test_some_weights_come_from_disk_within_the_host_budget(tiny):
    mg = tiny["tiered"].memgraph
    report = validate(mg)
    assert report.reads > 0 and report.read_bytes > 0
    assert mg.host_arena_bytes > 0 and mg.host_arena_peak() <= mg.host_arena_bytes
    meta = mg.meta
    assert meta["host_bytes"] == tiny["host"]
    assert meta["host_peak_bytes"] <= tiny["host"]
    assert meta["disk_weight_bytes"] > 0 and meta["pinned_bytes"] > 0
    sim = tiny["tiered"].simulation
    assert sim.disk_bytes == report.read_bytes >= sim.disk_min_bytes > 0
    assert sim.disk_s > 0
    at_disk = {n.tensor for n in mg.nodes if isinstance(n, InputNode) and n.at == "disk"}
    assert at_disk == {n.tensor for n in mg.nodes if isinstance(n, ReadNode)}
    # the device side of the plan is the unconstrained plan's
    free = tiny["free"].memgraph
    assert [n.kind for n in mg.nodes if n.kind != "read"] == [n.kind for n in free.nodes]
    assert mg.device_bytes == free.device_bytes


def test_tiered_logits_equal_the_unconstrained_run(tiny):
    mg, ids, weights, want = tiny["tiered"].memgraph, tiny["ids"], tiny["weights"], tiny["want"]
    assert np.array_equal(executor.run(mg, {"tokens": ids}, weights)["logits"], want)
    for seed in range(3):
        got = executor.run(mg, {"tokens": ids}, weights, order=seed)["logits"]
        assert np.array_equal(got, want), seed


def test_the_room_is_climbed_again_by_the_tiered_pass(monkeypatch):
    """Where the host budget sends blocks to disk and the disk binds, the compiler climbs the
    room again weighing each resident set by its tiered pass (`tier_room.climb_tiered`), beside
    the activation peak of a pass that writes its outputs back: more stays on the device, less
    is read from disk. A small llama with as many KV heads as heads (the KV rows its prefill
    writes a quarter of its weights) at half its weights, with a host for half of what streams:
    faster than the device search's set tiered, valid, and giving the unconstrained plan's
    logits in random orders."""
    from einpage.compiler import driver, rooms
    from einpage.models import config
    from einpage.models.checkpoint import RandomWeights
    # (the last plan tiered by size too gains more on the device search's set: another step)
    monkeypatch.setattr(driver, "by_size_tiers", lambda mg, sim, tiered, *a: tiered)
    cfg = dataclasses.replace(config.preset("small"), kv_heads=8)
    graph = llama.prefill_graph(cfg).bind(B=1, S=128)
    base = CompileOptions(cfg.weight_bytes() // 2)
    free = compile_graph(graph, base)
    needs = host_needs(free.memgraph)
    largest = max(free.memgraph.tensors[t].bytes for t in needs.streamed)
    options = dataclasses.replace(base, host_bytes=needs.fixed_bytes + 2 * largest
                                  + needs.streamed_bytes // 2)
    climbed = compile_graph(graph, options)
    monkeypatch.setattr(rooms, "climb_tiered", lambda trials, best, tiered, *rest: (tiered, best))
    device_only = compile_graph(graph, options)
    assert climbed.simulation.makespan_s < 0.85 * device_only.simulation.makespan_s
    assert 0 < climbed.simulation.disk_bytes < device_only.simulation.disk_bytes
    assert climbed.memgraph.meta["resident_bytes"] > device_only.memgraph.meta["resident_bytes"]
    mg = climbed.memgraph
    assert validate(mg).read_bytes == climbed.simulation.disk_bytes
    weights = RandomWeights(cfg, 0)
    ids = np.random.default_rng(0).integers(0, cfg.vocab, (1, 128))
    want = executor.run(free.memgraph, {"tokens": ids}, weights)["logits"]
    for order in ("sequential", 3, 7):
        got = executor.run(mg, {"tokens": ids}, weights, order=order)["logits"]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"order {order}")


def test_threads_backend_reads_the_safetensors_file(tiny):
    mg, ids, weights, want = tiny["tiered"].memgraph, tiny["ids"], tiny["weights"], tiny["want"]
    program = compile_streams(mg, preload=True)
    check_program(mg, program)
    assert program.report()["disk_nodes"] == mg.count("read") > 0
    from einpage.runtime.backends.inject import Delayed
    from einpage.runtime.backends.threads import ThreadsBackend
    for seed in range(2):  # random delays per queue: the edges are the only ordering
        run = run_streams(mg, {"tokens": ids}, weights,
                          backend=Delayed(ThreadsBackend(poison=True), seed, 2e-4))
        assert np.array_equal(run.outputs["logits"], want)
        assert run.measured.bytes("disk") == validate(mg).read_bytes
    run = run_streams(mg, {"tokens": ids}, weights,
                      backend=ThreadsBackend(poison=True, drop_cache=True))
    assert np.array_equal(run.outputs["logits"], want)


@pytest.fixture
def fake_cupy(monkeypatch, tmp_path_factory):
    from fake_cupy import installed
    yield from installed(monkeypatch, tmp_path_factory)


def test_cupy_stand_in_runs_the_disk_tier(tiny, fake_cupy):
    from einpage.runtime.backends.cuda import CupyBackend
    mg, ids, weights, want = tiny["tiered"].memgraph, tiny["ids"], tiny["weights"], tiny["want"]
    got = run_streams(mg, {"tokens": ids}, weights, backend=CupyBackend()).outputs["logits"]
    assert np.abs(got - want).max() < 1e-5


def test_json_round_trip_keeps_the_disk_tier(tiny, tmp_path):
    mg = tiny["tiered"].memgraph
    again = MemGraph.from_json(json.loads(json.dumps(mg.to_json())))
    def shape(g):
        return [(n.kind, n.deps, getattr(n, "tensor", None), getattr(n, "host_offset", None),
                 getattr(n, "at", None)) for n in g.nodes]
    assert shape(again) == shape(mg) and again.host_arena_bytes == mg.host_arena_bytes
    assert validate(again) == validate(mg)
    assert "read %t" in str(mg) and "host_arena_bytes=" in str(mg)


# ------------------------------------------------------------------ the validator rejects
def _reads(mg):
    return [n for n in mg.nodes if isinstance(n, ReadNode)]


def _with(mg, node, **changes):
    nodes = list(mg.nodes)
    nodes[node.id] = dataclasses.replace(node, **changes)
    return dataclasses.replace(mg, nodes=tuple(nodes))


def _rejects(mg, *fragments):
    with pytest.raises(PlanError) as info:
        validate(mg)
    for f in fragments:
        assert f in str(info.value), str(info.value)


def _reload_of(mg, read):
    return next(n for n in mg.nodes if isinstance(n, ReloadNode) and read.id in n.deps)


def test_rejects_a_reload_without_its_read_edge(tiny):
    mg = tiny["tiered"].memgraph
    r = _reads(mg)[0]
    reload = _reload_of(mg, r)
    _rejects(_with(mg, reload, deps=tuple(d for d in reload.deps if d != r.id)),
             "(reload)", "not an ancestor")


def test_rejects_a_missing_host_reuse_edge(tiny):
    mg = tiny["tiered"].memgraph
    reused = next(r for r in _reads(mg) if any(isinstance(mg.nodes[d], ReloadNode)
                                               for d in r.deps))
    _rejects(_with(mg, reused, deps=tuple(d for d in reused.deps
                                          if not isinstance(mg.nodes[d], ReloadNode))),
             "(read)", "host-reuse edge")


def test_rejects_overlapping_live_staging_buffers(tiny):
    mg = tiny["tiered"].memgraph
    reads = _reads(mg)
    first, second = reads[0], reads[1]
    assert first.host_offset != second.host_offset
    moved = _with(mg, second, host_offset=first.host_offset)
    with pytest.raises(PlanError) as info:
        validate(moved)
    assert "(read)" in str(info.value) or "(reload)" in str(info.value)


def test_rejects_misplaced_staging_buffers(tiny):
    mg = tiny["tiered"].memgraph
    r = _reads(mg)[0]
    _rejects(_with(mg, r, host_offset=r.host_offset + 256), "not aligned")
    _rejects(_with(mg, r, host_offset=mg.host_arena_bytes), "outside the host arena")
    reload = _reload_of(mg, r)
    _rejects(_with(mg, reload, host_offset=r.host_offset + HOST_ALIGNMENT), "(reload)",
             "staging buffer")
    _rejects(_with(mg, reload, host_offset=None), "no host copy", "at disk")


def test_rejects_a_read_of_a_tensor_not_at_disk(tiny):
    mg = tiny["tiered"].memgraph
    r = _reads(mg)[0]
    inp = next(n for n in mg.nodes if isinstance(n, InputNode) and n.tensor == r.tensor)
    _rejects(_with(mg, inp, at="host"), "(read)", "no input of it at disk")


def test_rejects_a_read_nothing_consumes(tiny):
    mg = tiny["tiered"].memgraph
    r = _reads(mg)[-1]
    reload = _reload_of(mg, r)
    nodes = list(mg.nodes)
    nodes[reload.id] = dataclasses.replace(reload, host_offset=None,
                                           deps=tuple(d for d in reload.deps if d != r.id))
    inp = next(n for n in mg.nodes if isinstance(n, InputNode) and n.tensor == r.tensor)
    broken = dataclasses.replace(mg, nodes=tuple(nodes))
    # the reload now reads a host copy: give it one, so only the unconsumed read is wrong
    broken = _with(broken, inp, at="disk")
    with pytest.raises(PlanError):
        validate(broken)


# ------------------------------------------------------------------ the choice
def test_unlimited_or_ample_host_memory_changes_nothing(tiny):
    free = tiny["free"]
    same = place_tiers(free.memgraph, free.simulation, None, H100)
    assert same.memgraph is free.memgraph
    needs = host_needs(free.memgraph)
    ample = place_tiers(free.memgraph, free.simulation, needs.fixed_bytes + needs.streamed_bytes,
                        H100)
    assert ample.memgraph is free.memgraph and ample.choice.disk_bytes == 0


def test_a_host_budget_too_small_names_the_one_that_works(tiny):
    free = tiny["free"]
    needs = host_needs(free.memgraph)
    with pytest.raises(BudgetError) as info:
        place_tiers(free.memgraph, free.simulation, needs.fixed_bytes, H100)
    smallest = info.value.needed
    assert "smallest host budget that would work" in str(info.value)
    place_tiers(free.memgraph, free.simulation, smallest, H100)  # and it does work


def test_staging_sizes_stop_past_the_best(tiny, monkeypatch):
    """`place_tiers` tries the staging sizes smallest first and stops at the first slower than
    the best so far (every larger one takes more bytes from the pinned set)."""
    from einpage.compiler import tiers
    free = tiny["free"]
    needs = host_needs(free.memgraph)
    largest = max(free.memgraph.tensors[t].bytes for t in needs.streamed)
    host = needs.fixed_bytes + STAGING_BLOCKS[-1] * -(-largest // HOST_ALIGNMENT) \
        * HOST_ALIGNMENT + needs.streamed_bytes // 4
    makespans = iter((3.0, 2.0, 2.5, 1.0, 0.5))
    tried = []

    def simulate_(mg, profile, *_, **__):
        tried.append(mg.host_arena_bytes)
        return dataclasses.replace(free.simulation, makespan_s=next(makespans))

    monkeypatch.setattr(tiers, "simulate", simulate_)
    chosen = place_tiers(free.memgraph, free.simulation, host, H100)
    assert len(tried) == 3 and chosen.choice.staging_bytes == tried[1]
    assert chosen.simulation.makespan_s == 2.0


def test_a_staging_size_whose_disk_alone_is_slower_is_not_tiered(tiny, monkeypatch):
    """`place_tiers` stops before tiering a staging size whose disk reads alone (each block
    read once, one at a time) take longer than the best plan so far: its choice is the best of
    every size tiered and simulated, with fewer tierings. On a slow disk every larger arena
    reads more and loses."""
    from einpage.compiler import tiers
    from einpage.compiler.tiers import tiered_seconds, with_disk_tier
    from einpage.predict.simulator import node_seconds
    free = tiny["free"]
    mg, needs = free.memgraph, host_needs(free.memgraph)
    sizes = {t: -(-mg.tensors[t].bytes // HOST_ALIGNMENT) * HOST_ALIGNMENT
             for t in needs.streamed}
    largest = max(sizes.values())
    host = needs.fixed_bytes + STAGING_BLOCKS[-1] * largest + needs.streamed_bytes // 4
    slow = with_overrides(H100, disk_bandwidth=1e6)
    tiered = []
    monkeypatch.setattr(tiers, "with_disk_tier",
                        lambda *a: tiered.append(a[2]) or with_disk_tier(*a))
    chosen = place_tiers(mg, free.simulation, host, slow)
    every = []  # each size tiered and simulated, as `place_tiers` weighs it
    for arena in (k * largest for k in STAGING_BLOCKS):
        capacity = host - needs.fixed_bytes - arena
        if capacity < 0 or arena >= needs.streamed_bytes:
            break
        disk = frozenset(needs.streamed) - choose_pinned(needs, sizes.__getitem__, capacity)
        plan = with_disk_tier(mg, disk, arena)
        sim = simulate(plan, slow, tiered_seconds(plan, node_seconds(mg, slow), slow))
        every.append(((sim.makespan_s, sim.disk_bytes), arena))
    assert len(every) >= 2 and chosen.choice.staging_bytes == min(every)[1]
    # the best first: the next size, slower by its disk alone, is not tiered
    assert min(every) == every[0] and tiered == [every[0][1]]


def test_a_tiering_keeps_its_plans_node_seconds(tiny):
    """`tiered_seconds` gives every node of a tiering the seconds `node_seconds` prices it at:
    the plan's nodes theirs, the reads the disk's (`place_tiers` prices each plan once and
    simulates every staging size it tries with them)."""
    from einpage.compiler.tiers import tiered_seconds, with_disk_tier
    from einpage.predict.simulator import node_seconds
    mg = tiny["free"].memgraph
    needs = host_needs(mg)
    largest = max(mg.tensors[t].bytes for t in needs.streamed)
    tiered = with_disk_tier(mg, frozenset(needs.streamed[::2]), 4 * largest)
    assert sum(n.kind == "read" for n in tiered.nodes) > 0
    assert tiered_seconds(tiered, node_seconds(mg, H100), H100) == node_seconds(tiered, H100)


def test_the_disk_weighs_the_partitions_apart_from_the_device():
    """llama-7b prefill at 4 GB with an 8 GB host: the halved partition wins on the device, but
    its 90 MB weight blocks need 172 MB of staging and read 3.21 GB from disk (1083 ms); tiered
    and climbed, the same partition with its weights capped at 14 MB blocks reads 2.89 GB
    (998 ms), and wins (`rooms.climb_tiers`)."""
    cfg, _ = resolve("llama-7b", random_weights=True)
    graph = llama.prefill_graph(cfg).bind(B=1, S=2048)
    compiled = compile_graph(graph, CompileOptions(4 * 10**9, host_bytes=8 * 10**9,
                                                   validate=False))
    meta = compiled.memgraph.meta
    assert meta["staging_bytes"] < 50 << 20 and meta["disk_weight_bytes"] < 2.95e9
    assert compiled.simulation.makespan_s < 1.01


def test_a_decode_steps_ladder_is_weighed_by_the_disk_and_continued_finer():
    """llama-7b decode B=8 (2048 rows past, a store of 2304) at 8 GB with a 14 GB host, host
    compute on: a placement of its applies on the host wins on the device, and tiered it runs
    652 ms; the device-only plans are climbed by the tiered pass instead
    (`driver._climb_device`). There the ladder's winner on the device (1 GB working sets) reads
    2.23 GB from disk a step, 752 ms; its 66 MB rung, a loser on the device, 1.37 GB and 462 ms
    (the ladder's rungs are rivals for `rooms.climb_tiers`); and the ladder continued on the
    tiered pass past the device's finest rung (`driver._finer_tiered`), 33 MB 425 ms, 16 MB
    417 ms: where the disk binds, the room for blocks in flight and the staging are bytes read
    from disk."""
    from einpage.models.generation import decode_step_graph
    cfg, _ = resolve("llama-7b", random_weights=True)
    compiled = compile_graph(decode_step_graph(cfg, 8, 2304),
                             CompileOptions(8 * 10**9, host_bytes=14 * 10**9, validate=False,
                                            host_compute=True))
    assert compiled.simulation.makespan_s < 0.42
    # no placement: the host gathers the step's embedding rows alone (`compiler.host_gather`)
    assert all(isinstance(n.op, GatherOp) for n in compiled.memgraph.nodes
               if n.kind == "apply" and n.on_host)
    assert compiled.memgraph.meta["disk_weight_bytes"] < 1.25e9
    assert compiled.report.compiled.tasks > 4000  # the device's ladder planned 1499 at most


def test_the_disk_climbs_resident_sets_that_keep_weights_before_the_kv_store(monkeypatch):
    """llama-7b decode B=16 over 2048 rows at 16 GB with a 20 GB host: the host keeps the whole
    KV store, so where the disk binds a resident KV block saves link bytes only and a resident
    weight a disk read too; the tiered climb (`rooms.climb_tier`) climbs resident sets that keep
    weights first (`resident.weights_first_at`): 298.2 ms, where climbing the paced sets the
    device search climbs runs slower."""
    from einpage.compiler import resident, rooms
    from einpage.models.generation import decode_step_graph
    cfg, _ = resolve("llama-7b", random_weights=True)
    graph = decode_step_graph(cfg, 16, 2048)
    options = CompileOptions(16 * 10**9, host_bytes=20 * 10**9, validate=False)
    first = compile_graph(graph, options).simulation.makespan_s
    monkeypatch.setattr(rooms, "weights_first_at", resident.paced_at)
    assert first < 0.300 and first < 0.99 * compile_graph(graph, options).simulation.makespan_s


def test_disk_bandwidth_prices_the_reads(tiny):
    mg = tiny["tiered"].memgraph
    slow = simulate(mg, with_overrides(H100, disk_bandwidth=1e6))
    fast = simulate(mg, with_overrides(H100, disk_bandwidth=1e12))
    assert slow.makespan_s > fast.makespan_s
    from einpage.predict.simulator import min_h2d_copies
    link = slow.h2d_min_bytes / H100.h2d_bandwidth + min_h2d_copies(mg) * H100.copy_latency
    assert slow.lower_bound_s == pytest.approx(max(slow.compute_s, link,
                                                   slow.d2h_bytes / H100.d2h_bandwidth,
                                                   slow.disk_min_bytes / 1e6))
    assert slow.makespan_s >= slow.disk_min_bytes / 1e6


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 50), st.integers(1, 3)), min_size=1, max_size=30),
       st.floats(0, 1.2), st.booleans())
def test_pinned_blocks_fit_and_favour_blocks_read_twice(blocks, share, by_size):
    sizes = {t: b * HOST_ALIGNMENT for t, (b, _) in enumerate(blocks)}
    reloads = {t: r for t, (_, r) in enumerate(blocks)}

    class Needs:
        streamed = tuple(sizes)
    Needs.reloads = reloads
    capacity = int(sum(sizes.values()) * share)
    pinned = choose_pinned(Needs, sizes.__getitem__, capacity, by_size)
    assert sum(sizes[t] for t in pinned) <= capacity
    left = capacity - sum(sizes[t] for t in pinned)
    assert all(sizes[t] > left for t in sizes if t not in pinned)  # nothing more fits


@pytest.mark.parametrize("share", [0.5, 0.75])
def test_pinned_by_size_reads_the_same_bytes_in_fewer_blocks(share):
    """Blocks of 1 and 3 units in turn, read once each: pinned by size, the disk reads the
    large ones (fewer reads for at least the bytes the budget leaves out), spread along the
    pass (some in its first half)."""
    sizes = {t: (3 if t % 2 else 1) * HOST_ALIGNMENT for t in range(48)}

    class Needs:
        streamed = tuple(sizes)
        reloads = dict.fromkeys(sizes, 1)
    capacity = int(sum(sizes.values()) * share)
    disk = {}
    for by_size in (False, True):
        pinned = choose_pinned(Needs, sizes.__getitem__, capacity, by_size)
        assert sum(sizes[t] for t in pinned) <= capacity
        disk[by_size] = [t for t in sizes if t not in pinned]
    assert len(disk[True]) < len(disk[False])
    assert min(disk[True]) < len(sizes) // 2


def test_the_last_plan_is_tiered_by_size_where_that_is_faster(tiny):
    """`by_size_tiers`: the faster of the tiering given and the one pinned by size; a plan
    that reads nothing from disk is left as it is."""
    from einpage.compiler.tiers import by_size_tiers
    from einpage.predict.devices import get_device
    free, host = tiny["free"], tiny["host"]
    profile = get_device("h100-pcie")
    given = place_tiers(free.memgraph, free.simulation, host, profile)
    assert given.choice.disk_bytes
    other = place_tiers(free.memgraph, free.simulation, host, profile, by_size=True)
    kept = by_size_tiers(free.memgraph, free.simulation, given, host, profile)
    assert kept.simulation.makespan_s == min(given.simulation.makespan_s,
                                             other.simulation.makespan_s)
    whole = place_tiers(free.memgraph, free.simulation, None, profile)
    assert by_size_tiers(free.memgraph, free.simulation, whole, None, profile) is whole


def test_renumbered_nodes_equal_their_replace(tiny):
    """`memgraph.renumbered` (the disk tier's fast renumbering) gives what `replace` gives, for
    every kind of node of a tiered plan (reads, reloads from staging, inputs at disk) and a
    changed field."""
    from einpage.ir.memgraph import renumbered
    mg = tiny["tiered"].memgraph
    assert {n.kind for n in mg.nodes} >= {"input", "read", "reload", "apply", "free"}
    for n in mg.nodes:
        deps = (*n.deps, len(mg.nodes))
        assert renumbered(n, n.id + 1, deps) == dataclasses.replace(n, id=n.id + 1, deps=deps)
        if n.kind == "input":
            assert renumbered(n, 0, (), at="disk") == dataclasses.replace(n, id=0, deps=(),
                                                                          at="disk")


def test_staging_buffers_form_a_ring_with_reuse_edges(tiny):
    free = tiny["free"].memgraph
    needs = host_needs(free)
    disk = frozenset(needs.streamed)
    largest = max(-(-free.tensors[t].bytes // HOST_ALIGNMENT) * HOST_ALIGNMENT for t in disk)
    for blocks in (1, 2, 3):
        mg = with_disk_tier(free, disk, blocks * largest)
        validate(mg)
        assert mg.host_arena_peak() <= blocks * largest
        got = executor.run(mg, {"tokens": tiny["ids"]}, tiny["weights"], order=blocks)["logits"]
        assert np.array_equal(got, tiny["want"])


# ------------------------------------------------------------------ reading blocks from files
@settings(max_examples=40, deadline=None)
@given(st.data())
def test_block_runs_cover_the_box(data):
    full = tuple(data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=4)))
    origin = tuple(data.draw(st.integers(0, f - 1)) for f in full)
    shape = tuple(data.draw(st.integers(1, f - o)) for f, o in zip(full, origin))
    whole = np.arange(int(np.prod(full)), dtype=np.int32).reshape(full)
    starts, run = block_runs(full, origin, shape, 4)
    raw = whole.reshape(-1).view(np.uint8)
    got = np.concatenate([raw[s:s + run] for s in starts]).view(np.int32).reshape(shape)
    want = whole[tuple(slice(o, o + n) for o, n in zip(origin, shape))]
    assert np.array_equal(got, want)


@pytest.mark.parametrize("file_dtype", ["f32", "bf16"])
def test_disk_reader_reads_blocks_of_a_file(tmp_path, file_dtype):
    from checkpoints import write_safetensors
    from einpage.models.checkpoint import read_safetensors_header
    rng = np.random.default_rng(1)
    w = rng.standard_normal((64, 48)).astype(np.float32)
    write_safetensors(tmp_path / "w.safetensors", {"pad": np.ones(3, np.float32), "w": w},
                      file_dtype)
    ref = read_safetensors_header(tmp_path / "w.safetensors")["w"]
    stored = w if file_dtype == "f32" else w.astype(ml_dtypes.bfloat16).astype(np.float32)

    class Source:
        def __call__(self, name):
            return stored

        def locate(self, name):
            return FileTensor(ref.file, ref.offset, ref.dtype, (64, 48))

    from einpage.ir.memgraph import TensorInfo
    from einpage.ir.tensors import Source as Src
    boxes = [((0, 0), (64, 48)), ((16, 0), (16, 48)), ((0, 24), (64, 24)), ((5, 7), (9, 30))]
    tensors = tuple(TensorInfo(k, int(np.prod(s)) * 4, DType.f32, s, "w", "weight",
                               Src("w", o, (64, 48), "w")) for k, (o, s) in enumerate(boxes))
    mg = MemGraph(1 << 20, tensors, (), ())
    reader = DiskReader(PlanIO(mg, {}, Source()), drop_cache=True)
    try:
        for k, (o, s) in enumerate(boxes):
            out = np.empty(s, np.float32)
            reader.read(k, out)
            assert np.array_equal(out, stored[o[0]:o[0] + s[0], o[1]:o[1] + s[1]]), (o, s)
        assert reader.bytes_read > 0
    finally:
        reader.close()


# ------------------------------------------------------------------ the command line
def test_compile_reports_the_tiers(capsys):
    assert cli("compile", "llama-7b", "--gpu-mem", "8GB", "--cpu-mem", "4GB", "--json") == 0
    d = json.loads(capsys.readouterr().out)
    assert d["host_bytes"] == 4 * 10**9 and 0 < d["host_peak_bytes"] <= 4 * 10**9
    assert d["disk_read_bytes"] > 0 and d["disk_s"] > 0
    assert d["plan_lower_bound_s"] >= d["disk_read_bytes"] / 3e9 - 1e-9
    assert cli("compile", "llama-7b", "--gpu-mem", "8GB", "--cpu-mem", "4GB",
               "--disk-bandwidth", "7GB/s", "--json") == 0
    fast = json.loads(capsys.readouterr().out)
    assert fast["disk_s"] < d["disk_s"] and fast["makespan_s"] <= d["makespan_s"]
    assert cli("compile", "llama-7b", "--gpu-mem", "8GB", "--cpu-mem", "unlimited",
               "--json") == 0
    none = json.loads(capsys.readouterr().out)
    assert none["disk_read_bytes"] == 0 and none["host_bytes"] is None


def test_compile_host_budget_too_small(capsys):
    code = cli("compile", "llama-7b", "--gpu-mem", "8GB", "--cpu-mem", "1GB")
    assert_one_line_error(capsys, code, "smallest host budget that would work")


def test_run_with_a_host_budget_gives_the_same_logits(capsys, tmp_path, tiny):
    out_free, out_tier = tmp_path / "free.npy", tmp_path / "tier.npy"
    budget = str(tiny["cfg"].weight_bytes() // 4)
    common = ("run", str(tiny["path"]), "--tokens-file", str(tiny["path"] / "input_ids.npy"),
              "--gpu-mem", budget, "--backend", "threads")
    assert cli(*common, "--cpu-mem", "unlimited", "--out", str(out_free)) == 0
    assert cli(*common, "--cpu-mem", str(tiny["host"]), "--out", str(out_tier)) == 0
    capsys.readouterr()
    assert np.array_equal(np.load(out_free), np.load(out_tier))


def test_default_host_budget_is_available_memory_less_a_margin(monkeypatch):
    import argparse

    from einpage.cli import common
    args = argparse.Namespace(cpu_mem=None)
    monkeypatch.delenv("EINPAGE_CPU_MEM", raising=False)
    monkeypatch.setattr(common, "available_host_memory", lambda: 10 * 10**9)
    budget, source = common.host_budget(args)
    assert budget == 8 * 10**9 and "available memory 10.00 GB less 2.00 GB" in source
    monkeypatch.setattr(common, "available_host_memory", lambda: 100 * 10**9)
    assert common.host_budget(args)[0] == 90 * 10**9
    monkeypatch.setenv("EINPAGE_CPU_MEM", "12GB")
    assert common.host_budget(args) == (12 * 10**9, "EINPAGE_CPU_MEM")
    assert common.host_budget(argparse.Namespace(cpu_mem="unlimited"))[0] is None
