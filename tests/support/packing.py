"""Packed layouts for the packed-rows tests (tests/ops/test_packed.py,
tests/sharding/test_packed_sharding.py): ``S`` sequences of given lengths laid into rows of
``T`` positions in a random order and row assignment, and the maps between that layout and
the padded ``[S, L]`` one (sequence ``s`` in row ``s``, ``L`` its longest length)."""

from __future__ import annotations

import numpy as np


class Packed:
    """Sequences of ``lengths`` packed first-fit, in a random order, into rows of ``T``
    positions, with random gaps (id -1) between them; ``interleave`` also shuffles each row's
    positions (a sequence need not be contiguous). ``rows`` may ask for more rows than needed
    (left empty: all -1)."""

    def __init__(self, rng, lengths, T, *, rows=None, interleave=False):
        self.lengths = list(lengths)
        self.S, self.L, self.T = len(lengths), max(lengths), T
        order = rng.permutation(self.S)
        places, row, col = {}, 0, 0
        for s in order:
            n = self.lengths[s]
            assert n <= T
            gap = int(rng.integers(0, 2))
            if col + gap + n > T:
                row, col, gap = row + 1, 0, 0
            places[s] = (row, col + gap + np.arange(n))
            col += gap + n
        self.B = max(row + 1, rows or 0)
        if interleave:
            perms = [rng.permutation(T) for _ in range(self.B)]
            places = {s: (r, perms[r][cols]) for s, (r, cols) in places.items()}
        self.places = places
        self.ids = -np.ones((self.B, T), np.int32)
        for s, (r, cols) in places.items():
            self.ids[r, cols] = s

    def pack(self, padded, fill=0):
        """``[S, L, ...]`` -> ``[B, T, ...]``; ``fill`` where no sequence lies."""
        padded = np.asarray(padded)
        out = np.full((self.B, self.T) + padded.shape[2:], fill, padded.dtype)
        for s, (r, cols) in self.places.items():
            out[r, cols] = padded[s, : len(cols)]
        return out

    def unpack(self, packed):
        """``[B, T, ...]`` -> ``[S, L, ...]``, 0 past each sequence's end."""
        packed = np.asarray(packed)
        out = np.zeros((self.S, self.L) + packed.shape[2:], packed.dtype)
        for s, (r, cols) in self.places.items():
            out[s, : len(cols)] = packed[r, cols]
        return out

    def pad_mask(self):
        """``[S, L]``: 1 on each sequence's positions."""
        return (np.arange(self.L)[None, :] < np.asarray(self.lengths)[:, None]).astype(np.float32)
