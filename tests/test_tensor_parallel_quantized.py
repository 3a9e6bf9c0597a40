"""Tensor parallelism of weights kept in a block format (`einpage.ir.storage`): each rank reads
its slice of a packed weight in the packed bytes (a cut before the rows, or of the rows' first
axis at whole groups), the split is refused in one line where the rows cannot be cut at whole
groups, and the ranks together give llama.cpp's logits and greedy tokens on its own GGUF files
(the like-for-like truth of `test_llamacpp_truth`: llama.cpp on its dequantized weights)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from test_llamacpp_truth import ROOT, _load
from test_pipeline import SMALL, _tokens

from einpage.compiler import CompileOptions, compile_graph
from einpage.compiler.tensor_parallel import compile_tensor_parallel, shard_graph
from einpage.errors import PlanError
from einpage.ir.graph import Input
from einpage.ir.quant import dequantize, quantize
from einpage.ir.storage import Storage
from einpage.models import llama
from einpage.models.checkpoint import RandomWeights
from einpage.models.generation import greedy, prefill
from einpage.models.schema import quantized
from einpage.runners import RanksRunner
from einpage.runtime import run
from einpage.runtime.ranks import run_ranks
from einpage.runtime.planio import held_storage
from einpage.runtime.shards import ShardedWeights, rank_weights

pytestmark = pytest.mark.skipif(not (ROOT / "tiny-llama-f32").is_dir(),
                                reason="the llama.cpp fixtures are not in this checkout")


def _tp_runner(cfg, weights):
    return RanksRunner(weights, CompileOptions(cfg.weight_bytes() // 3), 2, parallel="tensor")


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
def test_two_ranks_on_a_gguf_file_give_llamacpps_logits(fmt):
    cfg, weights, facts = _load("tiny-llama-f32", fmt)
    tokens = np.array(facts["input_ids"])
    got = prefill(cfg, tokens, _tp_runner(cfg, weights))["logits"]
    want = np.load(ROOT / "tiny-llama-f32" / facts["dequant_references"][fmt]["logits_file"])
    assert np.abs(got - want).max() <= 2e-5 * max(float(np.abs(want).max()), 1.0)


def test_two_ranks_give_llamacpps_greedy_tokens_over_32_steps():
    cfg, weights, facts = _load("tiny-llama-f32", "q4_0")
    want = np.array(facts["dequant_references"]["q4_0"]["greedy"])
    got = greedy(cfg, np.array(facts["greedy_prompt"]), want.shape[1], _tp_runner(cfg, weights))
    np.testing.assert_array_equal(np.asarray(got)[:, -want.shape[1]:], want)


def test_a_rank_reads_its_packed_slice_in_the_packed_bytes():
    cfg, weights, _ = _load("tiny-llama-f32", "q8_0")
    graph = llama.prefill_graph(cfg).bind(B=1, S=4)
    tp = compile_tensor_parallel(graph, 2, CompileOptions(cfg.weight_bytes() // 4))
    packed = {n.op.name: n.op.storage for n in graph.nodes
              if isinstance(n.op, Input) and n.op.storage is not None}
    for mg in tp.programs:
        mine = rank_weights(weights, mg)
        shards = {k: v for k, v in mine.shards.items() if k in packed}
        assert {"layers.0.wq", "layers.0.wo", "layers.1.w_up", "lm_head"} <= set(shards)
        for name, (axis, start, stop) in shards.items():
            st = held_storage(mine, name)
            assert st == packed[name], name  # kept packed: no dequantized copy
            got = np.asarray(mine(name))
            assert got.dtype == np.uint8
            full = _shape(graph, name)
            logical = tuple(s // 2 if a == axis else s for a, s in enumerate(full))
            want = dequantize(np.asarray(weights(name)), st, full, np.float32)
            np.testing.assert_array_equal(
                dequantize(got, st, logical, np.float32),
                want[(slice(None),) * axis + (slice(start, stop),)])


def _shape(graph, name):
    return next(tuple(int(s) for s in n.shape) for n in graph.nodes
                if isinstance(n.op, Input) and n.op.name == name)


def test_quantized_while_read_the_ranks_compute_the_one_device_plan():
    """--quantize: the weights are held unpacked and quantized block by block as a plan reads
    them; a rank's blocks of its slice are the whole weight's blocks there (whole groups), so
    the ranks' logits are the one-device plan's to float32 summation noise."""
    cfg = quantized(replace(SMALL, intermediate=384), "q4_0")  # 192 columns a rank: 6 groups
    assert dict(cfg.formats)["layers.0.w_down"] == "q4_0"
    weights = RandomWeights(replace(cfg, formats=()), 1)
    graph = llama.prefill_graph(cfg).bind(B=1, S=12)
    inputs = {"tokens": _tokens()}
    one = run(compile_graph(graph, CompileOptions(cfg.weight_bytes() // 3)).memgraph, inputs,
              weights)
    tp = compile_tensor_parallel(graph, 2, CompileOptions(cfg.weight_bytes() // 6))
    for order in ("sequential", 3):
        got = run_ranks(tp.programs, inputs, weights, order=order)
        for name in one:
            np.testing.assert_allclose(got[name], one[name], rtol=1e-4,
                                       atol=1e-5 * float(np.abs(one[name]).max()))


def test_rows_that_do_not_split_at_whole_groups_are_refused_in_one_line():
    q4 = quantized(SMALL, "q4_0")  # FFN 352: 176 columns a rank, 5.5 groups of 32
    assert dict(q4.formats)["layers.0.w_down"] == "q4_0"
    with pytest.raises(PlanError, match=r"'layers.0.w_down' is kept in q4_0 rows of 352 "
                                        r"elements, which 2 devices cannot split at whole "
                                        r"groups of 32: use a pipeline") as e:
        shard_graph(llama.prefill_graph(q4).bind(B=1, S=4), 2)
    assert "\n" not in str(e.value)


def test_a_packed_slice_off_the_groups_is_handed_out_dequantized():
    """A source holding a weight packed whose rank slice cuts its groups (a plan that keeps the
    weight unpacked may split it anywhere): the slice comes dequantized and `storage` says so."""
    st = Storage("q8_0", 1)
    rng = np.random.default_rng(0)
    dense = rng.standard_normal((6, 64)).astype(np.float32)

    class Packed:
        def __call__(self, name):
            return quantize(dense, st)

        def storage(self, name):
            return st

    on = ShardedWeights(Packed(), {"w": (1, 16, 32)}, {"w": (6, 64)})
    assert on.storage("w") is None
    want = dequantize(quantize(dense, st), st, (6, 64), np.float32)[:, 16:32]
    np.testing.assert_array_equal(on("w"), want)
    whole = ShardedWeights(Packed(), {"w": (1, 32, 64)}, {"w": (6, 64)})
    assert whole.storage("w") == st and whole("w").shape == (6, 34)
    np.testing.assert_array_equal(dequantize(whole("w"), st, (6, 32), np.float32),
                                  dequantize(quantize(dense, st), st, (6, 64), np.float32)[:, 32:])


def test_a_q8_0_kv_store_split_by_kv_heads_gives_one_devices_tokens():
    """--kv-dtype q8_0: each rank reads and writes its kv heads' packed rows of the store (a
    cut before the packed head dimension), and generation on two ranks picks one device's
    tokens, rows of different lengths."""
    from einpage.ir.dtypes import DType
    from einpage.models import config
    from einpage.models.generation import generate
    from einpage.runners import PlanRunner
    cfg = replace(config.preset("small").with_dtype(DType.f32), head_dim=32, kv_format="q8_0")
    weights = RandomWeights(cfg, 1)
    prompt = (np.arange(2 * 7).reshape(2, 7) * 7 + 3) % cfg.vocab
    lengths = np.array([7, 1])
    options = CompileOptions(cfg.weight_bytes() // 3)
    one = generate(cfg, prompt, 6, PlanRunner(weights, options, "threads"), lengths=lengths,
                   ignore_eos=True)
    two = generate(cfg, prompt, 6, RanksRunner(weights, options, 2, parallel="tensor"),
                   lengths=lengths, ignore_eos=True)
    np.testing.assert_array_equal(two.tokens, one.tokens)
