"""The package's shape: every module imports, and imports run down the pipeline only.

Allowed directions (an arrow means "may import"; every subpackage may import the leaf modules
`einpage.errors`, `einpage.units`, `einpage.outputs` (files written whole) and
`einpage._exports`):

    ir        -> (nothing above it)
    predict   -> ir
    compiler  -> ir, predict
    runtime   -> ir
    models    -> ir
    runners   -> compiler, runtime, ir, models     (compile-and-run glue)
    calibrate -> compiler, runtime, ir, predict    (measures a device profile through a backend)
    forecast  -> compiler, models, ir, predict     (a whole generation's plans, predicted)
    cli       -> everything

So `compiler` never imports `runtime` or `cli`, `runtime` never imports `compiler` or `cli`,
and there is no cycle between subpackages. Imports inside functions count too: they are found by
reading each module's syntax tree, not by what happens to be imported at load time.
"""
from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import pytest

import einpage

LEAVES = {"errors", "units", "outputs", "_exports", ""}
ALLOWED = {
    "ir": set(),
    "predict": {"ir"},
    "compiler": {"ir", "predict"},
    "runtime": {"ir"},
    "models": {"ir"},
    "runners": {"compiler", "runtime", "ir", "models"},
    "calibrate": {"compiler", "runtime", "ir", "predict"},
    "forecast": {"compiler", "models", "ir", "predict"},
    "serving": {"ir", "models"},
    "cli": {"ir", "predict", "compiler", "runtime", "models", "runners", "calibrate",
            "forecast", "serving"},
}
ROOT = Path(einpage.__file__).parent


def _modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages([str(ROOT)], "einpage."))


def _part(module: str) -> str:
    """`einpage.compiler.lowering` -> `compiler`; `einpage` -> ``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _imports(module: str) -> set[str]:
    """Every einpage module `module` imports, at the top or inside a function."""
    spec = importlib.util.find_spec(module)
    if not str(spec.origin).endswith(".py"):
        return set()  # a compiled extension (einpage.runtime._cpu) imports nothing of einpage
    tree = ast.parse(Path(spec.origin).read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("einpage")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.startswith("einpage"):
                found.add(node.module)
    return found


@pytest.mark.parametrize("module", _modules())
def test_every_module_imports(module):
    importlib.import_module(module)


def violations(imports: dict[str, set[str]]) -> list[str]:
    """Imports against ALLOWED, then cycles between subpackages, for `module -> imported`."""
    wrong, edges = [], {}
    for module in sorted(imports):
        src = _part(module)
        for target in sorted(imports[module]):
            dst = _part(target)
            if dst == src or dst in LEAVES:
                continue
            edges.setdefault(src, set()).add(dst)
            if dst not in ALLOWED.get(src, set()):
                wrong.append(f"{module} imports {target} ({src} -> {dst})")
    done: set[str] = set()

    def visit(node: str, path: tuple[str, ...]) -> None:
        if node in path:
            wrong.append("import cycle: " + " -> ".join((*path, node)))
        elif node not in done:
            for nxt in sorted(edges.get(node, ())):
                visit(nxt, (*path, node))
            done.add(node)

    for node in sorted(edges):
        visit(node, ())
    return wrong


def test_imports_run_down_the_pipeline_without_cycles():
    assert violations({m: _imports(m) for m in _modules()}) == []


def test_the_checker_rejects_a_forbidden_import_and_a_cycle(tmp_path, monkeypatch):
    """Trusted only if it rejects: a compiler module importing the runtime inside a function,
    and a cycle between two subpackages."""
    path = tmp_path / "bad.py"
    path.write_text("def f():\n    from einpage.runtime.executor import run\n")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: type("S", (), {"origin": path}))
    bad = {"einpage.compiler.bad": _imports("einpage.compiler.bad")}
    assert violations(bad) == ["einpage.compiler.bad imports einpage.runtime.executor "
                               "(compiler -> runtime)"]
    cycle = {"einpage.cli.a": {"einpage.runners"}, "einpage.runners": {"einpage.cli.a"}}
    assert "import cycle: cli -> runners -> cli" in violations(cycle)


def test_listing_models_imports_neither_sympy_nor_the_compiler():
    """Commands import what they need when they need it (the re-exports are lazy)."""
    import subprocess
    import sys
    code = ("import sys, io, contextlib\nfrom einpage.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n    main(['models'])\n"
            "print(sorted(m for m in ('sympy', 'einpage.compiler.driver', 'matplotlib') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
