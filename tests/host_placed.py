"""What the tests of applies placed on the host share: a decode step of a tiny model, its KV
store (or its experts) kept on the host and the plan that places the tasks reading it there."""
from __future__ import annotations

import numpy as np

from einpage.compiler.lower_options import LowerOptions
from einpage.compiler.lowering import lower
from einpage.compiler.order import memory_aware_order
from einpage.compiler.partitioner import PartitionOptions, partition
from einpage.compiler.placement import host_blocks, place_on_host
from einpage.compiler.policies import get_policy
from einpage.models import llama, resolve
from einpage.runtime import reference

MIXTRAL = "tiny-mixtral"


def decode_step(model: str, hf_fixture=None, batch: int = 2, capacity: int = 64):
    if hf_fixture is not None:
        cfg, weights = resolve(str(hf_fixture(model)))
    else:
        cfg, weights = resolve(model, random_weights=True, seed=1)
    graph = llama.decode_graph(cfg).bind(B=batch, C=capacity)
    rng = np.random.default_rng(0)
    inputs = {"tokens": rng.integers(0, cfg.vocab, (batch, 1)),
              "pos": rng.integers(1, capacity - 1, batch)}
    return cfg, weights, graph, inputs


def placed_plan(cfg, graph, kind: str, share: int = 3):
    budget = cfg.weight_bytes() // share
    tg = partition(graph, PartitionOptions(budget // 8))
    order = memory_aware_order(tg)
    kept = host_blocks(tg, kind)
    on_host = place_on_host(tg, order, kept)
    mg = lower(tg, order, LowerOptions(budget, get_policy("reuse-distance"),
                                       outputs_to_host=True, on_host=on_host))
    return tg, kept, on_host, mg


def inputs_for(mg, inputs):
    rng = np.random.default_rng(7)
    out = dict(inputs)
    for t in mg.inputs:
        if t.role == "cache":
            out[t.name] = rng.standard_normal(t.shape).astype(t.dtype.numpy)
    return out


def assert_close(got, want):
    assert set(got) == set(want)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], atol=1e-4, rtol=1e-5, err_msg=key)


def placed_llama():
    """The tiny llama's decode step with its KV store on the host: (graph, weights, inputs,
    taskgraph, kept blocks, tasks on the host, plan, the reference's outputs)."""
    cfg, weights, graph, inputs = decode_step("tiny")
    tg, kept, on_host, mg = placed_plan(cfg, graph, "kv")
    inputs = inputs_for(mg, inputs)
    return graph, weights, inputs, tg, kept, on_host, mg, reference.evaluate(graph, inputs,
                                                                            weights)
