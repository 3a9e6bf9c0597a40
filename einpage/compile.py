"""Deprecated: the compiler driver moved to `einpage.compiler` (and `run_paged` to
`einpage.runners`). This module re-exports them and warns; it will be removed."""
import warnings

from einpage.compiler import Compiled, CompileOptions, compile_graph
from einpage.runners import run_paged

warnings.warn("einpage.compile is deprecated: import compile_graph and CompileOptions from "
              "einpage.compiler, run_paged from einpage.runners", DeprecationWarning, stacklevel=2)

__all__ = ["CompileOptions", "Compiled", "compile_graph", "run_paged"]
