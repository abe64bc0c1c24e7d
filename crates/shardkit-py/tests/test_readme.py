"""The Python snippets of README.md and docs/*.md run as written.

Every ```python block is executed on its own, in a fresh temporary directory as the working
directory, so each block must create the data it reads. Code that cannot run here (a GPU, a
remote bucket) is fenced as ```text instead.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
# Each format's reference page must show its Python API in at least one runnable snippet.
FORMAT_PAGES = ["saev.md", "flat_tokens.md", "eagle3.md", "dspark.md", "sdnb.md"]


def doc_files():
    return [README] + sorted(DOCS.glob("*.md"))


def snippets(path):
    return re.findall(r"^```python\n(.*?)^```", path.read_text(), re.S | re.M)


def all_snippets():
    return [
        pytest.param(path, i, id=f"{path.relative_to(ROOT)}-{i}")
        for path in doc_files()
        for i in range(len(snippets(path)))
    ]


def test_readme_has_python_snippets():
    assert len(snippets(README)) >= 4, "README.md: a Python quick start per format"
    for name in FORMAT_PAGES:
        page = DOCS / name
        assert page.is_file(), f"docs/{name} is missing"
        assert snippets(page), f"docs/{name} has no ```python snippet"


@pytest.mark.parametrize("path,i", all_snippets())
def test_readme_snippet_runs(path, i, tmp_path, monkeypatch):
    code = snippets(path)[i]
    monkeypatch.chdir(tmp_path)
    name = f"{path.relative_to(ROOT)} snippet {i}"
    exec(compile(code, name, "exec"), {"__name__": "__readme__"})
