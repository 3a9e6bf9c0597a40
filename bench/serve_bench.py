"""Serving many requests at once (issue 34).

    python bench/serve_bench.py throughput [--layers 2] [--fraction 0.125] [--concurrent 16]
        LLaMA-7B shapes with `--layers` layers and random f16 weights, a budget of `--fraction`
        of the weights (a decode step streams most of them: its weight bytes well above its
        compute), the continuous-batching engine on the threads backend: `--requests` requests
        of `--new` tokens one at a time, then `--concurrent` at once; the aggregate tokens/s
        of each and their ratio.
    python bench/serve_bench.py load [--clients 32] [--each 20]
        the HTTP server on the Llama 3.1 fixture (Qwen2.5's chat template) under a paging
        budget, `--clients` concurrent openai clients x `--each` requests (temperature 0,
        streamed, prompts and lengths varied): errors, every answer against its solo run,
        requests/s, tokens/s, time to first token (p50, p99), and the aggregate tokens/s
        against one request at a time.
    python bench/serve_bench.py turns [--layers 2] [--turns 4]
        a conversation on LLaMA-7B shapes (random f16 weights, a byte-level tokenizer, Qwen2.5's
        chat template), all weights resident: each turn's prefill (tokens computed, tokens kept,
        seconds) against a fresh conversation that prefills the whole history at once.
    python bench/serve_bench.py predict [--model llama3.1-70b] [--gpu-mem 24GB]
        the served load predicted (`einpage compile --max-new-tokens N --concurrent
        1,8,32,64`, h100-pcie): tokens/s of the server at each load, per request, and the
        time to the first token.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))


class Letters:
    """A codec for a model without a tokenizer: token i is a letter (text is only shown)."""

    def decode(self, ids):
        return "".join(chr(ord("a") + int(i) % 26) for i in ids)

    def stream(self):
        from einpage.models.text import TextStream
        return TextStream(self)


def _run_all(engine, requests) -> tuple[float, int]:
    """Submit every request at once; (wall seconds until the last ends, tokens made)."""
    from einpage.serving.engine import Done
    done = threading.Semaphore(0)
    made = [0]

    def sink(event):
        if isinstance(event, Done):
            made[0] += event.completion_tokens
            done.release()

    t0 = time.perf_counter()
    for r in requests:
        r.sink = sink
        engine.submit(r)
    for _ in requests:
        done.acquire()
    return time.perf_counter() - t0, made[0]


def throughput(args) -> None:
    from quant_bench import HeldWeights, dense_weights

    from einpage import runners
    from einpage.compiler import CompileOptions
    from einpage.models import config
    from einpage.serving.engine import Engine, Request
    cfg = replace(config.preset("llama-7b"), layers=args.layers, name=f"llama-7b-{args.layers}l")
    weights = HeldWeights(cfg, dense_weights(cfg))
    budget = int(cfg.weight_bytes() * args.fraction)
    run = runners.PlanRunner(weights, CompileOptions(budget), backend="threads")
    engine = Engine(cfg, run, Letters(), max_batch=args.concurrent, context=256, granule=64)
    engine.start()
    rng = np.random.default_rng(0)

    def requests(n):
        return [Request(rng.integers(0, cfg.vocab, 16).tolist(), args.new) for _ in range(n)]

    # warm-up: every plan the measured runs use (prefill, each batch bucket) compiled once
    _run_all(engine, requests(args.concurrent))
    _run_all(engine, requests(1))
    alone = []
    for r in requests(args.requests):
        alone.append(_run_all(engine, [r]))
    one_s = sum(s for s, _ in alone)
    one_tokens = sum(n for _, n in alone)
    runs = [_run_all(engine, requests(args.concurrent)) for _ in range(args.reps)]
    engine.stop()
    rates = [n / s for s, n in runs]
    one = one_tokens / one_s
    print(f"llama-7b shapes, {args.layers} layers, random f16 weights "
          f"({cfg.weight_bytes() / 1e9:.2f} GB), budget {budget / 1e9:.3f} GB "
          f"({args.fraction:g} of the weights), threads backend, {args.new} new tokens a request")
    print(f"one at a time: {args.requests} requests, {one:.2f} tokens/s")
    print(f"{args.concurrent} at once: {', '.join(f'{r:.2f}' for r in rates)} tokens/s "
          f"(median {statistics.median(rates):.2f}; {statistics.median(rates) / one:.2f}x)")


def load(args) -> None:
    import openai
    import uvicorn

    from einpage import runners
    from einpage.compiler import CompileOptions
    from einpage.models.generation import generate
    from einpage.models.text import end_of_sequence
    from einpage.serving.app import Service, create_app
    from einpage.serving.engine import Engine
    from test_chat import chat_checkpoint

    class Factory:
        def mktemp(self, name):
            import tempfile
            return Path(tempfile.mkdtemp(prefix=name))

    d, cfg, weights, codec, template = chat_checkpoint(
        lambda name: ROOT / "tests" / "fixtures" / name, Factory())
    eos = end_of_sequence(d).ids
    budget = 200_000
    engine = Engine(cfg, runners.PlanRunner(weights, CompileOptions(budget), backend="threads"),
                    codec, max_batch=args.max_batch, context=512, granule=64)
    service = Service(engine, "tiny-chat", codec, template, eos, None, 16)
    srv = uvicorn.Server(uvicorn.Config(create_app(service), host="127.0.0.1",
                                        port=args.port, log_level="warning"))
    threading.Thread(target=srv.run, daemon=True).start()
    while not srv.started:
        time.sleep(0.05)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{args.port}/v1", api_key="none",
                           max_retries=0, timeout=600)
    prompts = ["Hi", "Tell me a story about a fox.", "2+2?", "Name three colours of the sea.",
               "What is einsum?", "Write a haiku.", "ok", "Why is the sky blue? Be precise."]
    lengths = [4, 8, 12, 16]
    solo_run = runners.PlanRunner(weights, CompileOptions(budget), backend="threads")
    solo = {}
    for p in prompts:
        ids = codec.encode_plain(template.render([{"role": "user", "content": p}]))
        for n in lengths:
            g = generate(cfg, np.array([ids]), n, solo_run, granule=64, eos_ids=eos)
            row = g.rows()[0]
            solo[(p, n)] = codec.decode(row[:-1] if g.finish[0] == "eos" else row)

    def ask(p, n, stats):
        t0 = time.perf_counter()
        first, parts, tokens = None, [], 0
        for chunk in client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": p}], temperature=0,
                max_tokens=n, stream=True, stream_options={"include_usage": True}):
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            for c in chunk.choices:
                if c.delta.content:
                    first = first or time.perf_counter()
                    parts.append(c.delta.content)
        stats.append(((first or time.perf_counter()) - t0, tokens, "".join(parts) == solo[(p, n)]))

    def client_loop(k, stats, errors):
        for i in range(args.each):
            p, n = prompts[(k + i) % len(prompts)], lengths[(k * 7 + i) % len(lengths)]
            try:
                ask(p, n, stats)
            except Exception as exc:  # counted, not raised: the load test reports errors
                errors.append(f"{type(exc).__name__}: {exc}")

    serial, errs = [], []
    t0 = time.perf_counter()
    for i in range(args.serial):
        client_loop(i, serial, errs)
    serial_s = time.perf_counter() - t0
    stats, errors = [], []
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client_loop, args=(k, stats, errors))
               for k in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    srv.should_exit = True
    ttft = sorted(s for s, _, _ in stats)
    tokens = sum(n for _, n, _ in stats)
    serial_tokens = sum(n for _, n, _ in serial)
    print(f"tiny-llama31 fixture (Qwen2.5 chat template), budget {budget} B (weights "
          f"{cfg.weight_bytes()} B: streamed), threads backend, max batch {args.max_batch}")
    print(f"{args.clients} clients x {args.each} requests: {len(stats)} answered, {len(errors)} "
          f"errors, {sum(ok for _, _, ok in stats)} equal to their solo run")
    print(f"  {len(stats) / wall:.2f} requests/s, {tokens / wall:.1f} tokens/s, time to first "
          f"token p50 {ttft[len(ttft) // 2] * 1e3:.0f} ms, p99 "
          f"{ttft[min(len(ttft) - 1, int(len(ttft) * 0.99))] * 1e3:.0f} ms; mean batch "
          f"{engine.step_rows / max(engine.steps, 1):.1f} rows a step")
    print(f"one request at a time ({len(serial)} requests): {serial_tokens / serial_s:.1f} "
          f"tokens/s; concurrent / serial: {tokens / wall / (serial_tokens / serial_s):.2f}x")
    if errors:
        print("first error:", errors[0])


def turns(args) -> None:
    from quant_bench import HeldWeights, dense_weights

    from einpage import runners
    from einpage.compiler import CompileOptions
    from einpage.models import config
    from einpage.models.chat import ChatTemplate
    from einpage.models.conversation import Conversation
    from einpage.models.text import TextCodec
    cfg = replace(config.preset("llama-7b"), layers=args.layers, name=f"llama-7b-{args.layers}l")
    weights = HeldWeights(cfg, dense_weights(cfg))
    run = runners.PlanRunner(weights, CompileOptions(int(cfg.weight_bytes() * 1.5)),
                             backend="threads")
    codec = TextCodec.from_checkpoint(ROOT / "tests" / "fixtures" / "tiny-llama31")
    template = ChatTemplate((ROOT / "tests" / "fixtures" / "chat" / "templates" /
                             "Qwen-Qwen2.5-7B-Instruct.jinja").read_text())
    said = ["Hello! Who are you?", "Tell me about the sea, in a few words.",
            "And the mountains?", "Which do you prefer, and why?", "Thanks, bye."]

    def talk():
        return Conversation(cfg, run, codec, template, (), 2048, granule=64)

    warm = talk()  # every plan compiled once: the extend widths and decode buckets used
    for line in said[:args.turns]:
        warm.say(line, args.new)
    conv = talk()
    print(f"llama-7b shapes, {args.layers} layers, random f16 weights resident, threads "
          f"backend, {args.new} new tokens a turn")
    print("| turn | prefilled | kept | prefill (s) | fresh: prefilled | fresh prefill (s) | "
          "same reply |")
    print("|---:|---:|---:|---:|---:|---:|---|")
    for k, line in enumerate(said[:args.turns]):
        turn = conv.say(line, args.new)
        fresh = talk().say(conv.messages[:-1], args.new)
        print(f"| {k + 1} | {turn.prefilled} | {turn.reused} | {turn.prefill_s:.3f} | "
              f"{fresh.prefilled} | {fresh.prefill_s:.3f} | "
              f"{'yes' if fresh.tokens == turn.tokens else 'no'} |", flush=True)


def predict(args) -> None:
    """`einpage compile --max-new-tokens N --concurrent ...` (each count a cohort of requests
    prefilled together, then decoded in one batch), as a Markdown table."""
    einpage = Path(sys.executable).parent / "einpage"
    done = subprocess.run([str(einpage), "compile", args.model, "--gpu-mem", args.gpu_mem,
                           "--seq", str(args.seq), "--max-new-tokens", str(args.new),
                           "--concurrent", ",".join(str(b) for b in args.loads), "--json",
                           "--quiet", *args.extra], capture_output=True, text=True, check=False)
    if done.returncode:
        sys.exit(done.stderr)
    r = json.loads(done.stdout)
    print(f"{r['model']}, prompts of {r['prompt']} tokens, {r['new_tokens']} new tokens, "
          f"{r['device_bytes'] / 1e9:g} GB on {r['device']}")
    print("| concurrent requests | tokens/s | per request | first token (s) | decode step (s) |")
    print("|---:|---:|---:|---:|---:|")
    for x in r["loads"]:
        print(f"| {x['concurrent']} | {x['tokens_per_s']:.2f} | "
              f"{x['per_request_tokens_per_s']:.3f} | {x['first_token_s']:.2f} | "
              f"{', '.join(f'{s:.3f}' for s in x['step_s'])} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    t = sub.add_parser("throughput")
    t.add_argument("--layers", type=int, default=2)
    t.add_argument("--fraction", type=float, default=0.125)
    t.add_argument("--concurrent", type=int, default=16)
    t.add_argument("--requests", type=int, default=4)
    t.add_argument("--new", type=int, default=16)
    t.add_argument("--reps", type=int, default=3)
    lo = sub.add_parser("load")
    lo.add_argument("--clients", type=int, default=32)
    lo.add_argument("--each", type=int, default=20)
    lo.add_argument("--serial", type=int, default=1, help="clients run one after another")
    lo.add_argument("--max-batch", type=int, default=32)
    lo.add_argument("--port", type=int, default=8099)
    tu = sub.add_parser("turns")
    tu.add_argument("--layers", type=int, default=2)
    tu.add_argument("--turns", type=int, default=4)
    tu.add_argument("--new", type=int, default=8)
    pr = sub.add_parser("predict")
    pr.add_argument("--model", default="llama3.1-70b")
    pr.add_argument("--gpu-mem", default="24GB")
    pr.add_argument("--loads", type=int, nargs="+", default=[1, 8, 32, 64])
    pr.add_argument("--seq", type=int, default=512)
    pr.add_argument("--new", type=int, default=128)
    pr.add_argument("--extra", nargs="*", default=["--cpu-mem", "unlimited"])
    args = ap.parse_args()
    {"throughput": throughput, "load": load, "turns": turns, "predict": predict}[args.what](args)


if __name__ == "__main__":
    main()
