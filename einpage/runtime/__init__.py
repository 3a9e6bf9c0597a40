"""Running graphs and plans.

    reference  the dense reference: a `Graph` on whole NumPy tensors (the truth)
    kernels    the NumPy block kernels shared by the runtimes
    executor   the sequential NumPy executor of a `MemGraph`, in plan order or any random
               topological order of its edges
    streams    the stream program: a `MemGraph` on compute / h2d / d2h queues with waits, and
               its checker
    stream_executor, backends
               the stream program run on a backend (threads, CuPy), a worker thread per queue

`runtime` imports only `ir`; it never imports `compiler` or `cli`."""
from einpage._exports import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "evaluate": "reference",
    "run": "executor",
    "StreamProgram": "streams", "compile_streams": "streams", "check_program": "streams",
    "NumpyExecutor": "executor", "random_topological_order": "executor",
    "run_streams": "stream_executor", "Measured": "measured",
})
