"""The null backend: every operation does nothing, so a pass on it costs what the stream executor
itself costs (its threads, waits and bookkeeping per node). `bench/node_overhead_bench.py` runs
the llama plans on it. It allocates no arena, reads no input or weight, and returns zeros of each
output block's shape and dtype."""
from __future__ import annotations

import numpy as np

from einpage.ir.memgraph import MemGraph, OutputRef
from einpage.runtime.backends.base import Backend
from einpage.runtime.planio import PlanIO


class NullBackend(Backend):
    name = "null"

    def open(self, mg: MemGraph, io: PlanIO) -> None:
        self.mg = mg

    def copy_h2d(self, n) -> None:
        pass

    def guard_on(self, n) -> bool:
        return True  # every expert's copy costs what the executor spends on it

    def copy_d2h(self, n) -> None:
        pass

    def read_disk(self, n) -> None:
        pass

    def run(self, n) -> None:
        pass

    def run_host(self, n) -> None:
        pass

    def record(self, queue: str, node: int) -> None:
        pass

    def wait(self, queue: str, node: int) -> None:
        pass

    def stamp(self, queue: str) -> float:
        return 0.0

    def seconds(self, start: float, end: float) -> float:
        return end - start

    def finish(self) -> None:
        pass

    def output(self, ref: OutputRef) -> np.ndarray:
        t = self.mg.tensors[ref.tensor]
        return np.zeros(t.shape, dtype=t.dtype.numpy)

    def write_input(self, tid, offset, lead, values) -> None:
        pass

    def close(self) -> None:
        pass
