"""Section checksums over KV where it lies, and raw layers copied and verified in one pass.

No thread is made here: a run is split only onto an executor its caller owns and passes in.
"""

from __future__ import annotations

from concurrent.futures import Executor

import numpy as np
import xxhash

RAW_RUN_BYTES = 1 << 20
"""Raw layers copied and then verified together (see :func:`copy_verified`): about what stays in cache."""
SPLIT_RUN_BYTES = 4 << 20
"""Whole raw layers fed at once from this size on are copied and verified by two threads when the
reader's caller lends an executor, each its own half (both the copy and the hash release the
GIL): a 32 MiB chunk read from a shared-memory mapping, say."""


def digest_from(seed: "xxhash.xxh3_64", section: np.ndarray) -> int:
    """xxh3_64 of ``seed``'s bytes followed by ``section``'s, read where it lies: whole when it
    is contiguous, else run by run (a token range of a longer prefix: one run per head)."""
    h = seed.copy()
    if section.flags.c_contiguous:
        h.update(section)
    else:
        for run in section:
            h.update(run if run.flags.c_contiguous else np.ascontiguousarray(run))
    return h.intdigest()


def copy_verified(dst: np.ndarray, src: np.ndarray, seed: "xxhash.xxh3_64", checks: list[int],
                  layer_bytes: int, pool: Executor | None = None) -> int | None:
    """Copy raw layers ``src`` into ``dst`` (both ``(layers, 2, H, T, D)``, same-width ints) in
    steps of about ``RAW_RUN_BYTES``, each step hashed where it landed, still in cache; ``checks``
    holds the expected digest of each ``(layer, K/V)`` row in order, every one seeded by ``seed``.
    Returns the first bad row in order, or None when all matched. From ``SPLIT_RUN_BYTES`` of
    container bytes on, with ``pool`` given, the second half of the steps runs on it; both halves
    finish before this returns. The result is the same with and without ``pool``.

    ``layer_bytes``: what one layer takes in the container (both sections, framed)."""
    layers = dst.shape[0]
    per = max(1, RAW_RUN_BYTES // layer_bytes)
    steps = [(a, min(a + per, layers)) for a in range(0, layers, per)]

    # rows (layer, K/V) in order, as views of dst: whole sections when dst is one run of memory
    rows = dst.reshape(2 * layers, -1) if dst.flags.c_contiguous else None

    def run(lo: int, hi: int) -> int | None:
        """Copy and verify steps ``lo:hi``; the first bad row, or None."""
        for a, b in steps[lo:hi]:
            np.copyto(dst[a:b], src[a:b], casting="no")
            for j in range(2 * a, 2 * b):
                if rows is not None:
                    h = seed.copy()
                    h.update(rows[j])
                    ok = h.intdigest() == checks[j]
                else:
                    ok = digest_from(seed, dst[j // 2, j % 2]) == checks[j]
                if not ok:
                    return j
        return None

    if pool is None or layers * layer_bytes < SPLIT_RUN_BYTES or len(steps) < 2:
        return run(0, len(steps))
    half = pool.submit(run, len(steps) // 2, len(steps))
    try:
        bad = run(0, len(steps) // 2)
    finally:
        later = half.result()  # the other half writes into dst: never leave it running
    return bad if bad is not None else later
