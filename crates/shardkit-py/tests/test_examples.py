"""The Python examples run as written (CI also type-checks them with mypy --strict)."""

import runpy
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.py"))


def test_there_are_examples():
    assert [p.name for p in EXAMPLES] == ["tour.py"]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(path, capsys):
    runpy.run_path(str(path), run_name="__main__")
    out = capsys.readouterr().out
    for fmt in ("saev:", "flat-tokens:", "eagle3:", "sdnb:", "errors: NotFoundError"):
        assert fmt in out, out
