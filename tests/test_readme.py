"""The README's Python snippets run as written (and assert what they claim)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
SNIPPETS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


@pytest.mark.parametrize("code", SNIPPETS, ids=[f"snippet{k}" for k in range(len(SNIPPETS))])
def test_readme_snippet_runs(code, capsys):
    exec(compile(code, str(README), "exec"), {})


def test_the_readme_has_python_snippets():
    assert SNIPPETS
