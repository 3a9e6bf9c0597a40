"""`bench/gpu_session.py`, the one command a GPU machine runs: its dry run end to end against the
CuPy stand-in (one step of every kind), and its parts without a GPU: the deadline (a step that
would not fit is skipped, one that runs past its limit or the deadline is stopped and recorded),
the step selection, the `--timing` and pytest parsers, the sanitizer invocation check."""
from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "bench" / "gpu_session.py"


@pytest.fixture(scope="module")
def gs():
    spec = importlib.util.spec_from_file_location("gpu_session", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_session"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("gpu_session", None)


# one step of every kind; the measured row with decode steps parses both pass kinds
DRY_STEPS = ("env,install,pytest-gpu,san-memcheck-disk,calibrate,mvp-tiny-llama-f32,"
             "weights-7b,mvp-decode64-b1,agree,soak,profile")
KINDS = {"env", "install", "pytest", "sanitizer", "calibrate", "measured", "agree", "soak",
         "profile", "weights"}
PEERS = "peers"  # bench/peers.py needs torch, transformers and accelerate: not in the dry run


@pytest.mark.slow  # 35-40 s on 2 cores; run it (`pytest -m slow tests/test_gpu_session.py`)
def test_dry_run_end_to_end(tmp_path, gs):  # before a GPU session and after changing the script
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("no C++ compiler for the CuPy stand-in")
    if not (gs.FIXTURES / gs.SMALL_FIXTURE / "model.safetensors").exists():
        pytest.skip(f"fixtures not found at {gs.FIXTURES}")
    out, work = tmp_path / "session", tmp_path / "work"
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(out),
                           "--work", str(work), "--steps", DRY_STEPS, "--families",
                           "tiny-qwen3"], capture_output=True, text=True, cwd=REPO, timeout=300)
    seconds = time.monotonic() - t0
    results = json.loads((out / "results.json").read_text())
    steps = {r["name"]: r for r in results["steps"]}
    bad = {name: (r["status"], r["note"]) for name, r in steps.items()
           if r["status"] not in ("ok", "skipped-dry-run")}
    assert not bad and done.returncode == 0, (bad, done.stdout[-3000:], done.stderr[-3000:])
    assert set(steps) == set(DRY_STEPS.split(","))  # in the session's order
    assert list(steps) == [s.name for s in gs.select(gs.build_steps(), DRY_STEPS)]
    assert {r["kind"] for r in steps.values()} == KINDS
    assert results["dry_run"] is True and results["elapsed_s"] <= seconds + 1
    # few files in --out (the device tool brings back 8); the logs in one archive and in --work
    assert {p.name for p in out.iterdir()} == {"results.json", "summary.md", "logs.tar.gz",
                                               "profile-fake-cupy.json"}
    with tarfile.open(out / "logs.tar.gz") as tar:
        logs = set(tar.getnames())
    for r in steps.values():  # every step: its command, exit status, seconds and log
        assert r["command"] and r["seconds"] >= 0
        assert (work / r["log"]).exists() and r["log"] in logs
        assert r["rc"] == 0 or r["status"] == "skipped-dry-run"
    assert steps["install"]["status"] == "skipped-dry-run"
    assert steps["pytest-gpu"]["numbers"]["passed"] >= 1
    san = steps["san-memcheck-disk"]["numbers"]
    assert san["sanitizer_command"].startswith(gs.sanitizer_argv("memcheck", [])[0])
    assert "--tool memcheck --error-exitcode 1" in san["sanitizer_command"]
    assert san["disk_bytes"]  # the run had a disk tier
    profile = json.loads((out / steps["calibrate"]["numbers"]["profile_file"]).read_text())
    assert profile["name"] == "cupy-calibrated" and profile["h2d_bandwidth"] > 0
    row = steps["mvp-tiny-llama-f32"]["numbers"]
    assert row["wall_measured_s"] > 0 and row["wall_predicted_s"] > 0 and row["ratio"] > 0
    assert "--device-file" in steps["mvp-tiny-llama-f32"]["command"]  # calibrate's profile
    decode = steps["mvp-decode64-b1"]["numbers"]
    assert decode["decode_steps"] == gs.DECODE_STEPS[1] and decode["decode_ratio"] > 0
    agree = steps["agree"]["numbers"]["fixtures"]
    assert set(agree) == {"tiny-qwen3"}
    f = agree["tiny-qwen3"]
    assert f["ok"] and f["logits_close"] and f["tokens_identical"] and f["text_identical"]
    assert f["cli_tokens_identical"] and f["cli_text_identical"] and f["draft_tokens_identical"]
    soak = steps["soak"]["numbers"]
    assert soak["steps"] == gs.SOAK_STEPS[1] and soak["device_free_delta_bytes"] == 0
    assert soak["hook_allocations"] == soak["hidden_allocations"] == 0
    prof = steps["profile"]["numbers"]  # the compute thread profiled: the backend's applies
    assert prof["us_per_apply"] > 0 and prof["first_pass_s"] > 0 and prof["applies"] > 0
    assert prof["compute_thread_s"] > 0 and len(prof["top"]) == 30
    assert sum(r["calls"] for r in prof["top"]) >= prof["applies"] * prof["profiled_passes"]
    summary = (out / "summary.md").read_text()
    assert summary.startswith("# GPU session") and "| step | status | seconds | result |" in summary
    for name in steps:
        assert f"| {name} |" in summary
    assert "## Measured against predicted" in summary and "## Decode soak" in summary
    # the short table comes last (the device tool returns only the tail of the output)
    tail = done.stdout.strip().splitlines()
    assert tail[-1].startswith("results: ") and tail[-2].startswith(f"{len(steps)}/{len(steps)} ok")


def _cmd(seconds: float) -> list[str]:
    return [sys.executable, "-c", f"import time; time.sleep({seconds}); print('done')"]


def test_deadline_skips_what_does_not_fit_and_stops_what_overruns(tmp_path, gs):
    Step = gs.Step
    steps = [
        Step("quick", "command", "fits", argv=lambda ctx: _cmd(0), dry_expect_s=0.5,
             dry_limit_s=30),
        Step("too-long", "command", "expected past the deadline", argv=lambda ctx: _cmd(0),
             dry_expect_s=1000, dry_limit_s=2000),
        Step("over-limit", "command", "runs past its own limit", argv=lambda ctx: _cmd(30),
             dry_expect_s=0.5, dry_limit_s=1),
        Step("over-deadline", "command", "runs past the session's deadline",
             argv=lambda ctx: _cmd(30), dry_expect_s=0.5, dry_limit_s=100),
        Step("after", "command", "nothing left", argv=lambda ctx: _cmd(0), dry_expect_s=0.5,
             dry_limit_s=30),
    ]
    ctx = gs.Context(out=tmp_path / "out", work=tmp_path, dry_run=True)
    t0 = time.monotonic()
    results = gs.run_steps(steps, ctx, deadline_s=gs.RESERVE_S + 4, say=lambda _: None)
    assert time.monotonic() - t0 < 15  # nothing waited for the 30 s sleeps
    got = {r["name"]: r for r in results["steps"]}
    assert got["quick"]["status"] == "ok" and got["quick"]["rc"] == 0
    assert "done" in (tmp_path / "quick.log").read_text()
    assert got["too-long"]["status"] == "skipped-time" and got["too-long"]["rc"] is None
    assert "1000 s" in got["too-long"]["note"]
    assert got["over-limit"]["status"] == "timeout" and "its limit" in got["over-limit"]["note"]
    assert got["over-deadline"]["status"] == "timeout"
    assert "deadline" in got["over-deadline"]["note"]
    assert got["after"]["status"] == "skipped-time"
    on_disk = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [r["status"] for r in on_disk["steps"]] == [r["status"] for r in results["steps"]]
    table = gs.short_table(results)
    assert table.splitlines()[-1].startswith("1/5 ok") and "too-long" in table


def test_a_failing_step_and_a_missing_need_are_recorded_not_fatal(tmp_path, gs):
    Step = gs.Step
    steps = [Step("fails", "command", "exit 3", dry_expect_s=0.5,
                  argv=lambda ctx: [sys.executable, "-c", "import sys; "
                                    "print('einpage: error: no good'); sys.exit(3)"]),
             Step("missing", "command", "needs what is not here", argv=lambda ctx: _cmd(0),
                  needs=lambda ctx: "no such tool"),
             Step("broken", "command", "a bug building its command",
                  argv=lambda ctx: 1 / 0),
             Step("fine", "command", "still runs", argv=lambda ctx: _cmd(0), dry_expect_s=0.5)]
    results = gs.run_steps(steps, gs.Context(out=tmp_path / "out", work=tmp_path,
                                             dry_run=True), deadline_s=60, say=lambda _: None)
    got = {r["name"]: r for r in results["steps"]}
    assert got["fails"]["status"] == "failed" and got["fails"]["rc"] == 3
    assert got["fails"]["note"] == "exit status 3: einpage: error: no good"
    assert got["missing"]["status"] == "not-available"
    assert got["missing"]["note"] == "not available: no such tool"
    assert got["broken"]["status"] == "failed" and "ZeroDivisionError" in got["broken"]["note"]
    assert got["fine"]["status"] == "ok"


def test_select_steps_by_name_and_glob(gs):
    steps = gs.build_steps()
    names = [s.name for s in steps]
    assert len(names) == len(set(names))
    assert [s.name for s in gs.select(steps, "soak,san-*-disk")] == [
        "san-memcheck-disk", "san-racecheck-disk", "san-synccheck-disk", "soak"]
    assert gs.select(steps, None) == steps
    with pytest.raises(SystemExit, match="matches no step"):
        gs.select(steps, "soak,sanitize")
    kinds = {s.kind for s in steps}
    assert kinds == KINDS | {PEERS}
    for s in steps:  # a dry run and a real run each fit their limits
        for dry in (True, False):
            expect, limit = s.times(dry)
            assert 0 < expect <= limit


TIMING = """row 0: next token 83
prefill pass on cupy: measured | predicted on h100-pcie
  wall              1.371 s |    1.52 ms  (903.31x)
  compute busy      1.369 s |    1.27 ms  (1081.28x)
  compute stall     2.05 ms |    0.24 ms  (8.49x)
  h2d busy          2.40 ms |    1.41 ms  (1.70x)
  d2h busy          0.16 ms |    0.16 ms  (0.98x)
  disk busy         8.97 ms |   11.63 ms  (0.77x)
  h2d bytes       485.65 KB |  485.65 KB   achieved 202.09 MB/s
  disk bytes      400.90 KB |  400.90 KB   achieved 44.69 MB/s
  h2d hidden behind compute: 91%
  before the pass: 48.38 KB of resident weights loaded in 0.85 ms
decode step 1 on cupy: measured | predicted on h100-pcie
  wall              2.00 ms |    1.00 ms  (2.00x)
decode step 2 on cupy: measured
  wall              3.00 ms |          -
"""


def test_parse_timing(gs):
    passes = gs.parse_timing(TIMING)
    assert [p["title"] for p in passes] == ["prefill pass", "decode step 1", "decode step 2"]
    first = passes[0]
    assert first["backend"] == "cupy" and first["device"] == "h100-pcie"
    assert first["wall"] == {"measured": 1.371, "predicted": pytest.approx(1.52e-3),
                             "ratio": 903.31}
    assert first["disk bytes"]["measured_bytes"] == 400_900
    assert first["h2d bytes"]["achieved"] == "202.09 MB/s" and first["h2d_hidden"] == "91%"
    assert first["load"]["seconds"] == pytest.approx(0.85e-3)
    assert passes[2]["wall"] == {"measured": 3e-3, "predicted": None, "ratio": None}
    record = {"status": "ok", "numbers": {}, "note": ""}
    gs.parse_measured(gs.Context(out=Path("."), dry_run=True), record, TIMING)
    n = record["numbers"]
    assert n["ratio"] == 903.31 and n["decode_steps"] == 2
    assert n["decode_measured_s"] == pytest.approx(5e-3) and n["decode_predicted_s"] is None


def test_parse_pytest_and_sanitizer_summaries(gs):
    record = {"status": "failed", "rc": 1, "numbers": {}, "note": ""}
    gs.parse_pytest(None, record, "FAILED tests/test_x.py::test_y - AssertionError: no\n"
                                  "SKIPPED [2] tests/test_z.py:9: a GPU is usable here\n"
                                  "1 failed, 120 passed, 3 skipped, 2 warnings in 61.20s\n")
    n = record["numbers"]
    assert (n["passed"], n["failed"], n["skipped"]) == (120, 1, 3)
    assert n["skip_reasons"] == ["a GPU is usable here"]
    assert n["failures"] == ["FAILED tests/test_x.py::test_y"]
    ctx = gs.Context(out=Path("."), dry_run=False)
    record = {"name": "san-racecheck-prefill", "status": "ok", "rc": 0, "numbers": {},
              "note": ""}
    gs.parse_sanitized(ctx, record, "========= RACECHECK SUMMARY: 0 hazards displayed "
                                    "(0 errors, 0 warnings)\n========= ERROR SUMMARY: 0 errors\n")
    assert record["status"] == "ok" and record["numbers"]["sanitizer_errors"] == 0
    # racecheck on a real GPU prints its own summary and no ERROR SUMMARY line
    for race, status in (("0 hazards displayed (0 errors, 0 warnings)", "ok"),
                         ("2 hazards displayed (1 error, 1 warning)", "failed")):
        record = {"name": "san-racecheck-decode", "status": "ok", "rc": 0, "numbers": {},
                  "note": ""}
        gs.parse_sanitized(ctx, record, f"========= RACECHECK SUMMARY: {race}\n")
        assert record["status"] == status, record
    record = {"name": "san-memcheck-prefill", "status": "ok", "rc": 0, "numbers": {},
              "note": ""}
    gs.parse_sanitized(ctx, record, "row 0: next token 1\n")
    assert record["status"] == "failed" and "no ERROR SUMMARY" in record["note"]


def test_sanitizer_invocation_check(gs):
    inner = [sys.executable, "-c", "pass"]
    assert gs.check_sanitizer_argv(gs.sanitizer_argv("racecheck", inner)) is None
    assert "expected one of" in gs.check_sanitizer_argv(gs.sanitizer_argv("memchek", inner))
    assert "no program" in gs.check_sanitizer_argv(gs.sanitizer_argv("memcheck", []))
    assert "not an executable" in gs.check_sanitizer_argv(
        gs.sanitizer_argv("memcheck", ["no-such-einpage", "run"]))
    assert "unknown" in gs.check_sanitizer_argv(["compute-sanitizer", "--tool", "memcheck",
                                                 "--error-exitcode", "1", "--bogus", "x",
                                                 *inner])
    assert "integer" in gs.check_sanitizer_argv(["compute-sanitizer", "--tool", "memcheck",
                                                 "--error-exitcode", "one", *inner])


def test_peers_step_runs_peers_py_on_the_llama_rows_tokens_and_reads_its_json(gs, tmp_path):
    """The peers step gives bench/peers.py the tokens the llama rows give einpage and the
    budget of the 4 GB rows, and reports each peer's prefill median and decode step."""
    ctx = gs.Context(out=tmp_path / "out", work=tmp_path / "work")
    ctx.work.mkdir(parents=True)
    argv = gs._peers_argv(ctx)
    assert argv[1].endswith("bench/peers.py")
    tokens = argv[argv.index("--tokens-file") + 1]
    assert np.load(tokens).shape == (1, gs.LLAMA_PREFILL_SEQ[0])
    assert argv[argv.index("--budget") + 1] == gs.PEER_BUDGET
    (ctx.work / "peers.json").write_text(json.dumps({"peers": {
        "eager": {"prefill": {"median_s": 0.25}, "generate": {"decode_step_s": 0.02}},
        "accelerate": {"prefill": {"median_s": 3.5}, "generate": {"one_token_s": 1.0}},
        "compile": {"skipped": "deadline"}}}))
    record = {"status": "ok", "numbers": {}, "note": ""}
    gs._parse_peers(ctx, record, "")
    n = record["numbers"]
    assert n["eager_prefill_s"] == 0.25 and n["eager_decode_step_s"] == 0.02
    assert n["accelerate_prefill_s"] == 3.5 and "accelerate_decode_step_s" not in n
    assert "compile_prefill_s" not in n and "eager_prefill_s 0.250 s" in record["note"]


def test_random_checkpoint_holds_the_random_weights(tmp_path):
    """bench/random_checkpoint.py writes a preset's --random-weights as a sharded Hugging Face
    checkpoint that einpage reads back as the same model computing the same logits; a second
    write of the same model and seed keeps it; a preset it cannot express is refused."""
    spec = importlib.util.spec_from_file_location("random_checkpoint",
                                                  REPO / "bench" / "random_checkpoint.py")
    rc = importlib.util.module_from_spec(spec)
    sys.modules["random_checkpoint"] = rc  # its shard workers pickle functions by module
    spec.loader.exec_module(rc)
    from einpage.models import resolve
    from einpage.models.generation import prefill
    from einpage.runtime import evaluate
    path = tmp_path / "tiny-random"
    assert rc.write("tiny", path, seed=3, workers=2) > 0
    files = sorted(p.name for p in path.glob("*.safetensors"))
    assert files == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    before = {p.name: p.stat().st_mtime_ns for p in path.iterdir()}
    rc.write("tiny", path, seed=3)
    assert {p.name: p.stat().st_mtime_ns for p in path.iterdir()} == before
    ids = np.array([[1, 2, 3, 4, 5]])
    cfg, weights = resolve("tiny", random_weights=True, seed=3)
    read, read_weights = resolve(str(path))
    assert (read.layers, read.hidden, read.dtype) == (cfg.layers, cfg.hidden, cfg.dtype)
    want = prefill(cfg, ids, lambda g, i: evaluate(g, i, weights))["logits"]
    got = prefill(read, ids, lambda g, i: evaluate(g, i, read_weights))["logits"]
    np.testing.assert_array_equal(got, want)
    with pytest.raises(SystemExit, match="only plain LLaMA"):
        rc.write("mixtral-8x7b", tmp_path / "x")


def test_summary_sets_einpage_against_the_peers(gs):
    """summary.md compares the measured rows with the peers step's figures against issue 27's
    goals (2x accelerate, within 1.3x of eager), and leaves out what did not run."""
    from gpu_session_runner import summary_markdown
    steps = [
        {"name": "mvp-7b-4GB", "kind": "measured", "status": "ok", "seconds": 1, "note": "",
         "numbers": {"wall_measured_s": 0.25, "first": "pass 1"}},
        {"name": "mvp-7b-fits", "kind": "measured", "status": "ok", "seconds": 1, "note": "",
         "numbers": {"wall_measured_s": 0.15, "first": "pass 1"}},
        {"name": "peers", "kind": "peers", "status": "ok", "seconds": 1, "note": "",
         "numbers": {"accelerate_prefill_s": 1.3, "eager_prefill_s": 0.06}}]
    text = summary_markdown({"steps": steps, "dry_run": True, "started": "now",
                             "deadline_s": 540, "elapsed_s": 3})
    table = text.split("## Against the peers")[1]
    assert "einpage 5.20x faster | >= 2.0x: met" in table
    assert "einpage at 2.50x the peer's time | <= 1.3x: not met" in table
    assert "decode step, 4 GB" not in table and "torch.compile" not in table
