"""The `shardkit` binary the CLI tests run: $SHARDKIT_BIN (scripts/test sets it), else the debug
build in the repository's target directory; a test skips, saying so, when neither exists."""

import os
from pathlib import Path

import pytest


def shardkit_cli() -> str:
    exe = os.environ.get("SHARDKIT_BIN") or str(Path(__file__).resolve().parents[3] / "target" / "debug" / "shardkit")
    if not os.path.exists(exe):
        pytest.skip(f"no shardkit CLI at {exe} (scripts/test builds it first; or set SHARDKIT_BIN)")
    return exe
