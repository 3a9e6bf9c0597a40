"""Speculative decoding measured on this machine (issue "Many tokens per streamed pass"): decode
tokens/s with and without drafts, on the threads backend, under a budget that streams.

    python bench/spec_bench.py [--layers 2] [--new 25] [--repeats 3] [--json out.json]

Rows:
- `llama-7b` shapes (every layer's and the vocabulary's), `--layers` of them, random weights,
  f16, a budget of 1/4 of the weights (every pass streams most of them): plain decoding against
  the model as its own draft (it proposes the model's own greedy continuation, so every proposal
  is accepted: the mechanism's ceiling) for k = 1, 2, 4;
- the `tiny-llama-f32` fixture at 1/4 of its weights, `--draft ngram` (prompt lookup) on its
  greedy prompt, k = 2, 4: the acceptance and speedup a real draft gets on text that repeats.

Each figure is the median of `--repeats` runs after one warm-up run (plans compiled, kernels and
host copies warm); decode seconds exclude the prefill. Tokens per pass = tokens each row got
from one pass of the model.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).absolute().parent
sys.path.insert(0, str(HERE.parent))

from einpage.compiler import CompileOptions  # noqa: E402
from einpage.models import resolve  # noqa: E402
from einpage.models.checkpoint import RandomWeights  # noqa: E402
from einpage.models.generation import generate  # noqa: E402
from einpage.models.speculative import NgramDraft, RowDraft  # noqa: E402
from einpage.runners import PlanRunner  # noqa: E402

FIXTURE = HERE.parent / "tests" / "fixtures" / "tiny-llama-f32"


class OwnDraft(RowDraft):
    """The model as its own draft: its greedy continuation, known from a plain run."""
    name = "self"

    def __init__(self, prompt_len: int, future: list[int], tokens: int):
        self.start, self.future, self.tokens = prompt_len, future, tokens

    def propose(self, history):
        at = len(history) - self.start
        ahead = self.future[at:at + self.tokens]
        return ahead + [0] * (self.tokens - len(ahead))


def timed(cfg, prompt, new, runner, repeats, draft=None):
    """(median decode seconds, the last run) over `repeats` runs after a warm-up."""
    runs = [generate(cfg, prompt, new, runner, draft=draft) for _ in range(repeats + 1)]
    return statistics.median(r.decode_s for r in runs[1:]), runs[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--new", type=int, default=25)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []

    base, _ = resolve("llama-7b")
    cfg = dataclasses.replace(base, layers=args.layers)
    weights = RandomWeights(cfg, seed=0)
    runner = PlanRunner(weights, CompileOptions(cfg.weight_bytes() // 4), "threads")
    prompt = np.random.default_rng(0).integers(0, cfg.vocab, (1, 32))
    plain_s, plain = timed(cfg, prompt, args.new, runner, args.repeats)
    decoded = args.new - 1
    name = f"llama-7b shapes, {args.layers} layers, random f16, 1/4 of the weights"
    rows.append({"case": name, "draft": "none", "k": 0, "decode_s": plain_s,
                 "tokens_per_s": decoded / plain_s, "speedup": 1.0, "tokens_per_pass": 1.0,
                 "acceptance": None, "passes": decoded})
    future = plain.tokens[0].tolist()
    for k in (1, 2, 4):
        spent, got = timed(cfg, prompt, args.new, runner, args.repeats,
                           OwnDraft(prompt.shape[1], future, k))
        assert np.array_equal(got.tokens, plain.tokens), "a draft changed the tokens"
        s = got.speculation
        rows.append({"case": name, "draft": "self", "k": k, "decode_s": spent,
                     "tokens_per_s": decoded / spent, "speedup": plain_s / spent,
                     "tokens_per_pass": s.tokens_per_pass, "acceptance": s.acceptance,
                     "passes": s.passes})

    cfg, weights = resolve(str(FIXTURE))
    runner = PlanRunner(weights, CompileOptions(cfg.weight_bytes() // 4), "threads")
    prompt = np.load(FIXTURE / "greedy_prompt.npy")
    new = 48
    plain_s, plain = timed(cfg, prompt, new, runner, args.repeats)
    name = "tiny-llama-f32 fixture, 1/4 of the weights"
    rows.append({"case": name, "draft": "none", "k": 0, "decode_s": plain_s,
                 "tokens_per_s": (new - 1) * prompt.shape[0] / plain_s, "speedup": 1.0,
                 "tokens_per_pass": 1.0, "acceptance": None, "passes": new - 1})
    for k in (2, 4):
        spent, got = timed(cfg, prompt, new, runner, args.repeats, NgramDraft(k))
        assert np.array_equal(got.tokens, plain.tokens), "a draft changed the tokens"
        s = got.speculation
        rows.append({"case": name, "draft": "ngram", "k": k, "decode_s": spent,
                     "tokens_per_s": (new - 1) * prompt.shape[0] / spent,
                     "speedup": plain_s / spent, "tokens_per_pass": s.tokens_per_pass,
                     "acceptance": s.acceptance, "passes": s.passes})

    print(f"# {platform.platform()}, {platform.python_version()}, "
          f"{time.strftime('%Y-%m-%d')}; median of {args.repeats} after a warm-up")
    print("| case | draft | k | decode s | tokens/s | speedup | tokens per pass | acceptance "
          "| passes |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
        print(f"| {r['case']} | {r['draft']} | {r['k']} | {r['decode_s']:.3f} | "
              f"{r['tokens_per_s']:.2f} | {r['speedup']:.2f}x | {r['tokens_per_pass']:.2f} | "
              f"{acc} | {r['passes']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
