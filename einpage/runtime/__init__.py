"""Running graphs and plans.

    reference  the dense reference: a `Graph` on whole NumPy tensors (the truth)
    kernels    the NumPy block kernels shared by the runtimes
    executor   the sequential NumPy executor of a `MemGraph`, in plan order or any random
               topological order of its edges

`runtime` imports only `ir`; it never imports `compiler` or `cli`."""
from einpage._exports import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "evaluate": "reference",
    "run": "executor", "NumpyExecutor": "executor", "random_topological_order": "executor",
})
