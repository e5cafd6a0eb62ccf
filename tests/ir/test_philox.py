"""ir/philox.py against the generator itself, not against its own `uniform`: Random123's known
answers for `philox4x32`, then `uniform` (and the interpreter's random_uniform) rebuilt here from
`philox4x32` and the documented layout (key = (seed, step low 32 bits), counter = (index low,
index high, stream, step high 32 bits)) at steps past 2**28 and 2**32, where a key or counter
truncated to fewer bits would repeat an earlier step's masks."""
from __future__ import annotations

import numpy as np
import pytest

from ember.ir import TensorType, interpreter, philox

KAT = [  # Random123 kat_vectors (philox4x32, 10 rounds): counter, key -> output
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]
STEPS = [0, 7, 2**28 - 1, 2**28 + 3, 2**31 + 1, 2**32 + 5, 2**40 + 2**28 + 9, 2**63 - 1]


@pytest.mark.parametrize("counter,key,want", KAT)
def test_philox4x32_known_answers(counter, key, want):
    got = philox.philox4x32(tuple(np.uint64(c) for c in counter), key)
    assert tuple(int(w) for w in got) == want


def _expected(shape: tuple[int, ...], seed: int, step: int, stream: int) -> np.ndarray:
    n = int(np.prod(shape))
    idx = np.arange(n, dtype=np.uint64)
    lo, hi = step & 0xFFFFFFFF, step >> 32
    words = [philox.philox4x32((np.uint64(int(i) & 0xFFFFFFFF), np.uint64(int(i) >> 32), np.uint64(stream),
                                np.uint64(hi)), (seed, lo))[0] for i in idx]
    return np.array([(int(w) >> 8) * 2.0**-24 for w in words], np.float32).reshape(shape)


@pytest.mark.parametrize("step", STEPS)
def test_uniform_is_philox_of_seed_step_stream_and_index(step):
    shape, seed, stream = (3, 5), 0xDEADBEEF, 6
    np.testing.assert_array_equal(philox.uniform(shape, seed, step, stream), _expected(shape, seed, step, stream))
    got = interpreter.IMPLS["random_uniform"]([np.asarray(step, np.int64)], dict(seed=seed, stream=stream),
                                               TensorType(shape, "float32"))
    np.testing.assert_array_equal(got, _expected(shape, seed, step, stream))


@pytest.mark.parametrize("step", [s for s in STEPS if s >= 2**28])
def test_every_step_bit_counts(step):
    # a large step is not a smaller one in disguise: not the same masks as step mod 2**28 or 2**32
    u = philox.uniform((64,), 1, step, 0)
    for bits in (28, 32):
        if step >= 2**bits:
            assert not np.array_equal(u, philox.uniform((64,), 1, step % 2**bits, 0)), bits
