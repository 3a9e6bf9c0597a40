"""`bench/gpu_session.py`'s engine: named steps (`Step`), the session they run in (`Context`),
running them under one deadline (a step that would not fit is skipped, one past its limit
stopped), and the files a session leaves in `--out` (results.json, summary.md, the logs in one
archive) and the short table it prints last."""
from __future__ import annotations
import fnmatch
import glob
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

REPO = Path(__file__).absolute().parent.parent
#: the session's command: its children run `SCRIPT _cli ...` (einpage) and `SCRIPT _py ...`
SCRIPT = REPO / "bench" / "gpu_session.py"
DEFAULT_DEADLINE_S = 9 * 60
#: seconds kept back from the deadline to write the results and print the table
RESERVE_S = 10.0
FAKE_ENV = "EINPAGE_GPU_SESSION_FAKE"   # the stand-in's kernel directory, in dry-run children
OK_STATUSES = ("ok", "skipped-dry-run")
SANITIZER_TOOLS = ("memcheck", "racecheck", "synccheck")


@dataclass
class Step:
    """A named step: `argv(ctx)` (a command) or `py` (a function name in PY_STEPS, run in a
    child interpreter); `expect_s` the time it normally takes (it is not started unless that
    fits before the deadline), `limit_s` its hard limit; `dry_*` the same in a dry run.
    `parse(ctx, record, log_text)` adds numbers to the record and may set its status;
    `sanitizer` names the compute-sanitizer tool wrapping the command; `needs(ctx)` returns why
    the step cannot run here (not-available), or None."""
    name: str
    kind: str
    about: str
    argv: Callable[["Context"], list[str]] | None = None
    py: str | None = None
    expect_s: float = 30.0
    limit_s: float = 120.0
    dry_expect_s: float = 5.0
    dry_limit_s: float = 120.0
    parse: Callable | None = None
    sanitizer: str | None = None
    needs: Callable[["Context"], str | None] | None = None
    skip_in_dry_run: bool = False

    def times(self, dry: bool) -> tuple[float, float]:
        return (self.dry_expect_s, self.dry_limit_s) if dry else (self.expect_s, self.limit_s)


@dataclass
class Context:
    """What the steps share: the output directory (`results.json`, `summary.md`, `logs.tar.gz`,
    the calibrated profile: few files, as the device tool brings back at most 8 from $OUT), the
    work directory (each step's log, plans, inputs, scratch), the mode, how to call einpage, and
    what earlier steps found (the GPU's kind, the calibrated profile)."""
    out: Path
    work: Path | None = None
    dry_run: bool = False
    python: str = sys.executable
    einpage: list[str] = field(default_factory=list)
    kind: str = "gpu"
    gpu_name: str = ""
    profile: str | None = None        # --device-file of the measured rows (calibrate's)
    profile_note: str = ""
    sanitizer_path: str | None = None
    notes: list[str] = field(default_factory=list)

    def __post_init__(self):
        if self.work is None:
            self.work = self.out / "work"
        if not self.einpage:
            self.einpage = [self.python, str(SCRIPT), "_cli"]

    def pick(self, pair):
        return pair[1] if self.dry_run else pair[0]

    @property
    def kernels(self) -> Path:
        return self.work / "host-kernels"

    @property
    def inputs(self) -> Path:
        path = self.work / "inputs"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def env(self) -> dict:
        env = dict(os.environ)
        paths = [str(REPO)] + ([str(REPO / "tests")] if self.dry_run else [])
        if env.get("PYTHONPATH"):
            paths.append(env["PYTHONPATH"])
        env["PYTHONPATH"] = os.pathsep.join(paths)
        env["PYTHONUNBUFFERED"] = "1"
        env.pop("EINPAGE_CPU_MEM", None)
        if self.dry_run:
            self.kernels.mkdir(parents=True, exist_ok=True)
            env[FAKE_ENV] = str(self.kernels)
        else:
            env.pop(FAKE_ENV, None)
        return env


def select(steps: list[Step], spec: str | None) -> list[Step]:
    """The steps `spec` names (comma-separated names or globs, in the session's order), or all.
    An entry that matches nothing is an error (a typo must not silently run nothing)."""
    if not spec:
        return list(steps)
    wanted = [s.strip() for s in spec.split(",") if s.strip()]
    for w in wanted:
        if not any(fnmatch.fnmatchcase(s.name, w) for s in steps):
            raise SystemExit(f"gpu_session: --steps {w!r} matches no step; see --list")
    return [s for s in steps if any(fnmatch.fnmatchcase(s.name, w) for w in wanted)]


def _kill_group(proc: subprocess.Popen) -> None:
    """Stop the child we started and its children (its own process group), by its id."""
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


_CURRENT: list[subprocess.Popen] = []


def run_command(argv: list[str], log: Path, timeout: float, env: dict, cwd: Path = REPO
                ) -> tuple[int | None, float, bool]:
    """(exit status or None, seconds, timed out) of `argv`, its output appended to `log`."""
    t0 = time.monotonic()
    with open(log, "ab") as fh:
        fh.write(f"$ {shlex.join(argv)}\n".encode())
        fh.flush()
        try:
            # its own process group (not session): stopped as a group, and still ended
            # with the session that runs this script
            proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=env, cwd=cwd,
                                    preexec_fn=os.setpgrp)
        except OSError as exc:
            fh.write(f"cannot start: {exc}\n".encode())
            return 127, time.monotonic() - t0, False
        _CURRENT.append(proc)
        try:
            rc = proc.wait(max(timeout, 0.1))
            timed_out = False
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            rc, timed_out = proc.returncode, True
        except BaseException:  # interrupted: the child does not outlive the session
            _kill_group(proc)
            raise
        finally:
            _CURRENT.remove(proc)
    return rc, time.monotonic() - t0, timed_out


def run_steps(steps: list[Step], ctx: Context, deadline_s: float = DEFAULT_DEADLINE_S,
              say: Callable[[str], None] = print, started: float | None = None) -> dict:
    """Run `steps` in order within `deadline_s` (from `started`, default now); return the
    results (also written to `ctx.out` after every step, with the logs so far)."""
    ctx.out.mkdir(parents=True, exist_ok=True)
    ctx.work.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic() if started is None else started
    deadline = t_start + deadline_s
    results = {"started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               "dry_run": ctx.dry_run, "deadline_s": deadline_s, "repo": str(REPO),
               "argv": sys.argv, "work": str(ctx.work), "logs": LOGS, "steps": [],
               "notes": ctx.notes}
    for k, step in enumerate(steps):
        expect, limit = step.times(ctx.dry_run)
        left = deadline - time.monotonic() - RESERVE_S
        record = {"name": step.name, "kind": step.kind, "about": step.about, "command": None,
                  "rc": None, "seconds": 0.0, "status": None, "note": "", "numbers": {},
                  "expect_s": expect, "limit_s": limit}
        results["steps"].append(record)
        if expect > left:
            record.update(status="skipped-time", note=f"expected {expect:.0f} s, "
                                                      f"{max(left, 0):.0f} s left before the deadline")
            say(f"[{k + 1}/{len(steps)}] {step.name}: skipped-time ({record['note']})")
            _write(results, ctx, t_start)
            continue
        say(f"[{k + 1}/{len(steps)}] {step.name} ({step.about}) ...")
        record["status"] = "running"
        _write(results, ctx, t_start)
        try:
            _run_one(step, ctx, record, min(limit, left), limit)
        except KeyboardInterrupt:
            record.update(status="interrupted", note="interrupted (SIGINT/SIGTERM)")
            _write(results, ctx, t_start)
            raise
        except Exception as exc:  # a bug of this script: record it, go on with the next step
            record.update(status="failed", note=f"gpu_session error: {type(exc).__name__}: {exc}")
        say(f"    {record['status']} in {record['seconds']:.1f} s"
            + (f": {record['note']}" if record["note"] else ""))
        _write(results, ctx, t_start)
    return results


def _run_one(step: Step, ctx: Context, record: dict, timeout: float, limit: float) -> None:
    log = ctx.work / f"{step.name}.log"
    log.unlink(missing_ok=True)
    record["log"] = log.name
    why = step.needs(ctx) if step.needs else None
    if why:
        record.update(status="not-available", note=f"not available: {why}")
        log.write_text(record["note"] + "\n")
        return
    if step.py:
        commands = [[ctx.python, str(SCRIPT), "_py", step.py, step.name,
                     str(ctx.work)] + (["--dry-run"] if ctx.dry_run else [])]
    else:
        got = step.argv(ctx)
        commands = got if got and isinstance(got[0], list) else [got]
    if step.sanitizer:  # the main command (the last) runs under compute-sanitizer
        wrapped = _sanitized(step, ctx, commands[-1], record)
        if wrapped is None:  # a malformed invocation (recorded)
            log.write_text(record["note"] + "\n")
            return
        commands[-1] = wrapped
    record["command"] = " && ".join(shlex.join(c) for c in commands)
    if step.skip_in_dry_run and ctx.dry_run:
        record.update(status="skipped-dry-run", note="dry run: not run")
        log.write_text(f"dry run: not run: {record['command']}\n")
        return
    t0 = time.monotonic()
    for argv in commands:  # preparation (a plan to compile), then the step's command
        rc, _, timed_out = run_command(argv, log, timeout - (time.monotonic() - t0), ctx.env())
        if rc != 0 or timed_out:
            break
    seconds = time.monotonic() - t0
    record.update(rc=rc, seconds=round(seconds, 2))
    if timed_out:
        which = ("its limit" if timeout >= limit else "the session's deadline")
        record.update(status="timeout", note=f"stopped at {which} after {seconds:.0f} s")
    else:
        record["status"] = "ok" if rc == 0 else "failed"
        if rc != 0:
            record["note"] = f"exit status {rc}: " + _last_error(log)
    text = log.read_text(errors="replace")
    if step.py:
        done = ctx.work / f"{step.name}.json"
        if done.exists():
            got = json.loads(done.read_text())
            record["numbers"].update(got.get("numbers", {}))
            if got.get("status") and got["status"] != "ok" and record["status"] == "ok":
                record["status"] = got["status"]  # the function's own verdict, where worse
            if got.get("note") and got.get("status") != "ok":
                record["note"] = got["note"]
    if step.parse is not None:
        try:
            step.parse(ctx, record, text)
        except Exception as exc:
            record["numbers"]["parse_error"] = f"{type(exc).__name__}: {exc}"
            if record["status"] == "ok":
                record.update(status="failed", note=f"output not understood: {exc}")


def _last_error(log: Path) -> str:
    """The most telling line of a failed step's log: an `einpage: error:` line, a Python
    exception, or the last line."""
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    for pattern in (r"^einpage: error:", r"^(FAILED|ERROR) ", r"^\w+(Error|Exception)\b",
                    r"ERROR SUMMARY: [1-9]"):
        hits = [ln for ln in lines if re.search(pattern, ln)]
        if hits:
            return hits[-1][:300]
    return lines[-1][:300] if lines else "(no output)"


# ====================================================================== output files

def _write(results: dict, ctx: Context, t_start: float) -> None:
    results["elapsed_s"] = round(time.monotonic() - t_start, 1)
    results["gpu"] = ctx.gpu_name
    results["kind"] = ctx.kind
    results["profile"] = ctx.profile
    tmp = ctx.out / ".results.json.tmp"
    tmp.write_text(json.dumps(results, indent=1, default=str) + "\n")
    tmp.replace(ctx.out / "results.json")
    tmp = ctx.out / ".summary.md.tmp"
    tmp.write_text(summary_markdown(results))
    tmp.replace(ctx.out / "summary.md")
    _pack_logs(results, ctx)


#: every step's log, in one file of the output directory
LOGS = "logs.tar.gz"
#: a log longer than this goes into the archive as its first and last bytes
LOG_CAP = 4 << 20


def _pack_logs(results: dict, ctx: Context) -> None:
    import io
    import tarfile
    tmp = ctx.out / f".{LOGS}.tmp"
    with tarfile.open(tmp, "w:gz") as tar:
        for record in results["steps"]:
            path = ctx.work / record.get("log", "-")
            if not record.get("log") or not path.exists():
                continue
            data = path.read_bytes()
            if len(data) > LOG_CAP:
                data = (data[:LOG_CAP // 4] + b"\n[... cut by gpu_session ...]\n"
                        + data[-3 * LOG_CAP // 4:])
            info = tarfile.TarInfo(path.name)
            info.size, info.mtime = len(data), int(path.stat().st_mtime)
            tar.addfile(info, io.BytesIO(data))
    tmp.replace(ctx.out / LOGS)


def _key(record: dict) -> str:
    """One short phrase of a step's result for the tables."""
    n = record.get("numbers", {})
    if record["status"] not in ("ok", "failed"):
        return record.get("note", "")[:90]
    kind = record["kind"]
    if kind == "env" and "modules" in n:
        return (f"{n.get('gpu_name') or 'no GPU'}; cupy {n['modules'].get('cupy')}; "
                f"compute-sanitizer {'found' if n.get('sanitizer') else 'missing'}")
    if kind == "install" and "version" in n:
        return f"einpage {n['version']} at {n.get('einpage', '?')}"
    if kind == "pytest" and "passed" in n:
        return ", ".join(f"{n[k]} {k}" for k in ("passed", "failed", "errors", "skipped")
                         if n.get(k))
    if kind == "sanitizer":
        errs = n.get("sanitizer_errors")
        base = (f"{errs} sanitizer errors" if errs is not None else
                "dry run: invocation checked, inner run alone" if n.get("dry_run")
                else "no sanitizer summary")
        return base + (f"; disk {n['disk_bytes']}" if n.get("disk_bytes") else "")
    if kind == "calibrate" and "h2d_GBps" in n:
        return (f"h2d {n['h2d_GBps']:.3g} GB/s, d2h {n['d2h_GBps']:.3g} GB/s, f16 "
                f"{n.get('f16_TFLOPs', 0):.3g} TFLOP/s, per node "
                f"{n.get('launch_overhead_us', 0):.3g} us"
                + (f" ({n['graph_launch_overhead_us']:.3g} us replayed)"
                   if n.get("graph_launch_overhead_us") is not None else ""))
    if kind == "measured" and "wall_measured_s" in n:
        text = (f"{n.get('steady') or n['first']}: {_s(n['wall_measured_s'])} vs "
                f"{_s(n.get('wall_predicted_s'))} ({_x(n.get('ratio'))})")
        if n.get("steady"):
            text += f"; first pass {_s(n.get('first_measured_s'))} ({_x(n.get('first_ratio'))})"
        if n.get("decode_steps"):
            text += (f"; {n['decode_steps']} decode steps {_s(n['decode_measured_s'])} vs "
                     f"{_s(n.get('decode_predicted_s'))} ({_x(n.get('decode_ratio'))})")
        return text
    if kind == "soak" and "steps" in n:
        return (f"{n['steps']} steps, device free {n.get('device_free_delta_bytes')} B apart, "
                f"RSS {n.get('rss_growth_pct', 0):+.2f}%, "
                f"{n.get('hook_allocations', 0) + n.get('hidden_allocations', 0)} allocations "
                "outside the arena")
    if kind == "profile" and "us_per_apply" in n:
        top = n["top"][0]["function"] if n.get("top") else "-"
        return (f"{n['us_per_apply']:.1f} us per apply, pass {n['pass_s_median'] * 1e3:.2f} ms "
                f"(first {n['first_pass_s'] * 1e3:.2f} ms); "
                f"most own time: {top}")
    if kind == "agree" and "fixtures" in n:
        good = sum(1 for f in n["fixtures"].values() if f.get("ok"))
        return f"{good}/{len(n['fixtures'])} families agree"
    return record.get("note", "")[:90]


def _s(v) -> str:
    if v is None:
        return "-"
    return f"{v:.3f} s" if v >= 0.1 else f"{v * 1e3:.2f} ms"


def _x(v) -> str:
    return "-" if v is None else f"{v:.2f}x"


def summary_markdown(results: dict) -> str:
    steps = results["steps"]
    mode = "dry run (FakeCupy stand-in)" if results["dry_run"] else f"on {results.get('gpu') or 'the GPU'}"
    lines = [f"# GPU session, {results['started']}, {mode}", "",
             f"{len(steps)} steps, {results.get('elapsed_s', 0):.0f} s of a "
             f"{results['deadline_s']:.0f} s deadline; profile: {results.get('profile') or '-'}",
             "", "| step | status | seconds | result |", "| --- | --- | ---: | --- |"]
    for r in steps:
        lines.append(f"| {r['name']} | {r['status']} | {r['seconds']:.1f} | "
                     f"{_key(r).replace('|', '/')} |")
    measured = [r for r in steps if r["kind"] == "measured" and r["numbers"].get("passes")]
    if measured:
        lines += ["", "## Measured against predicted (`--timing`)", "",
                  "Ratios are measured / predicted. Decode: the sum over its steps.", "",
                  "| row | workload | pass | measured | predicted | ratio | compute busy ratio "
                  "| h2d bytes | h2d achieved | h2d hidden |",
                  "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in measured:
            n = r["numbers"]
            for p in [q for q in n["passes"] if not q["title"].startswith("decode step")]:
                lines.append(f"| {r['name']} | {n.get('workload', '')} | {p['title']} | "
                             f"{_s(p.get('wall', {}).get('measured'))} | "
                             f"{_s(p.get('wall', {}).get('predicted'))} | "
                             f"{_x(p.get('wall', {}).get('ratio'))} | "
                             f"{_x(p.get('compute busy', {}).get('ratio'))} | "
                             f"{p.get('h2d bytes', {}).get('measured', '-')} | "
                             f"{p.get('h2d bytes', {}).get('achieved', '-')} | "
                             f"{p.get('h2d_hidden', '-')} |")
            if n.get("decode_steps"):
                lines.append(f"| {r['name']} | | {n['decode_steps']} decode steps | "
                             f"{_s(n.get('decode_measured_s'))} | "
                             f"{_s(n.get('decode_predicted_s'))} | {_x(n.get('decode_ratio'))} "
                             "| | | | |")
    agree = [r for r in steps if r["kind"] == "agree" and r["numbers"].get("fixtures")]
    for r in agree:
        lines += ["", "## cupy against threads at 1/4 of the weights", "",
                  "`run`: logits of a plan file on cupy against `--gpu-mem W/4` on threads; "
                  "generate: in-process, plans for an arena of W/4 on both; CLI generate: "
                  "cupy against threads, both at --arena W/4.", "",
                  "| family | run: logits max diff | close | vs transformers | generate: tokens "
                  "identical | text identical | CLI generate: tokens, text identical | error |",
                  "| --- | ---: | --- | ---: | --- | --- | --- | --- |"]
        for fam, f in r["numbers"]["fixtures"].items():
            diff, tf = f.get("logits_max_abs_diff"), f.get("vs_transformers_max_abs_diff")
            error = (f.get("error") or "").replace("|", "/")[:160]
            lines.append(f"| {fam} | {'-' if diff is None else f'{diff:.3g}'} | "
                         f"{f.get('logits_close', '-')} | {'-' if tf is None else f'{tf:.3g}'} | "
                         f"{f.get('tokens_identical', '-')} | {f.get('text_identical', '-')} | "
                         f"{f.get('cli_tokens_identical', '-')}, "
                         f"{f.get('cli_text_identical', '-')} | {error} |")
    soak = [r for r in steps if r["kind"] == "soak" and r["numbers"].get("marks")]
    for r in soak:
        n = r["numbers"]
        lines += ["", "## Decode soak", "",
                  f"{n['steps']} decode steps of {n.get('fixture')} (B={n.get('batch')}, "
                  f"plan arena {n.get('arena_bytes')} B) in one session on {n.get('backend')}: "
                  f"step time p50 {_s(n.get('step_p50_s'))}, p95 {_s(n.get('step_p95_s'))}.", "",
                  "| step | device free (memGetInfo) | host RSS |", "| ---: | ---: | ---: |"]
        for m in n["marks"]:
            lines.append(f"| {m['step']} | {m.get('device_free')} | {m.get('rss')} |")
    lines += _peers_table(steps)
    notes = results.get("notes") or []
    if notes:
        lines += ["", "## Notes", ""] + [f"- {t}" for t in notes]
    return "\n".join(lines) + "\n"


#: (label, einpage's row and figure, the peer and its figure, the goal's factor, how compared):
#: einpage faster by peer / einpage (>= goal), or within goal x of the peer (einpage / peer)
PEER_ROWS = (
    ("prefill 2048, 4 GB, vs accelerate", ("mvp-7b-4GB", "wall_measured_s"),
     ("accelerate", "accelerate_prefill_s"), 2.0, "faster"),
    ("decode step, 4 GB, vs accelerate", ("mvp-decode64-b1-4GB", "decode_replay_mean_s"),
     ("accelerate", "accelerate_decode_step_s"), 2.0, "faster"),
    ("prefill 2048, fits, vs eager PyTorch", ("mvp-7b-fits", "wall_measured_s"),
     ("eager", "eager_prefill_s"), 1.3, "within"),
    ("prefill 2048, fits, vs torch.compile", ("mvp-7b-fits", "wall_measured_s"),
     ("compile", "compile_prefill_s"), None, "within"),
)


def _peers_table(steps: list[dict]) -> list[str]:
    """einpage's rows against the peers step's figures (issue 27's goals), where both ran."""
    by_name = {r["name"]: r["numbers"] for r in steps}
    peers = next((r["numbers"] for r in steps if r["kind"] == "peers"), None)
    if not peers:
        return []
    rows = []
    for label, (row, key), (peer, peer_key), goal, how in PEER_ROWS:
        ours, theirs = by_name.get(row, {}).get(key), peers.get(peer_key)
        if ours is None or theirs is None:
            continue
        if how == "faster":
            ratio, verdict = theirs / ours, f"einpage {theirs / ours:.2f}x faster"
            met = None if goal is None else ratio >= goal
        else:
            ratio, verdict = ours / theirs, f"einpage at {ours / theirs:.2f}x the peer's time"
            met = None if goal is None else ratio <= goal
        goal_text = "-" if goal is None else f"{'>=' if how == 'faster' else '<='} {goal}x: " + (
            "met" if met else "not met")
        rows.append(f"| {label} | {_s(ours)} ({row}) | {_s(theirs)} ({peer}) | {verdict} | "
                    f"{goal_text} |")
    if not rows:
        return []
    return ["", "## Against the peers (`bench/peers.py`)", "",
            "einpage's steady-state figure (the median of its replayed passes, or the mean "
            "replayed decode step) "
            "against the peer's median on the same machine.", "",
            "| workload | einpage | peer | comparison | goal |", "| --- | ---: | ---: | --- | --- |",
            *rows]


def short_table(results: dict) -> str:
    rows = [(r["name"], r["status"], f"{r['seconds']:.0f}", _key(r)[:70]) for r in results["steps"]]
    w0 = max([len(r[0]) for r in rows] + [4])
    w1 = max([len(r[1]) for r in rows] + [6])
    out = [f"{'step':<{w0}}  {'status':<{w1}}  {'s':>4}  result"]
    out += [f"{a:<{w0}}  {b:<{w1}}  {c:>4}  {d}" for a, b, c, d in rows]
    bad = [r["name"] for r in results["steps"] if r["status"] not in OK_STATUSES]
    out.append(f"{len(rows) - len(bad)}/{len(rows)} ok; {results.get('elapsed_s', 0):.0f} s"
               + (f"; not ok: {', '.join(bad)}" if bad else ""))
    return "\n".join(out)


# ---------------------------------------------------------------------- the sanitizer

def find_sanitizer() -> str | None:
    """compute-sanitizer on PATH, in a CUDA toolkit, or in the nvidia pip packages."""
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    patterns = ["/usr/local/cuda*/bin/compute-sanitizer",
                "/usr/local/cuda*/compute-sanitizer/compute-sanitizer",
                "/opt/nvidia/*/compute-sanitizer/compute-sanitizer",
                "/opt/cuda*/bin/compute-sanitizer"]
    patterns += [f"{p}/nvidia/cuda_sanitizer_api/**/compute-sanitizer" for p in sys.path if p]
    for pattern in patterns:
        hits = sorted(h for h in glob.glob(pattern, recursive=True) if os.access(h, os.X_OK))
        if hits:
            return hits[-1]
    return None


def sanitizer_argv(tool: str, inner: list[str], path: str = "compute-sanitizer") -> list[str]:
    return [path, "--tool", tool, "--error-exitcode", "1", "--print-limit", "20", *inner]


def check_sanitizer_argv(argv: list[str]) -> str | None:
    """Why `argv` is not a well-formed compute-sanitizer invocation of a program, or None."""
    if not argv or Path(argv[0]).name != "compute-sanitizer":
        return "the command does not start with compute-sanitizer"
    k, known = 1, {"--tool": SANITIZER_TOOLS + ("initcheck",), "--error-exitcode": None,
                   "--print-limit": None}
    while k < len(argv) and argv[k].startswith("--"):
        opt = argv[k]
        if opt not in known or k + 1 >= len(argv):
            return f"unknown or incomplete sanitizer option {opt!r}"
        value = argv[k + 1]
        if known[opt] is not None and value not in known[opt]:
            return f"{opt} {value!r}: expected one of {known[opt]}"
        if known[opt] is None and not value.isdigit():
            return f"{opt} {value!r}: expected an integer"
        k += 2
    if "--tool" not in argv[1:k] or "--error-exitcode" not in argv[1:k]:
        return "--tool and --error-exitcode are both needed"
    inner = argv[k:]
    if not inner:
        return "no program after the sanitizer's options"
    if not (shutil.which(inner[0]) or Path(inner[0]).is_file()):
        return f"the program {inner[0]!r} is not an executable"
    return None


def _sanitized(step: Step, ctx: Context, inner: list[str], record: dict) -> list[str] | None:
    """The sanitizer-wrapped command (real run), or the inner command once the wrapped one is
    checked (dry run); None where the invocation is malformed (recorded)."""
    path = ctx.sanitizer_path or find_sanitizer()
    wrapped = sanitizer_argv(step.sanitizer, inner, path or "compute-sanitizer")
    record["numbers"]["sanitizer_command"] = shlex.join(wrapped)
    problem = check_sanitizer_argv(wrapped)
    if problem:
        record.update(status="failed", note=f"malformed sanitizer invocation: {problem}")
        return None
    if ctx.dry_run:
        record["numbers"]["sanitizer"] = "invocation checked; dry run: inner command run alone"
        record["numbers"]["dry_run"] = True
        return inner
    record["numbers"]["sanitizer"] = step.sanitizer
    return wrapped
