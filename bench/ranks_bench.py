"""Several devices measured on this machine (issue 31): one rank against N MPI ranks of the same
budget each, on the threads backend.

LLaMA-7B shapes with `--layers` layers and random f16 weights (made once per process from one
seed, so every rank holds the same model), a prefill of `--batch` rows of `--seq` tokens. The
one-rank plan is compiled for `--fraction` of the weights; the N-rank plan (`--parallel
pipeline`: `compile_pipeline`; `tensor`: `compile_tensor_parallel`, every rank a 1/N slice of
every layer) gives each rank that budget too. The batch runs as `--micro-batches` passes in a row (each rank's
session held open, pass m's messages meeting pass m's), after one warm-up pass, `--reps` times;
printed: the median wall time of the whole batch, from a barrier to the last rank's end, and the
logits' largest difference from the one-rank run's.

    python bench/ranks_bench.py [--layers 4] [--ranks 2] [--micro-batches 1]
                                [--parallel pipeline|tensor]
    (it starts `mpiexec -bind-to core -n N` on itself for the ranks: the mpich wheel's
    mpiexec, each rank's threads on cores of its own)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from einpage.compiler import CompileOptions, compile_graph
from einpage.compiler.parallel import compile_parallel
from einpage.models import config, llama
from einpage.runtime.stream_executor import StreamSession

sys.path.insert(0, str(Path(__file__).parent))
from quant_bench import HeldWeights, dense_weights  # noqa: E402  (same random model)


def setup(args):
    cfg = replace(config.preset("llama-7b"), layers=args.layers, name=f"llama-7b-{args.layers}l")
    weights = HeldWeights(cfg, dense_weights(cfg))
    per = args.batch // args.micro_batches
    graph = llama.prefill_graph(cfg).bind(B=per, S=args.seq)
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, cfg.vocab, (args.batch, args.seq))
    batches = [{"tokens": tokens[m * per:(m + 1) * per]} for m in range(args.micro_batches)]
    options = CompileOptions(int(cfg.weight_bytes() * args.fraction))
    return cfg, weights, graph, batches, options


def timed(session, batches, reps, barrier=lambda: None):
    """(median seconds of the whole batch, the logits of the last repetition)."""
    for b in batches:  # warm-up: opens the backend, loads the resident blocks
        session.run(b)
    times, out = [], None
    for _ in range(reps):
        barrier()
        start = time.perf_counter()
        out = [session.run(b).outputs.get("logits") for b in batches]
        barrier()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def rank_main(args) -> None:
    """One MPI rank: its program of the pipeline, `reps` batches; rank 0 prints the time."""
    from einpage.runtime.comm import MpiCommunicator
    cfg, weights, graph, batches, options = setup(args)
    from einpage.runtime.shards import rank_weights
    pipeline = compile_parallel(graph, args.ranks, options, args.parallel)
    with MpiCommunicator(timeout=600) as comm:
        mg = pipeline.programs[comm.rank]
        with StreamSession(mg, rank_weights(weights, mg), "threads", comm=comm) as session:
            seconds, out = timed(session, batches, args.reps, lambda: comm.barrier(600))
        if out[0] is not None:  # a pipeline's last rank, or each tensor-parallel rank's slice
            np.save(f"{args.logits}.{comm.rank}.npy", np.concatenate(out))
        if comm.rank == 0:
            print(json.dumps({"seconds": seconds,
                              "cut": list(getattr(pipeline.split, "cut", ())),
                              "predicted": [r.compiled.simulation.makespan_s
                                            for r in pipeline.ranks]}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=1)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--parallel", choices=("pipeline", "tensor"), default="pipeline")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--fraction", type=float, default=1 / 4,
                    help="each rank's budget, as a share of the whole model's weights")
    ap.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--logits", default="/tmp/ranks_bench_logits.npy", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_worker:
        return rank_main(args)
    cfg, weights, graph, batches, options = setup(args)
    one = compile_graph(graph, options)
    with StreamSession(one.memgraph, weights, "threads") as session:
        alone, out = timed(session, batches, args.reps)
    want = np.concatenate(out)
    mpiexec = Path(sys.executable).parent / "mpiexec"
    # each rank on cores of its own (the BLAS and the kernels' threads follow the affinity)
    argv = [str(mpiexec), "-launcher", "fork", "-bind-to", "core", "-n", str(args.ranks),
            sys.executable, __file__, "--rank-worker", *sys.argv[1:]]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_"))}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        sys.exit(f"the ranks failed:\n{done.stdout}{done.stderr}")
    ranks = json.loads(done.stdout.strip().splitlines()[-1])
    parts = [f"{args.logits}.{r}.npy" for r in range(args.ranks)]
    if args.parallel == "tensor":  # each rank's slice of the vocabulary
        got = np.concatenate([np.load(p) for p in parts], axis=-1)
    else:
        got = np.load(parts[-1])
    diff = float(np.abs(got.astype(np.float32) - want.astype(np.float32)).max()
                 / np.abs(want.astype(np.float32)).max())
    print(f"llama-7b shapes, {args.layers} layers, prefill B={args.batch} S={args.seq} in "
          f"{args.micro_batches} micro-batch(es), budget {options.device_bytes / 1e9:.3f} GB per "
          f"rank ({args.fraction:g} of the weights), threads backend, median of {args.reps}")
    print(f"1 rank:  {alone:.3f} s  (predicted on h100-pcie {one.simulation.makespan_s:.4f} s)")
    how = (f"cut at stages {ranks['cut']}" if args.parallel == "pipeline"
           else "tensor parallel")
    print(f"{args.ranks} ranks: {ranks['seconds']:.3f} s  ({alone / ranks['seconds']:.2f}x; "
          f"{how}; logits differ by {diff:.1e} of the largest: f16, blocks cut otherwise)")


if __name__ == "__main__":
    main()
