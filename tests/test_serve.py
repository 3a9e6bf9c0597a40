"""`einpage serve` (`einpage.serving`): the OpenAI-compatible API called by the real `openai`
client on a paged plan, requests batched continuously: with temperature 0 every response equals
the request run alone, several at once, of different lengths, joining mid-generation; streams,
stop strings, logprobs; bad requests are 400s that harm nothing; a client that goes away frees
its row; Ctrl-C stops the server cleanly."""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from test_chat import chat_checkpoint  # noqa: E402

from einpage import runners  # noqa: E402
from einpage.compiler import CompileOptions  # noqa: E402
from einpage.models.generation import generate  # noqa: E402
from einpage.models import resolve  # noqa: E402
from einpage.models.text import TextCodec, end_of_sequence  # noqa: E402
from einpage.serving.app import Service, create_app  # noqa: E402
from einpage.serving.engine import Done, Engine, Request, wait_for  # noqa: E402

KEY = "test-key"
EINPAGE = Path(sys.executable).parent / "einpage"
BUDGET = 200_000  # bytes of the tiny model's plans: its weights stream


@pytest.fixture(scope="module")
def model(hf_fixture, tmp_path_factory):
    return chat_checkpoint(hf_fixture, tmp_path_factory)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(model):
    d, cfg, weights, codec, template = model
    run = runners.PlanRunner(weights, CompileOptions(BUDGET), backend="threads")
    engine = Engine(cfg, run, codec, max_batch=8, context=512, granule=64)
    service = Service(engine, "tiny-chat", codec, template, end_of_sequence(d).ids, KEY, 8)
    port = _free_port()
    srv = uvicorn.Server(uvicorn.Config(create_app(service), host="127.0.0.1", port=port,
                                        log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    for _ in range(200):
        if srv.started:
            break
        time.sleep(0.05)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
    yield client, service, port
    srv.should_exit = True
    thread.join(30)
    assert not engine.thread.is_alive()


_SOLO: dict = {}


def _solo(model, ids, max_tokens):
    """The request run alone: `generate` on plans of its own (one runner, kept: its plans
    compiled once), stopped at the checkpoint's EOS."""
    d, cfg, weights, codec, _ = model
    if d not in _SOLO:
        _SOLO[d] = runners.PlanRunner(weights, CompileOptions(BUDGET), backend="threads")
    run = _SOLO[d]
    eos = end_of_sequence(d).ids
    done = generate(cfg, np.array([ids]), max_tokens, run, granule=64, eos_ids=eos)
    tokens = done.rows()[0]
    stopped = done.finish[0] == "eos"
    return codec.decode(tokens[:-1] if stopped else tokens), "stop" if stopped else "length"


def _chat_ids(model, messages):
    _, _, _, codec, template = model
    return codec.encode_plain(template.render(messages))


PROMPTS = ["Hi", "Tell me a story about a fox and a crow, please.", "2+2?",
           "What is the capital of France? Answer in one word, then explain at length.", "ok",
           "Write a haiku about the sea."]


def test_concurrent_requests_joining_mid_generation_answer_as_each_alone(model, server):
    client, service, _ = server
    results = [None] * len(PROMPTS)

    def ask(i):
        time.sleep(0.03 * i)  # later ones join a running batch
        messages = [{"role": "user", "content": PROMPTS[i]}]
        r = client.chat.completions.create(model="tiny-chat", messages=messages, temperature=0,
                                           max_tokens=4 + 2 * i)
        results[i] = (r.choices[0].message.content, r.choices[0].finish_reason, r.usage)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i, prompt in enumerate(PROMPTS):
        ids = _chat_ids(model, [{"role": "user", "content": prompt}])
        text, finish = _solo(model, ids, 4 + 2 * i)
        got_text, got_finish, usage = results[i]
        assert (got_text, got_finish) == (text, finish), i
        assert usage.prompt_tokens == len(ids)
    assert service.engine.step_rows > service.engine.steps  # some steps ran several rows


def test_a_stream_gives_the_same_reply_in_pieces(server):
    client, _, _ = server
    messages = [{"role": "user", "content": "Hello there"}]
    whole = client.chat.completions.create(model="m", messages=messages, temperature=0,
                                           max_tokens=6)
    pieces, usage, finish = [], None, None
    for chunk in client.chat.completions.create(model="m", messages=messages, temperature=0,
                                                max_tokens=6, stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            pieces.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert "".join(pieces) == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_completions_with_logprobs_and_a_stop_string(model, server):
    client, _, _ = server
    r = client.completions.create(model="m", prompt="The quick brown fox", temperature=0,
                                  max_tokens=6, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == r.usage.completion_tokens
    assert all(x <= 0 for x in lp.token_logprobs)
    assert all(len(top) <= 3 and max(top.values()) >= t - 1e-9
               for top, t in zip(lp.top_logprobs, lp.token_logprobs))
    text = r.choices[0].text
    assert "".join(lp.tokens) == text or r.choices[0].finish_reason == "stop"
    stop = text[2:4]
    if stop and text.find(stop) == 2:
        cut = client.completions.create(model="m", prompt="The quick brown fox", temperature=0,
                                        max_tokens=6, stop=[stop])
        assert cut.choices[0].text == text[:2] and cut.choices[0].finish_reason == "stop"


def test_seeded_sampling_repeats(server):
    client, _, _ = server
    ask = lambda: client.chat.completions.create(  # noqa: E731
        model="m", messages=[{"role": "user", "content": "Hi"}], temperature=1.0, top_p=0.9,
        seed=7, max_tokens=5).choices[0].message.content
    assert ask() == ask()


@pytest.mark.parametrize("body,param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": 5}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": 3}, "stop"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
    ({"messages": [{"role": "user"}, "hi"]}, "messages[1]"),
    ({"messages": [{"role": "user", "content": "word " * 600}]}, "messages"),
])
def test_bad_requests_are_400s_that_harm_nothing(server, body, param):
    client, _, port = server
    r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body,
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert error["message"]
    ok = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                        temperature=0, max_tokens=2)
    assert ok.usage.completion_tokens >= 1


def test_malformed_json_and_keys(server):
    _, _, port = server
    base = f"http://127.0.0.1:{port}"
    r = httpx.post(f"{base}/v1/completions", content=b"{not json",
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.get(f"{base}/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{base}/health").json()["status"] == "ok"  # no key needed
    models = httpx.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert [m["id"] for m in models["data"]] == ["tiny-chat"]
    assert httpx.get(f"{base}/v2/nothing").status_code == 404


class _Slow:
    """A runner whose held-open plans take at least `seconds` a pass: a reply of hundreds of
    tokens outlasts its client however loaded the machine (a tiny model's whole reply could
    otherwise be generated before the client read its first chunk)."""

    def __init__(self, run, seconds: float):
        self.inner, self.seconds = run, seconds

    def __call__(self, graph, inputs):
        return self.inner(graph, inputs)

    def open(self, graph):
        session, seconds = self.inner.open(graph), self.seconds
        step = session.run

        def run(inputs):
            time.sleep(seconds)
            return step(inputs)

        session.run = run
        return session

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_client_that_goes_away_frees_its_row(server):
    _, service, port = server
    body = {"messages": [{"role": "user", "content": "Tell me everything."}],
            "max_tokens": 400, "temperature": 0, "stream": True}
    engine = service.engine
    fast, engine.run = engine.run, _Slow(engine.run, 0.02)  # 400 steps: 8 s at least
    try:
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body,
                          headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and '"content"' in line:
                    break
            assert engine.active == 1
        deadline = time.time() + 5
        while engine.active and time.time() < deadline:
            time.sleep(0.05)
        assert engine.active == 0
    finally:
        engine.run = fast


def test_stopping_the_engine_cancels_what_is_in_flight(model):
    _, cfg, weights, codec, _ = model
    engine = Engine(cfg, runners.dense_runner(weights), codec, max_batch=2, context=256,
                    granule=64)
    engine.start()
    events = []
    gate = threading.Event()

    def sink(event):
        events.append(event)
        gate.set()

    engine.submit(Request(codec.encode("hello"), 200, sink=sink))
    gate.wait(30)
    engine.stop()
    assert isinstance(events[-1], Done) and events[-1].finish == "cancelled"
    with pytest.raises(Exception, match="shutting down"):
        wait_for(engine, Request(codec.encode("again"), 2), timeout=5)


def test_ctrl_c_stops_the_server_cleanly_with_a_request_in_flight(model):
    d = model[0]
    port = _free_port()
    proc = subprocess.Popen([str(EINPAGE), "serve", str(d), "--port", str(port),
                             "--backend", "reference", "--context", "4096"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    got: list[str] = []

    def stream():  # a long reply, still streaming when Ctrl-C comes
        body = {"prompt": "once", "max_tokens": 3000, "temperature": 0, "stream": True}
        try:
            with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body,
                              timeout=60) as r:
                for line in r.iter_lines():
                    got.append(line)
        except httpx.HTTPError:
            got.append("cut")

    try:
        for _ in range(200):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        client = threading.Thread(target=stream)
        client.start()
        while not any('"text"' in line for line in got):
            time.sleep(0.05)
        t0 = time.time()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        took = time.time() - t0
        client.join(30)
    finally:
        proc.kill()
    assert proc.returncode in (0, 130) and "Traceback" not in out, out
    assert f"127.0.0.1:{port}" in out and took < 20
    assert not client.is_alive() and got
    # the engine ended the stream after the grace (a last chunk, then [DONE]): not cut mid-way
    assert "cut" not in got and "data: [DONE]" in got, got[-3:]


class _Letters:
    """A codec whose token i is the letter a + i (no special tokens)."""

    def decode(self, ids):
        return "".join(chr(ord("a") + int(i)) for i in ids)

    def stream(self):
        from einpage.models.text import TextStream
        return TextStream(self)


@pytest.mark.parametrize("stop,tokens,shown,text,finish", [
    (("cd",), [0, 1, 2, 3, 4], ["a", "b", "", ""], "ab", "stop"),      # held, then cut
    (("cx",), [0, 2, 3], ["a", "", "cd"], "acd", "length"),             # held, then let go
    (("bcd", "b"), [0, 1], ["a", ""], "a", "stop"),                      # "b" ends it at once
    (("d", "bc"), [0, 1, 2, 3], ["a", "", ""], "a", "stop"),             # the earliest in the text
    (("c",), [0, 1], ["a", "b"], "ab", "length"),                        # the end shows all
])
def test_a_stop_string_is_never_shown_even_across_tokens(stop, tokens, shown, text, finish):
    from einpage.serving.engine import _Row
    events = []
    row = _Row(Request([1], len(tokens) if finish == "length" else 10, stop=stop,
                       sink=events.append), _Letters())
    got = None
    for t in tokens:
        got = row.take(t, np.zeros(26, np.float32))
        if got is not None:
            break
    assert [e.text for e in events] == shown
    assert row.text == text and got == finish


def test_a_failing_request_fails_alone_and_a_stopped_engine_is_unavailable(model):
    from einpage.serving.engine import Unavailable
    _, cfg, weights, codec, _ = model
    engine = Engine(cfg, runners.dense_runner(weights), codec, max_batch=4, context=256,
                    granule=64)
    engine.start()
    with pytest.raises(Exception, match="outside|out of range|vocabulary"):
        wait_for(engine, Request([cfg.vocab + 5], 3), timeout=60)  # its prefill fails
    tokens, done = wait_for(engine, Request(codec.encode("hello"), 3), timeout=60)
    assert done.completion_tokens == 3 and not engine.failure
    engine.stop()
    with pytest.raises(Unavailable, match="shutting down"):
        engine.submit(Request(codec.encode("again"), 2))


def test_a_ring_store_serves_past_its_slots(hf_fixture):
    """Mistral's window keeps a ring of 5 slots: rows run past them, the engine's KV bucket
    never outgrows the store."""
    d = hf_fixture("tiny-mistral")
    cfg, weights = resolve(str(d))
    codec = TextCodec.from_checkpoint(d)
    engine = Engine(cfg, runners.dense_runner(weights), codec, max_batch=2, context=256,
                    granule=64)
    assert engine.store.capacity == cfg.kv_ring < 12
    engine.start()
    try:
        prompt = codec.encode("one two")
        tokens, done = wait_for(engine, Request(prompt, 12), timeout=60)
        want = generate(cfg, np.array([prompt]), 12, runners.dense_runner(weights)).tokens[0]
        assert [t.id for t in tokens] == want.tolist() and done.finish == "length"
    finally:
        engine.stop()


def test_greedy_takes_a_seed_and_a_key_of_any_text_is_checked(server):
    client, _, port = server
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                       temperature=0, seed=3, top_p=0.5, max_tokens=2)
    assert r.usage.completion_tokens >= 1
    r = httpx.get(f"http://127.0.0.1:{port}/v1/models",
                  headers={"Authorization": "Bearer clé".encode("utf-8")})
    assert r.status_code == 401


@pytest.mark.parametrize("parallel,devices", [("tensor", 2), ("pipeline", 2), ("hybrid", 4)])
def test_the_engine_serves_a_model_spread_over_several_devices(model, parallel, devices):
    """Every rank in this process (a `RanksRunner`): the joining requests answer as alone."""
    _, cfg, weights, codec, _ = model
    run = runners.RanksRunner(weights, CompileOptions(BUDGET), devices, "threads",
                              parallel=parallel)
    engine = Engine(cfg, run, codec, max_batch=4, context=256, granule=64)
    engine.start()
    try:
        prompts = [codec.encode(t) for t in ("Hello there", "The quick brown fox", "a")]
        results = [None] * len(prompts)

        def ask(i):
            time.sleep(0.05 * i)
            results[i] = [t.id for t in wait_for(engine, Request(prompts[i], 6), 120)[0]]

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for p, got in zip(prompts, results):
            want = generate(cfg, np.array([p]), 6, runners.dense_runner(weights)).tokens[0]
            assert got == want.tolist()
    finally:
        engine.stop()
