"""The README's Python snippets run as written (the torch one when torch is installed)."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[3] / "README.md"


def snippets():
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_has_python_snippets():
    assert len(snippets()) >= 3


@pytest.mark.parametrize("i", range(len(snippets())))
def test_readme_snippet_runs(i, tmp_path, monkeypatch):
    code = snippets()[i]
    monkeypatch.chdir(tmp_path)
    exec(compile(code, f"README.md snippet {i}", "exec"), {"__name__": "__readme__"})
