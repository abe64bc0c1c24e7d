"""What the Python bench scripts share with `shardkit bench` (crates/shardkit-bench/src/bench.rs):
a ratio is reported only between two measured rates. A rate that is missing, zero or not finite
fails the script (non-zero exit) instead of printing an infinite or zero ratio."""

import math


class BenchError(RuntimeError):
    """A comparison that cannot be reported."""


def ratio(what: str, ours: float, theirs: float) -> float:
    """``ours / theirs`` for the comparison named ``what``; both must be positive and finite."""
    for x in (ours, theirs):
        if not isinstance(x, (int, float)) or not math.isfinite(x) or x <= 0:
            raise BenchError(f"{what}: no ratio of {ours!r} to {theirs!r}: a rate is missing, zero or "
                             "not finite (the measurement failed; nothing to compare)")
    return ours / theirs
