"""The exceptions shardkit raises: every one is a :class:`ShardkitError`, and also the builtin
exception Python code already catches for that kind of failure (``ValueError``, ``OSError`` and
its errno subclasses, ``IndexError``), so ``except ValueError`` and ``except OSError`` keep
working.

=============================  ===============================  =================================
exception                      also a                           raised when
=============================  ===============================  =================================
``CorruptDataError``           ``ValueError``                   a file breaks its format's rules,
                                                                or fails its checksum
``IncompleteDatasetError``     ``ValueError``                   a dataset was never finished (a
                                                                killed writer); resumable
``InvalidArgumentError``       ``ValueError``                   an argument or option is invalid
``InvalidArgumentTypeError``   ``InvalidArgumentError``,        an argument of the wrong type, an
                               ``TypeError``                    unknown keyword, a missing one
``ShardkitOSError``            ``OSError``                      the operating system refused an
                                                                operation (subclasses by errno:
                                                                ``PermissionDeniedError`` is a
                                                                ``PermissionError``, ...)
``NotFoundError``              ``FileNotFoundError``            a file or directory is missing
``AlreadyExistsError``         ``FileExistsError``              the output exists
``LockedError``                ``BlockingIOError``              another writer holds the dataset
``RemoteError``                ``OSError``                      an object-store request failed
                                                                after its retries (names the
                                                                object and the byte range)
``OutOfRangeError``            ``IndexError``                   an index past the end
``InternalError``              ``RuntimeError``                 a bug or a failed thread; report it
=============================  ===============================  =================================

Every message names the file (and where useful the byte range or record) and the rule.
"""

import errno as _errno
from typing import Dict, Optional, Type

__all__ = [
    "ShardkitError",
    "CorruptDataError",
    "IncompleteDatasetError",
    "InvalidArgumentError",
    "InvalidArgumentTypeError",
    "ShardkitOSError",
    "NotFoundError",
    "AlreadyExistsError",
    "LockedError",
    "RemoteError",
    "PermissionDeniedError",
    "OutOfRangeError",
    "InternalError",
]


class ShardkitError(Exception):
    """The base of every exception shardkit raises."""


class CorruptDataError(ShardkitError, ValueError):
    """A file breaks its format's rules (or its checksum): the message names it and the rule."""


class IncompleteDatasetError(ShardkitError, ValueError):
    """The dataset is not completely written; the message says how much is present. Its writer
    can resume it (``resume=True`` / ``--resume``)."""


class InvalidArgumentError(ShardkitError, ValueError):
    """An argument or option is invalid (nothing on disk was touched)."""


class InvalidArgumentTypeError(InvalidArgumentError, TypeError):
    """An argument of the wrong type (a float where an int goes, None where a path goes), an
    unknown keyword (the message suggests the close match) or a missing one. Also a
    ``TypeError``, which Python itself raises for these."""


class ShardkitOSError(ShardkitError, OSError):
    """The operating system refused an operation; ``errno`` and ``filename`` say which."""


class NotFoundError(ShardkitOSError, FileNotFoundError):
    """A file or directory that should exist does not."""


class AlreadyExistsError(ShardkitOSError, FileExistsError):
    """The output already exists (pass the overwrite or resume option to replace or continue)."""


class LockedError(ShardkitOSError, BlockingIOError):
    """Another live writer holds the dataset's lock; the message names its pid."""


class PermissionDeniedError(ShardkitOSError, PermissionError):
    """EACCES or EPERM."""


class _IsADirectory(ShardkitOSError, IsADirectoryError):
    pass


class _NotADirectory(ShardkitOSError, NotADirectoryError):
    pass


class _Interrupted(ShardkitOSError, InterruptedError):
    pass


class _TimedOut(ShardkitOSError, TimeoutError):
    pass


class RemoteError(ShardkitOSError):
    """An object-store request (``s3://``) failed after its retries with backoff were spent, or
    could not be retried (access denied, a bad endpoint); the message names the object and the
    byte range."""


class OutOfRangeError(ShardkitError, IndexError):
    """An index (example, sample, step, variable) past the end."""


class InternalError(ShardkitError, RuntimeError):
    """Something that should not happen did (a bug, or a thread that could not start)."""


_BY_ERRNO: Dict[int, Type[ShardkitOSError]] = {
    _errno.EACCES: PermissionDeniedError,
    _errno.EPERM: PermissionDeniedError,
    _errno.ENOENT: NotFoundError,
    _errno.EEXIST: AlreadyExistsError,
    _errno.EISDIR: _IsADirectory,
    _errno.ENOTDIR: _NotADirectory,
    _errno.EINTR: _Interrupted,
    _errno.ETIMEDOUT: _TimedOut,
}


def _os_error(errno: Optional[int], message: str) -> ShardkitOSError:
    """The exception for an operating-system error (used by the compiled core); the message
    already names the file, so it is not passed again as OSError's ``filename``."""
    if errno is None:
        return ShardkitOSError(message)
    return _BY_ERRNO.get(errno, ShardkitOSError)(errno, message)
