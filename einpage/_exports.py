"""Re-exports imported on first use (PEP 562), so that `from einpage.compiler import
compile_graph` works while `import einpage.ir.dtypes` does not pull in SymPy, the compiler or
matplotlib: a command imports what it needs when it needs it."""
from __future__ import annotations

import importlib
import sys
from typing import Callable


def lazy_exports(package: str, table: dict[str, str]) -> tuple[Callable, Callable, list[str]]:
    """`__getattr__`, `__dir__` and `__all__` for `package`, whose public names live in its
    submodules: `table` maps each name to the submodule that defines it."""
    def __getattr__(name: str):
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(sys.modules[package], name, value)  # later lookups skip __getattr__
        return value

    def __dir__() -> list[str]:
        return sorted(set(table) | set(vars(sys.modules[package])))

    return __getattr__, __dir__, sorted(table)
