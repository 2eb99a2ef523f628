"""Hypothesis strategies and host helpers for packed sequences (segment ids, varlen).

A packing is a list of per-sequence lengths plus trailing padding rows. q and kv packings are
either equal (one packing, ``Lq == Lkv`` per sequence) or independent (each sequence has its own
q and kv length, as flash-attn's varlen functions allow).
"""
from dataclasses import dataclass
from typing import Tuple

import numpy as np
from hypothesis import strategies as st


@dataclass(frozen=True)
class Packing:
    """Sequences packed into one row each for q and kv.

    Attributes:
        q_lens, kv_lens: per-sequence lengths (equal tuples for an equal packing).
        q_pad, kv_pad: padding rows after the last sequence.
        empty: extra empty sequences at the end (``cu_seqlens`` repeats its last offset), the
            documented way to pass fewer sequences than the static bound.
    """
    q_lens: Tuple[int, ...]
    kv_lens: Tuple[int, ...]
    q_pad: int = 0
    kv_pad: int = 0
    empty: int = 0

    @property
    def total_q(self):
        return sum(self.q_lens) + self.q_pad

    @property
    def total_k(self):
        return sum(self.kv_lens) + self.kv_pad

    @property
    def num_seqs(self):
        """The static bound: real plus empty sequences."""
        return len(self.q_lens) + self.empty

    def cu_seqlens(self):
        """``(cu_seqlens_q, cu_seqlens_k)`` int32 ``[num_seqs + 1]``."""
        def cu(lens):
            offsets = np.concatenate([[0], np.cumsum(lens)])
            return np.concatenate([offsets, np.full(self.empty, offsets[-1])]).astype(np.int32)
        return cu(self.q_lens), cu(self.kv_lens)

    def segment_ids(self):
        """``(q_ids [1, total_q], kv_ids [1, total_k])`` int32, -1 on padding."""
        def ids(lens, pad):
            return np.concatenate([np.repeat(np.arange(len(lens)), lens),
                                   np.full(pad, -1)]).astype(np.int32)[None]
        return ids(self.q_lens, self.q_pad), ids(self.kv_lens, self.kv_pad)


@st.composite
def packings(draw, *, max_seqs=8, max_len=200, max_total=None, equal=None, max_pad=16):
    """A :class:`Packing` of 1..``max_seqs`` sequences of lengths 1..``max_len``.

    Args:
        max_seqs, max_len: bounds of the sequence count and lengths.
        max_total: bound on ``total_q`` and ``total_k`` (lengths are drawn to fit), or None.
        equal: True (one packing for q and kv), False (independent) or None (either).
        max_pad: bound on the padding rows.
    """
    n = draw(st.integers(1, max_seqs))
    cap = max_total if max_total is not None else n * max_len + max_pad

    def lengths():
        lens, room = [], cap
        for s in range(n):
            hi = min(max_len, room - (n - 1 - s))  # leave 1 row for each later sequence
            lens.append(draw(st.integers(1, max(1, hi))))
            room -= lens[-1]
        return tuple(lens)

    q_lens = lengths()
    same = draw(st.booleans()) if equal is None else equal
    kv_lens = q_lens if same else lengths()
    q_pad = draw(st.integers(0, max(0, min(max_pad, cap - sum(q_lens)))))
    kv_pad = q_pad if same else draw(st.integers(0, max(0, min(max_pad, cap - sum(kv_lens)))))
    empty = draw(st.integers(0, 2))
    return Packing(q_lens, kv_lens, q_pad, kv_pad, empty)
