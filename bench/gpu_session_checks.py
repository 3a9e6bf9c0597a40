"""The GPU session's in-process checks, each run in a child interpreter of `gpu_session.py`
(`PY_STEPS`): `env` (the machine and its packages), `agree` (cupy against threads on every
family), `decode` (prefill and decode steps for the sanitizer), `soak` (1,000 decode steps:
memory flat) and `profile` (`gpu_session_profile`). Each returns (status, note, numbers)."""
from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

from gpu_session_config import (AGREE_NEW_TOKENS, FAMILIES, FAMILIES_ENV, OPTIONAL, REQUIRED,
                                SAN_DECODE_STEPS, SMALL_FIXTURE, SOAK_MARK, SOAK_STEPS, fixture,
                                npy_shape, slug)
from gpu_session_profile import py_profile as profile_step
from gpu_session_runner import find_sanitizer


def _rss() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def py_env(work: Path, dry: bool, shims: list[str]) -> tuple[str, str, dict]:
    import importlib.metadata as md
    import importlib.util
    n: dict = {"python": sys.version.split()[0], "platform": platform.platform(),
               "cpus": os.cpu_count(), "stand_in_lacks": shims}
    versions = {}
    for mod in REQUIRED + OPTIONAL:
        if mod in sys.modules:  # the stand-in (dry run) has no __spec__
            versions[mod] = getattr(sys.modules[mod], "__version__", "present")
            continue
        if importlib.util.find_spec(mod) is None:
            versions[mod] = None
            continue
        dist = {"cupy": None, "opt_einsum": "opt_einsum"}.get(mod, mod)
        try:
            versions[mod] = md.version(dist) if dist else "present"
        except md.PackageNotFoundError:
            versions[mod] = "present"
    n["modules"] = versions
    if versions.get("cupy") or dry:
        try:
            import cupy
            versions["cupy"] = getattr(cupy, "__version__", "present")
        except Exception as exc:
            versions["cupy"] = f"import failed: {type(exc).__name__}: {exc}"
    missing = [m for m in REQUIRED if not versions.get(m)]
    smi = shutil.which("nvidia-smi")
    if smi and not dry:
        try:
            got = subprocess.run([smi, "--query-gpu=name,memory.total,driver_version,"
                                  "compute_cap", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=30)
            first = got.stdout.strip().splitlines()[0].split(", ")
            n.update(gpu_name=first[0], gpu_memory=first[1], driver=first[2],
                     compute_cap=first[3] if len(first) > 3 else None)
        except Exception as exc:
            n["nvidia_smi"] = f"failed: {exc}"
    try:
        from einpage.runtime.backends.cuda import _unusable_reason
        reason = _unusable_reason()
        n["cuda_usable"] = reason is None
        if reason:
            n["cuda_unusable_reason"] = reason
        else:
            import cupy
            props = cupy.cuda.runtime.getDeviceProperties(0)
            name = props.get("name", b"")
            n.setdefault("gpu_name", name.decode() if isinstance(name, bytes) else str(name))
            n["device_memory_bytes"] = int(props.get("totalGlobalMem", 0))
            n["mem_get_info"] = list(cupy.cuda.runtime.memGetInfo())
            n["cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
    except Exception as exc:
        n["cuda_probe_error"] = f"{type(exc).__name__}: {exc}"
    try:
        import einpage
        n["einpage"] = {"version": einpage.__version__, "file": einpage.__file__}
    except Exception as exc:
        n["einpage"] = f"import failed: {type(exc).__name__}: {exc}"
        missing.append("einpage")
    n["sanitizer"] = find_sanitizer()
    n["fixtures"] = {f: (fixture(f) / "model.safetensors").exists() for f in FAMILIES}
    n["kind"] = "fake-cupy" if dry else slug(n.get("gpu_name") or "gpu")
    if missing:
        return "failed", f"missing: {', '.join(missing)}", n
    if not dry and not n.get("cuda_usable"):
        return "failed", f"no usable GPU: {n.get('cuda_unusable_reason')}", n
    return "ok", "", n


def _cli_in_process(argv: list[str]) -> tuple[int, str, str]:
    """`einpage ARGV` in this process: (exit status, stdout, stderr)."""
    import contextlib
    import io
    from einpage.cli.main import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue()


def arena_runner(weights, arena: int, backend: str = "cupy", timing: bool = False):
    """A `PlanRunner` whose plans are compiled for an arena of exactly `arena` bytes (as
    `--arena` asks): on cupy the CUDA context and the workspaces come on top instead of out of
    the budget, which 1/4 of a fixture's weights could not hold."""
    from einpage.compiler import CompileOptions
    from einpage.runners import PlanRunner
    return PlanRunner(weights, CompileOptions(arena), backend, timing=timing, arena=True)


def _fixture_prompt(path: Path):
    """(tokens, lengths, codec or None) of a fixture's generation prompt: its prompt.txt through
    its tokenizer where it has one (as `einpage generate --prompt-file`), else
    greedy_prompt.npy."""
    import numpy as np
    from einpage.models.generation import pad_rows
    from einpage.models.text import TextCodec, has_tokenizer
    codec = TextCodec.from_checkpoint(path) if has_tokenizer(path) else None
    if codec is not None and (path / "prompt.txt").exists():
        lines = [ln for ln in (path / "prompt.txt").read_text(encoding="utf-8").splitlines() if ln]
        return (*pad_rows([codec.encode(t) for t in lines]), codec)
    tokens = np.load(path / "greedy_prompt.npy").astype(np.int64)
    return tokens, np.full(tokens.shape[0], tokens.shape[1], np.int64), codec


def _generate(path: Path, runner, new_tokens: int, ignore_eos: bool = False):
    """Greedy generation of a fixture on `runner`, with its EOS ids as `einpage generate`."""
    from einpage.models import resolve
    from einpage.models.generation import generate
    from einpage.models.text import end_of_sequence
    cfg, _ = resolve(str(path))
    tokens, lengths, codec = _fixture_prompt(path)
    eos = end_of_sequence(path)
    done = generate(cfg, tokens, new_tokens, runner, lengths=lengths,
                    eos_ids=None if ignore_eos else eos.ids, pad_id=eos.pad_id)
    texts = [codec.decode(row) for row in done.rows()] if codec is not None else None
    return done, texts


def py_agree(work: Path, dry: bool, shims: list[str]) -> tuple[str, str, dict]:
    """cupy against threads for every fixture family at 1/4 of its weights: `einpage run` (a
    plan file compiled for 1/4 on cupy; `--gpu-mem W/4` on threads) gives logits within
    tolerance, greedy generation (in-process, plans for an arena of 1/4 on both) gives identical
    tokens and text, and `einpage generate --backend cupy --arena W/4` gives the tokens and text
    of `einpage generate --backend threads --arena W/4`, and with `--draft ngram` (verify
    steps) the tokens of plain decoding on cupy."""
    import numpy as np
    from einpage.models import resolve
    work = work / "agree"
    work.mkdir(exist_ok=True)
    fixtures, bad = {}, []
    chosen = os.environ.get(FAMILIES_ENV)
    for fam in [f for f in chosen.split(",") if f] if chosen else FAMILIES:
        path = fixture(fam)
        if not (path / "model.safetensors").exists():
            fixtures[fam] = {"ok": False, "error": "fixture missing"}
            bad.append(fam)
            continue
        cfg, weights = resolve(str(path))
        arena = cfg.weight_bytes() // 4
        batch, seq = npy_shape(path / "input_ids.npy")
        f: dict = {"arena": arena}
        try:
            plan, got = work / f"{fam}.plan.json", {}
            steps = {"compile": ["compile", path, "--gpu-mem", arena, "--batch", batch, "--seq",
                                 seq, "--quiet", "-o", plan],
                     "cupy": ["run", plan, "--checkpoint", path, "--tokens-file",
                              path / "input_ids.npy", "--backend", "cupy", "--out",
                              work / f"{fam}-cupy.npy"],
                     "threads": ["run", path, "--tokens-file", path / "input_ids.npy",
                                 "--gpu-mem", arena, "--backend", "threads", "--out",
                                 work / f"{fam}-threads.npy"]}
            for what, argv in steps.items():
                rc, so, se = _cli_in_process(argv)
                print(f"{fam}: einpage {' '.join(map(str, argv))}: rc {rc}\n{so}{se}", flush=True)
                if rc:
                    raise RuntimeError(f"einpage {argv[0]} ({what}): {se.strip()}")
            a, b = np.load(work / f"{fam}-cupy.npy"), np.load(work / f"{fam}-threads.npy")
            f["logits_max_abs_diff"] = float(np.max(np.abs(a - b)))
            f["logits_close"] = bool(np.allclose(a, b, rtol=1e-4, atol=2e-5))
            if (path / "logits.npy").exists():
                want = np.load(path / "logits.npy")
                if want.shape == a.shape:
                    f["vs_transformers_max_abs_diff"] = float(np.max(np.abs(a - want)))
            for backend in ("cupy", "threads"):
                got[backend] = _generate(path, arena_runner(weights, arena, backend),
                                         AGREE_NEW_TOKENS)
            (cu, cu_text), (th, th_text) = got["cupy"], got["threads"]
            f["tokens_identical"] = bool(np.array_equal(cu.tokens, th.tokens))
            if cu_text is not None:
                f["text_identical"] = cu_text == th_text
            prompt = (["--prompt-file", path / "prompt.txt"] if (path / "prompt.txt").exists()
                      else ["--tokens-file", path / "greedy_prompt.npy"])
            cli = {}
            for backend in ("cupy", "threads"):
                argv = ["generate", path, *prompt, "--max-new-tokens", AGREE_NEW_TOKENS,
                        "--arena", str(arena), "--backend", backend, "--json"]
                rc, so, se = _cli_in_process(argv)
                print(f"{fam}: einpage {' '.join(map(str, argv))}: rc {rc}\n{so}{se}", flush=True)
                if rc:
                    raise RuntimeError(f"einpage generate --backend {backend}: {se.strip()}")
                cli[backend] = json.loads(so.strip().splitlines()[-1])
            # speculative decoding on cupy (verify steps, captured as decode steps are): the
            # tokens of plain decoding
            argv = ["generate", path, *prompt, "--max-new-tokens", AGREE_NEW_TOKENS, "--arena",
                    str(arena), "--backend", "cupy", "--json", "--draft", "ngram",
                    "--draft-tokens", "3"]
            rc, so, se = _cli_in_process(argv)
            print(f"{fam}: einpage {' '.join(map(str, argv))}: rc {rc}\n{so}{se}", flush=True)
            if rc:
                raise RuntimeError(f"einpage generate --draft ngram: {se.strip()}")
            spec = json.loads(so.strip().splitlines()[-1])
            f["draft_tokens_identical"] = spec["tokens"] == cli["cupy"]["tokens"]
            f["draft_acceptance"] = spec["acceptance"]
            f["cli_tokens_identical"] = cli["cupy"]["tokens"] == cli["threads"]["tokens"]
            f["cli_text_identical"] = cli["cupy"].get("text") == cli["threads"].get("text")
            f["cli_matches_in_process"] = cli["threads"]["tokens"] == th.tokens.tolist()
            f["ok"] = bool(f["logits_close"] and f["tokens_identical"]
                           and f.get("text_identical", True) and f["cli_tokens_identical"]
                           and f["cli_text_identical"] and f["draft_tokens_identical"])
        except Exception as exc:
            f.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:400])
        fixtures[fam] = f
        if not f["ok"]:
            bad.append(fam)
    n = {"fixtures": fixtures, "new_tokens": AGREE_NEW_TOKENS,
         "tolerance": "rtol 1e-4, atol 2e-5"}
    return ("failed", f"differ or failed: {', '.join(bad)}", n) if bad else ("ok", "", n)


def py_decode(work: Path, dry: bool, shims: list[str]) -> tuple[str, str, dict]:
    """The sanitizer's decode run: the small fixture's prefill and SAN_DECODE_STEPS decode steps
    on cupy, plans for an arena of 1/4 of its weights."""
    from einpage.models import resolve
    path = fixture(SMALL_FIXTURE)
    cfg, weights = resolve(str(path))
    runner = arena_runner(weights, cfg.weight_bytes() // 4, "cupy")
    done, _ = _generate(path, runner, SAN_DECODE_STEPS + 1, ignore_eos=True)
    print(json.dumps({"decode_steps": done.decode_steps, "tokens": done.tokens.tolist()}))
    n = {"decode_steps": done.decode_steps, "passes": len(runner.passes),
         "arena": cfg.weight_bytes() // 4}
    if done.decode_steps != SAN_DECODE_STEPS:
        return "failed", f"{done.decode_steps} decode steps, not {SAN_DECODE_STEPS}", n
    return "ok", "", n


def py_soak(work: Path, dry: bool, shims: list[str]) -> tuple[str, str, dict]:
    """Decode steps of the small fixture, plans for an arena of 1/4 of its weights, in one
    `PlanSession` (one KV bucket holds every step) on cupy: `cupy.cuda.runtime.memGetInfo` and
    host RSS at step SOAK_MARK and at the last step; flat device memory and RSS growth <= 1%
    pass."""
    import cupy
    import numpy as np
    from einpage.models import resolve
    from einpage.models.generation import decode_step_graph, last_logits, prefill
    from einpage.models.kvstore import KVStore, capacity_for
    steps = SOAK_STEPS[1] if dry else SOAK_STEPS[0]
    path = fixture(SMALL_FIXTURE)
    cfg, weights = resolve(str(path))
    prompt = np.load(path / "greedy_prompt.npy")
    batch, length = prompt.shape
    arena = cfg.weight_bytes() // 4
    runner = arena_runner(weights, arena, "cupy")
    logits = prefill(cfg, prompt, runner)
    last = np.argmax(last_logits(logits["logits"]), axis=-1)
    capacity = capacity_for(length + steps)
    store = KVStore(cfg, batch, capacity)
    store.fill(logits)
    graph = decode_step_graph(cfg, batch, capacity)
    marks, times = [], []
    with runner.open(graph) as session:
        for k in range(1, steps + 1):
            t0 = time.perf_counter()
            got = session.run({"tokens": last[:, None], "pos": store.pos.copy(),
                               **store.view(capacity)})
            for name, lead, row in store.write(got):
                session.write(name, lead, row)
            last = np.argmax(last_logits(got["logits"]), axis=-1)
            times.append(time.perf_counter() - t0)
            if k in (1, SOAK_MARK, steps) or k % 100 == 0:
                free, total = cupy.cuda.runtime.memGetInfo()
                marks.append({"step": k, "device_free": int(free), "device_total": int(total),
                              "rss": _rss()})
        # CuPy allocations outside the arena and workspace since the session's warm-up: the
        # pool (the memory hook, every queue) and the allocator the compute thread sets
        backend = session._streams.backend
        hook = {"hook_allocations": int(backend.hook.allocations),
                "hook_bytes": int(backend.hook.bytes),
                "hidden_allocations": int(backend.hidden_allocations)}
    at = {m["step"]: m for m in marks}
    first, end = at[SOAK_MARK], at[steps]
    growth = (end["rss"] - first["rss"]) / first["rss"] * 100
    ordered = sorted(times)
    n = {"fixture": SMALL_FIXTURE, "backend": runner.backend, "batch": batch, "steps": steps,
         "arena_bytes": arena, "capacity": capacity, "marks": marks,
         "device_free_delta_bytes": end["device_free"] - first["device_free"],
         "rss_growth_pct": growth, "passes_kept": len(runner.passes), **hook,
         "step_p50_s": ordered[len(ordered) // 2],
         "step_p95_s": ordered[max(int(len(ordered) * 0.95) - 1, 0)],
         "tokens_last": last.tolist()}
    problems = []
    if end["device_free"] != first["device_free"]:
        problems.append(f"device free memory moved by {n['device_free_delta_bytes']} B between "
                        f"step {SOAK_MARK} and {steps}")
    if growth > 1.0:
        problems.append(f"host RSS grew {growth:.2f}% (> 1%)")
    if hook["hook_allocations"] or hook["hidden_allocations"]:
        problems.append(f"{hook['hook_allocations']} allocations through CuPy's pool "
                        f"({hook['hook_bytes']} B) and {hook['hidden_allocations']} through the "
                        "compute thread's allocator outside the arena and workspace")
    return ("failed", "; ".join(problems), n) if problems else ("ok", "", n)


def py_profile(work: Path, dry: bool, shims: list[str]) -> tuple[str, str, dict]:
    return profile_step(work, dry, shims, fixture(SMALL_FIXTURE))


#: the python steps: (output dir, dry run, what the stand-in lacked) -> (status, note, numbers)
PY_STEPS = {"env": py_env, "agree": py_agree, "soak": py_soak, "decode": py_decode,
            "profile": py_profile}
