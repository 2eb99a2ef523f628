"""The graphs the attention benchmark runs: flash and naive PopXL attention, forward and backward.

Each benchmark case builds two main graphs over the same host data: one calling
:func:`popxl_flash.flash_attention` (or ``flash_attention_grad``) and one naive PopXL attention
(:mod:`popxl_flash.checks.naive`) that materialises the full ``[G, Lq, Lkv]`` score matrix, as a PopXL
user would write it.
:func:`popxl_flash.checks.harness.run_graph` compiles and runs one of them and returns its outputs,
timing and (on the emulator) the run profile.
"""
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

import popxl_flash as pf
from popxl_flash.checks import naive
from popxl_flash import popxl

ops = popxl.ops


@dataclass(frozen=True)
class Case:
    """One benchmark configuration (``Lq = Lkv = seq_len``).

    Attributes:
        pass_: ``"fwd"`` (forward) or ``"bwd"`` (stash-mode backward: out and lse are inputs).
        seq_len, head_dim, groups: L, D, G.
        dtype: ``"float16"`` or ``"float32"``.
        mask: label, ``"causal"``, ``"none"`` or ``"window:LEFT,RIGHT"`` (a non-causal window).
        chunks: ``None`` (automatic) or ``(num_chunks_q, num_chunks_kv)``.
    """
    pass_: str
    seq_len: int
    head_dim: int
    groups: int
    dtype: str
    mask: str
    chunks: Optional[Tuple[int, int]]

    @property
    def causal(self) -> bool:
        return self.mask == "causal"

    @property
    def window(self):
        if not self.mask.startswith("window:"):
            return None
        return tuple(int(side) for side in self.mask[len("window:"):].split(","))

    @property
    def options(self) -> dict:
        """Keyword options of the flash functional API."""
        nq, nkv = self.chunks or (None, None)
        return dict(num_chunks_q=nq, num_chunks_kv=nkv, causal=self.causal, window=self.window)

    def config(self) -> "pf.AttentionConfig":
        shape = (self.groups, self.seq_len, self.head_dim)
        return pf.AttentionConfig.from_shapes(shape, shape, shape, (self.dtype,) * 3,
                                              **self.options)


def host_inputs(case, seed=0):
    """Random host arrays: ``[q, k, v]`` (fwd) or ``[dout, q, k, v, out, lse]`` (bwd)."""
    rng = np.random.default_rng(seed)
    shape = (case.groups, case.seq_len, case.head_dim)
    q, k, v, dout = (rng.standard_normal(shape).astype(case.dtype) for _ in range(4))
    if case.pass_ == "fwd":
        return [q, k, v]
    out, lse = pf.reference.attention(q, k, v, causal=case.causal, window=case.window)
    return [dout, q, k, v, out.astype(case.dtype), lse.astype(np.float32)]


def flash_graph(case):
    """Graph body for :func:`popxl_flash.checks.harness.run_graph`: the library's forward, or its
    stash-mode backward."""
    if case.pass_ == "fwd":
        return lambda q, k, v: [pf.flash_attention(q, k, v, **case.options)]
    return lambda dout, q, k, v, out, lse: list(
        pf.flash_attention_grad(dout, q, k, v, out, lse, **case.options))


def naive_graph(case):
    """Graph body for :func:`popxl_flash.checks.harness.run_graph`: naive attention (forward, or the
    hand-written backward with ``out`` stashed: 5 matmuls, like flash's stash mode)."""
    options = dict(causal=case.causal, window=case.window, scale=case.config().scale)
    if case.pass_ == "fwd":
        return lambda q, k, v: [naive.naive_attention(q, k, v, **options)]
    return lambda dout, q, k, v, out: list(
        naive.naive_attention_grad(dout, q, k, v, out, **options))


def naive_inputs(case, arrays):
    """The host arrays the naive graph loads: all but ``lse`` (it recomputes P from q, k)."""
    return arrays if case.pass_ == "fwd" else arrays[:5]


def naive_flops(case) -> int:
    """Matmul FLOPs naive attention executes: 2 (fwd) or 5 (bwd) matmuls of 2*D*L*L*G."""
    matmuls = 2 if case.pass_ == "fwd" else 5
    return 2 * matmuls * case.head_dim * case.seq_len ** 2 * case.groups
