"""Argument checks shared by the public API.

Two layers: the validators (:func:`integer`, :func:`boolean`, :func:`choice`, ...) check an
argument where the Python wrapper knows its name and what is allowed, and raise
:class:`~shardkit.errors.InvalidArgumentError` (or :class:`~shardkit.errors.InvalidArgumentTypeError`
for a wrong type, also a ``TypeError``) naming the argument, the value and the rule. :func:`guard`
is the net under them: it wraps every public function and method, and turns what would
otherwise escape as a builtin exception into the documented classes: a call that does not bind
(an unknown keyword, with the close match suggested; a missing argument), and the compiled
core's argument conversions (PyO3's ``argument 'layer': 'float' object cannot be interpreted
as an integer``, an ``OverflowError`` for a negative count).
"""

from __future__ import annotations

import difflib
import functools
import inspect as _inspect
import operator
import os
import re
from typing import Any, Callable, Dict, Iterable, Optional, Sequence, TypeVar

import numpy as np

from .errors import InvalidArgumentError as InvalidArgumentError
from .errors import InvalidArgumentTypeError as InvalidArgumentTypeError
from .errors import ShardkitError

F = TypeVar("F", bound=Callable[..., Any])

_U64 = (1 << 64) - 1


def _kind(value: Any) -> str:
    return type(value).__name__


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def is_int(value: Any) -> bool:
    """An int or a numpy integer, not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def integer(
    name: str,
    value: Any,
    *,
    lo: Optional[int] = None,
    hi: Optional[int] = None,
    rule: Optional[str] = None,
) -> int:
    """``value`` as an int: an int or a numpy integer (not a bool, not a float even when it is
    whole), within ``lo..hi`` (``rule`` says what is allowed when they are not enough)."""
    if not is_int(value):
        raise InvalidArgumentTypeError(
            f"{name} must be an integer{_range_text(lo, hi)}, got {_show(value)} ({_kind(value)})"
        )
    v = operator.index(value)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise InvalidArgumentError(f"{name} must be {rule or 'an integer' + _range_text(lo, hi)}, got {v}")
    return v


def _range_text(lo: Optional[int], hi: Optional[int]) -> str:
    if lo is None and hi is None:
        return ""
    if hi is None or hi >= _U64:
        return " >= 0" if lo == 0 else f" >= {lo}"
    if lo is None:
        return f" <= {hi}"
    return f" in {lo}..{hi}"


def count(name: str, value: Any, *, lo: int = 0) -> int:
    """A non-negative (or ``>= lo``) integer that fits 64 bits."""
    return integer(name, value, lo=lo, hi=_U64)


def optional_count(name: str, value: Any, *, lo: int = 0) -> Optional[int]:
    return None if value is None else count(name, value, lo=lo)


def threads(name: str, value: Any) -> int:
    """A thread count: None or 0 for every core."""
    return 0 if value is None else integer(name, value, lo=0, hi=1 << 16, rule="a thread count (0 or None: every core)")


def boolean(name: str, value: Any) -> bool:
    """A bool (or a numpy bool); 0 and 1 are not taken for one."""
    if not isinstance(value, (bool, np.bool_)):
        raise InvalidArgumentTypeError(f"{name} must be True or False, got {_show(value)} ({_kind(value)})")
    return bool(value)


def follow_timeout(follow: bool, value: Any) -> Optional[float]:
    """A follow-mode loader's ``follow_timeout``: seconds >= 0, with ``follow=True`` only."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgumentTypeError(
            f"follow_timeout must be a number of seconds, got {value!r} ({type(value).__name__})")
    if not 0 <= value < float("inf"):
        raise InvalidArgumentError(f"follow_timeout must be a number of seconds >= 0, got {value!r}")
    if not follow:
        raise InvalidArgumentError("follow_timeout applies with follow=True only")
    return float(value)


def follow_broadcast(follow: bool, value: Any) -> Any:
    """A follow-mode loader's ``follow_broadcast``: a callable, with ``follow=True`` only."""
    if value is None:
        return None
    if not callable(value):
        raise InvalidArgumentTypeError(
            f"follow_broadcast must be a callable fn(value: Optional[list[int]]) -> list[int], got {_show(value)} "
            f"({_kind(value)})")
    if not follow:
        raise InvalidArgumentError("follow_broadcast applies with follow=True only")
    return value


def optional_boolean(name: str, value: Any) -> Optional[bool]:
    return None if value is None else boolean(name, value)


def string(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise InvalidArgumentTypeError(f"{name} must be a string, got {_show(value)} ({_kind(value)})")
    return value


def choice(name: str, value: Any, allowed: Sequence[str]) -> str:
    """One of ``allowed`` (the message lists them and suggests the close match)."""
    options = ", ".join(repr(a) for a in allowed)
    if not isinstance(value, str):
        raise InvalidArgumentTypeError(f"{name} must be one of {options}, got {_show(value)} ({_kind(value)})")
    if value not in allowed:
        raise InvalidArgumentError(f"{name} must be one of {options}, got {value!r}{_suggest(value, allowed)}")
    return value


def optional_choice(name: str, value: Any, allowed: Sequence[str]) -> Optional[str]:
    return None if value is None else choice(name, value, allowed)


def path(name: str, value: Any) -> str:
    """A ``str`` or ``os.PathLike`` (an ``s3://`` URL is a str)."""
    if not isinstance(value, (str, os.PathLike)):
        raise InvalidArgumentTypeError(
            f"{name} must be a path (str or os.PathLike), got {_show(value)} ({_kind(value)})"
        )
    p = os.fspath(value)
    if not isinstance(p, str):
        raise InvalidArgumentTypeError(f"{name} must be a str path, got bytes {p!r}")
    if not p:
        raise InvalidArgumentError(f"{name} must be a path, got an empty string")
    if "\0" in p:
        raise InvalidArgumentError(f"{name} must be a path, got {p!r} (it holds a NUL byte)")
    return p


def optional_path(name: str, value: Any) -> Optional[str]:
    return None if value is None else path(name, value)


#: The names of the value types activations are stored in, and what each is called.
_DTYPES = {
    "float32": "float32", "f32": "float32", "fp32": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "f16": "float16", "fp16": "float16", "half": "float16",
}


def dtype(name: str, value: Any) -> Optional[str]:
    """A stored value type as its canonical name (``"float32"``, ``"bfloat16"``,
    ``"float16"``), or None: a name (``"bf16"``, ``"fp16"``, ...), a numpy dtype (``ml_dtypes``'
    bfloat16 included) or a torch dtype (``torch.bfloat16``)."""
    if value is None:
        return None
    allowed = "'float32', 'bfloat16' ('bf16') or 'float16' ('fp16'), or the numpy/torch dtype"
    if isinstance(value, str):
        text = value
    elif type(value).__module__ == "torch" and type(value).__name__ == "dtype":
        text = str(value).replace("torch.", "", 1)
    elif isinstance(value, bool):
        raise InvalidArgumentTypeError(f"{name} must be {allowed}, got {_show(value)} ({_kind(value)})")
    else:
        try:
            text = np.dtype(value).name
        except TypeError:
            raise InvalidArgumentTypeError(f"{name} must be {allowed}, got {_show(value)} ({_kind(value)})") from None
    canonical = _DTYPES.get(text.lower())
    if canonical is None:
        raise InvalidArgumentError(f"{name} must be {allowed}, got {_show(value)}{_suggest(text, list(_DTYPES))}")
    return canonical


def rel_error(name: str, value: Any) -> Optional[float]:
    """A bound on a row's relative L2 rounding error: a finite number >= 0, or None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise InvalidArgumentTypeError(
            f"{name} must be a number (a row's relative L2 error, e.g. 0.01) or None, got {_show(value)} ({_kind(value)})")
    v = float(value)
    if not (0.0 <= v < float("inf")):
        raise InvalidArgumentError(
            f"{name} must be a finite number >= 0 (a row's relative L2 error ||x - q|| / ||x||, e.g. 0.01), got {value!r}")
    return v


def callback(name: str, value: Any) -> Any:
    """``progress``-style arguments: None, a bool, or a callable."""
    if value is None or isinstance(value, bool) or callable(value):
        return value
    raise InvalidArgumentTypeError(f"{name} must be None, a bool or a callable, got {_show(value)} ({_kind(value)})")


def rank_world(rank: Optional[int], world_size: Optional[int]) -> None:
    """``rank`` in ``0..world_size-1`` when both are given (each may be None: the environment's)."""
    if rank is not None:
        integer("rank", rank, lo=0, hi=_U64)
    if world_size is not None:
        integer("world_size", world_size, lo=1, hi=_U64, rule="a positive integer")
    if rank is not None and world_size is not None and rank >= world_size:
        raise InvalidArgumentError(f"rank must be below world_size, got rank={rank} with world_size={world_size}")


def _suggest(word: str, options: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


# --- the net ------------------------------------------------------------------------------

# PyO3's message for an argument it could not convert.
_PYO3_ARGUMENT = re.compile(r"^argument '([A-Za-z_][A-Za-z0-9_]*)': (.*)$", re.S)
_UNEXPECTED = re.compile(r"unexpected keyword argument '([^']+)'")


def _callable_name(f: Callable[..., Any]) -> str:
    module = getattr(f, "__module__", "") or ""
    short = module.replace("shardkit.", "", 1) if module.startswith("shardkit.") else ""
    qual = getattr(f, "__qualname__", getattr(f, "__name__", "?"))
    if qual.endswith(".__init__"):
        qual = qual[: -len(".__init__")]
    return f"{short}.{qual}" if short and short != "shardkit" else qual


def _translate(f: Callable[..., Any], args: Sequence[Any], kw: Dict[str, Any], e: BaseException) -> Optional[BaseException]:
    """The documented exception for ``e`` raised by calling ``f(*args, **kw)``, or None to let
    ``e`` through (it came from inside the call and is not an argument conversion)."""
    name = _callable_name(f)
    if isinstance(e, TypeError):
        try:
            sig = _inspect.signature(f)
        except (TypeError, ValueError):  # pragma: no cover - every wrapped function has one
            sig = None
        if sig is not None:
            takes_any = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
            params = [p for p in sig.parameters if p not in ("self", "args", "kw", "kwargs")]
            unknown = [k for k in kw if k not in sig.parameters] if not takes_any else []
            if unknown:
                bad = unknown[0]
                return InvalidArgumentTypeError(
                    f"{name}() got an unexpected keyword argument {bad!r}{_suggest(bad, params)}; "
                    f"it takes {', '.join(params)}"
                )
            try:
                sig.bind(*args, **kw)
            except TypeError as bind_error:
                m = _UNEXPECTED.search(str(bind_error))
                if m:
                    bad = m.group(1)
                    return InvalidArgumentTypeError(
                        f"{name}() got an unexpected keyword argument {bad!r}{_suggest(bad, params)}; "
                        f"it takes {', '.join(params)}"
                    )
                return InvalidArgumentTypeError(f"{name}(): {bind_error}")
        m = _PYO3_ARGUMENT.match(str(e))
        if m:
            return InvalidArgumentTypeError(f"{name}(): argument {m.group(1)!r}: {m.group(2)}")
        return None
    if isinstance(e, OverflowError):
        # PyO3 converting a negative number, or one past 64 bits, into an unsigned count.
        return InvalidArgumentError(f"{name}(): an integer argument is out of range ({e})")
    return None


def guard(f: F) -> F:
    """``f`` raising the documented exceptions for arguments it cannot take (see the module
    docstring). Exceptions that are already ``ShardkitError``s pass through untouched."""
    if getattr(f, "__shardkit_guarded__", False):
        return f

    @functools.wraps(f)
    def guarded(*args: Any, **kw: Any) -> Any:
        try:
            return f(*args, **kw)
        except (TypeError, OverflowError) as e:
            if isinstance(e, ShardkitError):
                raise
            new = _translate(f, args, kw, e)
            if new is None:
                raise
            raise new from None

    guarded.__shardkit_guarded__ = True  # type: ignore[attr-defined]
    return guarded  # type: ignore[return-value]


_SKIP = frozenset({"__repr__", "__str__", "__len__", "__enter__", "__exit__", "__getstate__", "__setstate__",
                   "__del__", "__bool__", "__hash__", "__eq__"})


def guard_class(cls: type) -> type:
    """Guards every function defined in ``cls`` (not generators: they validate first and
    return a generator, or take no arguments)."""
    for attr, value in list(vars(cls).items()):
        if attr in _SKIP or not _inspect.isfunction(value) or _inspect.isgeneratorfunction(value):
            continue
        if attr.startswith("_") and not (attr.startswith("__") and attr.endswith("__")):
            continue
        setattr(cls, attr, guard(value))
    return cls


def guard_module(namespace: Dict[str, Any], names: Iterable[str]) -> None:
    """Guards the public functions and classes ``names`` of a module (its ``__all__``)."""
    module = namespace.get("__name__")
    for n in names:
        obj = namespace.get(n)
        if getattr(obj, "__module__", None) != module:
            continue  # re-exported from elsewhere: guarded there
        if _inspect.isclass(obj):
            guard_class(obj)
        elif _inspect.isfunction(obj) and not _inspect.isgeneratorfunction(obj):
            namespace[n] = guard(obj)
