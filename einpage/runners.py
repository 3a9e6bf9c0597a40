"""Graph runners: what turns a concrete graph and its inputs into outputs. The dense reference,
or a plan compiled for a device budget and executed on a backend (the sequential NumPy executor,
or the stream executor on threads or CuPy). This module joins the compiler and the runtime
(which never import each other); the command line and user code build runners here."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from typing import Callable, Mapping

import numpy as np

from einpage.compiler import CompileOptions, Compiled, compile_graph
from einpage.errors import BudgetError, PlanError, named
from einpage.ir.graph import Graph
from einpage.ir.memgraph import MemGraph
from einpage.ir.tensors import WeightSource
from einpage.runtime.executor import run
from einpage.runtime.measured import Measured

#: runs a concrete graph: (graph, inputs by name) -> outputs by name
Runner = Callable[[Graph, Mapping[str, np.ndarray]], Mapping[str, np.ndarray]]


def run_paged(graph: Graph, inputs: Mapping[str, np.ndarray],
              weights: WeightSource, options: CompileOptions, order="sequential") -> dict:
    """Compile `graph` for the budget and run the plan on the NumPy executor."""
    compiled = compile_graph(graph, options)
    return run(compiled.memgraph, inputs, weights, order=order)


def dense_runner(weights: WeightSource) -> Runner:
    """The dense reference on whole tensors."""
    from einpage.runtime.reference import evaluate
    return lambda graph, inputs: evaluate(graph, inputs, weights)


def paged_runner(weights: WeightSource, options: CompileOptions) -> Runner:
    """Compile every graph for `options.device_bytes` and execute the plan."""
    return lambda graph, inputs: run_paged(graph, inputs, weights, options)


@dataclass(frozen=True)
class Pass:
    """One plan run by a `PlanRunner`: the compiled plan and what its pass measured."""
    compiled: Compiled
    measured: Measured


@dataclass(frozen=True)
class RanksPass:
    """One pass of the programs of several devices run by a `RanksRunner` with timing: the
    programs and what each rank's pass measured (every rank in this process)."""
    programs: tuple[MemGraph, ...]
    measured: Mapping[int, Measured]


class PlanRunner:
    """Compiles every graph for the budget and runs the plan on `backend` (`numpy`: the
    sequential executor; `threads`, `cupy`: the stream executor; `auto`: cupy where a GPU is
    usable, else threads), keeping each pass in `passes`. With `options.device_bytes` None the
    budget is the backend's memory (`backend_memory`). On cupy the budget is all the process
    takes of the device: the CUDA context and cuBLAS handles (measured), cuBLAS's workspace and
    the apply workspace come out of it, the plan gets the rest (`reservation` says how much
    went where). With `arena`, `options.device_bytes` is the plan's arena itself and the rest
    comes on top (a small model paged on a GPU, whose whole budget the context would exceed).

    Plans are cached by graph for the life of the runner (a decode step's graph is the same for
    every step of a KV bucket: one compile). `open(graph)` holds its plan open on the backend for
    many passes (`PlanSession`): what a generation's decode steps run on."""

    def __init__(self, weights: WeightSource, options: CompileOptions, backend: str = "auto",
                 timing: bool = False, arena: bool = False, graphs: bool = True):
        from einpage.runtime.backends import resolve
        self.weights, self.timing = weights, timing
        self.graphs = graphs  # replay CUDA graphs (off: every pass issued and timed by node)
        self.backend = "numpy" if backend == "numpy" else resolve(backend)
        self.context_bytes = 0
        if self.backend == "cupy":
            from einpage.runtime.backends import make_backend
            # fails here, with one line, where no GPU is usable
            self.context_bytes = make_backend("cupy").context_bytes()
        budget = options.device_bytes or backend_memory(self.backend) + self.context_bytes
        self.options = replace(options, device_bytes=budget)
        self.reservation = None  # on cupy: what the budget holds besides the plan (last plan)
        self.arena = arena       # `options.device_bytes` is the plan's arena, not the budget
        self.passes: list[Pass] = []
        self._plans: dict[Graph, tuple[Compiled, int]] = {}
        self.compile_s = 0.0

    @property
    def plans_compiled(self) -> int:
        return len(self._plans)

    def predicted_s(self, graph: Graph) -> float:
        """The predicted seconds of a pass of `graph`'s plan (compiled once)."""
        return self.plan(graph)[0].simulation.makespan_s

    def plan(self, graph: Graph) -> tuple[Compiled, int]:
        """The plan of `graph` (compiled once) and the cupy workspace it needs."""
        if graph not in self._plans:
            t0 = time.perf_counter()
            self._plans[graph] = self._compile(graph)
            self.compile_s += time.perf_counter() - t0
        return self._plans[graph]

    def __call__(self, graph: Graph, inputs: Mapping[str, np.ndarray]) -> dict:
        with self.open(graph) as session:
            return session.run(inputs)

    def open(self, graph: Graph) -> "PlanSession":
        compiled, workspace = self.plan(graph)
        return PlanSession(self, compiled, workspace)

    def _compile(self, graph: Graph) -> tuple[Compiled, int]:
        """The plan, and on cupy the apply workspace it needs: compiled for the arena the budget
        leaves once the CUDA context, cuBLAS's workspace and the plan's own apply workspace are
        taken (`cuda_memory.reserve`); the workspace is known only from the plan, so a couple
        of rounds at most."""
        budget = self.options.device_bytes
        if self.backend != "cupy":
            return compile_graph(graph, self.options), 0
        from einpage.runtime.backends.apply_plan import STATUS_BYTES, workspace_bytes
        from einpage.runtime.backends.cuda_memory import around, reserve
        if self.arena:
            compiled = compile_graph(graph, self.options)
            workspace = workspace_bytes(compiled.memgraph)
            self.reservation = around(budget, self.context_bytes, workspace)
            return compiled, workspace
        workspace = STATUS_BYTES
        for _ in range(4):
            reservation = reserve(budget, self.context_bytes, workspace)
            compiled = compile_graph(graph, replace(self.options,
                                                    device_bytes=reservation.arena))
            need = workspace_bytes(compiled.memgraph)
            if need <= workspace:
                self.reservation = reservation
                return compiled, workspace
            workspace = need
        raise BudgetError(f"the budget of {budget} bytes cannot hold both a plan and the "
                          f"{workspace} bytes of workspace its kernels need", workspace, budget)


class PlanSession:
    """A compiled plan held open for many passes (`models.generation.Session`): on a stream
    backend one `StreamSession` (the arena, and the weights and KV blocks that stay on the device,
    from the first pass to `close`); on `numpy` each pass runs the sequential executor from the
    host inputs. Every pass is appended to the runner's `passes`."""

    def __init__(self, runner: PlanRunner, compiled: Compiled, workspace: int):
        self.runner, self.compiled = runner, compiled
        self._streams = None
        if runner.backend != "numpy":
            from einpage.runtime.backends import make_backend
            from einpage.runtime.stream_executor import StreamSession
            made = (make_backend("cupy", workspace_bytes=workspace) if runner.backend == "cupy"
                    else make_backend(runner.backend))
            self._streams = StreamSession(compiled.memgraph, runner.weights, made,
                                          timing=runner.timing or runner.backend == "threads",
                                          graphs=runner.graphs)

    def __enter__(self) -> "PlanSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        mg, runner = self.compiled.memgraph, self.runner
        if self._streams is None:
            outputs, measured = run_plan(mg, inputs, runner.weights, "numpy")
        else:
            result = self._streams.run(inputs)
            outputs, measured = result.outputs, result.measured
        runner.passes.append(Pass(self.compiled, measured))
        return outputs

    def write(self, name: str, lead: tuple[int, ...], values: np.ndarray) -> None:
        if self._streams is not None:
            self._streams.write(name, lead, values)

    def close(self) -> None:
        if self._streams is not None:
            self._streams.close()


def run_plan(mg: MemGraph, inputs: Mapping[str, np.ndarray], weights: WeightSource | None,
             backend: str, timing: bool = False, workspace: int | None = None
             ) -> tuple[dict[str, np.ndarray], Measured]:
    """Run a plan once on a backend by name: `numpy` (the sequential executor: wall time only)
    or a stream backend (`threads` always times its nodes, `cupy` with `timing`; `workspace`
    sizes cupy's temporaries, default what the plan needs)."""
    outputs, measured = run_plan_passes(mg, inputs, weights, backend, timing, workspace)
    return outputs, measured[0]


def run_plan_passes(mg: MemGraph, inputs: Mapping[str, np.ndarray],
                    weights: WeightSource | None, backend: str, timing: bool = False,
                    workspace: int | None = None, passes: int = 1, graphs: bool = True
                    ) -> tuple[dict[str, np.ndarray], list[Measured]]:
    """`run_plan` `passes` times on the same inputs: on a stream backend in one session (the
    arena and the resident weights stay from one pass to the next); the last pass's outputs
    and every pass's measurement."""
    if backend == "numpy":
        measured = []
        for _ in range(passes):
            t0 = time.perf_counter()
            outputs = run(mg, inputs, weights, poison_freed=False)
            measured.append(Measured("numpy", time.perf_counter() - t0, 0.0, 0, ()))
        return outputs, measured
    from einpage.runtime.backends import make_backend, resolve
    from einpage.runtime.stream_executor import StreamSession
    name = resolve(backend)
    made = (make_backend(name, workspace_bytes=workspace) if name == "cupy" and workspace
            else make_backend(name))
    measured = []
    with StreamSession(mg, weights, made, timing=timing or name == "threads",
                       graphs=graphs) as session:
        for _ in range(passes):
            result = session.run(inputs)
            measured.append(result.measured)
    return result.outputs, measured


def plan_weights(mg: MemGraph, checkpoint) -> WeightSource:
    """The weights a saved plan reads, from `checkpoint` (a `models.checkpoint.Checkpoint`, or
    the weights of a GGUF file: `_source_plan_weights`), checked before anything runs: every weight the plan reads names a tensor of the checkpoint
    whose shape is the one the plan was made for (the logical shape by the checkpoint's own
    config, and its element count) and, where the plan records the dtype of the checkpoint it
    was compiled from (`meta["weights_dtype"]`), in that dtype. A `CheckpointError` names the
    first tensor that differs."""
    from einpage.errors import CheckpointError
    from einpage.models import schema
    if not hasattr(checkpoint, "tensors"):  # the weights of a GGUF file
        return _source_plan_weights(mg, checkpoint)
    if getattr(checkpoint, "int4", None) is not None or any(
            t.storage is not None and not t.storage.spec.writable for t in mg.tensors):
        from einpage.models.checkpoint import CheckpointWeights  # checked weight by weight
        return _source_plan_weights(mg, CheckpointWeights(checkpoint))
    planned = {t.name: t for t in mg.inputs if t.role == "weight"}
    sources = {t.source.input: t.source.checkpoint for t in mg.tensors
               if t.source is not None and t.source.input in planned}
    model = schema.weight_shapes(checkpoint.config)
    made_for = mg.meta.get("weights_dtype")
    where = checkpoint.directory
    from einpage.runtime.shards import whole_shape  # a tensor-parallel rank reads a slice
    shapes = {name: whole_shape(mg, name, t.shape) for name, t in planned.items()}
    for name, want in planned.items():  # in the plan's order: the first that differs is named
        hf = sources.get(name)
        if not hf:
            raise CheckpointError(f"the plan's weight {name!r} names no checkpoint tensor: "
                                  "the plan was not compiled from a model")
        ref = checkpoint.tensors.get(hf)
        if ref is None:
            raise CheckpointError(f"{where}: no tensor {hf!r}, which the plan reads: it was "
                                  "compiled for another model")
        count = int(np.prod(shapes[name], dtype=np.int64))
        if model.get(name) != shapes[name] or int(np.prod(ref.shape)) != count:
            raise CheckpointError(f"{where}: tensor {hf!r} has shape {tuple(ref.shape)}, but the "
                                  f"plan reads it as {shapes[name]}: it was compiled for "
                                  "another model")
        if made_for is not None and ref.dtype.value != made_for:
            raise CheckpointError(f"{where}: tensor {hf!r} is {ref.dtype}, but the plan was "
                                  f"compiled from a checkpoint of {made_for}: compile it from "
                                  "this one")

    return _PlanWeights(checkpoint, sources, shapes)


def _source_plan_weights(mg: MemGraph, weights) -> WeightSource:
    """A weight source's weights (a GGUF file's, an AWQ/GPTQ checkpoint's) for a saved plan:
    every weight the plan reads is one of the source's model, of the plan's shape, and stored
    as the plan stores it (or unpacked on one side: the reader quantizes or dequantizes as it
    reads); a `CheckpointError` names the first that differs."""
    from einpage.errors import CheckpointError
    from einpage.models import schema
    where = (getattr(getattr(weights, "model", None), "path", None)
             or getattr(getattr(weights, "checkpoint", None), "directory", "the checkpoint"))
    model = schema.weight_shapes(weights.config)
    stored = {t.source.input: t.storage for t in mg.tensors
              if t.source is not None and t.role == "weight"}
    from einpage.runtime.shards import whole_shape
    for t in mg.inputs:
        if t.role != "weight":
            continue
        shape = whole_shape(mg, t.name, t.shape)
        if model.get(t.name) != shape:
            raise CheckpointError(f"{where}: the plan reads weight {t.name!r} as "
                                  f"{shape}, which the file's model "
                                  f"{'lacks' if t.name not in model else 'has as ' + str(model[t.name])}"
                                  ": it was compiled for another model")
        held, want = weights.storage(t.name), stored.get(t.name)
        if want is not None and (held.format != want.format if held is not None
                                 else not want.spec.writable):
            raise CheckpointError(f"{where}: weight {t.name!r} is stored "
                                  f"{'as ' + held.format if held else 'unpacked'}, but the plan "
                                  f"reads it as {want.format}: compile the plan from this file")
    return weights


class _PlanWeights:
    """A saved plan's weights: name -> the checkpoint view in the plan's shape; `locate` tells the
    disk tier's reader where each lies in the files."""

    def __init__(self, checkpoint, sources: dict, shapes: dict):
        self.checkpoint, self.sources, self.shapes = checkpoint, sources, shapes

    def __call__(self, name: str) -> np.ndarray:
        return self.checkpoint.array(self.sources[name]).reshape(self.shapes[name])

    def locate(self, name: str):
        from einpage.ir.tensors import FileTensor
        ref = self.checkpoint.tensors[self.sources[name]]
        return FileTensor(ref.file, ref.offset, ref.dtype, self.shapes[name])


def backend_memory(backend: str) -> int:
    """The budget a backend has when none is given: on cupy the device's free memory less a
    tenth (the CUDA context and libraries live there too), otherwise half of the host memory
    available now."""
    if backend == "cupy":
        import cupy
        free, _ = cupy.cuda.runtime.memGetInfo()
        return int(free * 0.9)
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        available = 8 << 30
    return int(available // 2)


class RanksRunner:
    """Compiles every graph for `world` devices of `options.device_bytes` each
    (`compiler.pipeline.compile_pipeline`: plans cached by graph) and runs the ranks' programs
    on `backend` (threads, or cupy: rank r on GPU r modulo the GPUs seen): with `comm` None
    every rank in this process, one thread each, over a `LocalCommunicator` group per plan;
    with `comm` (an `MpiCommunicator` under mpiexec) this process's rank only, every process
    compiling the same programs (checked: `ranks.check_same`). `open(graph)` holds the plans open across passes (`RanksSession`): a
    generation's decode steps. `kv_names`: the KV-store inputs this process's plans read (every
    layer's in one process; its own rank's layers under MPI), so that a generation keeps only
    those (`KVStore(names=...)`). With `timing` (every rank in this process; a flag's name,
    such as "--trace", for the line refusing it under MPI) each pass is kept in `passes`
    (`RanksPass`)."""

    def __init__(self, weights: WeightSource, options: CompileOptions, world: int,
                 backend: str = "threads", comm=None, parallel: str = "pipeline",
                 timing: bool | str = False, role: str | None = None):
        from einpage.runtime.backends import resolve
        if backend not in ("threads", "cupy", "auto"):
            from einpage.errors import InputError
            raise InputError(f"--backend {backend}: plans for several devices run on threads "
                             "or cupy")
        from einpage.compiler.parallel import PARALLEL
        if parallel not in PARALLEL:
            from einpage.errors import InputError
            raise InputError(f"parallel {parallel!r}: one of {', '.join(PARALLEL)}")
        self.weights, self.options, self.world, self.comm = weights, options, world, comm
        self.parallel = parallel
        self.role = role  # what it runs, named in a plan's error (a draft model)
        self.backend = resolve(backend)
        if timing and comm is not None:
            from einpage.errors import InputError
            flag = timing if isinstance(timing, str) else "--timing"
            raise InputError(f"{flag} with --devices measures every rank in one process: "
                             "run it without mpiexec")
        self.timing = bool(timing)
        self.passes: list[RanksPass] = []
        self._predicted: dict[Graph, float] = {}
        self._plans: dict[Graph, object] = {}
        self.cut: tuple[int, ...] | None = None
        self.group: int | None = None  # ranks per tensor-parallel group of a hybrid plan
        self.compile_s = 0.0

    @property
    def plans_compiled(self) -> int:
        return len(self._plans)

    def plan(self, graph: Graph):
        """The pipeline of `graph`, compiled once. Every graph of one runner takes the stage cut
        of the first (a generation's prefill): a layer's KV rows stay on the rank that made
        them."""
        if graph not in self._plans:
            from einpage.compiler.parallel import compile_parallel
            t0 = time.perf_counter()
            try:
                pipeline = compile_parallel(graph, self.world, self.options, self.parallel,
                                            cut=self.cut, group=self.group)
            except (PlanError, BudgetError) as exc:
                if self.role is None:
                    raise
                raise named(exc, self.role) from None
            if self.comm is not None:  # every process compiles: the same programs, or stop
                from einpage.ir.peers import messages_digest
                from einpage.runtime.ranks import check_same
                check_same(self.comm, messages_digest(pipeline.programs))
            self._plans[graph] = pipeline
            self.parallel = pipeline.programs[0].meta.get("parallel", "pipeline")
            self.cut = getattr(pipeline.split, "cut", None)
            self.group = pipeline.programs[0].meta.get("group")
            self.compile_s += time.perf_counter() - t0
        return self._plans[graph]

    def predicted_s(self, graph: Graph) -> float:
        """The predicted seconds of a pass of `graph`'s programs, the ranks simulated together
        on the options' device profile (compiled once)."""
        if graph not in self._predicted:
            self._predicted[graph] = self.plan(graph).makespan_s(self.options.device)
        return self._predicted[graph]

    def close(self) -> None:
        """Close this process's communicator (under MPI: its sends delivered)."""
        if self.comm is not None:
            self.comm.close()

    def __call__(self, graph: Graph, inputs: Mapping[str, np.ndarray]) -> dict:
        with self.open(graph) as session:
            return session.run(inputs)

    def open(self, graph: Graph) -> "RanksSession":
        return RanksSession(self, self.plan(graph).programs)

    @property
    def kv_names(self) -> set[str] | None:
        """The KV-store rows this process's ranks make (None: every layer's, all ranks being
        here): the `cache.*` results of its programs so far (a generation's prefill)."""
        if self.comm is None:
            return None
        return {t.name for p in self._plans.values()
                for t in p.programs[self.comm.rank].results if t.name.startswith("cache.")}


class RanksSession:
    """The programs of every rank held open for many passes: a `StreamSession` per rank of this
    process. A pass runs every rank (in this process, one thread each) and returns the results
    the driver needs: under MPI every process gets the logits whole, so that each picks the
    same next token (gathered from the slices of the ranks that make them, or sent by the last
    rank under tag `RESULTS_TAG` to every rank that does not make them), and the new KV rows of
    its own layers (`runtime.ranks.gather_results`)."""

    def __init__(self, runner: RanksRunner, programs):
        from einpage.runtime.comm import LocalCommunicator
        from einpage.runtime.ranks import rank_backend
        from einpage.runtime.shards import rank_weights
        from einpage.runtime.stream_executor import StreamSession
        self.runner, self.programs = runner, programs
        world = len(programs)
        if runner.comm is None:
            comms = LocalCommunicator.group(world)
            mine = range(world)
        else:
            comms = {runner.comm.rank: runner.comm}
            mine = [runner.comm.rank]
        self.comms = comms
        self.sessions = {}
        try:
            for r in mine:
                self.sessions[r] = StreamSession(programs[r],
                                                 rank_weights(runner.weights, programs[r]),
                                                 rank_backend(runner.backend, r),
                                                 timing=runner.timing, comm=comms[r])
        except BaseException as exc:  # the peers would wait for this rank's messages
            self.close()
            for r in mine:
                comms[r].abort(f"{type(exc).__name__}: {exc}")
            raise

    def __enter__(self) -> "RanksSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        from einpage.runtime.ranks import RESULTS_TAG, gather_results, run_together
        from einpage.runtime.shards import assemble, gathered_of, makers_of
        from einpage.runtime.shards import rank_inputs
        results = run_together({r: (lambda r=r, s=s: s.run(rank_inputs(self.programs[r],
                                                                       inputs)))
                                for r, s in self.sessions.items()}, self.comms)
        outs = {r: result.outputs for r, result in results.items()}
        if self.runner.timing:
            self.runner.passes.append(RanksPass(tuple(self.programs),
                                                {r: result.measured
                                                 for r, result in results.items()}))
        comm = self.runner.comm
        if comm is not None:  # the gathered slices of every rank, on every process
            outs = gather_results(comm, self.programs, outs[comm.rank])
        merged = assemble(self.programs, outs)
        last = len(self.programs) - 1
        if comm is not None and "logits" not in gathered_of(self.programs[last]):
            # made whole on the last rank (and on the others of its group, if any): it sends
            # them to every rank that does not make them, so each picks the same next token
            makers = makers_of(self.programs, "logits")
            if comm.rank == last:
                for r in range(len(self.programs)):
                    if r not in makers:
                        comm.send(np.ascontiguousarray(merged["logits"]), r, RESULTS_TAG)
            elif comm.rank not in makers:
                t = next(t for t in self.programs[last].results if t.name == "logits")
                merged["logits"] = np.empty(t.shape, t.dtype.numpy)
                comm.recv(merged["logits"], last, RESULTS_TAG)
        return merged

    def write(self, name: str, lead: tuple[int, ...], values: np.ndarray) -> None:
        from einpage.runtime.shards import rank_rows
        for r, session in self.sessions.items():
            if any(t.name == name for t in self.programs[r].inputs):
                session.write(name, lead, rank_rows(self.programs[r], name, lead, values))

    def close(self) -> None:
        for session in self.sessions.values():
            session.close()
