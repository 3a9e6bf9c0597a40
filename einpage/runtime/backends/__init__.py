"""Stream backends, registered by name: `threads` (any machine) and `cupy` (an NVIDIA GPU).
`resolve("auto")` picks cupy where a GPU is usable, else threads. Backends import their heavy
dependencies (CuPy) only when made."""
from __future__ import annotations

from einpage.errors import BackendError
from einpage.runtime.backends.base import Backend

NAMES = ("threads", "cupy")


def cuda_usable() -> bool:
    """A CUDA device CuPy can use (CuPy installed, a driver, at least one device)."""
    from einpage.runtime.backends.cuda import cuda_usable as usable
    return usable()


def resolve(name: str) -> str:
    """The backend `name` asks for: `auto` is cupy where a GPU is usable, else threads."""
    if name == "auto":
        return "cupy" if cuda_usable() else "threads"
    if name not in NAMES:
        raise BackendError(f"unknown backend {name!r}; choose auto, {', '.join(NAMES)}")
    return name


def make_backend(name: str, **options) -> Backend:
    """A new backend by name (after `resolve`); raises `BackendError` where it cannot run."""
    name = resolve(name)
    if name == "threads":
        from einpage.runtime.backends.threads import ThreadsBackend
        return ThreadsBackend(**options)
    from einpage.runtime.backends.cuda import CupyBackend
    return CupyBackend(**options)


__all__ = ["Backend", "NAMES", "cuda_usable", "make_backend", "resolve"]
