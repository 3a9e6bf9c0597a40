"""The stream runtime's own cost per node: real plans run through a `StreamSession` on the null
backend (every operation does nothing), `timing=False`, so a pass costs only what the executor
spends on its threads, waits and bookkeeping.

Plans (compiled once on the default profile and cached under `--cache`):
- `65b-prefill`: llama-65b, B=1 S=2048, `--gpu-mem 16GB` (`einpage compile llama-65b --gpu-mem
  16GB`);
- `7b-decode-b1`, `7b-decode-b16`: one llama-7b decode step at a 2048-row KV store (the step at
  position 2047), B=1 and B=16, 16 GB.

Each plan is held open in one session: the first pass (which also loads the resident blocks) is
a warm-up; then `--passes` passes. Per pass: the executor's own wall (`Measured.wall_s`: from
issuing the first node to every queue drained) and the whole `StreamSession.run` (adds the
between-pass input check and assembling the outputs), each divided by the steps the program
issues; the process's CPU time over the same steps; and the voluntary context switches (threads
that blocked and were woken: the handoffs between queues). Beside them, the serial floor: the
same steps issued in plan order by one thread (no handoffs). Figures are medians over the
passes.

Weights come from `RandomWeights` (lazy; the null backend reads none) and every activation and
KV-store input is a zero-stride view of its shape, so nothing large is materialised. The
prefill's KV-cache outputs (5.4 GB that `PlanIO.results` would assemble every pass) are dropped
from the plan's outputs: the program, and so every node the pass issues, is unchanged.

    python bench/node_overhead_bench.py [--plans 65b-prefill,7b-decode-b1,7b-decode-b16]
        [--passes 7] [--cache /tmp/einpage-node-bench] [--profile 65b-prefill] [--top 25]
        [--json out.json]

`--profile PLAN` also runs cProfile over that plan's session, warm-up included, in every thread
(the threads' profiles merged), and prints the top functions by own time; a thread's time blocked
on a lock counts as the lock's `acquire`.
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import json
import pstats
import resource
import statistics
import threading
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np

from einpage.compiler import CompileOptions, compile_graph
from einpage.ir.memgraph import InputNode, MemGraph
from einpage.models import llama, resolve, schema
from einpage.runtime.backends.null import NullBackend
from einpage.runtime.stream_executor import StreamSession
from einpage.runtime.streams import QUEUES, StreamProgram, compile_streams

BUDGET = 16 * 10**9
PLANS = {  # name: (model, phase, batch, seq or capacity)
    "65b-prefill": ("llama-65b", "prefill", 1, 2048),
    "7b-decode-b1": ("llama-7b", "decode", 1, 2048),
    "7b-decode-b16": ("llama-7b", "decode", 16, 2048),
}


def compiled_plan(name: str, cache: Path) -> MemGraph:
    """The plan `name`, compiled once and kept in `cache`."""
    path = cache / f"{name}.json.gz"
    if path.exists():
        return MemGraph.load(path)
    model, phase, batch, size = PLANS[name]
    cfg, _ = resolve(model)
    graph = (llama.prefill_graph(cfg).bind(B=batch, S=size) if phase == "prefill"
             else llama.decode_graph(cfg).bind(B=batch, C=size))
    sources = {w: schema.hf_tensor(w) for w in schema.weight_shapes(cfg)}
    t0 = time.perf_counter()
    mg = compile_graph(graph, CompileOptions(BUDGET, sources=sources)).memgraph
    print(f"# compiled {name} in {time.perf_counter() - t0:.1f} s", flush=True)
    cache.mkdir(parents=True, exist_ok=True)
    mg.save(path)
    return mg


def logits_only(mg: MemGraph) -> MemGraph:
    """`mg` returning only its logits (see the module docstring)."""
    return dataclasses.replace(mg, outputs=tuple(o for o in mg.outputs if o.name == "logits"),
                               results=tuple(r for r in mg.results if r.name == "logits"))


def zero_inputs(mg: MemGraph) -> dict[str, np.ndarray]:
    """Every non-weight input of `mg` as a zero-stride view of its shape (no memory)."""
    shapes = {t.name: (t.role, tuple(t.shape), t.dtype.numpy) for t in mg.inputs}
    for n in mg.nodes:
        if isinstance(n, InputNode):
            t = mg.tensors[n.tensor]
            if t.source is not None and t.source.input not in shapes:
                shapes[t.source.input] = (t.role, tuple(t.source.full_shape), t.dtype.numpy)
    return {name: np.broadcast_to(np.zeros((), dtype), shape)
            for name, (role, shape, dtype) in shapes.items() if role != "weight"}


class ThreadProfiles:
    """cProfile in every thread started while active (worker threads included), merged."""

    def __init__(self):
        self.profiles: list[cProfile.Profile] = []
        self._run = threading.Thread.run

    def __enter__(self):
        profiles, run = self.profiles, self._run

        def profiled(thread):
            p = cProfile.Profile()
            profiles.append(p)
            p.runcall(run, thread)

        threading.Thread.run = profiled
        self.main = cProfile.Profile()
        self.main.enable()
        return self

    def __exit__(self, *exc) -> None:
        self.main.disable()
        threading.Thread.run = self._run

    def report(self, top: int) -> str:
        out = io.StringIO()
        stats = pstats.Stats(self.main, stream=out)
        for p in self.profiles:
            stats.add(p)
        stats.sort_stats("tottime").print_stats(top)
        return out.getvalue()


def serial_floor(mg: MemGraph, program: StreamProgram, passes: int) -> float:
    """Median seconds to issue the program's steps in plan order in one thread on the null
    backend (each step's call, and `record` where it records): the per-node cost with no
    handoff between threads, for comparison."""
    backend = NullBackend()
    issue = {"compute": backend.run, "h2d": backend.copy_h2d, "h2d_host": backend.copy_h2d,
             "d2h": backend.copy_d2h, "disk": backend.read_disk, "host": backend.run_host}
    steps = [(issue[s.queue], mg.nodes[s.node], s.queue, s.node in program.events)
             for s in program.steps]
    walls = []
    for _ in range(passes):
        t0 = time.perf_counter()
        for fn, node, queue, records in steps:
            fn(node)
            if records:
                backend.record(queue, node.id)
        walls.append(time.perf_counter() - t0)
    return statistics.median(walls)


def timed_passes(mg: MemGraph, program: StreamProgram, weights, inputs, passes: int) -> dict:
    """One session on the null backend: a warm-up pass, then `passes` passes, each measured:
    the executor's wall, the whole `run`, the process's CPU time and voluntary switches."""
    out = {"wall": [], "run": [], "cpu": [], "switches": []}
    with StreamSession(mg, weights, NullBackend(), program, timing=False) as session:
        session.run(inputs)  # warm-up: loads the resident blocks
        for _ in range(passes):
            ru0, c0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.process_time(), \
                time.perf_counter()
            result = session.run(inputs)
            t1, c1, ru1 = time.perf_counter(), time.process_time(), \
                resource.getrusage(resource.RUSAGE_SELF)
            out["wall"].append(result.measured.wall_s)
            out["run"].append(t1 - t0)
            out["cpu"].append(c1 - c0)
            out["switches"].append(ru1.ru_nvcsw - ru0.ru_nvcsw)
    return out


def measure(name: str, mg: MemGraph, passes: int, profile: bool, top: int) -> dict:
    program = compile_streams(mg, preload=True)
    steps = len(program.steps)
    _, weights = resolve(PLANS[name][0], random_weights=True)
    profiles = ThreadProfiles() if profile else None
    with profiles or nullcontext():  # from the start: a session's threads start at its first pass
        got = timed_passes(mg, program, weights, zero_inputs(mg), passes)
    per_node = {k: statistics.median(v) / steps for k, v in got.items()}
    row = dict(plan=name, steps=steps, waits=sum(len(s.waits) for s in program.steps),
               events=len(program.events), preloaded=len(program.preloaded), passes=passes,
               us_per_node=per_node["wall"] * 1e6, us_per_node_min=min(got["wall"]) / steps * 1e6,
               run_us_per_node=per_node["run"] * 1e6, cpu_us_per_node=per_node["cpu"] * 1e6,
               switches_per_node=per_node["switches"],
               serial_us_per_node=serial_floor(mg, program, passes) / steps * 1e6,
               pass_ms=statistics.median(got["wall"]) * 1e3)
    for q in QUEUES:
        row[f"{q}_steps"] = sum(1 for s in program.steps if s.queue == q)
    if profiles:
        row["profile"] = profiles.report(top)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plans", default=",".join(PLANS))
    ap.add_argument("--passes", type=int, default=7)
    ap.add_argument("--cache", type=Path, default=Path("/tmp/einpage-node-bench"))
    ap.add_argument("--profile", help="a plan to profile (cProfile in every thread)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows = []
    for name in args.plans.split(","):
        mg = logits_only(compiled_plan(name, args.cache))
        row = measure(name, mg, args.passes, args.profile == name, args.top)
        text = row.pop("profile", None)
        print(json.dumps(row), flush=True)
        if text:
            print(text, flush=True)
        rows.append(row)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
