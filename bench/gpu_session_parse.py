"""`bench/gpu_session.py`: the numbers each step's output holds, parsed (`einpage run
--timing`'s text, `generate --json`, pytest's summary, calibrate's profile, compute-sanitizer's
summaries) into the step's record."""
from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpu_session import Context

_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10,
          "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(text: str) -> int | None:
    m = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?\d+)?)\s*([KMGT]i?B|B)?\s*", text, re.I)
    if not m:
        return None
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "B").upper()])


def parse_secs(text: str) -> float | None:
    m = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?\d+)?)\s*(ms|us|s)\s*", text)
    if not m:
        return None
    return float(m.group(1)) * {"s": 1.0, "ms": 1e-3, "us": 1e-6}[m.group(2)]


_TITLE = re.compile(r"^(\S.*?) on (\S+)( \((?:one CUDA graph launch|captured as a CUDA graph, "
                    r"then launched): wall only\))?: measured"
                    r"(?: \| predicted on (.+))?$")
_ROW = re.compile(r"^\s+(wall|compute busy|compute stall|h2d busy|d2h busy|disk busy)\s+"
                  r"(-|[0-9.e+-]+ m?s)\s+\|\s+(-|[0-9.e+-]+ m?s)(?:\s+\(([0-9.e+-]+)x\))?\s*$")
_BYTES = re.compile(r"^\s+(h2d|d2h|disk) bytes\s+(.+?)\s+\|\s+(.+?)\s+achieved (.+?)\s*$")
_HIDDEN = re.compile(r"^\s+h2d hidden behind compute: (\d+)%")
_LOAD = re.compile(r"^\s+before the pass: (.+?) of resident weights loaded in (.+?)\s*$")


def parse_timing(text: str) -> list[dict]:
    """The passes `--timing` printed (einpage.cli.timing.print_measured): title, backend,
    device, and per figure measured / predicted / ratio."""
    passes: list[dict] = []
    for line in text.splitlines():
        m = _TITLE.match(line)
        if m:
            passes.append({"title": m.group(1), "backend": m.group(2),
                           "replayed": "one CUDA graph launch" in (m.group(3) or ""),
                           "captured": "captured" in (m.group(3) or ""), "device": m.group(4)})
            continue
        if not passes:
            continue
        p = passes[-1]
        if m := _ROW.match(line):
            got, want = parse_secs(m.group(2)), parse_secs(m.group(3))
            ratio = float(m.group(4)) if m.group(4) else (got / want if got and want else None)
            p[m.group(1)] = {"measured": got, "predicted": want, "ratio": ratio}
        elif m := _BYTES.match(line):
            p[f"{m.group(1)} bytes"] = {"measured": m.group(2), "predicted": m.group(3),
                                        "achieved": m.group(4),
                                        "measured_bytes": parse_bytes(m.group(2)),
                                        "predicted_bytes": parse_bytes(m.group(3))}
        elif m := _HIDDEN.match(line):
            p["h2d_hidden"] = f"{m.group(1)}%"
        elif m := _LOAD.match(line):
            p["load"] = {"bytes": m.group(1), "seconds": parse_secs(m.group(2))}
    return passes


def _json_line(text: str) -> dict | None:
    """The last line of `text` that is a JSON object (generate --json), or None."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


def parse_measured(ctx: Context, record: dict, text: str) -> None:
    passes = parse_timing(text)
    n = record["numbers"]
    n["passes"] = passes
    n["profile"] = ctx.profile or ctx.profile_note
    if record["status"] != "ok":
        return
    if not passes:
        raise ValueError("no --timing pass in the output")
    first = passes[0]
    n["first"] = first["title"]
    # `--passes N`: the first pass, then the median of the others, which the row reports
    steady = next((p for p in passes[1:] if p["title"].startswith(("median of passes",
                                                                   "pass 2 of 2",
                                                                   "median of the",
                                                                   "the replay"))), None)
    if steady is not None:
        cold = first.get("wall", {})
        n.update(first_measured_s=cold.get("measured"), first_ratio=cold.get("ratio"),
                 steady=steady["title"], steady_replayed=steady["replayed"])
    row = steady or first
    wall = row.get("wall", {})
    n.update(wall_measured_s=wall.get("measured"), wall_predicted_s=wall.get("predicted"),
             ratio=wall.get("ratio"))
    if wall.get("predicted") is None:
        record["note"] = "no prediction printed (no --device/--device-file?)"
    decode = [p for p in passes[1:] if p["title"].startswith("decode step")]
    if decode:
        got = sum(p.get("wall", {}).get("measured") or 0.0 for p in decode)
        want = [p.get("wall", {}).get("predicted") for p in decode]
        want_s = sum(want) if all(w is not None for w in want) else None
        replays = [p.get("wall", {}).get("measured") or 0.0 for p in decode if p["replayed"]]
        n.update(decode_steps=len(decode), decode_replayed=len(replays),
                 decode_measured_s=got, decode_predicted_s=want_s,
                 decode_ratio=got / want_s if want_s else None,
                 decode_step_mean_s=got / len(decode),
                 # the steady step: a replay (the first step is issued, the second captured)
                 decode_replay_mean_s=sum(replays) / len(replays) if replays else None)
    summary = _json_line(text)
    if summary:
        for key in ("prefill_s", "decode_s", "prefill_tokens_per_s", "decode_tokens_per_s",
                    "compile_s", "plans_compiled", "decode_steps", "backend", "batch"):
            if key in summary:
                n[f"json_{key}"] = summary[key]


def parse_pytest(ctx: Context, record: dict, text: str) -> None:
    n = record["numbers"]
    tail = [ln for ln in text.splitlines() if re.search(r"\d+ (passed|failed|error|skipped)", ln)]
    if tail:
        for count, what in re.findall(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|"
                                      r"deselected|warnings?)", tail[-1]):
            key = {"error": "errors", "warning": "warnings"}.get(what, what)
            n[key] = int(count)
    n["failures"] = [ln.split(" - ")[0][:200] for ln in text.splitlines()
                     if ln.startswith(("FAILED ", "ERROR "))][:30]
    # why each skip (-rs): on the GPU machine only a reason that really holds there may stand
    n["skip_reasons"] = sorted({ln.split(": ", 1)[-1][:200] for ln in text.splitlines()
                                if ln.startswith("SKIPPED ")})[:30]
    if record["status"] == "failed" and record["rc"] == 5:
        record["note"] = "pytest collected no test"
    if record["status"] == "ok" and "passed" not in n:
        raise ValueError("no pytest summary line")


def parse_calibrate(ctx: Context, record: dict, text: str) -> None:
    if record["status"] != "ok":
        return
    path = ctx.out / f"profile-{ctx.kind}.json"
    profile = json.loads(path.read_text())
    n = record["numbers"]
    n["profile_file"] = str(path.relative_to(ctx.out))
    n["profile"] = profile
    n["h2d_GBps"] = profile["h2d_bandwidth"] / 1e9
    n["d2h_GBps"] = profile["d2h_bandwidth"] / 1e9
    n["hbm_GBps"] = profile["hbm_bandwidth"] / 1e9
    for dtype, flops in profile.get("matmul_flops", {}).items():
        n[f"{dtype}_TFLOPs"] = flops / 1e12
    n["launch_overhead_us"] = profile.get("launch_overhead", 0) * 1e6
    if profile.get("graph_launch_overhead") is not None:
        n["graph_launch_overhead_us"] = profile["graph_launch_overhead"] * 1e6
    ctx.profile = str(path)
    ctx.profile_note = f"calibrated: {path.name}"
    record["note"] = (f"copy {n['profile_file']} to bench/profiles/{ctx.kind}.json to keep it"
                      if not ctx.dry_run else "")


_SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) errors?")
_RACE = re.compile(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)")


def parse_sanitized(ctx: Context, record: dict, text: str) -> None:
    n = record["numbers"]
    sums = [int(x) for x in _SUMMARY.findall(text)]
    if sums:
        n["sanitizer_errors"] = sums[-1]
    if m := list(_RACE.finditer(text)):
        n["race_hazards"], n["race_errors"], n["race_warnings"] = (int(g) for g in m[-1].groups())
        if not sums:  # racecheck prints only its own summary (seen on an H200, 2026-11-27)
            sums = [n["race_hazards"]]
            n["sanitizer_errors"] = sums[-1]
    passes = parse_timing(text)
    if passes:
        disk = passes[0].get("disk bytes", {})
        if disk:
            n["disk_bytes"] = disk.get("measured")
        n["passes"] = len(passes)
    summary = _json_line(text)
    if summary and "decode_steps" in summary:
        n["decode_steps"] = summary["decode_steps"]
    if record["status"] == "ok" and not ctx.dry_run:
        if not sums:
            record.update(status="failed", note="no ERROR SUMMARY (nor RACECHECK SUMMARY) line "
                                                "from compute-sanitizer")
        elif sums[-1]:
            record.update(status="failed", note=f"{sums[-1]} sanitizer errors")
    if record["status"] == "ok" and record["name"].endswith("-disk") and not n.get("disk_bytes"):
        record.update(status="failed", note="the run read nothing from disk: no disk tier")
