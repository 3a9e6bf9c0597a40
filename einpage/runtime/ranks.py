"""Running the programs of several ranks: each rank's program on its own executor, its sends and
recvs through a `Communicator` (`einpage.runtime.comm`).

`run_ranks` runs every rank in this process, one thread each, over a `LocalCommunicator` group:
the check that a pipeline's programs, run in any orders, give the one-device answers. Under
`mpiexec` each process runs its own rank with `run_rank` over MPI. Either way a rank that fails
aborts the group, so that every other rank stops (a blocked recv raises) instead of waiting for
a message that will never come; the error raised names the rank that failed first and why.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Mapping, Sequence

import numpy as np

from einpage.errors import CheckpointError, InputError, Interrupted, PlanError
from einpage.ir.memgraph import MemGraph
from einpage.ir.peers import is_boundary, validate_ranks
from einpage.ir.tensors import WeightSource
from einpage.runtime import executor
from einpage.runtime.comm import (DEFAULT_TIMEOUT, MAX_TAG, CommError, Communicator,
                                  LocalCommunicator)
from einpage.runtime.measured import Measured, joined
from einpage.runtime.shards import gathered_of

#: the tag a generation's driver sends the last rank's logits under, to every other rank (a
#: plan's own tags count up from 0)
RESULTS_TAG = MAX_TAG - 1
#: the tag under which rank 0 tells the others a value all must agree on (`agree`)
AGREE_TAG = MAX_TAG - 2
#: the tag under which each rank of a tensor-parallel plan sends its slices of the results to
#: the others (`gather_results`)
GATHER_TAG = MAX_TAG - 3
#: how often the calling thread looks up from waiting on the ranks (Ctrl-C is seen between looks)
_POLL_S = 0.05


Inputs = Mapping[str, np.ndarray]


def rank_backend(name: str, rank: int):
    """The stream backend rank `rank` runs on: `threads`, or `cupy` on GPU `rank` modulo the
    GPUs this process sees (the ranks of one machine, one GPU each); `auto` is cupy where a
    GPU is usable."""
    from einpage.runtime.backends import cuda_usable, make_backend, resolve
    if resolve(name) != "cupy":
        return make_backend("threads")
    if not cuda_usable():
        return make_backend("cupy")  # raises the one-line BackendError saying why
    import cupy
    return make_backend("cupy", device=rank % cupy.cuda.runtime.getDeviceCount())


def run_rank(mg: MemGraph, comm: Communicator, inputs: Inputs | Sequence[Inputs] | None = None,
             weights: WeightSource | None = None, order: str | int = "sequential",
             poison_freed: bool = True, backend=None, repeat: int = 1,
             measured: list[Measured] | None = None) -> dict[str, np.ndarray]:
    """Run this rank's program, on the NumPy executor in `order`, or on a stream `backend` (a
    name or a `Backend`, the plan held open across passes); its results without the values it
    only sends to later ranks. `inputs` may be a list, one pass per entry (the micro-batches of
    a batch, in order: pass m's messages meet the peers' pass m), the results then joined along
    their first axis (the batch). `repeat`: the whole batch this many times (the results of the
    last); `measured`, where given, gets one `Measured` per batch (its micro-batches `joined`;
    the NumPy executor's has the wall only). A failure here aborts the group first, so the
    peers stop too."""
    from einpage.runtime.shards import rank_inputs, rank_weights
    passes = [rank_inputs(mg, given) for given in
              (inputs if isinstance(inputs, (list, tuple)) else [inputs])]
    weights = rank_weights(weights, mg)
    timed = measured is not None
    try:
        if backend is None:
            def one(given) -> tuple[dict, Measured]:
                t0 = time.perf_counter()
                out = executor.run(mg, given, weights, order, poison_freed, comm=comm)
                return out, Measured("numpy", time.perf_counter() - t0, 0.0, 0, ())
            session = None
        else:
            from einpage.runtime.stream_executor import StreamSession
            session = StreamSession(mg, weights, backend, timing=timed, comm=comm,
                                    graphs=not timed)

            def one(given) -> tuple[dict, Measured]:
                result = session.run(given or {})
                return result.outputs, result.measured
        try:
            for _ in range(repeat):
                outs, parts = [], []
                for given in passes:
                    t0 = time.perf_counter()
                    out, m = one(given)
                    outs.append(out)
                    parts.append((t0, m))
                if timed:
                    measured.append(joined(parts))
        finally:
            if session is not None:
                session.close()
    except CommError:
        raise
    except Exception as exc:
        comm.abort(f"{type(exc).__name__}: {_first_line(exc)}")
        raise
    return {name: (outs[0][name] if len(outs) == 1
                   else np.concatenate([o[name] for o in outs]))
            for name in outs[0] if not is_boundary(name)}


def run_ranks(programs: Sequence[MemGraph], inputs: Inputs | Sequence[Inputs] | None = None,
              weights: WeightSource | Sequence[WeightSource] | None = None,
              order: str | int = "sequential",
              poison_freed: bool = True, timeout: float = DEFAULT_TIMEOUT,
              backend: str | None = None,
              delays: int | None = None, repeat: int = 1,
              measured: Mapping[int, list[Measured]] | None = None) -> dict[str, np.ndarray]:
    """Run every rank's program in this process, one thread each, and return all their results
    by name: on the NumPy executor (rank r in order `order`, or in the random order of seed
    `order + r`), or on the stream `backend` named, each rank's queues delayed at random from
    seed `[delays, r]` where `delays` is given. `weights`: one source for every rank, or one
    per rank; `inputs`: one pass, or a list of passes; `repeat`, and `measured` (rank -> the
    list rank r's measurements go to): as `run_rank`. The programs are validated together
    first (`einpage.ir.peers.validate_ranks`)."""
    validate_ranks(programs)
    world = len(programs)
    comms = LocalCommunicator.group(world, timeout=timeout)

    def work(r: int) -> dict:
        rank_order = order if isinstance(order, str) else int(order) + r
        engine = None
        if backend is not None:
            engine = rank_backend(backend, r)
            if delays is not None:
                from einpage.runtime.backends.inject import Delayed
                engine = Delayed(engine, seed=delays * 1000 + r)
        source = weights[r] if isinstance(weights, (list, tuple)) else weights
        return run_rank(programs[r], comms[r], inputs, source, rank_order, poison_freed, engine,
                        repeat, None if measured is None else measured[r])

    try:
        results = run_together({r: (lambda r=r: work(r)) for r in range(world)}, comms)
    finally:
        for c in comms:
            c.close()
    from einpage.runtime.shards import assemble
    return assemble(programs, results)


def gather_results(comm: Communicator, programs: Sequence[MemGraph],
                   mine: Mapping[str, np.ndarray]) -> dict[int, Mapping[str, np.ndarray]]:
    """Under MPI, the slices of the gathered results every process needs (for
    `shards.assemble`): each rank sends, packed in one message, the slices it holds of the
    gathered outputs another rank makes too (the KV rows of its group's layers) and of the
    logits (every process picks the next token) to that rank, and takes each other rank's
    the same way, their sizes known from its program. A plan that gathers nothing (a
    pipeline's) gives this rank's alone."""
    def needed(q: int, r: int) -> list[str]:
        """The gathered results of rank q that rank r takes."""
        if q == r:
            return []
        return sorted(n for n in gathered_of(programs[q]) if n in makes[q]
                      and (n == "logits" or n in makes[r]))

    makes = [{t.name for t in mg.results} for mg in programs]
    me = comm.rank
    for q in range(comm.world):
        names = needed(me, q)
        if names:
            comm.send(np.concatenate([np.ascontiguousarray(mine[n]).reshape(-1).view(np.uint8)
                                      for n in names]), q, GATHER_TAG)
    outs: dict[int, Mapping[str, np.ndarray]] = {me: mine}
    for q in range(comm.world):
        names = needed(q, me)
        if not names:
            continue
        results = {t.name: t for t in programs[q].results}
        shapes = {n: _result_shape(programs[q], results[n]) for n in names}
        sizes = {n: int(np.prod(shapes[n])) * results[n].dtype.itemsize for n in names}
        got = np.empty(sum(sizes.values()), np.uint8)
        comm.recv(got, q, GATHER_TAG)
        outs[q], at = {}, 0
        for n in names:
            outs[q][n] = got[at:at + sizes[n]].view(results[n].dtype.numpy).reshape(shapes[n])
            at += sizes[n]
    return outs


def _result_shape(mg: MemGraph, result) -> tuple[int, ...]:
    """The shape rank `mg.rank`'s result arrives in: its micro-batches' joined along the batch
    (`run_rank`)."""
    m = int(mg.meta.get("micro_batches", 1))
    return (int(result.shape[0]) * m, *(int(s) for s in result.shape[1:]))


def run_together(jobs: Mapping[int, Callable[[], object]], comms) -> dict[int, object]:
    """Each rank's job, one thread each where there are several (a job that fails aborts its
    communicator, so the others stop); their results by rank, or the first cause raised with
    its rank (not the aborts it set off in the other ranks): an `InputError` or
    `CheckpointError` as such, anything else as a `PlanError`."""
    results: dict[int, object] = {}
    errors: dict[int, BaseException] = {}

    done = {r: threading.Event() for r in jobs}

    def work(r: int) -> None:
        try:
            results[r] = jobs[r]()
        except BaseException as exc:  # reported below, by rank
            errors[r] = exc
            comms[r].abort(f"{type(exc).__name__}: {_first_line(exc)}")
        finally:
            done[r].set()

    if len(jobs) == 1:
        (r,) = jobs
        work(r)
    else:
        for r in jobs:
            threading.Thread(target=work, args=(r,), name=f"rank-{r}", daemon=True).start()
        # waits on events, not joins: a join that Ctrl-C interrupts may later return while its
        # thread still runs (CPython), and the ranks must have stopped before this returns
        try:
            for event in done.values():
                while not event.wait(_POLL_S):  # Ctrl-C reaches this thread between waits
                    pass
        except BaseException:
            for r in jobs:  # every rank stops at its next message; then the cause is raised
                comms[r].abort("interrupted")
            for event in done.values():
                event.wait()
            raise Interrupted("interrupted: every rank stopped") from None
    if errors:
        failed = sorted(errors)
        first = next((r for r in failed if not isinstance(errors[r], CommError)), failed[0])
        exc = errors[first]
        if isinstance(exc, CommError) and len(jobs) == 1:
            raise exc  # a peer's failure, under MPI: its own line names it
        cls = type(exc) if isinstance(exc, (InputError, CheckpointError)) else PlanError
        raise cls(f"rank {first}: {exc}") from exc
    return results


def agree(comm: Communicator, value: int) -> int:
    """Rank 0's `value`, on every rank (a budget each process would otherwise measure for
    itself, so that every process compiles the same plans)."""
    box = np.array([value], np.int64)
    if comm.rank == 0:
        for r in range(1, comm.world):
            comm.send(box, r, AGREE_TAG)
    else:
        comm.recv(box, 0, AGREE_TAG)
    return int(box[0])


def check_same(comm: Communicator, digest: str) -> None:
    """Raise `CommError` on every rank whose `digest` (of the programs it compiled) differs
    from rank 0's: the processes would exchange messages of different shapes."""
    mine = np.frombuffer(bytes.fromhex(digest), np.uint8).copy()
    theirs = mine.copy()
    if comm.rank == 0:
        for r in range(1, comm.world):
            comm.send(mine, r, AGREE_TAG)
    else:
        comm.recv(theirs, 0, AGREE_TAG)
        if not np.array_equal(mine, theirs):
            cause = (f"rank {comm.rank} compiled other programs than rank 0 (every process "
                     "must be given the same model and options)")
            comm.abort(cause)
            raise CommError(cause, comm.rank)


def _first_line(exc: BaseException) -> str:
    text = str(exc)
    return text.splitlines()[0] if text else ""
