"""Filesystem faults made real wherever the suite runs, as root (CI) or as an ordinary user.

- A permission check (a file chmod 000, a directory chmod 555): file modes bind an ordinary user
  as they are, but not root. So the operation runs in a child process that, as root, drops to
  nobody (65534) first (`must_drop()`, `DROP_SRC`), in a directory that user can traverse
  (`world_dir`); as an ordinary user the child keeps its rights and chmod denies it.
- A mount (a 2 MB tmpfs for ENOSPC, a read-only bind mount for EROFS): made in a private mount
  namespace held by a child process, `unshare --mount` as root and `unshare --user
  --map-root-user --mount` as an ordinary user (or as a root that may not mount, in a container
  without CAP_SYS_ADMIN), and reached through /proc/PID/root of that holder (`private_mounts`).
  Nothing outside the test sees the mount, and it goes away with the holder, whatever happens to
  the test (no umount to forget). Where neither may mount, the test skips saying why.
"""

import contextlib
import functools
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile

import pytest

NOBODY = 65534

# Python for a child's source: drops to nobody (no supplementary groups) when DROP is true.
DROP_SRC = '''
if DROP:
    os.setgroups([])
    os.setgid(%d)
    os.setuid(%d)
''' % (NOBODY, NOBODY)


@functools.cache
def _modes_bind_this_user():
    """Whether a file chmod 000 is unreadable to this process (so not root, no CAP_DAC_OVERRIDE)."""
    fd, probe = tempfile.mkstemp(prefix="shardkit-mode-probe-")
    os.close(fd)
    try:
        os.chmod(probe, 0)
        try:
            open(probe, "rb").close()
        except PermissionError:
            return True
        return False
    finally:
        os.remove(probe)


def must_drop():
    """Whether a child must drop to nobody for chmod to deny it: true as root, false as an
    ordinary user (file modes bind it as they are). Skips, saying why, for a non-root user that
    file modes do not bind (CAP_DAC_OVERRIDE) and that cannot drop privileges."""
    if os.geteuid() == 0:
        return True
    if _modes_bind_this_user():
        return False
    pytest.skip(f"uid {os.geteuid()} reads a file chmod 000 (CAP_DAC_OVERRIDE) and, not being root, "
                "cannot drop to nobody: no permission check can deny it here")


@pytest.fixture
def world_dir():
    """A directory the child of `must_drop()` can traverse, as nobody too (pytest's own tmp is
    0700); cleaned up whatever modes a test left in it."""
    d = tempfile.mkdtemp(prefix="shardkit-fs-faults-")
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        for dirpath, dirs, files in os.walk(d):
            for n in dirs + files:
                try:
                    os.chmod(os.path.join(dirpath, n), 0o755, follow_symlinks=False)
                except (OSError, NotImplementedError):
                    pass
        shutil.rmtree(d, ignore_errors=True)


CALL_CHILD = r'''
import json, os, sys
DROP = {drop!r}
{imports}
{drop_src}
try:
    {code}
except Exception as e:
    sys.stdout.write("RESULT " + json.dumps(dict(ok=False, mro=[c.__name__ for c in type(e).__mro__],
                                                 errno=getattr(e, "errno", None), message=str(e))) + "\n")
else:
    sys.stdout.write("RESULT " + json.dumps(dict(ok=True)) + "\n")
'''


def call_denied(code, imports="import shardkit", timeout=60):
    """Runs the statement `code` in a child that file modes bind (dropped to nobody as root, see
    `must_drop`), after `imports`; returns {"ok": True} or {"ok": False, "mro", "errno",
    "message"} for the exception it raised."""
    src = CALL_CHILD.format(drop=must_drop(), imports=imports, drop_src=DROP_SRC, code=code)
    p = subprocess.run([sys.executable, "-c", src], capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"child died ({p.returncode}):\n{p.stdout}\n{p.stderr}"
    return json.loads(lines[-1][len("RESULT "):])


def _holders():
    """The ways to hold a private mount namespace in which this process may mount, best first."""
    userns = ["unshare", "--user", "--map-root-user", "--mount", "--propagation", "private"]
    if os.geteuid() == 0:
        return [["unshare", "--mount", "--propagation", "private"], userns]
    return [userns]


@contextlib.contextmanager
def private_mounts(setup):
    """Runs the shell commands `setup` (mounts on directories that exist here) in a private mount
    namespace, held by a child until the block ends; yields the prefix that reaches that
    namespace from here (/proc/PID/root: prefix + an absolute path is the path as mounted).
    Skips, saying why, where no namespace may mount (EPERM); fails on any other error."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare (util-linux) to make a private mount namespace")
    failures = []
    for holder in _holders():
        p = subprocess.Popen(holder + ["sh", "-c", f"set -e\n{setup}\necho ready\nexec cat"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
        try:
            if p.stdout.readline().strip() == "ready":
                yield f"/proc/{p.pid}/root"
                return
            p.stdin.close()
            p.wait(timeout=10)
            failures.append(f"{shlex.join(holder[:-2])}: {' '.join(p.stderr.read().split())}")
        finally:
            # EOF ends the holder (cat), and with it the namespace and its mounts.
            if not p.stdin.closed:
                p.stdin.close()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            p.stdout.close()
            p.stderr.close()
    # Only a refusal (no user namespaces, no CAP_SYS_ADMIN: EPERM) is the environment's; any other
    # failure is the test's.
    if all("not permitted" in f or "ermission denied" in f for f in failures):
        pytest.skip("may not mount in a private mount namespace here: " + "; ".join(failures))
    pytest.fail("cannot make the mounts: " + "; ".join(failures))
