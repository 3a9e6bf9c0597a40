#!/usr/bin/env python3
"""One command for a machine with an NVIDIA GPU: install the checkout, run the GPU tests,
compute-sanitizer on paged plans, `einpage calibrate --backend cupy`, measured-vs-predicted
passes, the CuPy backend against the threads backend on every fixture family, and a 1,000-step
decode soak, within 9 minutes; every result under `--out DIR`.

    python bench/gpu_session.py --out "$OUT"                       # on the GPU machine
    python bench/gpu_session.py --out "$OUT" --steps 'san-*,soak'  # some steps (names or globs)
    python bench/gpu_session.py --list                             # the steps, in order
    python bench/gpu_session.py --dry-run --out /tmp/gs            # no GPU: against the stand-in

The session is a list of named steps, run in order. Each is a command line (or a preparation
command, such as compiling a plan, then the command) or a Python function run in a fresh child
interpreter through this file (so that a time limit can stop it and GPU memory starts clean);
each has the time it is expected to take and a hard limit, and records the command, exit
status, seconds and the numbers parsed from its output. A global deadline (default 9 minutes)
bounds the whole: a step whose expected time no longer fits is recorded as `skipped-time` and
not started; a running step is stopped at its own limit or at the deadline and recorded as
`timeout`, saying which.

`--out DIR` receives few files, since the device tool brings back at most 8 from $OUT:
`results.json` (per step: the command, rc, seconds, status, parsed numbers), `summary.md` (the
tables), `logs.tar.gz` (every step's log) and `profile-<kind>.json` (calibrate's). Each step's
output goes to `<step>.log` in the work directory (`--work`, default a new one in /tmp, kept),
with the plans, inputs and scratch. All of it is rewritten after every step, so a session cut
short from outside still leaves what it did. A short table is printed last.

`--dry-run` (any machine with g++): `tests/fake_cupy.FakeCupy` stands in for CuPy in every
child, pip install is skipped, the sanitizer steps check the compute-sanitizer invocation and
run the inner command directly, and workloads too large for a CPU are shrunk (recorded per
step): the whole script runs end to end so that its first GPU run cannot die of a typo. Its
test (`tests/test_gpu_session.py::test_dry_run_end_to_end`, about 40 s) is marked slow: run
`python -m pytest -m slow tests/test_gpu_session.py` before a GPU session and after changing
this script.

Statuses: ok, failed, timeout, skipped-time (the deadline), skipped-dry-run, not-available
(something the step needs is missing here: the reason is recorded), interrupted.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

HERE = Path(__file__).absolute().parent
REPO = HERE.parent
if str(HERE) not in sys.path:  # the session's own modules (also when loaded by path)
    sys.path.insert(0, str(HERE))
from gpu_session_fake import install_fake  # noqa: E402
from gpu_session_runner import (_CURRENT, DEFAULT_DEADLINE_S, FAKE_ENV,  # noqa: E402
                                LOGS, OK_STATUSES, Context, Step, _kill_group,
                                find_sanitizer, run_steps, select, short_table)
# the tests reach these here
from gpu_session_runner import RESERVE_S, check_sanitizer_argv, sanitizer_argv  # noqa: E402, F401
from gpu_session_parse import (parse_bytes, parse_calibrate, parse_measured,  # noqa: E402
                               parse_pytest, parse_sanitized)
from gpu_session_parse import parse_timing  # noqa: E402, F401 (the tests reach it here)
from gpu_session_config import (DECODE_PROMPT, DECODE_STEPS, FAMILIES,  # noqa: E402, F401
                                FAMILIES_ENV, FIXTURES, FIXTURES_ENV, GPU_TEST_FILES,
                                FITS_BUDGET, LLAMA_PREFILL_SEQ, MEASURED_PASSES, PEER_BUDGET,
                                PEERS_DEADLINE_S, REQUIRED, SAN_DECODE_STEPS,
                                SMALL_FIXTURE, SOAK_STEPS, TEST_FIXTURES, XDIST_ENV, fixture,
                                npy_shape, slug)
from gpu_session_checks import PY_STEPS, arena_runner  # noqa: E402, F401
import gpu_session_config as config  # noqa: E402
# ====================================================================== the steps

def _hasfixture(name: str) -> Callable[[Context], str | None]:
    def need(ctx: Context) -> str | None:
        path = fixture(name)
        return None if (path / "model.safetensors").exists() else f"no fixture {path}"
    return need


def _needs_modules(*names: str) -> Callable[[Context], str | None]:
    def need(ctx: Context) -> str | None:
        import importlib.util
        missing = [n for n in names if importlib.util.find_spec(n) is None]
        return f"python modules missing: {', '.join(missing)}" if missing else None
    return need


def _weight_bytes(path: Path) -> int:
    """A checkpoint's weight bytes (einpage's own figure: `cfg.weight_bytes()`)."""
    from einpage.models import resolve
    return resolve(str(path))[0].weight_bytes()


def _preset_bytes(name: str) -> int:
    from einpage.models.config import PRESETS
    return PRESETS[name].weight_bytes()


def _device_args(ctx: Context) -> list[str]:
    if ctx.profile:
        return ["--device-file", ctx.profile]
    name = _builtin_device(ctx.gpu_name)
    ctx.profile_note = f"builtin {name} (no calibrated profile)"
    return ["--device", name]


def _builtin_device(gpu_name: str) -> str:
    """The cost model's profile nearest the GPU's name (h100-pcie where none matches)."""
    from einpage.predict import PROFILES
    g = gpu_name.lower()
    for key, name in (("h200", "h200"), ("h100 pcie", "h100-pcie"), ("h100", "h100-sxm"),
                      ("a100-pcie", "a100-pcie"), ("a100", "a100-sxm"), ("v100", "v100"),
                      ("p100", "p100"), ("t4", "t4"), ("4090", "rtx4090")):
        if key in g:
            return name if name in PROFILES else "h100-pcie"
    return "h100-pcie"


def _tokens_file(ctx: Context, batch: int, seq: int, vocab: int = 32000) -> str:
    import numpy as np
    path = ctx.inputs / f"tokens-{batch}x{seq}-v{vocab}.npy"
    if not path.exists():
        rng = np.random.default_rng(0)
        np.save(path, rng.integers(1, vocab, (batch, seq), dtype=np.int64))
    return str(path)


def _host_budget_for_disk(ctx: Context, path: Path, arena: int) -> str:
    """A `--cpu-mem` small enough that most streamed weight blocks come from disk: what
    `einpage compile --cpu-mem 1` names as the smallest host budget that works, with a margin
    (the figure is rounded)."""
    batch, seq = npy_shape(path / "input_ids.npy")
    argv = ctx.einpage + ["compile", str(path), "--gpu-mem", str(arena), "--batch", str(batch),
                          "--seq", str(seq), "--cpu-mem", "1", "--quiet"]
    env = ctx.env()
    env.pop(FAKE_ENV, None)
    got = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    m = re.search(r"smallest host budget that would work is ([0-9.]+ ?[KMGT]?i?B)", got.stderr)
    if not m:
        raise RuntimeError("could not learn the smallest host budget: "
                           + (got.stderr.strip().splitlines() or ["(no error)"])[-1])
    return str(int(parse_bytes(m.group(1)) * 1.25) + 64 * 1024)


def _fixture_plan_run(name: str, disk: bool = False, timing: bool = True, passes: int = 1):
    """A fixture's prefill on cupy at 1/4 of its weights, the way einpage runs a small model on a
    GPU: `einpage compile FIXTURE --gpu-mem W/4 -o plan` (with `disk`: a `--cpu-mem` that puts
    weights on disk), then `einpage run plan --checkpoint FIXTURE --backend cupy`. (With
    `--gpu-mem` a cupy budget counts the CUDA context, which 1/4 of a fixture cannot hold.)"""
    def argv(ctx: Context) -> list[list[str]]:
        path = fixture(name)
        arena = _weight_bytes(path) // 4
        batch, seq = npy_shape(path / "input_ids.npy")
        plans = ctx.work / "plans"
        plans.mkdir(exist_ok=True)
        plan = plans / f"{name}{'-disk' if disk else ''}.json"
        compile_ = ctx.einpage + ["compile", str(path), "--gpu-mem", str(arena), "--batch",
                                  str(batch), "--seq", str(seq), "--quiet", "-o", str(plan)]
        if disk:
            compile_ += ["--cpu-mem", _host_budget_for_disk(ctx, path, arena)]
        run = ctx.einpage + ["run", str(plan), "--checkpoint", str(path), "--tokens-file",
                             str(path / "input_ids.npy"), "--backend", "cupy"]
        if timing:
            run += ["--timing", *_device_args(ctx)]
        if passes > 1:
            run += ["--passes", str(passes)]
        return [compile_, run]
    return argv


def _needs_sanitizer(ctx: Context) -> str | None:
    if ctx.dry_run:
        return None
    ctx.sanitizer_path = ctx.sanitizer_path or find_sanitizer()
    return None if ctx.sanitizer_path else ("compute-sanitizer not found (PATH, /usr/local/cuda*"
                                            ", /opt/nvidia, nvidia pip packages)")


def _both(*needs):
    def need(ctx):
        for n in needs:
            why = n(ctx)
            if why:
                return why
        return None
    return need


def _install_argv(ctx: Context) -> list[str]:
    script = (
        "import subprocess, sys, shutil, pathlib\n"
        "base = [sys.executable, '-m', 'pip', 'install', '--no-deps', '--no-build-isolation']\n"
        f"repo = {str(REPO)!r}\n"
        "rc = subprocess.call(base + ['-e', repo])\n"
        "if rc:\n"
        "    print('editable install failed; trying a plain install', flush=True)\n"
        "    rc = subprocess.call(base + [repo])\n"
        "if rc: sys.exit(rc)\n"
        "exe = pathlib.Path(sys.executable).parent / 'einpage'\n"
        "exe = str(exe) if exe.exists() else shutil.which('einpage')\n"
        "print('einpage entry point:', exe, flush=True)\n"
        "sys.exit(subprocess.call([exe, '--version']) if exe else 3)\n")
    return [ctx.python, "-c", script]


def parse_install(ctx: Context, record: dict, text: str) -> None:
    m = re.search(r"^einpage entry point: (\S+)$", text, re.M)
    if record["status"] == "ok" and m and m.group(1) != "None":
        ctx.einpage = [m.group(1)]
        record["numbers"]["einpage"] = m.group(1)
    if v := re.search(r"^einpage (\d\S*)$", text, re.M):
        record["numbers"]["version"] = v.group(1)
    if record["status"] != "ok":
        ctx.notes.append("install failed: the einpage commands run from the source tree "
                         "(PYTHONPATH) through bench/gpu_session.py _cli")


def _pytest_argv(gpu: bool) -> Callable[[Context], list[str]]:
    def argv(ctx: Context) -> list[str]:
        base = [ctx.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs"]
        files = [f for f in GPU_TEST_FILES if (REPO / f).exists()]
        if ctx.dry_run:  # a few fast tests: the invocation and the parsing, not the suite
            if gpu:
                return base + ["tests/test_cuda_backend.py", "-k",
                               "workspace_bytes or one_line"]
            return base + ["tests/test_scalar.py"]
        if gpu:  # serially: a cupy budget counts what other processes hold of the device
            return base + files
        workers = int(os.environ.get(XDIST_ENV) or 0)
        return (base + ([f"-n{workers}"] if workers else [])
                + [f"--ignore={f}" for f in files])
    return argv


def _calibrate_argv(ctx: Context) -> list[str]:
    cmd = ctx.einpage + ["calibrate", "--backend", "cupy", "-o",
                         str(ctx.out / f"profile-{ctx.kind}.json")]
    if not ctx.dry_run:  # the drive of the checkpoints: 1 GB written there, read, removed
        fixtures = config.FIXTURES
        cmd += ["--disk", str(fixtures.parent if fixtures.parent.is_dir() else REPO)]
    return cmd


def _parse_env(ctx: Context, record: dict, text: str) -> None:
    n = record["numbers"]
    ctx.kind = n.get("kind", ctx.kind)
    ctx.gpu_name = n.get("gpu_name", "")
    if n.get("sanitizer"):
        ctx.sanitizer_path = n["sanitizer"]
    if n.get("stand_in_lacks"):
        ctx.notes.append("the CuPy stand-in (tests/fake_cupy.py) lacks "
                         f"{', '.join(n['stand_in_lacks'])}: gpu_session adds them in dry runs")


def dry_budget(arena: int) -> int:
    """Dry run: the `--gpu-mem` that leaves about `arena` bytes to the plan on the stand-in,
    whose CUDA context and cuBLAS handles take `fake_cupy.CONTEXT_BYTES` + 2 handles (the
    budget counts them, `einpage.runtime.backends.cuda_memory.reserve`)."""
    try:
        sys.path.insert(0, str(REPO / "tests"))
        import fake_cupy
        context = fake_cupy.CONTEXT_BYTES + 2 * fake_cupy.HANDLE_BYTES
    except Exception:
        context = 320 << 20
    try:
        from einpage.runtime.backends.cuda_memory import GRANULE, cublas_workspace
    except ImportError:
        return context + (64 << 20) + arena
    budget = context + arena
    for _ in range(8):  # cuBLAS's share depends on the budget: a fixed point in a few rounds
        budget = context + -(-cublas_workspace(budget) // 256) * 256 + GRANULE + arena
    return budget


def _random_dir(ctx: Context, model: str) -> Path:
    """Where the `weights-*` step writes `model`'s random weights (bench/random_checkpoint.py)."""
    return ctx.work / f"{model}-random"


def _weights(ctx: Context, model: str) -> list[str]:
    """`model --random-weights`, or the checkpoint of the same weights a `weights-*` step of
    this session wrote (read from the page cache: no weights made again per run)."""
    path = _random_dir(ctx, model)
    return [str(path)] if (path / "einpage-random.json").exists() else [model, "--random-weights"]


def _write_weights(model: str):
    def argv(ctx: Context) -> list[str]:
        name = "small" if ctx.dry_run else model
        return [ctx.python, str(REPO / "bench" / "random_checkpoint.py"), name,
                str(_random_dir(ctx, name))]
    return argv


def _llama_run(model: str, budget: str, dry_arena: Callable[[int], int]):
    def argv(ctx: Context) -> list[str]:
        if ctx.dry_run:
            name, flag = "small", str(dry_budget(dry_arena(_preset_bytes("small"))))
        else:
            name, flag = model, budget
        seq = ctx.pick(LLAMA_PREFILL_SEQ)
        return ctx.einpage + ["run", *_weights(ctx, name), "--tokens-file",
                              _tokens_file(ctx, 1, seq, 256 if ctx.dry_run else 32000),
                              "--gpu-mem", flag, "--backend", "cupy", "--timing",
                              "--passes", str(MEASURED_PASSES), *_device_args(ctx)]
    return argv


def _llama_decode(batch: int, budget: str = "16GB"):
    def argv(ctx: Context) -> list[str]:
        name, flag = (("small", str(dry_budget(2 * _preset_bytes("small")))) if ctx.dry_run
                      else ("llama-7b", budget))
        prompt = ctx.pick(DECODE_PROMPT)
        steps = ctx.pick(DECODE_STEPS)
        return ctx.einpage + ["generate", *_weights(ctx, name), "--tokens-file",
                              _tokens_file(ctx, batch, prompt, 256 if ctx.dry_run else 32000),
                              "--max-new-tokens", str(steps + 1), "--ignore-eos",
                              "--gpu-mem", flag, "--backend", "cupy", "--json", "--timing",
                              *_device_args(ctx)]
    return argv


def _peers_argv(ctx: Context) -> list[str]:
    """bench/peers.py on llama-7b (dry run: the `tiny` preset, eager only, on the CPU) with the
    tokens the llama rows give einpage; its JSON goes to the work directory."""
    seq = ctx.pick(LLAMA_PREFILL_SEQ)
    argv = [ctx.python, str(REPO / "bench" / "peers.py"), "--json", str(ctx.work / "peers.json"),
            "--tokens-file", _tokens_file(ctx, 1, seq, 256 if ctx.dry_run else 32000),
            "--seq", str(seq), "--prompt", str(ctx.pick(DECODE_PROMPT)),
            "--new", str(ctx.pick(DECODE_STEPS)), "--budget", PEER_BUDGET,
            "--deadline", str(PEERS_DEADLINE_S)]
    written = _weights(ctx, "tiny" if ctx.dry_run else "llama-7b")
    if len(written) == 1:
        argv += ["--checkpoint", written[0]]
    if ctx.dry_run:
        argv += ["--model", "tiny", "--which", "eager", "--reps", "2"]
    return argv


def _parse_peers(ctx: Context, record: dict, text: str) -> None:
    """The peers' seconds: prefill median, decode seconds per step and tokens/s, per peer."""
    path = ctx.work / "peers.json"
    if not path.exists():
        return
    got = json.loads(path.read_text())
    n = record["numbers"]
    n["peers"] = got
    for peer, r in got.get("peers", {}).items():
        pre, gen = r.get("prefill", {}), r.get("generate", {})
        if pre.get("median_s") is not None:
            n[f"{peer}_prefill_s"] = pre["median_s"]
        if gen.get("decode_step_s") is not None:
            n[f"{peer}_decode_step_s"] = gen["decode_step_s"]
    record["note"] = ", ".join(f"{k} {v:.3f} s" for k, v in n.items()
                               if isinstance(v, float))


def _workload(text: str, shrunk: bool = True):
    """A parse that also records, in words, the workload (and its dry-run stand-in)."""
    def parse(ctx: Context, record: dict, log: str) -> None:
        record["numbers"]["workload"] = (f"dry run: `small` preset for {text}"
                                         if ctx.dry_run and shrunk else text)
        parse_measured(ctx, record, log)
    return parse


def build_steps() -> list[Step]:
    """The session, in the order it runs (the most wanted first: what does not fit the deadline
    is at the end)."""
    san_need = _both(_hasfixture(SMALL_FIXTURE), _needs_sanitizer)
    steps = [
        Step("env", "env", "python, GPU, CuPy, dependencies, compute-sanitizer, fixtures",
             py="env", expect_s=10, limit_s=60, parse=_parse_env),
        Step("install", "install", "pip install --no-deps --no-build-isolation -e . ; einpage "
             "--version", argv=_install_argv, expect_s=30, limit_s=120, parse=parse_install,
             skip_in_dry_run=True),
        Step("pytest-gpu", "pytest", "the GPU test files (the backend on the real device)",
             argv=_pytest_argv(True), expect_s=150, limit_s=300, dry_expect_s=5,
             parse=parse_pytest, needs=_needs_modules("pytest", "hypothesis")),
    ]
    for tool, expect in (("memcheck", 60), ("racecheck", 90), ("synccheck", 60)):
        steps.append(Step(f"san-{tool}-disk", "sanitizer", f"compute-sanitizer {tool}: "
                          f"{SMALL_FIXTURE} prefill plan at 1/4 with a disk tier (small "
                          "--cpu-mem)", argv=_fixture_plan_run(SMALL_FIXTURE, disk=True),
                          sanitizer=tool, expect_s=expect, limit_s=3 * expect, dry_expect_s=5,
                          parse=parse_sanitized, needs=san_need))
    steps += [
        Step("calibrate", "calibrate", "einpage calibrate --backend cupy (and --disk)",
             argv=_calibrate_argv, expect_s=40, limit_s=150, dry_expect_s=10,
             parse=parse_calibrate),
    ]
    for fam in FAMILIES:
        steps.append(Step(f"mvp-{fam}", "measured", f"{fam} prefill plan at 1/4 of its weights,"
                          " --timing", argv=_fixture_plan_run(fam, passes=MEASURED_PASSES),
                          expect_s=12, limit_s=90,
                          dry_expect_s=4, parse=_workload(f"{fam} prefill at 1/4", shrunk=False),
                          needs=_hasfixture(fam)))
    steps += [
        Step("agree", "agree", "cupy vs threads on every family at 1/4: run (plan file) and "
             "generate (in-process)", py="agree", expect_s=60, limit_s=240, dry_expect_s=20),
        Step("soak", "soak", f"{SOAK_STEPS[0]} decode steps in one session: memGetInfo and "
             "RSS flat", py="soak", expect_s=60, limit_s=300, dry_expect_s=8,
             needs=_hasfixture(SMALL_FIXTURE)),
        Step("profile", "profile", f"{SMALL_FIXTURE} prefill passes in one session: time per "
             "apply, and cProfile of the compute queue's thread", py="profile", expect_s=20,
             limit_s=120, dry_expect_s=15, needs=_hasfixture(SMALL_FIXTURE)),
        Step("weights-7b", "weights", "llama-7b's --random-weights written once as a "
             "checkpoint (bench/random_checkpoint.py): the llama-7b rows and peers read it",
             argv=_write_weights("llama-7b"), expect_s=30, limit_s=240, dry_expect_s=3),
        Step("mvp-7b-16GB", "measured", "llama-7b --random-weights prefill B=1 S=2048 at 16 GB",
             argv=_llama_run("llama-7b", "16GB", lambda w: 2 * w), expect_s=90, limit_s=300,
             dry_expect_s=5, parse=_workload("llama-7b B=1 S=2048 at 16GB")),
        Step("mvp-7b-4GB", "measured", "llama-7b --random-weights prefill B=1 S=2048 at 4 GB",
             argv=_llama_run("llama-7b", "4GB", lambda w: w // 4), expect_s=120, limit_s=360,
             dry_expect_s=5, parse=_workload("llama-7b B=1 S=2048 at 4GB")),
        Step("mvp-decode64-b1", "measured", "llama-7b 64 decode steps, B=1, prompt 512, 16 GB",
             argv=_llama_decode(1), expect_s=150, limit_s=400, dry_expect_s=6,
             parse=_workload("llama-7b decode 64 steps B=1 at 16GB")),
        Step("mvp-decode64-b16", "measured", "llama-7b 64 decode steps, B=16, prompt 512, 16 GB",
             argv=_llama_decode(16), expect_s=180, limit_s=450, dry_expect_s=8,
             parse=_workload("llama-7b decode 64 steps B=16 at 16GB")),
        Step("mvp-7b-fits", "measured", f"llama-7b --random-weights prefill B=1 S=2048 at "
             f"{FITS_BUDGET} (the model fits: against eager PyTorch)",
             argv=_llama_run("llama-7b", FITS_BUDGET, lambda w: 2 * w), expect_s=60,
             limit_s=300, dry_expect_s=5, parse=_workload(f"llama-7b B=1 S=2048 at {FITS_BUDGET}")),
        Step("mvp-decode64-b1-4GB", "measured", "llama-7b 64 decode steps, B=1, prompt 512, "
             f"{PEER_BUDGET} (against accelerate)", argv=_llama_decode(1, PEER_BUDGET),
             expect_s=120, limit_s=400, dry_expect_s=6,
             parse=_workload(f"llama-7b decode 64 steps B=1 at {PEER_BUDGET}")),
        Step("peers", "peers", f"bench/peers.py: eager PyTorch, accelerate (max_memory "
             f"{PEER_BUDGET}) and torch.compile on llama-7b with einpage's random weights",
             argv=_peers_argv, expect_s=240, limit_s=PEERS_DEADLINE_S + 120, dry_expect_s=10,
             parse=_parse_peers, needs=_needs_modules("torch", "transformers", "accelerate")),
    ]
    for tool, expect in (("memcheck", 60), ("racecheck", 90), ("synccheck", 60)):
        steps.append(Step(f"san-{tool}-prefill", "sanitizer", f"compute-sanitizer {tool}: "
                          f"{SMALL_FIXTURE} prefill plan at 1/4",
                          argv=_fixture_plan_run(SMALL_FIXTURE), sanitizer=tool,
                          expect_s=expect, limit_s=3 * expect, dry_expect_s=5,
                          parse=parse_sanitized, needs=san_need))
    for tool, expect in (("memcheck", 60), ("racecheck", 90), ("synccheck", 60)):
        steps.append(Step(f"san-{tool}-decode", "sanitizer", f"compute-sanitizer {tool}: "
                          f"{SMALL_FIXTURE} prefill + {SAN_DECODE_STEPS} decode steps at 1/4 "
                          "(in-process)", py="decode", sanitizer=tool, expect_s=expect,
                          limit_s=3 * expect, dry_expect_s=5, parse=parse_sanitized,
                          needs=san_need))
    steps += [
        Step("weights-13b", "weights", "llama-13b's --random-weights written once as a "
             "checkpoint", argv=_write_weights("llama-13b"), expect_s=50, limit_s=300,
             dry_expect_s=3),
        Step("mvp-13b-12GB", "measured", "llama-13b --random-weights prefill B=1 S=2048 at 12 GB",
             argv=_llama_run("llama-13b", "12GB", lambda w: w // 3), expect_s=180,
             limit_s=450, dry_expect_s=5, parse=_workload("llama-13b B=1 S=2048 at 12GB")),
        Step("pytest-cpu", "pytest", "the rest of the test suite", argv=_pytest_argv(False),
             expect_s=150, limit_s=420, dry_expect_s=5, parse=parse_pytest,
             needs=_needs_modules("pytest", "hypothesis")),
    ]
    return steps


def _launch_cli(argv: list[str]) -> int:
    kernels = os.environ.get(FAKE_ENV)
    if kernels:
        install_fake(Path(kernels))
    from einpage.cli.main import main
    return main(argv)


def _run_py_step(function: str, name: str, work: Path, dry: bool) -> int:
    """A python step in this (child) process: its numbers go to `out/<name>.json`."""
    shims = []
    kernels = os.environ.get(FAKE_ENV)
    if kernels:
        shims = install_fake(Path(kernels))
    status, note, numbers = PY_STEPS[function](work, dry, shims)
    (work / f"{name}.json").write_text(json.dumps({"status": status, "note": note,
                                                  "numbers": numbers}, indent=1, default=str))
    print(json.dumps({"status": status, "note": note}), flush=True)
    return 0 if status == "ok" else 1


# ====================================================================== the command

def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_cli"]:
        return _launch_cli(argv[1:])
    if argv[:1] == ["_py"]:
        return _run_py_step(argv[1], argv[2], Path(argv[3]), "--dry-run" in argv[4:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT") or "gpu-session",
                   help="directory for results.json, summary.md, logs.tar.gz (every step's log)"
                        " and profile-<kind>.json (default $OUT, else ./gpu-session)")
    p.add_argument("--work", help="directory for each step's <step>.log, plans, inputs and "
                                  "scratch (default: a new directory in /tmp, kept)")
    p.add_argument("--steps", help="comma-separated step names or globs (default: all, in "
                                   "order; see --list)")
    p.add_argument("--deadline", type=float, default=DEFAULT_DEADLINE_S,
                   help=f"seconds for the whole session (default {DEFAULT_DEADLINE_S})")
    p.add_argument("--dry-run", action="store_true",
                   help="no GPU: the CuPy stand-in (tests/fake_cupy.py, needs g++), no pip "
                        "install, no compute-sanitizer, small workloads")
    p.add_argument("--families", help="comma-separated fixture families the agree step checks "
                                      f"(default: all of {', '.join(FAMILIES)})")
    p.add_argument("--fixtures", help="the Hugging Face fixtures directory (default: the "
                                      "repository's tests/fixtures)")
    p.add_argument("--profile", help="a device profile (einpage calibrate -o) for the measured "
                                     "steps' predictions when calibrate is not among the steps")
    p.add_argument("--xdist", type=int, default=0,
                   help="run pytest-cpu on N pytest-xdist workers (default: serially)")
    p.add_argument("--list", action="store_true", help="print the steps and exit")
    args = p.parse_args(argv)
    if args.families:
        unknown = [f for f in args.families.split(",") if f not in FAMILIES]
        if unknown:
            p.error(f"--families: unknown {', '.join(unknown)}; families: {', '.join(FAMILIES)}")
        os.environ[FAMILIES_ENV] = args.families
    if str(REPO) not in sys.path:  # the steps' arguments use einpage (installed or not)
        sys.path.insert(0, str(REPO))
    notes = _use_fixtures(args.fixtures)
    if args.xdist:
        os.environ[XDIST_ENV] = str(args.xdist)
    steps = build_steps()
    if args.list:
        for s in steps:
            exp, lim = s.times(args.dry_run)
            print(f"{s.name:<22} {s.kind:<10} ~{exp:>4.0f} s (limit {lim:>4.0f})  {s.about}")
        return 0
    chosen = select(steps, args.steps)
    if args.dry_run and not (shutil.which("g++") or shutil.which("c++")):
        print("gpu_session: --dry-run needs g++ (the stand-in compiles the kernels for the host)",
              file=sys.stderr)
        return 2
    import tempfile
    work = (Path(args.work).absolute() if args.work
            else Path(tempfile.mkdtemp(prefix="gpu-session-work-")))
    ctx = Context(out=Path(args.out).absolute(), work=work, dry_run=args.dry_run)
    ctx.notes += notes
    if args.profile:
        ctx.profile = str(Path(args.profile).absolute())
        ctx.profile_note = f"--profile {args.profile}"
    if "env" not in [s.name for s in chosen] and not args.dry_run:
        ctx.kind = slug(_gpu_name_quick() or "gpu")
    ctx.notes.append("on cupy --gpu-mem counts all the process takes of the device (the CUDA "
                     "context, cuBLAS's workspace, the apply workspace), which 1/4 of a fixture's "
                     "weights cannot hold: the fixture prefill steps compile a plan for 1/4 "
                     "(einpage compile -o) and run the plan file, einpage generate takes "
                     "--arena W/4, and the in-process decode checks (agree, soak, san-*-decode) "
                     "run plans for an arena of 1/4 (gpu_session.arena_runner)")
    ctx.notes.append("einpage --timing prints text only: the measured and predicted figures are "
                     "parsed from it (einpage.cli.timing.print_measured's format)")
    started = time.monotonic()

    def stop(signum, frame):
        for proc in list(_CURRENT):
            _kill_group(proc)
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, stop)
    try:
        results = run_steps(chosen, ctx, args.deadline, started=started,
                            say=lambda line: print(line, flush=True))
    except KeyboardInterrupt:
        results = json.loads((ctx.out / "results.json").read_text())
        print("gpu_session: interrupted; results so far are in", ctx.out, file=sys.stderr)
    print()
    print(short_table(results))
    print(f"results: {ctx.out / 'results.json'}, {ctx.out / 'summary.md'}, "
          f"{ctx.out / LOGS}; logs and scratch: {ctx.work}")
    return 0 if all(r["status"] in OK_STATUSES for r in results["steps"]) else 1


def _use_fixtures(given: str | None) -> list[str]:
    """Point FIXTURES (here and, through the environment, in the children) at `given` or the
    repository's own (tests/fixtures, where the tests look); where that does not exist, link
    it to `given`. Returns notes of what was done."""
    candidates = [Path(given)] if given else [TEST_FIXTURES]
    found = next((c for c in candidates if c.is_dir()), None)
    if found is None:
        return [f"no fixtures directory ({', '.join(map(str, candidates))}): the fixture steps "
                "are not available"]
    fixtures = config.FIXTURES = found.absolute()  # `config.fixture` reads it
    os.environ[FIXTURES_ENV] = str(fixtures)
    notes = [] if fixtures == TEST_FIXTURES.absolute() else [f"fixtures from {fixtures}"]
    if not TEST_FIXTURES.exists():
        try:
            TEST_FIXTURES.parent.mkdir(parents=True, exist_ok=True)
            TEST_FIXTURES.symlink_to(fixtures, target_is_directory=True)
            notes.append(f"linked {TEST_FIXTURES} -> {fixtures} for the tests")
        except OSError as exc:
            notes.append(f"the tests will not find the fixtures: cannot link {TEST_FIXTURES}: "
                         f"{exc}")
    return notes


def _gpu_name_quick() -> str:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return ""
    try:
        got = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return got.stdout.strip().splitlines()[0] if got.stdout.strip() else ""
    except Exception:
        return ""


if __name__ == "__main__":
    sys.exit(main())
