"""Shared fixtures for the interop tests (pytest)."""

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def _find_binary():
    env = os.environ.get("SHARDKIT_BIN")
    if env:
        return Path(env), "SHARDKIT_BIN"
    release = REPO_ROOT / "target" / "release" / "shardkit"
    if release.exists():
        return release, "release build"
    return REPO_ROOT / "target" / "debug" / "shardkit", "debug build"


@pytest.fixture(scope="session")
def shardkit_bin():
    """Path of the shardkit CLI: $SHARDKIT_BIN, else target/release/shardkit, else target/debug/shardkit."""
    path, origin = _find_binary()
    if not path.is_file():
        if origin == "SHARDKIT_BIN":
            pytest.fail(f"SHARDKIT_BIN={path} does not exist")
        pytest.skip(f"no shardkit binary at {path}; build it with `cargo build -p shardkit-cli`")
    return str(path)


@pytest.fixture(scope="session")
def saev_fixtures():
    """The read-only saev reference fixtures (../shared/fixtures/saev relative to the repo root)."""
    path = REPO_ROOT.parent / "shared" / "fixtures" / "saev"
    if not path.is_dir():
        pytest.skip(f"saev fixtures not found at {path}")
    return path


@pytest.fixture(scope="session")
def flat_tokens_fixtures():
    """The read-only flat-tokens reference data (../shared/fixtures/flat_tokens)."""
    path = REPO_ROOT.parent / "shared" / "fixtures" / "flat_tokens"
    if not path.is_dir():
        pytest.skip(f"flat-tokens fixtures not found at {path}")
    return path


@pytest.fixture(scope="session")
def zarr2_python():
    """A Python with zarr-python 2.18 (what seqax runs on): $SHARDKIT_ZARR2_PYTHON, else the
    .venv-zarr2 that scripts/setup-venv creates."""
    env = os.environ.get("SHARDKIT_ZARR2_PYTHON")
    path = Path(env) if env else REPO_ROOT / ".venv-zarr2" / "bin" / "python"
    if not path.is_file():
        pytest.fail(f"no zarr-python 2.18 interpreter at {path}; run scripts/setup-venv")
    return str(path)
