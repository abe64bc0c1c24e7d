"""What the multi-process tests share: a directory's bytes, a clean environment for a child
process, and a child run that can be SIGKILLed at a line it prints."""

import os
import signal
import subprocess
import sys

TIMEOUT = 300


def snapshot(root):
    """Every file under `root` (relative path -> bytes), hidden ones included; {} when absent."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = os.path.join(dirpath, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = fh.read()
    return out


def child_env(path_first=(), **extra):
    """This process's environment without any launcher's rank variables or test fault points
    (a child sets its own), with this interpreter's path (`path_first` before it), and
    `extra`."""
    e = {k: v for k, v in os.environ.items()
         if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_", "SHARDKIT_TEST_"))}
    e["PYTHONPATH"] = os.pathsep.join([str(p) for p in path_first] + [p for p in sys.path if p])
    e.update({k: str(v) for k, v in extra.items()})
    return e


def run_child(argv, kill_at=None, path_first=(), **extra):
    """Runs `argv` with `child_env(path_first, **extra)`; with `kill_at` (a line prefix), SIGKILLs it once it
    printed that line. A child neither killed nor aborted by a SHARDKIT_TEST_ABORT_AFTER_*
    fault point (after so many renames or PUTs) must succeed. Returns (killed or failed, its output lines)."""
    p = subprocess.Popen(argv, env=child_env(path_first, **extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    lines = []
    killed = False
    for line in p.stdout:
        lines.append(line.strip())
        if kill_at is not None and line.startswith(kill_at):
            p.send_signal(signal.SIGKILL)
            killed = True
            break
    p.wait(timeout=TIMEOUT)
    err = p.stderr.read()
    p.stdout.close()
    p.stderr.close()
    if not killed and not any(k.startswith("SHARDKIT_TEST_ABORT_AFTER_") for k in extra):
        assert p.returncode == 0, err
    return killed or p.returncode != 0, lines
