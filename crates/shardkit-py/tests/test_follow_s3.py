"""Reading a saev dataset in a store while writer processes write it there
(``saev.Loader("s3://...", follow=True)``, moto on loopback): the epoch read during the write
serves every row exactly once and never a torn row, a state saved part way resumes exactly, the
epoch after the commit is a finished dataset's, and the loader only reads (every request it
makes is a GET or a HEAD). The writers talk to the server directly, the loader through the
proxy that logs each request, so the log holds the loader's requests alone."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from shardkit import IncompleteDatasetError, saev

from _procs import child_env
from _s3 import S3, environment
from test_follow import METADATA, N, T, TIMEOUT, WRITER, expected, finish, loader, n_rounds, rows

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def s3() -> Iterator[S3]:
    server = S3()
    try:
        yield server
    finally:
        server.stop()


def test_a_follow_loader_on_s3_serves_each_row_once_while_writers_write_and_only_reads(s3: S3, tmp_path: Path) -> None:
    root = f"s3://{s3.bucket()}/acts"
    env = child_env([HERE], **s3.env(SHARDKIT_STAGING_DIR=str(tmp_path / "staging")))
    procs = [
        subprocess.Popen([sys.executable, "-c", WRITER, json.dumps(METADATA), str(r), "2", "0.03", root],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    path = procs[0].stdout.readline().strip()
    assert path.startswith(root), procs[0].stderr.read()
    with environment(s3.env(proxy=True)):
        mark = len(s3.proxy.request_log)
        follow = loader(path, follow=True, follow_timeout=TIMEOUT)
        seen, states = [], []
        for b in follow:
            for e, c, a in zip(b["example_idx"], b["token_idx"], b["act"]):
                np.testing.assert_array_equal(a, expected(int(e), int(c)))
            seen.append(rows(b))
            states.append(follow.state_dict())
        finish(procs)
        log = s3.proxy.request_log[mark:]
        assert {m for m, _ in log} <= {"GET", "HEAD"}, sorted({m for m, _ in log})
        assert saev.status(path)["committed"]
        served = sorted((e, c) for ex, tok, _ in seen for e, c in zip(ex, tok))
        assert served == [(e, c) for e in range(N) for c in range(T - 1)]
        assert n_rounds(states[-1]["follow_rounds"]) > 1, f"the write was read in one round: {states[-1]}"

        # A state of the first round resumes it exactly, then serves every row left once.
        first_round_end = next(i for i, st in enumerate(states) if st["follow_rounds"] != states[0]["follow_rounds"])
        again = loader(path, follow=True, follow_timeout=TIMEOUT)
        again.load_state_dict(states[0])
        rest = [rows(b) for b in again]
        assert rest[:first_round_end - 1] == seen[1:first_round_end]
        assert sorted((e, c) for ex, tok, _ in seen[:1] + rest for e, c in zip(ex, tok)) == served

        # Committed: the next epoch is the committed loader's, batch for batch.
        follow.set_epoch(1)
        plain = loader(path, epoch=1)
        assert [rows(b) for b in follow] == [rows(b) for b in plain]


def test_a_follow_loader_on_s3_names_the_missing_shards_when_they_do_not_come(s3: S3, tmp_path: Path) -> None:
    root = f"s3://{s3.bucket()}/acts"
    env = child_env([HERE], **s3.env(SHARDKIT_STAGING_DIR=str(tmp_path / "staging")))
    # Rank 0 of 2 writes its part and exits; rank 1 never starts.
    p = subprocess.Popen([sys.executable, "-c", WRITER, json.dumps(METADATA), "0", "2", "0", root],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    path = p.stdout.readline().strip()
    finish([p])
    with environment(s3.env()):
        follow = loader(path, follow=True, follow_timeout=0.3)
        t0 = time.monotonic()
        with pytest.raises(IncompleteDatasetError, match=r"shards 5\.\.10 \(claimed by no live writer\)"):
            for _ in follow:
                pass
        assert time.monotonic() - t0 < 10
