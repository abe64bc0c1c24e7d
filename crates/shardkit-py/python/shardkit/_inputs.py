"""How the writers take data: one set of rules for every format.

* Arrays may be numpy arrays, torch tensors (copied to the CPU when they live elsewhere;
  ``torch`` is never imported unless a tensor is given) or nested lists.
* Float fields stored as float32 take float32 as it is, float16 and bfloat16 (numpy,
  ``ml_dtypes`` or torch) widened exactly, and float64 or integer input only when every value
  converts exactly; anything lossy is refused with :class:`~shardkit.errors.InvalidArgumentError`
  naming the field and the dtype (cast explicitly to write it rounded).
* Integer fields take integers of any dtype (bool where the field is a mask) whose values are
  in the field's range, checked before the values are narrowed to the stored dtype: a label of
  300 is refused, not stored as 44. Floats are refused, even whole ones.
* A value out of range is refused with the message the compiled core gives
  (``shardkit::Error::Refused``): the field, where, the value and what is allowed. A wrong type
  is an :class:`~shardkit.errors.InvalidArgumentTypeError` (also a ``TypeError``).

Nothing is written when a check fails, so the dataset stays as it was and resumable.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional, Tuple

import numpy as np

from .errors import InvalidArgumentError, InvalidArgumentTypeError

#: Where the first offending element is, in words, from its index in the array.
Where = Callable[[Tuple[int, ...]], str]

_F32_ALLOWED = "float32, or float16/bfloat16 (widened exactly), or float64/integers whose values float32 holds exactly"


def refused(path: str, field: str, at: str, value: Any, allowed: str) -> InvalidArgumentError:
    """The error for a value a writer cannot store (the same words as the compiled core's)."""
    return InvalidArgumentError(
        f"{path}: refused `{field}` at {at}: {value} (allowed: {allowed}); nothing of this write was stored"
    )


def _index_words(idx: Tuple[int, ...]) -> str:
    return "index " + ", ".join(str(i) for i in idx) if idx else "the scalar"


def _torch_tensor(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def array(x: Any, field: str, path: str) -> np.ndarray:
    """``x`` as a numpy array without changing its values: a torch tensor is detached and
    copied to the CPU where needed (bfloat16 widened to float32, exactly); numpy arrays and
    array-likes as numpy makes them. Ragged or non-numeric input is refused."""
    if x is None:
        raise InvalidArgumentTypeError(f"{path}: `{field}` must be an array (numpy, torch or a nested list), got None")
    if _torch_tensor(x):
        import torch  # already imported by the caller: x is a torch tensor

        t = x.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if t.dtype == torch.bfloat16:
            t = t.float()  # exact: every bfloat16 is a float32
        try:
            return t.numpy()  # type: ignore[no-any-return]
        except (TypeError, RuntimeError) as e:
            raise InvalidArgumentTypeError(f"{path}: `{field}`: a torch tensor of {t.dtype} cannot be written ({e})") from None
    if isinstance(x, np.ndarray):
        a = x
    else:
        try:
            a = np.asarray(x)
        except (ValueError, TypeError, OverflowError) as e:
            raise InvalidArgumentTypeError(
                f"{path}: `{field}` is not a rectangular array of numbers ({e})"
            ) from None
    if a.dtype.kind not in "biuf" and a.dtype.name != "bfloat16":
        raise InvalidArgumentTypeError(
            f"{path}: `{field}` must hold numbers, got an array of {a.dtype} (shape {a.shape})"
        )
    return a


def check_shape(a: np.ndarray, field: str, path: str, expected: Tuple[Optional[int], ...], names: str) -> None:
    """Refuses ``a`` unless its shape is ``expected`` (None: any size), described by ``names``."""
    ok = a.ndim == len(expected) and all(e is None or e == s for e, s in zip(expected, a.shape))
    if not ok:
        want = "(" + ", ".join("b" if e is None else str(e) for e in expected) + ")"
        raise InvalidArgumentError(f"{path}: `{field}` must have shape {want} = {names}; got {tuple(a.shape)}")


def float32(x: Any, field: str, path: str) -> np.ndarray:
    """``x`` as a C-contiguous float32 array, converted only where the conversion is exact."""
    a = array(x, field, path)
    d = a.dtype
    if d == np.float32:
        out = a
    elif d == np.float16 or d.name == "bfloat16":
        out = a.astype(np.float32)  # exact
    elif d.kind in "fiu":
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is inexact: refused below
            out = a.astype(np.float32)
            bad = _first_inexact(a, out)
        if bad is not None:
            idx = tuple(int(j) for j in np.unravel_index(bad, a.shape))
            value = a[idx].item() if idx else a.item()
            raise InvalidArgumentError(
                f"{path}: `{field}` is {d}, and its value {value!r} at {_index_words(idx)} has no exact "
                f"float32 value; the format stores float32, so cast explicitly (e.g. .astype(np.float32)) "
                f"to write the values rounded"
            )
    else:
        raise InvalidArgumentTypeError(f"{path}: `{field}` must be floats ({_F32_ALLOWED}), got {d}")
    return np.ascontiguousarray(out, dtype=np.float32)


def _first_inexact(a: np.ndarray, f: np.ndarray) -> Optional[int]:
    """The flat index of the first value of ``a`` that float32 ``f`` does not hold exactly."""
    if a.size == 0:
        return None
    flat_a, flat_f = a.reshape(-1), f.reshape(-1)
    if a.dtype.kind == "f":
        same = (flat_f.astype(a.dtype) == flat_a) | (np.isnan(flat_a) & np.isnan(flat_f))
        return None if bool(same.all()) else int(np.argmin(same))
    # Integers: float32 holds every one up to 2**24 in magnitude; beyond that, look closer.
    big = np.flatnonzero((flat_a > 1 << 24) | (flat_a < -(1 << 24)))
    if big.size == 0:
        return None
    # Up to 2**53 float64 holds both sides exactly; past it, compare as Python ints.
    wide = flat_a[big]
    huge = (wide > 1 << 53) | (wide < -(1 << 53))
    differ = (flat_f[big].astype(np.float64) != wide.astype(np.float64)) & ~huge
    for j in np.flatnonzero(huge).tolist():
        differ[j] = int(wide[j]) != int(flat_f[big[j]].astype(np.float64))
    return int(big[int(np.argmax(differ))]) if bool(differ.any()) else None


def integers(
    x: Any,
    field: str,
    path: str,
    *,
    dtype: Any,
    lo: int,
    hi: int,
    allowed: str,
    where: Optional[Where] = None,
    booleans: bool = False,
    a: Optional[np.ndarray] = None,
) -> np.ndarray:
    """``x`` as a C-contiguous array of integer ``dtype``, every value in ``lo..=hi`` (checked
    before narrowing; ``allowed`` says the rule in words, ``where`` names an index). Booleans
    only where ``booleans``; floats never."""
    if a is None:
        a = array(x, field, path)
    d = a.dtype
    if d == np.bool_:
        if not booleans:
            raise InvalidArgumentTypeError(f"{path}: `{field}` must hold integers ({allowed}), got bool")
        return np.ascontiguousarray(a, dtype=dtype)
    if d.kind not in "iu":
        raise InvalidArgumentTypeError(
            f"{path}: `{field}` must hold integers ({allowed}), got {d}; cast explicitly "
            f"(e.g. .astype(np.int64)) if its values are whole numbers"
        )
    if a.size:
        low, high = int(a.min()), int(a.max())
        if low < lo or high > hi:
            bad = a < lo if low < lo else a > hi
            idx = tuple(int(j) for j in np.unravel_index(int(np.argmax(bad)), a.shape))
            value = int(a[idx]) if idx else int(a)
            at = where(idx) if where is not None else _index_words(idx)
            raise refused(path, field, at, value, allowed)
    return np.ascontiguousarray(a, dtype=dtype)
