"""One rank of a pipeline plan under MPI, for `tests/test_ranks_cli.py`: `mpiexec -n 2 python
tests/mpi_ranks_worker.py SEED`. Every rank compiles the same two-rank prefill of the small
preset (f32, a third of its weights per device: streamed, the hidden state sent in blocks), runs
its own program on the threads backend with seeded random delays per queue (seed `[SEED,
rank]`), and the last rank compares the logits with the dense reference: one `RESULT {json}`
line."""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # einpage, even if not installed

import numpy as np  # noqa: E402

from einpage.compiler import CompileOptions  # noqa: E402
from einpage.compiler.pipeline import compile_pipeline  # noqa: E402
from einpage.ir.dtypes import DType  # noqa: E402
from einpage.models import config, llama  # noqa: E402
from einpage.models.checkpoint import RandomWeights  # noqa: E402
from einpage.runtime import evaluate  # noqa: E402
from einpage.runtime.backends import make_backend  # noqa: E402
from einpage.runtime.backends.inject import Delayed  # noqa: E402
from einpage.runtime.comm import MpiCommunicator  # noqa: E402
from einpage.runtime.ranks import run_rank  # noqa: E402


def main(seed: int) -> None:
    cfg = config.preset("small").with_dtype(DType.f32)
    weights = RandomWeights(cfg, 0)
    graph = llama.prefill_graph(cfg).bind(B=1, S=12)
    tokens = (np.arange(12).reshape(1, 12) * 7 + 3) % cfg.vocab
    pipeline = compile_pipeline(graph, 2, CompileOptions(cfg.weight_bytes() // 6,
                                                         block_bytes=8192))
    with MpiCommunicator(timeout=60) as comm:
        backend = Delayed(make_backend("threads"), seed=seed * 1000 + comm.rank)
        out = run_rank(pipeline.programs[comm.rank], comm, {"tokens": tokens}, weights,
                       backend=backend)
        if "logits" in out:
            want = evaluate(graph, {"tokens": tokens}, weights)["logits"]
            err = float(np.abs(out["logits"] - want).max() / np.abs(want).max())
            print("RESULT " + json.dumps({"rank": comm.rank, "error": err,
                                          "recvs": pipeline.programs[comm.rank].count("recv")}),
                  flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]))
