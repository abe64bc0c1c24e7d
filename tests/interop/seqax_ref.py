"""seqax's shuffle (flat_tokens.md §5.4-5.6) written with numpy's own SeedSequence and Philox.

An independent implementation for the interop tests: it shares no code with shardkit, so
agreement on the golden vectors, and on later epochs (seed + e * 2**64), checks both.
"""

import numpy as np


def perm(seed: int, n: int) -> np.ndarray:
    """seqax's ``_random_permutation``: Fisher-Yates driven by Philox outputs in reverse."""
    u = np.random.Philox(seed).random_raw(n) if n else np.zeros(0, dtype=np.uint64)
    a = np.arange(n, dtype=np.uint32)
    for i in range(n - 1, -1, -1):
        j = int(u[i]) % (i + 1)
        a[i], a[j] = a[j], a[i]
    return a


def step_rows(n_seq: int, batch: int, S: int, R: int, B: int, seed: int, t: int) -> list:
    """The sequence index of every row of step ``t`` (the closed form of §5.5)."""
    rbc = ((n_seq // B) // S) * S
    minipochs = -(-rbc // (S * R))
    bips = batch // S
    p0 = perm(seed, rbc)
    cache = {}
    rows = []
    for b in range(batch):
        s = b // bips
        q = t * bips + b % bips
        m, r = divmod(q, R * B)
        blocks_m = R if m < minipochs - 1 else rbc // S - R * m
        if (m, s) not in cache:
            cache[(m, s)] = perm(seed + 1 + m * S + s, blocks_m * B)
        p = int(cache[(m, s)][r])
        rows.append(int(p0[(m * R + p // B) * S + s]) * B + p % B)
    return rows
