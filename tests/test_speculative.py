"""Speculative decoding (issue "Many tokens per streamed pass"): the verify step
computes what that many decode steps compute; prompt-lookup drafts; greedy acceptance gives
plain decoding's tokens, token for token, on every family fixture,
paged and dense, rows of different lengths accepting different counts, sliding-window rings
that wrap; a perfect draft yields
k + 1 tokens per pass; the speculative sampling rule keeps the target's distribution (a
chi-square test that a wrong rule fails); the KV store takes the accepted rows only; the CLI
and its bad input."""
from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
from test_cli import assert_one_line_error, cli

from einpage.compiler import CompileOptions
from einpage.errors import InputError
from einpage.models import resolve
from einpage.models.generation import decode_step_graph, generate, pad_rows, prefill
from einpage.models.kvstore import KVStore
from einpage.models.speculative import NgramDraft, RowDraft, speculate, verify_step_graph
from einpage.runners import PlanRunner, dense_runner

FAMILIES = ["tiny-llama-f32", "tiny-llama-bf16", "tiny-llama31", "tiny-mistral", "tiny-qwen2",
            "tiny-qwen3", "tiny-mixtral"]


def _verify_against_steps(cfg, weights, capacity):
    """A verify step of 4 tokens against 4 decode steps, from the same prefill (rows of
    different lengths): logits, new rows, and the store after each wrote its rows."""
    run = dense_runner(weights)
    prompt, lengths = pad_rows([[5, 9, 2, 7, 7, 3, 1], [4, 4, 8]])
    out = prefill(cfg, prompt, run, lengths)
    one, many = KVStore(cfg, 2, capacity), KVStore(cfg, 2, capacity)
    one.fill(out, lengths)
    many.fill(out, lengths)
    c = one.capacity
    fed = np.random.default_rng(0).integers(0, cfg.vocab, (2, 4))
    steps = []
    for i in range(4):
        step = run(decode_step_graph(cfg, 2, c), {"tokens": fed[:, i:i + 1],
                                                 "pos": one.pos.copy(), **one.view(c)})
        one.write(step)
        steps.append(step)
    ring = {"slots": many.slot_positions(c)} if cfg.kv_ring else {}
    verify = run(verify_step_graph(cfg, 2, c, 4), {"tokens": fed, "pos": many.pos.copy(),
                                                   **ring, **many.view(c)})
    want = np.concatenate([s["logits"] for s in steps], axis=1)
    scale = np.abs(want).max()
    np.testing.assert_allclose(verify["logits"], want, rtol=0, atol=2e-6 * max(scale, 1))
    for name in ("new.0.k", "new.0.v", f"new.{cfg.layers - 1}.v"):
        rows = np.concatenate([s[name] for s in steps], 1).astype(np.float32)
        np.testing.assert_allclose(verify[name].astype(np.float32), rows, rtol=0,
                                   atol=2e-6 * max(np.abs(rows).max(), 1))
    many.write_rows(verify, np.array([4, 4]))
    for name, array in one.arrays.items():  # (float32 rounding of the rows' own values)
        array = array.astype(np.float32)
        np.testing.assert_allclose(many.arrays[name].astype(np.float32), array, rtol=0,
                                   atol=2e-6 * max(np.abs(array).max(), 1))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_verify_step_computes_what_that_many_decode_steps_compute(hf_fixture, family):
    cfg, weights = resolve(str(hf_fixture(family)))
    _verify_against_steps(cfg, weights, 24)


@pytest.mark.parametrize("window", [3, 5])
def test_a_verify_step_over_a_ring_that_wraps(hf_fixture, window):
    """Mistral with a window of 3 or 5: a ring of 2 or 4 slots that wraps within the prompt
    and the step; the later new tokens no longer see the ring's oldest rows."""
    cfg, weights = resolve(str(hf_fixture("tiny-mistral")))
    cfg = dataclasses.replace(cfg, sliding_window=window)
    assert cfg.kv_ring == window - 1
    _verify_against_steps(cfg, weights, cfg.kv_ring)
    tokens, lengths = pad_rows([[5, 9, 2, 7, 7, 3, 1, 8, 5, 9, 2], [4, 4, 8]])
    run = dense_runner(weights)
    plain = generate(cfg, tokens, 16, run, lengths=lengths)
    for k in (1, 3):
        spec = generate(cfg, tokens, 16, run, lengths=lengths, draft=NgramDraft(k))
        assert np.array_equal(spec.tokens, plain.tokens)


def test_slot_positions(hf_fixture):
    cfg, _ = resolve(str(hf_fixture("tiny-mistral")))
    ring = KVStore(dataclasses.replace(cfg, sliding_window=5), 3, 8)  # 4 slots, a ring
    ring.pos[:] = [2, 4, 7]
    assert ring.slot_positions(4).tolist() == [[0, 1, -1, -1], [0, 1, 2, 3], [4, 5, 6, 3]]
    flat = KVStore(cfg, 2, 8)
    flat.pos[:] = [3, 0]
    assert flat.slot_positions(5).tolist() == [[0, 1, 2, -1, -1], [-1] * 5]


def _runners(cfg, weights):
    return {"dense": dense_runner(weights),
            "paged": PlanRunner(weights, CompileOptions(cfg.weight_bytes() // 4), "threads")}


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_speculation_gives_plain_decodings_tokens(hf_fixture, family):
    """Every family, dense and paged at 1/4 of the weights, several draft sizes, rows of
    different lengths (they accept different counts) and the checkpoint's EOS."""
    path = hf_fixture(family)
    cfg, weights = resolve(str(path))
    prompt = np.load(path / "greedy_prompt.npy")
    rows = [prompt[0].tolist(), prompt[0, :max(2, prompt.shape[1] // 2)].tolist()]
    tokens, lengths = pad_rows(rows)
    for kind, runner in _runners(cfg, weights).items():
        plain = generate(cfg, tokens, 20, runner, lengths=lengths, eos_ids=(3,))
        for k in (1, 4):
            spec = generate(cfg, tokens, 20, runner, lengths=lengths, eos_ids=(3,),
                            draft=NgramDraft(k))
            assert np.array_equal(spec.tokens, plain.tokens), (kind, k)
            assert spec.new_lengths == plain.new_lengths and spec.finish == plain.finish
            s = spec.speculation
            assert s.passes >= 1 and s.proposed == k * s.row_passes
            assert s.emitted == sum(plain.new_lengths) - 2  # all but the prefill's picks
            assert s.row_passes <= s.emitted <= (k + 1) * s.row_passes


class _Oracle(RowDraft):
    """A perfect draft: the target's own greedy continuation (the mechanism's ceiling)."""
    name = "oracle"

    def __init__(self, prompt_len: int, future: list[int], tokens: int):
        self.start, self.future, self.tokens = prompt_len, future, tokens

    def propose(self, history):
        at = len(history) - self.start  # tokens generated so far, the first included
        ahead = self.future[at:at + self.tokens]
        return ahead + [0] * (self.tokens - len(ahead))


@pytest.mark.parametrize("k", [1, 3, 4])
def test_a_perfect_draft_yields_k_plus_one_tokens_per_pass(hf_fixture, k):
    cfg, weights = resolve(str(hf_fixture("tiny-llama-f32")))
    runner = _runners(cfg, weights)["paged"]
    prompt = np.array([[5, 9, 2, 7, 7, 3, 1, 8]])
    plain = generate(cfg, prompt, 25, runner)
    future = plain.tokens[0].tolist()
    out = prefill(cfg, prompt, runner)
    store = KVStore(cfg, 1, 8 + 24)
    store.fill(out)
    from einpage.models.generation import TokenPicker
    picker = TokenPicker(1)
    picker.emit(0, future[0])
    tokens, _, stats = speculate(cfg, store, np.array(future[:1]), 24, runner, 256, None,
                                 picker, _Oracle(8, future, k), [prompt[0].tolist() + future[:1]])
    assert tokens[0].tolist() == future[1:]
    assert stats.passes == math.ceil(24 / (k + 1)) and stats.acceptance == 1.0
    assert stats.tokens_per_pass == pytest.approx(24 / stats.passes)
    assert int(store.pos[0]) == 8 + 24


def test_ngram_proposals():
    draft = NgramDraft(3)
    assert draft.propose([1, 2, 3, 4, 9, 2, 3]) == [4, 9, 2]  # after the latest "2 3"
    assert draft.propose([7, 1, 2, 8, 1, 2]) == [8, 1, 2]
    assert draft.propose([5, 6, 7, 5]) == [6, 7, 5]  # a 1-gram match
    assert draft.propose([1, 2, 1]) == [2, 1, 1]  # a short continuation: its last repeated
    assert draft.propose([4, 5, 6]) == [6, 6, 6]  # no match: the last token
    assert NgramDraft(2, max_ngram=1).propose([3, 1, 3, 2, 3]) == [2, 3]
    for bad in (0, -1, 1.5, True):
        with pytest.raises(InputError, match="draft tokens must be an integer >= 1"):
            NgramDraft(bad)


def test_the_store_takes_the_accepted_rows_only(hf_fixture):
    cfg, _ = resolve(str(hf_fixture("tiny-llama-f32")))
    store = KVStore(cfg, 2, 6)
    store.pos[:] = [1, 3]
    step = {f"new.{layer}.{kv}": np.full((2, 4, cfg.kv_heads, 2, cfg.head_dim // 2),
                                         10 * layer + i, np.float32)
            for layer in range(cfg.layers) for i, kv in enumerate("kv")}
    for b in range(2):
        for name in step:
            step[name][b] += np.arange(4)[:, None, None, None] + 100 * b
    written = store.write_rows(step, np.array([2, 0]))
    assert store.pos.tolist() == [3, 3] and len(written) == 2 * 2 * cfg.layers
    k = store.arrays["cache.0.k"]
    assert k[0, 1, 0, 0, 0] == 0 and k[0, 2, 0, 0, 0] == 1 and not k[0, 3].any()
    assert not k[1].any()
    with pytest.raises(InputError, match="cannot take positions up to 6"):
        store.write_rows(step, np.array([4, 0]))
    with pytest.raises(InputError, match="row counts"):
        store.write_rows(step, np.array([1]))


def test_cli_generate_with_a_draft(capsys, hf_fixture):
    path = hf_fixture("tiny-llama31")
    common = ["generate", path, "--prompt-file", path / "prompt.txt", "--max-new-tokens", 12,
              "--gpu-mem", "200KB", "--backend", "threads", "--json"]
    assert cli(*common) == 0
    plain = json.loads(capsys.readouterr().out)
    assert cli(*common, "--draft", "ngram", "--draft-tokens", 3) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["tokens"] == plain["tokens"] and spec["text"] == plain["text"]
    assert spec["draft"] == "ngram" and spec["draft_tokens"] == 3
    assert spec["verify_passes"] >= 1 and spec["proposed"] == 3 * spec["verify_passes"]
    assert 0 <= spec["acceptance"] <= 1 and 1 <= spec["tokens_per_pass"] <= 4
    assert "draft" not in plain
    assert cli(*common[:-1], "--draft", "ngram") == 0
    assert "speculative: ngram drafts of 4 tokens;" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--draft-tokens", "2"], "--draft-tokens is an option of --draft"),
    (["--draft", "ngram", "--draft-tokens", "0"], "--draft-tokens must be between 1 and 64"),
    (["--draft", "ngram", "--draft-tokens", "65"], "--draft-tokens must be between 1 and 64"),
    (["--draft", "ngram", "--draft-tokens", "9", "--kv-granule", "8"],
     "--draft-tokens must be between 1 and 8"),
    (["--draft", "model.gguf"], "--draft takes ngram or a draft checkpoint"),
])
def test_bad_draft_options_are_one_line(capsys, hf_fixture, args, message):
    path = hf_fixture("tiny-llama-f32")
    code = cli("generate", path, "--tokens", "1,2,3", "--max-new-tokens", 4, *args)
    assert_one_line_error(capsys, code, message)


def test_a_row_stops_at_its_eos_inside_an_accepted_run(hf_fixture):
    """The EOS id is a token the rows emit mid-generation: each row stops there (even inside a
    pass's accepted run), the other goes on, as plain decoding does."""
    cfg, weights = resolve(str(hf_fixture("tiny-llama-f32")))
    runner = dense_runner(weights)
    tokens, lengths = pad_rows([[5, 9, 2, 7, 7, 3, 1, 8], [4, 4, 8]])
    free = generate(cfg, tokens, 24, runner, lengths=lengths)
    eos = int(free.tokens[0, 6])
    plain = generate(cfg, tokens, 24, runner, lengths=lengths, eos_ids=(eos,))
    assert "eos" in plain.finish
    for k in (2, 5):
        spec = generate(cfg, tokens, 24, runner, lengths=lengths, eos_ids=(eos,),
                        draft=NgramDraft(k))
        assert np.array_equal(spec.tokens, plain.tokens)
        assert spec.finish == plain.finish and spec.new_lengths == plain.new_lengths


# ------------------------------------------------------------------ sampling


def _chi_square_p(observed: dict, expected: dict) -> float:
    """The p-value of Pearson's chi-square statistic over the cells (cells expected below 5
    pooled into one), by the Wilson-Hilferty normal approximation of the chi-square tail."""
    big = [c for c, e in expected.items() if e >= 5]
    rest_o = sum(v for c, v in observed.items() if c not in big)
    rest_e = sum(e for c, e in expected.items() if c not in big)
    stat = sum((observed.get(c, 0) - expected[c]) ** 2 / expected[c] for c in big)
    df = len(big) - 1
    if rest_e > 0:
        stat += (rest_o - rest_e) ** 2 / rest_e
        df += 1
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.fixture(scope="module")
def two_token_tables(hf_fixture):
    """The target's distributions for the two tokens after a fixed prefix (tiny-llama-f32,
    temperature 0.05, top-k 5): p1 over the first, p2[x] over the second after first token x
    (every x), and the verify step's own [3, vocab] rows for proposals (d1, d2)."""
    from einpage.models.generation import Sampling, probabilities
    cfg, weights = resolve(str(hf_fixture("tiny-llama-f32")))
    run = dense_runner(weights)
    sampling = Sampling(temperature=0.05, top_k=5, seed=0).resolved()
    prefix = np.array([[5, 9, 2, 7, 7, 3, 1, 8]])
    out = prefill(cfg, prefix, run)
    p1 = probabilities(out["logits"][:, -1], sampling)[0]
    vocab = cfg.vocab
    store = KVStore(cfg, vocab, 16)
    store.fill({k: np.repeat(v, vocab, axis=0) for k, v in out.items() if k != "logits"})
    step = run(decode_step_graph(cfg, vocab, 16), {"tokens": np.arange(vocab)[:, None],
                                                   "pos": store.pos.copy(), **store.view(16)})
    p2 = probabilities(step["logits"][:, 0], sampling)
    order = np.argsort(-p1)
    d1, d2 = int(order[1]), int(np.argsort(-p2[order[1]])[0])  # likely, not certain
    assert 0.05 < p1[d1] < 0.9 and 0.05 < p2[d1, d2] < 0.95
    mine = KVStore(cfg, 1, 16)  # the prefix but its last token, which the step feeds first
    mine.fill({k: v for k, v in out.items() if k != "logits"}, np.array([prefix.shape[1] - 1]))
    verify = run(verify_step_graph(cfg, 1, 16, 3), {"tokens": np.array([[int(prefix[0, -1]),
                                                                         d1, d2]]),
                                                    "pos": mine.pos.copy(), **mine.view(16)})
    rows = probabilities(verify["logits"][0], sampling)
    np.testing.assert_allclose(rows[0], p1, atol=1e-6)
    np.testing.assert_allclose(rows[1], p2[d1], atol=1e-6)
    return p1, p2, rows, (d1, d2)


def _two_tokens(rule, p1, p2, rows, proposals, samples: int, seed: int) -> dict:
    """The first two tokens after the prefix, drawn `samples` times: one verify pass by `rule`,
    then, if it gave one token, the next pass's first token from its own distribution."""
    from einpage.models.speculative import draw
    rng = np.random.default_rng(seed)
    counts: dict = {}
    for _ in range(samples):
        tokens, _ = rule(rows, list(proposals), rng)
        if len(tokens) < 2:
            tokens = tokens + [draw(p2[tokens[0]], rng.random())]
        key = (tokens[0], tokens[1])
        counts[key] = counts.get(key, 0) + 1
    return counts


def test_speculative_sampling_keeps_the_targets_distribution(two_token_tables):
    from einpage.models.speculative import accept_sampled, draw
    p1, p2, rows, proposals = two_token_tables
    samples = 20_000
    expected = {(a, b): samples * p1[a] * p2[a, b] for a in range(len(p1)) if p1[a] > 0
                for b in np.flatnonzero(p2[a] > 0).tolist()}
    good = _two_tokens(accept_sampled, p1, p2, rows, proposals, samples, seed=1)
    assert _chi_square_p(good, expected) > 0.01

    def resample_from_p(probs, props, rng):  # wrong: a rejection draws from p, d included
        for i, d in enumerate(props):
            if rng.random() < probs[i][d]:
                continue
            return list(props[:i]) + [draw(probs[i], rng.random())], i
        return list(props) + [draw(probs[len(props)], rng.random())], len(props)

    def accept_always(probs, props, rng):  # wrong: every proposal taken
        return list(props) + [draw(probs[len(props)], rng.random())], len(props)

    for wrong in (resample_from_p, accept_always):
        bad = _two_tokens(wrong, p1, p2, rows, proposals, samples, seed=1)
        assert _chi_square_p(bad, expected) < 1e-6, wrong.__name__


def test_sampled_generation_with_a_draft_is_seeded_and_runs_paged(hf_fixture):
    cfg, weights = resolve(str(hf_fixture("tiny-llama-f32")))
    runner = _runners(cfg, weights)["paged"]
    prompt = np.array([[5, 9, 2, 7, 7, 3, 1, 8], [4, 4, 8, 4, 4, 8, 4, 4]])
    runs = [generate(cfg, prompt, 16, runner, temperature=0.8, top_k=20, seed=7,
                     draft=NgramDraft(3)) for _ in range(2)]
    assert np.array_equal(runs[0].tokens, runs[1].tokens) and runs[0].tokens.shape == (2, 16)
    s = runs[0].speculation
    assert s.emitted == 2 * 15 and s.passes <= 15 and s.proposed == 3 * s.row_passes
    assert runs[0].seed == 7


def test_cli_samples_with_a_draft(capsys, hf_fixture):
    path = hf_fixture("tiny-llama-f32")
    args = ["generate", path, "--tokens", "5,9,2,7,7,3,1,8", "--max-new-tokens", 10,
            "--temperature", "0.7", "--seed", 3, "--draft", "ngram", "--json"]
    assert cli(*args) == 0
    first = json.loads(capsys.readouterr().out)
    assert cli(*args) == 0
    again = json.loads(capsys.readouterr().out)
    assert first["tokens"] == again["tokens"] and first["sampling"]["seed"] == 3
    assert first["draft"] == "ngram" and len(first["tokens"][0]) == 10


# ------------------------------------------------------------------ the forecast


def test_expected_tokens_per_pass():
    from einpage.models.speculative import expected_tokens
    assert expected_tokens(4, 0.0) == 1.0 and expected_tokens(4, 1.0) == 5.0
    assert expected_tokens(2, 0.5) == pytest.approx(1.75)
    assert expected_tokens(8, 0.7) == pytest.approx(sum(0.7 ** i for i in range(9)))


def test_compile_forecasts_verify_passes_and_picks_k(capsys):
    args = ["compile", "small", "--gpu-mem", "300KB", "--phase", "decode", "--past", 100,
            "--draft", "ngram"]
    assert cli(*args, "--json") == 0
    f = json.loads(capsys.readouterr().out)
    assert [v["k"] for v in f["verify"]] == list(range(1, 9)) and f["acceptance"] == 0.7
    best = max(f["verify"], key=lambda v: v["tokens_per_s"])
    assert f["k"] == best["k"] and f["tokens_per_s"] == best["tokens_per_s"]
    for v in f["verify"]:  # a streamed pass: a verify pass costs about what a step does
        assert 0.8 * f["plain_step_s"] <= v["pass_s"] <= 3 * f["plain_step_s"]
        assert v["tokens_per_s"] == pytest.approx(v["tokens_per_pass"] / v["pass_s"])
    assert best["speedup"] > 1.5
    assert cli(*args, "--draft-tokens", 3, "--acceptance", 1) == 0
    out = capsys.readouterr().out
    assert "acceptance 1.00 per proposal" in out and "  3 | " in out and "picks k = 3" in out


@pytest.mark.parametrize("args, message", [
    (["--draft", "ngram"], "--draft forecasts decode steps: add --phase decode"),
    (["--phase", "decode", "--draft", "ngram", "--acceptance", "1.5"],
     "--acceptance must be between 0 and 1"),
    (["--phase", "decode", "--acceptance", "0.5"], "--acceptance is an option of --draft"),
    (["--phase", "decode", "--draft", "ngram", "--draft-tokens", "0"],
     "--draft-tokens must be between 1 and 64"),
    (["--phase", "decode", "--draft", "ngram", "-o", "plan.json"], "-o writes one plan"),
])
def test_bad_forecast_options_are_one_line(capsys, tmp_path, args, message):
    args = [str(tmp_path / a) if a == "plan.json" else a for a in args]
    assert_one_line_error(capsys, cli("compile", "small", "--gpu-mem", "300KB", *args),
                          message)


def test_a_forecast_over_a_ring_store(capsys, hf_fixture):
    """tiny-mistral's sliding window of 6 keeps a ring of 5 slots, far below position 100."""
    assert cli("compile", hf_fixture("tiny-mistral"), "--gpu-mem", "100KB", "--phase", "decode",
               "--past", 100, "--draft", "ngram", "--draft-tokens", 2, "--json") == 0
    f = json.loads(capsys.readouterr().out)
    assert f["capacity"] == 5 and f["k"] == 2
    assert f["verify"][0]["tokens_per_s"] > f["plain_tokens_per_s"]


# ------------------------------------------------------------------ a draft model


@pytest.mark.parametrize("kind", ["dense", "paged"])
def test_a_draft_model_gives_plain_decodings_tokens(hf_fixture, kind):
    """The model as its own draft (every proposal right: k + 1 tokens per pass but at the end)
    and another model of the same vocabulary (tiny-llama-bf16, a different random model:
    hardly any proposal right) both give plain decoding's tokens, rows of different lengths."""
    from einpage.models.speculative import ModelDraft
    cfg, weights = resolve(str(hf_fixture("tiny-llama-f32")))
    other_cfg, other = resolve(str(hf_fixture("tiny-llama-bf16")))
    runner = _runners(cfg, weights)[kind]
    other_runner = _runners(other_cfg, other)[kind]
    tokens, lengths = pad_rows([[5, 9, 2, 7, 7, 3, 1, 8], [4, 4, 8]])
    plain = generate(cfg, tokens, 21, runner, lengths=lengths)
    for k in (1, 4):
        own = generate(cfg, tokens, 21, runner, lengths=lengths,
                       draft=ModelDraft(cfg, runner, k, 256))
        assert np.array_equal(own.tokens, plain.tokens)
        s = own.speculation
        assert s.draft == "model" and s.acceptance == 1.0
        assert s.passes == math.ceil(20 / (k + 1))
        theirs = generate(cfg, tokens, 21, runner, lengths=lengths,
                          draft=ModelDraft(other_cfg, other_runner, k, 256))
        assert np.array_equal(theirs.tokens, plain.tokens)
        assert theirs.speculation.acceptance < 0.2


def test_a_ring_model_as_its_own_draft(hf_fixture):
    from einpage.models.speculative import ModelDraft
    cfg, weights = resolve(str(hf_fixture("tiny-mistral")))
    cfg = dataclasses.replace(cfg, sliding_window=5)
    run = dense_runner(weights)
    tokens, lengths = pad_rows([[5, 9, 2, 7, 7, 3, 1, 8, 5, 9, 2], [4, 4, 8]])
    plain = generate(cfg, tokens, 16, run, lengths=lengths)
    own = generate(cfg, tokens, 16, run, lengths=lengths, draft=ModelDraft(cfg, run, 3, 256))
    assert np.array_equal(own.tokens, plain.tokens) and own.speculation.acceptance == 1.0


def test_cli_generate_with_a_draft_model(capsys, hf_fixture):
    path = hf_fixture("tiny-llama-f32")
    common = ["generate", path, "--tokens", "5,9,2,7,7,3,1,8", "--max-new-tokens", 12,
              "--gpu-mem", "900KB", "--backend", "threads", "--json"]
    assert cli(*common) == 0
    plain = json.loads(capsys.readouterr().out)
    assert cli(*common, "--draft", path, "--draft-tokens", 3) == 0
    own = json.loads(capsys.readouterr().out)
    assert own["tokens"] == plain["tokens"] and own["acceptance"] == 1.0
    assert own["draft"] == "model" and own["draft_model"] == str(path)
    assert 0 < own["draft_bytes"] < 900_000 and own["verify_passes"] == 3
    assert cli(*common, "--draft", path, "--draft-gpu-mem", "100KB") == 0
    assert json.loads(capsys.readouterr().out)["draft_bytes"] == 100_000


@pytest.mark.parametrize("model, args, message", [
    ("tiny-llama31", ["--draft", "@tiny-qwen2"], "has another tokenizer than"),
    ("tiny-llama-f32", ["--draft", "@tiny-qwen2"], "has a vocabulary of 260, the model 256"),
    ("tiny-llama-f32", ["--draft", "nosuch"], "--draft takes ngram or a draft checkpoint"),
    ("tiny-llama-f32", ["--draft", "@tiny-llama-f32", "--gpu-mem", "100KB"],
     "no room is left for the model"),
    ("tiny-llama-f32", ["--draft", "ngram", "--draft-gpu-mem", "1MB"],
     "--draft-gpu-mem is the budget of a draft model"),
    ("tiny-llama-f32", ["--draft-gpu-mem", "1MB"], "--draft-gpu-mem is an option of --draft"),
    ("tiny-llama-f32", ["--draft", "@tiny-llama-f32", "--draft-gpu-mem", "1MB"],
     "--draft-gpu-mem splits a --gpu-mem budget"),
])
def test_bad_draft_models_are_one_line(capsys, hf_fixture, model, args, message):
    args = [str(hf_fixture(a[1:])) if a.startswith("@") else a for a in args]
    assert_one_line_error(capsys, cli("generate", hf_fixture(model), "--tokens", "1,2",
                                      "--max-new-tokens", 3, *args), message)


def test_compile_forecasts_a_draft_model(capsys):
    """A draft model's steps are priced: a pass is k + 1 of them and the verify pass, the
    model planned for the budget the draft leaves."""
    args = ["compile", "small", "--gpu-mem", "6MB", "--phase", "decode", "--past", 100,
            "--draft", "small", "--draft-gpu-mem", "2MB", "--json"]
    assert cli(*args) == 0
    f = json.loads(capsys.readouterr().out)
    assert f["draft"] == "small" and f["draft_bytes"] == 2_000_000 and f["draft_step_s"] > 0
    for v in f["verify"]:
        assert v["pass_s"] == pytest.approx((v["k"] + 1) * f["draft_step_s"] + v["verify_s"])
        assert v["tokens_per_s"] == pytest.approx(v["tokens_per_pass"] / v["pass_s"])
    assert_one_line_error(capsys, cli(*args[:-3], "--draft-gpu-mem", "6MB"),
                          "no room is left for the model")
    assert_one_line_error(capsys, cli(*args[:-5], "--draft", "qwen2.5-7b"),
                          "has a vocabulary of")


# ------------------------------------------------------------------ --draft-tokens auto


def test_auto_picks_k_by_expected_tokens_over_pass_time():
    from einpage.models.speculative import AutoTokens, SpeculationStats
    auto, fresh = AutoTokens(), SpeculationStats("ngram", "auto")
    assert auto.pick(fresh, lambda k: 1.0) == 8  # a streamed pass: more proposals, more tokens
    assert auto.pick(fresh, lambda k: None) == 8  # nothing to price: the same
    assert auto.pick(fresh, lambda k: 1.0 + k) == 1  # each proposal costs a whole step
    sure = SpeculationStats("model", "auto", proposed=400, accepted=396)
    assert auto.pick(sure, lambda k: 1.0 + 0.05 * k) == 8
    never = SpeculationStats("ngram", "auto", proposed=400, accepted=0)
    assert auto.pick(never, lambda k: 1.0 + 0.01 * k) == 1
    assert AutoTokens((1, 2)).pick(fresh, lambda k: 1.0) == 2


def test_auto_draft_tokens_give_plain_decodings_tokens(hf_fixture, capsys):
    from einpage.models.speculative import AUTO_TOKENS
    cfg, weights = resolve(str(hf_fixture("tiny-llama-f32")))
    runner = _runners(cfg, weights)["paged"]
    tokens, lengths = pad_rows([[5, 9, 2, 7, 7, 3, 1, 8], [4, 4, 8]])
    plain = generate(cfg, tokens, 24, runner, lengths=lengths)
    auto = generate(cfg, tokens, 24, runner, lengths=lengths, draft=NgramDraft(8),
                    auto_tokens=True)
    assert np.array_equal(auto.tokens, plain.tokens)
    s = auto.speculation
    assert s.draft_tokens == "auto" and set(s.used) <= set(AUTO_TOKENS)
    assert sum(s.used.values()) == s.passes
    path = hf_fixture("tiny-llama-f32")
    assert cli("generate", path, "--tokens", "5,9,2,7,7,3,1,8", "--max-new-tokens", 12,
               "--gpu-mem", "200KB", "--backend", "threads", "--draft", "ngram",
               "--draft-tokens", "auto", "--json") == 0
    out = json.loads(capsys.readouterr().out)
    assert out["draft_tokens"] == "auto" and sum(out["draft_tokens_used"].values()) == \
        out["verify_passes"]
    assert_one_line_error(capsys, cli("generate", path, "--tokens", "1,2", "--max-new-tokens",
                                      3, "--draft", "ngram", "--draft-tokens", "many"),
                          "--draft-tokens takes a count or auto")


def test_compile_searches_the_drafts_share_of_the_budget(capsys):
    assert cli("compile", "small", "--gpu-mem", "6MB", "--phase", "decode", "--past", 100,
               "--draft", "small", "--json") == 0
    f = json.loads(capsys.readouterr().out)
    splits = f["draft_splits"]
    sizes = [s["draft_bytes"] for s in splits]
    assert len(splits) == 3 and sizes == sorted(sizes, reverse=True)
    kept = max(splits, key=lambda s: s["tokens_per_s"])
    assert f["draft_bytes"] == kept["draft_bytes"]
    assert f["tokens_per_s"] == pytest.approx(kept["tokens_per_s"])


def test_the_draft_fixture_drafts_for_its_target(capsys, hf_fixture):
    """tiny-llama31-draft (made by the fixture script: one layer, tiny-llama31's tokenizer)
    drafts for tiny-llama31 through the CLI, paged: plain decoding's tokens and text; its own
    logits are transformers' (float32 rounding)."""
    draft = hf_fixture("tiny-llama31-draft")
    target = hf_fixture("tiny-llama31")
    common = ["generate", target, "--prompt-file", target / "prompt.txt", "--max-new-tokens", 16,
              "--gpu-mem", "300KB", "--backend", "threads", "--json"]
    assert cli(*common) == 0
    plain = json.loads(capsys.readouterr().out)
    assert cli(*common, "--draft", draft, "--draft-tokens", 3) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["tokens"] == plain["tokens"] and spec["text"] == plain["text"]
    assert spec["draft_model"] == str(draft) and 0 <= spec["acceptance"] <= 1
    cfg, weights = resolve(str(draft))
    ids = np.load(draft / "input_ids.npy")
    got = prefill(cfg, ids, dense_runner(weights))["logits"]
    np.testing.assert_allclose(got, np.load(draft / "logits.npy"), rtol=1e-4, atol=2e-5)
