"""Philox-4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11): the
counter-based generator behind `random_uniform`, hence Dropout's masks.

A counter-based generator is a pure function of (counter, key), so element i's random number
needs no state and no sequence: every backend computes it from i alone, in any order, on any
number of threads, and gets the same bits. That is what makes a dropout mask identical on the
reference interpreter, the C++ kernels and the CUDA kernels. The C++ and CUDA spellings
(`em_philox_uniform` in the targets' preludes) compute exactly what `uniform` computes here.

ember's use: key = (seed, low 32 bits of the step), counter = (element index low 32 bits, high
32 bits, stream, high 32 bits of the step); the stream tells apart the dropout calls of one
step. The uniform float is the top 24 bits of the first output word times 2**-24: exact in
float32, in [0, 1), so `u >= p` is the same comparison on every backend.
"""
from __future__ import annotations

import numpy as np

M0, M1 = 0xD2511F53, 0xCD9E8D57  # round multipliers
W0, W1 = 0x9E3779B9, 0xBB67AE85  # key schedule increments (golden ratio, sqrt(3) - 1)
ROUNDS = 10
_MASK = np.uint64(0xFFFFFFFF)


def philox4x32(counter: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
               key: tuple[int, int], rounds: int = ROUNDS) -> tuple[np.ndarray, ...]:
    """The four output words for counters given as four uint32-valued arrays (broadcast together)."""
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) & _MASK for c in counter)
    k0, k1 = np.uint64(key[0] & 0xFFFFFFFF), np.uint64(key[1] & 0xFFFFFFFF)
    for r in range(rounds):
        if r:  # the key is bumped between rounds, not before the first
            k0, k1 = (k0 + np.uint64(W0)) & _MASK, (k1 + np.uint64(W1)) & _MASK
        p0, p1 = c0 * np.uint64(M0), c2 * np.uint64(M1)  # 32 x 32 -> 64 bits: no uint64 overflow
        c0, c1, c2, c3 = ((p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & _MASK, (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & _MASK)
    return c0, c1, c2, c3


def uniform(shape: tuple[int, ...], seed: int, step: int, stream: int) -> np.ndarray:
    """float32 in [0, 1) for every element of `shape` (row-major index as the counter)."""
    n = int(np.prod(shape, dtype=np.int64))
    idx = np.arange(n, dtype=np.uint64)
    step = int(step) & 0xFFFFFFFFFFFFFFFF
    r0 = philox4x32((idx & _MASK, idx >> np.uint64(32), np.uint64(stream), np.uint64(step >> 32)),
                    (seed, step & 0xFFFFFFFF))[0]
    return ((r0 >> np.uint64(8)).astype(np.float32) * np.float32(2.0 ** -24)).reshape(shape)
