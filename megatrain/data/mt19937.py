"""The C++ standard library's Mersenne Twisters, ``std::mt19937`` and ``std::mt19937_64``.

Megatron-LM's ``helpers.cpp`` draws the BERT target sample lengths from ``std::mt19937(seed)``
and shuffles the samples with ``std::mt19937_64(seed + 1)``; reproducing its samples needs both
streams bit for bit.

* `MT19937` (32-bit): numpy's legacy ``RandomState(seed)`` seeds with the same ``init_genrand``
  recurrence as ``std::mt19937(seed)`` and its full-range ``uint32`` draws are the raw outputs,
  so the stream comes from numpy's C code.
* `MT19937_64`: written here; the twist of the 312-word state runs as three numpy slices (the
  words whose partners are not yet updated, those whose partners are, and the last word), the
  tempering on all 312 outputs at once.

Reference values (C++11 [rand.predef]): the 10000th output of a default-constructed
(seed 5489) ``mt19937`` is 4123659995, of ``mt19937_64`` 9981545732273789042.
"""

from __future__ import annotations

import numpy as np

__all__ = ["MT19937", "MT19937_64"]

_MASK32 = (1 << 32) - 1
_MASK64 = (1 << 64) - 1


class MT19937:
    """``std::mt19937(seed)``: the stream of 32-bit outputs, drawn in blocks.

    ``seed`` is reduced modulo 2**32 as the C++ engine does (a negative ``int`` seed converts
    to a large unsigned one).
    """

    def __init__(self, seed: int = 5489):
        self._state = np.random.RandomState(int(seed) & _MASK32)

    def take(self, n: int) -> np.ndarray:
        """The next ``n`` outputs (uint32)."""
        return self._state.randint(0, 1 << 32, size=int(n), dtype=np.uint32)


class MT19937_64:
    """``std::mt19937_64(seed)``: the stream of 64-bit outputs, drawn in blocks."""

    n = 312
    m = 156
    matrix_a = np.uint64(0xB5026F5AA96619E9)
    upper = np.uint64(0xFFFFFFFF80000000)
    lower = np.uint64(0x7FFFFFFF)

    def __init__(self, seed: int = 5489):
        state = [int(seed) & _MASK64]
        for i in range(1, self.n):
            prev = state[-1]
            state.append((6364136223846793005 * (prev ^ (prev >> 62)) + i) & _MASK64)
        self._mt = np.array(state, dtype=np.uint64)
        self._out = np.empty(0, dtype=np.uint64)  # tempered outputs of the current state
        self._pos = 0

    def _mix(self, cur: np.ndarray, nxt: np.ndarray, far: np.ndarray) -> np.ndarray:
        x = (cur & self.upper) | (nxt & self.lower)
        xa = x >> np.uint64(1)
        xa ^= np.where((x & np.uint64(1)) != 0, self.matrix_a, np.uint64(0))
        return far ^ xa

    def _twist(self) -> None:
        mt, n, m = self._mt, self.n, self.m
        # Words [0, n-m): partner mt[i+m] and mt[i+1] are still the old values.
        mt[: n - m] = self._mix(mt[: n - m], mt[1 : n - m + 1], mt[m:n])
        # Words [n-m, n-1): partner mt[i+m-n] is new, mt[i+1] old.
        mt[n - m : n - 1] = self._mix(mt[n - m : n - 1], mt[n - m + 1 : n], mt[: m - 1])
        # The last word pairs with the new mt[0] and mt[m-1].
        mt[n - 1 :] = self._mix(mt[n - 1 :], mt[:1], mt[m - 1 : m])
        y = mt.copy()
        y ^= (y >> np.uint64(29)) & np.uint64(0x5555555555555555)
        y ^= (y << np.uint64(17)) & np.uint64(0x71D67FFFEDA60000)
        y ^= (y << np.uint64(37)) & np.uint64(0xFFF7EEE000000000)
        y ^= y >> np.uint64(43)
        self._out = y
        self._pos = 0

    def take(self, n: int) -> np.ndarray:
        """The next ``n`` outputs (uint64)."""
        n = int(n)
        result = np.empty(n, dtype=np.uint64)
        filled = 0
        while filled < n:
            if self._pos >= self._out.shape[0]:
                self._twist()
            k = min(n - filled, self._out.shape[0] - self._pos)
            result[filled : filled + k] = self._out[self._pos : self._pos + k]
            self._pos += k
            filled += k
        return result
