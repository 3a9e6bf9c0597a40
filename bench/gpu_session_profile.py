"""The GPU session's `profile` step: where the host's time goes when it issues a pass.

On the first GPU (2026-11-27, bench/RESULTS.md) a pass's applies followed each other with no gap
on the device, each lasting what the host took to issue it (60-180 us for an elementwise kernel
of a few microseconds): the passes were bound by the runtime's cost per apply. This step runs a
prefill of the small fixture, a plan for an arena of 1/4 of its weights, several times in one
session on cupy, node by node (no CUDA graph) and without timing events: the wall time per pass
(median) and per apply, then the same passes with `cProfile` on the compute queue's thread (the
one that issues the kernels and GEMMs), whose functions it lists by own time. The first pass is timed apart: what it adds over the median is
what a one-pass `einpage run --timing` also measures (CUDA loads each cuBLAS kernel at its first
launch; the warm-up runs no GEMM). A later session reads there what to make cheaper.
"""
from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import time
from pathlib import Path

TIMED_PASSES = (7, 3)      # (real, dry run): passes timed without the profiler
PROFILED_PASSES = (3, 1)   # passes under cProfile
TOP = 30                   # functions listed


def profile_compute_thread(run_pass, passes: int) -> pstats.Stats:
    """Run `run_pass` `passes` times with cProfile enabled in the compute queue's worker thread
    only (cProfile profiles the thread that enables it)."""
    from einpage.runtime import stream_executor
    crew = stream_executor._Crew
    original = crew._work
    profile = cProfile.Profile()

    def work(self, k, steps, stamps):
        if self.queues[k] != "compute":
            return original(self, k, steps, stamps)
        profile.enable()
        try:
            return original(self, k, steps, stamps)
        finally:
            profile.disable()

    crew._work = work
    try:
        for _ in range(passes):
            run_pass()
    finally:
        crew._work = original
    return pstats.Stats(profile)


def top_functions(stats: pstats.Stats, n: int) -> list[dict]:
    """The `n` functions with the most own time: file:line(name), calls, own and cumulative
    seconds."""
    rows = []
    for (path, line, name), (_, calls, own, cum, _) in stats.stats.items():
        rows.append({"function": f"{Path(path).name}:{line}({name})", "calls": calls,
                     "own_s": own, "cumulative_s": cum})
    rows.sort(key=lambda r: -r["own_s"])
    return rows[:n]


def py_profile(work: Path, dry: bool, shims: list[str], fixture: Path) -> tuple[str, str, dict]:
    import numpy as np
    from einpage.models import llama, resolve
    from einpage.ir.memgraph import ApplyNode
    from einpage.compiler import CompileOptions, compile_graph
    from einpage.runtime.backends import make_backend
    from einpage.runtime.backends.apply_plan import workspace_bytes
    from einpage.runtime.stream_executor import StreamSession
    cfg, weights = resolve(str(fixture))
    tokens = np.load(fixture / "input_ids.npy").astype(np.int64)
    graph = llama.prefill_graph(cfg).bind(B=tokens.shape[0], S=tokens.shape[1])
    mg = compile_graph(graph, CompileOptions(cfg.weight_bytes() // 4)).memgraph
    applies = sum(isinstance(n, ApplyNode) for n in mg.nodes)
    nodes = len(mg.nodes)
    timed, profiled = TIMED_PASSES[dry], PROFILED_PASSES[dry]
    backend = make_backend("cupy", workspace_bytes=workspace_bytes(mg))
    # every pass issued node by node (no CUDA graph), without the timing events
    with StreamSession(mg, weights, backend, timing=False, graphs=False) as session:

        def run_pass():
            session.run({"tokens": tokens})

        t0 = time.perf_counter()
        run_pass()  # the first: resident weights loaded, kernels warm, cuBLAS loads its kernels
        first = time.perf_counter() - t0
        walls = []
        for _ in range(timed):
            t0 = time.perf_counter()
            run_pass()
            walls.append(time.perf_counter() - t0)
        stats = profile_compute_thread(run_pass, profiled)
    text = io.StringIO()
    stats.stream = text
    stats.sort_stats("tottime").print_stats(TOP)
    print(text.getvalue())
    wall = statistics.median(walls)
    rows = top_functions(stats, TOP)
    n = {"fixture": fixture.name, "passes": timed, "nodes": nodes, "applies": applies,
         "first_pass_s": first, "pass_s_median": wall, "us_per_apply": wall / applies * 1e6,
         "us_per_node": wall / nodes * 1e6, "profiled_passes": profiled,
         "compute_thread_s": stats.total_tt / profiled, "top": rows}
    for r in rows[:12]:
        print(f"{r['own_s'] / profiled * 1e3:9.2f} ms/pass {r['calls'] // profiled:7d} calls  "
              f"{r['function']}")
    print(f"first pass {first * 1e3:.2f} ms; median pass {wall * 1e3:.2f} ms over {timed}: "
          f"{n['us_per_apply']:.1f} us per apply ({applies} applies, {nodes} nodes)")
    return "ok", "", n
