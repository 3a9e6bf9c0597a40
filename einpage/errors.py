"""The error hierarchy. Every error a user can cause is an `EinpageError`; the CLI turns one into a
single line on stderr and exit status 2."""


class EinpageError(Exception):
    """Base of every error einpage raises on bad input or an impossible request."""


class SpecError(EinpageError):
    """A malformed einsum spec, or operands that do not match it."""


class ShapeError(EinpageError):
    """Shapes that disagree: sizes of one index, a reshape, a concat, a slice."""


class GraphError(EinpageError):
    """A graph that breaks an invariant of `Graph.verify()`, or a bad binding of symbolic sizes."""


class CheckpointError(EinpageError):
    """A missing, malformed or mis-shaped checkpoint, config or weight tensor."""


class ModelError(EinpageError):
    """An unknown model name or an unsupported model type."""


class InputError(EinpageError):
    """Bad run-time input: a token file, token ids out of range, a missing input tensor."""


class OutputError(InputError):
    """An output that cannot be written: a missing or unwritable directory, a path that is a
    directory, a full disk or a file-size limit. The file is never left half-written: outputs go
    to a temporary file beside the target and are renamed into place (`einpage.outputs`)."""


class BudgetError(EinpageError):
    """A device budget too small for the plan; carries the bytes needed and available."""

    def __init__(self, message: str, needed: int, available: int):
        super().__init__(message)
        self.needed = needed
        self.available = available


class PlanError(EinpageError):
    """A memgraph (or plan file) that breaks a rule of the format."""


class ExecutionError(EinpageError):
    """A plan that failed while running: an error on one of the runtime's queues (a kernel, a
    copy, a device error). Every queue has stopped and the runtime's memory is released."""


class Interrupted(ExecutionError):
    """A run stopped by the user (Ctrl-C); every queue has stopped and memory is released."""


class BackendError(EinpageError):
    """A runtime backend that cannot be used here (no GPU, CuPy missing) or an unknown one."""


def named(exc: EinpageError, what: str) -> EinpageError:
    """`exc` again, of its own type, its message led by `what` (the draft model, say)."""
    if isinstance(exc, BudgetError):
        return BudgetError(f"{what}: {exc}", exc.needed, exc.available)
    return type(exc)(f"{what}: {exc}")
