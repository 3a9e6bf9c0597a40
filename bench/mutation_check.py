"""Mutation check of the CuPy backend's synchronisation: delete one `record`, `wait_event` or
`synchronize` call of `einpage/runtime/backends/cuda.py` at a time and run the CPU tests that
drive the backend through the asynchronous CuPy stand-in (`tests/fake_cupy.py`); a mutant is
caught when at least one test fails. Each mutant runs in a copy of the checkout, so the working
tree is never touched.

    python bench/mutation_check.py [--tests 'tests/test_cuda_backend.py tests/...'] [--json F]

Prints one line per mutant and the count caught; exits 1 if any mutant survived.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET = Path("einpage/runtime/backends/cuda.py")
CALLS = ("record", "wait_event", "synchronize")
TESTS = ("tests/test_cuda_backend.py", "tests/test_cuda_memory.py", "tests/test_tiers.py",
         "tests/test_constant_blocks.py")


def mutants(source: str) -> list[tuple[int, str, str]]:
    """(line, call, mutated source) for every statement that is one call of `CALLS`."""
    lines = source.splitlines(keepends=True)
    out = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Attribute)
                and node.value.func.attr in CALLS):
            first, last = node.lineno - 1, node.end_lineno
            indent = lines[first][:len(lines[first]) - len(lines[first].lstrip())]
            mutated = lines[:first] + [f"{indent}pass  # mutant\n"] + lines[last:]
            out.append((node.lineno, node.value.func.attr, "".join(mutated)))
    return sorted(out)


def run_tests(tree: Path, tests: list[str]) -> tuple[bool, float]:
    """Whether every test passes in `tree`, and the seconds it took."""
    env = dict(os.environ, PYTHONPATH=str(tree), CI="1")
    t0 = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                             *tests], cwd=tree, env=env, capture_output=True, text=True)
    return result.returncode == 0, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", default=" ".join(TESTS))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    tests = args.tests.split()
    source = (ROOT / TARGET).read_text()
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "checkout"
        tree.mkdir()
        for part in ("einpage", "tests"):
            shutil.copytree(ROOT / part, tree / part,
                            ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy(ROOT / "pyproject.toml", tree / "pyproject.toml")
        ok, seconds = run_tests(tree, tests)
        if not ok:
            print("the unmutated backend fails its tests: nothing to check", file=sys.stderr)
            return 2
        print(f"unmutated: pass ({seconds:.0f} s)")
        rows = []
        for line, call, mutated in mutants(source):
            (tree / TARGET).write_text(mutated)
            passed, seconds = run_tests(tree, tests)
            rows.append({"line": line, "call": call, "caught": not passed,
                         "seconds": round(seconds, 1)})
            print(f"cuda.py:{line:<4} {call:<12} {'caught' if not passed else 'SURVIVED'} "
                  f"({seconds:.0f} s)", flush=True)
    caught = sum(r["caught"] for r in rows)
    print(f"{caught} of {len(rows)} mutants caught")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0 if caught == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
