"""Validated attention options. Every argument error of the public API is raised here.

The configuration is a frozen dataclass built from the tensors' shapes and dtype names and the
user's options, at graph-build time. It resolves the automatic chunk counts and normalises the
window, then hands ``(Lq, Lkv, chunk_q, chunk_kv, causal, window)`` to the planner.

Chunking rule: ``num_chunks_*=None`` lets the cost model (:mod:`popxl_flash.plan.costmodel`)
choose the chunk lengths: the least modelled forward + backward IPU time among the candidate
chunkings whose memory fits ``memory_budget``. For a given count ``n`` the chunk length is
``ceil(L / n)`` and the number of chunks actually used is ``ceil(L / chunk_len)``; the last chunk
is a padded tail (masked, never asserted). That count is ``n`` except when ``n`` does not split
``L`` into non-empty chunks (``L=10, n=6`` gives chunks of 2, so 5 chunks: a sixth would hold
padding only). With segment ids the automatic sides are chosen again for the packed pass, by
modelled time within the budget against a stated packing assumption
(:meth:`AttentionConfig.with_segments`, :mod:`popxl_flash.plan.packed`).
"""
import math
import numbers
from dataclasses import dataclass, replace
from typing import Optional, Tuple

import numpy as np

from popxl_flash.plan import costmodel
from popxl_flash.plan import memory as _memory
from popxl_flash.plan import packed as _packed
from popxl_flash.plan import schedule as _schedule
from popxl_flash.plan.schedule import normalise_window
from popxl_flash.plan.segments import MAX_LEN, SegmentConfig

#: dtypes the kernels support (the IPU has no bfloat16).
SUPPORTED_DTYPES = ("float16", "float32")

#: Largest |scale|: the scale is a float32 constant of the graph.
MAX_SCALE = float(np.finfo(np.float32).max)


def _unwrap(value):
    """A 0-d numpy array becomes its numpy scalar; anything else is returned unchanged."""
    if isinstance(value, np.ndarray) and value.ndim == 0:
        return value[()]
    return value


def _python_scalar(value):
    """NumPy scalars and 0-d arrays become the equal Python scalar; others are unchanged."""
    value = _unwrap(value)
    return value.item() if isinstance(value, np.generic) else value


def check_bool(name, value):
    """Return ``value`` as a Python bool, or raise naming ``name``.

    Args:
        name: the option's name, for messages (``"causal"``).
        value: a Python bool, a ``numpy.bool_`` or a 0-d numpy bool array.

    Returns:
        ``bool(value)``.
    """
    value = _unwrap(value)
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool (Python or NumPy), got "
                        f"{name}={_python_scalar(value)!r} ({type(value).__name__})")
    return bool(value)


def check_window(window, name="window"):
    """Normalise a window option to ``(left, right)`` ints, ``-1`` = unbounded.

    Args:
        window: ``None`` or a ``(left, right)`` pair (tuple, list or 1-D NumPy integer array)
            of ints >= -1 or ``None``; NumPy integers and 0-d arrays count as ints.
        name: the option's name in messages (``"window"``, ``"window_size"``).

    Returns:
        ``(left, right)``.
    """
    if isinstance(window, np.ndarray):
        window = window.tolist()  # Python ints (floats, bools: rejected below); 0-d: a scalar
    elif isinstance(window, tuple):
        window = tuple(_python_scalar(side) for side in window)
    elif isinstance(window, list):
        window = [_python_scalar(side) for side in window]
    try:
        return normalise_window(window)
    except (TypeError, ValueError) as err:
        raise type(err)(str(err).replace("window=", f"{name}=", 1)) from None


def _check_int(name, value, *, low=1, high=None):
    """Return ``value`` as an int in ``[low, high]`` or raise naming ``name``.

    Python ints, NumPy integers and 0-d NumPy integer arrays are accepted; bools are not.
    """
    value = _unwrap(value)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {_python_scalar(value)!r} "
                        f"({type(value).__name__})")
    value = int(value)
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bound}, got {name}={value}")
    return value


def check_dtype_name(dtype, name="dtype"):
    """A dtype argument of the explain functions as its name: ``"float16"``/``"float32"``,
    or the NumPy (``np.float16``, ``np.dtype("float32")``) or PopXL (``popxl.float16``) dtype.

    Returns:
        The name, one of :data:`SUPPORTED_DTYPES`.

    Raises:
        TypeError: anything else (another dtype, a non-dtype).
    """
    if isinstance(dtype, str):
        dtype_name = dtype
    elif isinstance(getattr(dtype, "name", None), str) and not isinstance(dtype, type):
        dtype_name = dtype.name  # popxl.dtype, np.dtype
    else:
        try:
            dtype_name = np.dtype(dtype).name  # np.float16, float
        except (TypeError, ValueError):
            dtype_name = None
    if dtype_name not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} must be one of {SUPPORTED_DTYPES} (a name, a NumPy or a PopXL "
                        f"dtype), got {name}={dtype!r}")
    return dtype_name


def _check_shape(name, shape, rank, meaning):
    """Check a tensor shape's rank and positive dims; return it as a tuple."""
    shape = tuple(int(d) for d in shape)
    if len(shape) != rank:
        raise ValueError(f"{name} must have rank {rank} ({meaning}), got shape {shape}")
    if any(d < 1 for d in shape):
        raise ValueError(f"{name} must have non-empty dims ({meaning}), got shape {shape}")
    return shape


def resolve_num_chunks(name, length, num_chunks):
    """Resolve a chunk-count option.

    Args:
        name: the option's name, for messages (``"num_chunks_q"``).
        length: the sequence length it splits.
        num_chunks: ``None`` (automatic: returns ``(None, None)``, resolved by the cost
            model) or an int in ``[1, length]``.

    Returns:
        ``(chunk_len, count)``: chunk length ``ceil(length / n)`` and the number of chunks used.
    """
    if num_chunks is None:
        return None, None
    num_chunks = _check_int(name, num_chunks, low=1, high=length)
    chunk_len = math.ceil(length / num_chunks)
    return chunk_len, math.ceil(length / chunk_len)


def check_scale(scale, head_dim, name="scale"):
    """Resolve the softmax scale.

    Args:
        scale: ``None`` (``1/sqrt(D)``) or a finite real number (Python, NumPy scalar or 0-d
            array; a bool is rejected).
        head_dim: D.
        name: the option's name in messages (``"scale"``, ``"softmax_scale"``).

    Returns:
        The scale as a Python float.
    """
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    scale = _unwrap(scale)
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise TypeError(f"{name} must be a real number or None, got "
                        f"{name}={_python_scalar(scale)!r} ({type(scale).__name__})")
    try:
        value = float(scale)
    except OverflowError:  # a Python int beyond float64
        value = math.inf
    if not math.isfinite(value) or abs(value) > MAX_SCALE:
        raise ValueError(f"{name} must be finite in float32 (|{name}| <= {MAX_SCALE:.4g}), "
                         f"got {name}={_python_scalar(scale)!r}")
    return value


def _spec_text(t):
    """``None`` or ``shape dtype`` of a tensor, for messages."""
    return "None" if t is None else f"<tensor {tuple(t.shape)} {t.dtype.name}>"


def _check_ids(name, ids, groups, length_name, length, group_name="G"):
    """A segment-id spec must be int32 ``[groups or 1, length]``; return its row count."""
    expected = f"[{group_name}={groups} or 1, {length_name}={length}]"
    if ids.dtype.name != "int32":
        raise TypeError(f"{name} must have dtype int32 {expected}, got dtype {ids.dtype.name}")
    shape = tuple(ids.shape)
    if len(shape) != 2 or shape[0] not in (groups, 1) or shape[1] != length:
        raise ValueError(f"{name} must have shape {expected}, got shape {shape}")
    return shape[0]


@dataclass(frozen=True)
class AttentionConfig:
    """Everything static about one attention call.

    Attributes:
        groups: G = batch x heads of q.
        kv_groups: Gk, the groups of k and v: ``G`` (multi-head attention) or a divisor of it
            (grouped-query attention; 1 is multi-query): q group ``g`` reads kv group
            ``g // (G // Gk)``.
        q_len, kv_len: Lq and Lkv.
        head_dim: D.
        dtype: ``"float16"`` or ``"float32"`` (q, k, v and out).
        chunk_q, chunk_kv: chunk lengths (the last chunk may be a padded tail).
        num_chunks_q, num_chunks_kv: chunk counts actually used.
        causal: bottom-right aligned causal mask.
        scale: softmax scale applied to the scores.
        window: ``(left, right)``, ``-1`` = unbounded.
        segments: ``None``, or the :class:`~popxl_flash.plan.segments.SegmentConfig` of runtime
            segment ids (and positions) given with the data.
        mods: ``None``, or the :class:`~popxl_flash.plan.score_mods.ScoreMods` of the call
            (softcap, ALiBi, score_mod, dropout).
        lean_forward, lean_backward: whether that pass, where it loops, runs its memory-lean
            structure (FlashAttention-2's floor, ``docs/design.md``): no full-length scaled
            copy of k (each step scales its k slice), float32 full-length work in pieces
            (:func:`popxl_flash.plan.steps.lean_pieces`), and in the backward dk and dv
            accumulated one kv piece at a time. Chosen with the chunks where the budget needs
            it (:func:`popxl_flash.plan.costmodel.choose`).
    """
    groups: int
    kv_groups: int
    q_len: int
    kv_len: int
    head_dim: int
    dtype: str
    chunk_q: int
    chunk_kv: int
    num_chunks_q: int
    num_chunks_kv: int
    causal: bool
    scale: float
    window: Tuple[int, int]
    segments: Optional[SegmentConfig] = None
    mods: Optional[object] = None
    lean_forward: bool = False
    lean_backward: bool = False

    @classmethod
    def from_shapes(cls, q_shape, k_shape, v_shape, dtypes, *, num_chunks_q=None,
                    num_chunks_kv=None, causal=True, scale=None, window=None,
                    names=("q", "k", "v"), memory_budget=None, mods=None, lean=None):
        """Validate shapes, dtypes and options.

        Args:
            q_shape: ``[G, Lq, D]``; k_shape, v_shape: ``[Gk, Lkv, D]`` with ``G % Gk == 0``.
            dtypes: the dtype names of q, k, v (``str``).
            names: how the three tensors are named in error messages.
            memory_budget: bytes for the automatic chunk choice (``None``: the default,
                :func:`popxl_flash.plan.memory.default_budget`); an explicit budget that no
                chunking meets raises ``ValueError``.
            mods: ``None`` or the call's :class:`~popxl_flash.plan.score_mods.ScoreMods`,
                which the automatic choice's memory bound weighs (the config's own ``mods`` are
                set by :func:`popxl_flash.graph.score_mods.check_extras`).
            lean: ``None`` (the memory-lean structure where the chosen chunking needs it to
                meet the budget; with explicit chunks and no budget, never), ``True`` (both
                passes lean where they loop) or ``False`` (never).

        Returns:
            A validated :class:`AttentionConfig`.
        """
        qn, kn, vn = names
        G, Lq, D = _check_shape(qn, q_shape, 3, "[G, Lq, D]")
        Gk, Lkv, Dk = _check_shape(kn, k_shape, 3, "[Gk, Lkv, D]")
        v_shape = _check_shape(vn, v_shape, 3, "[Gk, Lkv, D]")
        if Dk != D:
            raise ValueError(f"{kn} must have q's head dim D={D} ([Gk, Lkv, D={D}] to match "
                             f"{qn} {(G, Lq, D)}), got {kn} shape {(Gk, Lkv, Dk)}")
        if G % Gk:
            raise ValueError(f"{kn} must have a group count Gk that divides q's G={G} (Gk = G "
                             f"for multi-head attention; Gk < G is grouped-query attention, q "
                             f"group g reading kv group g // (G // Gk)), got {kn} shape "
                             f"{(Gk, Lkv, Dk)} for {qn} shape {(G, Lq, D)}")
        if v_shape != (Gk, Lkv, Dk):
            raise ValueError(f"{vn} must have the shape of {kn} {(Gk, Lkv, Dk)}, "
                             f"got {vn} shape {v_shape}")
        dtype = cls._check_dtypes(dict(zip(names, dtypes)))
        causal = check_bool("causal", causal)
        chunk_q, _ = resolve_num_chunks("num_chunks_q", Lq, num_chunks_q)
        chunk_kv, _ = resolve_num_chunks("num_chunks_kv", Lkv, num_chunks_kv)
        scale, window = check_scale(scale, D), check_window(window)
        budget = None if memory_budget is None else _memory.check_budget(memory_budget)
        if lean is not None:
            lean = check_bool("lean", lean)
        leans = (bool(lean), bool(lean))
        if chunk_q is None or chunk_kv is None or budget is not None:
            choice = costmodel.choose(Lq, Lkv, head_dim=D, groups=G, dtype=dtype, causal=causal,
                                      window=window, chunk_q=chunk_q, chunk_kv=chunk_kv,
                                      kv_groups=Gk, memory_budget=budget, scale=scale,
                                      mods=mods, lean=lean)
            if budget is not None and not choice.chosen.fits:
                raise ValueError(
                    f"memory_budget={budget:,} bytes: no chunking of this call fits it (the "
                    f"least memory, chunks {choice.chosen.chunk_q} x "
                    f"{choice.chosen.chunk_kv}, needs {choice.chosen.memory_bytes:,} bytes "
                    "beyond the inputs and outputs); raise memory_budget, or split the call "
                    "(context parallelism, fewer heads per IPU); pf.explain(...) shows the "
                    "candidates")
            chunk_q, chunk_kv = choice.chosen.chunk_q, choice.chosen.chunk_kv
            leans = (choice.chosen.lean_forward, choice.chosen.lean_backward)
        return cls(groups=G, kv_groups=Gk, q_len=Lq, kv_len=Lkv, head_dim=D, dtype=dtype,
                   chunk_q=chunk_q, chunk_kv=chunk_kv, num_chunks_q=math.ceil(Lq / chunk_q),
                   num_chunks_kv=math.ceil(Lkv / chunk_kv), causal=causal, scale=scale,
                   window=window, lean_forward=leans[0], lean_backward=leans[1])

    @classmethod
    def from_packed_shape(cls, qkv_shape, dtype, **options):
        """Validate a packed ``qkv [3, G, L, D]`` and options (see :meth:`from_shapes`)."""
        shape = _check_shape("qkv", qkv_shape, 4, "[3, G, L, D]")
        if shape[0] != 3:
            raise ValueError(f"qkv must have shape [3, G, L, D], got qkv.shape[0]={shape[0]} "
                             f"(shape {shape})")
        inner = shape[1:]
        return cls.from_shapes(inner, inner, inner, (dtype,) * 3,
                               names=("qkv[0]", "qkv[1]", "qkv[2]"), **options)

    @staticmethod
    def _check_dtypes(named_dtypes):
        """All dtypes equal and supported; return the common name."""
        for name, dt in named_dtypes.items():
            if dt not in SUPPORTED_DTYPES:
                raise TypeError(f"{name} has dtype {dt}; expected one of {SUPPORTED_DTYPES}")
        if len(set(named_dtypes.values())) != 1:
            raise TypeError(f"q, k and v must share one dtype, got {named_dtypes}")
        return next(iter(named_dtypes.values()))

    def check_like(self, name, shape, dtype, expected_shape, expected_dtype):
        """Check that an extra tensor (``dout``, ``out``, ``lse``) has the expected spec."""
        if tuple(shape) != tuple(expected_shape) or dtype != expected_dtype:
            raise ValueError(f"{name} must have shape {tuple(expected_shape)} and dtype "
                             f"{expected_dtype}, got shape {tuple(shape)} and dtype {dtype}")

    def with_segments(self, q_segment_ids, kv_segment_ids, q_positions=None, kv_positions=None,
                      automatic=(False, False), memory_budget=None, packing=None,
                      step_table=None):
        """Validate segment-id (and position) tensor specs; return the config with them.

        Args:
            q_segment_ids: ``None`` or a spec (``.shape``, ``.dtype.name``) int32
                ``[G or 1, Lq]``; kv_segment_ids: int32 ``[Gk or 1, Lkv]``; given together.
            q_positions, kv_positions: ``None`` or int32 specs shaped like the ids (internal:
                the varlen API's bottom-right positions; causal and window then compare them).
            automatic: whether the q and kv chunk counts were chosen automatically; with
                segment ids those sides are chosen again for the packed pass
                (:func:`popxl_flash.plan.packed.choose`: the least modelled forward +
                backward time within ``memory_budget``, priced against ``packing``).
            memory_budget: bytes, as :meth:`from_shapes` (``None``: the default); an explicit
                budget no chunking of the packed pass meets raises ``ValueError``.
            packing: the :class:`popxl_flash.plan.packed.Packing` assumption (``None``: one
                sequence over the whole row, the most any packing runs).
            step_table: ``None`` or the spec of a run-time step table, int32 ``[V, 3]``
                (internal: context parallelism's per-replica block lists,
                :class:`popxl_flash.plan.segments.SegmentConfig`); needs positions and a static
                schedule of full blocks only.

        Returns:
            ``self`` without segment ids, else a copy whose ``segments`` is set.
        """
        if (q_segment_ids is None) != (kv_segment_ids is None):
            raise ValueError("q_segment_ids and kv_segment_ids must be given together (or both "
                             f"None), got q_segment_ids={_spec_text(q_segment_ids)}, "
                             f"kv_segment_ids={_spec_text(kv_segment_ids)}")
        if q_segment_ids is None:
            return self
        if self.lean_forward or self.lean_backward:  # packed passes price their own chunks
            self = replace(self, lean_forward=False, lean_backward=False)
        for name, length in (("q_len", self.q_len), ("kv_len", self.kv_len)):
            if length > MAX_LEN:
                raise ValueError(f"segment ids support lengths up to {MAX_LEN}, got "
                                 f"{name}={length}")
        gq = _check_ids("q_segment_ids", q_segment_ids, self.groups, "Lq", self.q_len)
        gk = _check_ids("kv_segment_ids", kv_segment_ids, self.kv_groups, "Lkv", self.kv_len,
                        group_name="Gk")
        positions = q_positions is not None
        if positions:
            for name, ids, t in (("q_positions", q_segment_ids, q_positions),
                                 ("kv_positions", kv_segment_ids, kv_positions)):
                self.check_like(name, t.shape, t.dtype.name, ids.shape, "int32")
        table_steps = 0
        if step_table is not None:
            shape = tuple(step_table.shape)
            if step_table.dtype.name != "int32" or len(shape) != 2 or shape[1] != 3:
                raise ValueError(f"step_table must be int32 [V, 3], got {shape} "
                                 f"{step_table.dtype.name}")
            if not positions or any(automatic):
                raise ValueError("step_table needs positions and explicit chunk counts")
            table_steps = shape[0]
        segments = SegmentConfig(gq, gk, positions, table_steps)
        chunks = {}
        if any(automatic):
            chunks = self._packed_chunks(segments, automatic, memory_budget, packing)
        return replace(self, segments=segments, **chunks)

    def _packed_chunks(self, segments, automatic, memory_budget, packing):
        """The automatic sides' chunks of a packed pass (:func:`popxl_flash.plan.packed.
        choose`), as ``replace`` keywords; an explicit budget nothing meets raises."""
        budget = None if memory_budget is None else _memory.check_budget(memory_budget)
        choice = _packed.choose(
            self.q_len, self.kv_len, head_dim=self.head_dim, groups=self.groups,
            dtype=self.dtype, causal=self.causal, window=self.window, segments=segments,
            packing=packing or _packed.ONE_SEQUENCE,
            chunk_q=None if automatic[0] else self.chunk_q,
            chunk_kv=None if automatic[1] else self.chunk_kv, kv_groups=self.kv_groups,
            scale=self.scale, memory_budget=budget)
        chosen = choice.chosen
        if budget is not None and not chosen.fits:
            raise ValueError(
                f"memory_budget={budget:,} bytes: no chunking of this packed call fits it (the "
                f"least memory, chunks {chosen.chunk_q} x {chosen.chunk_kv}, needs "
                f"{chosen.memory_bytes:,} bytes beyond the inputs and outputs); expected a "
                "budget of at least that, or split the call; pf.explain(...) shows the "
                "candidates")
        return dict(chunk_q=chosen.chunk_q, num_chunks_q=chosen.num_chunks_q,
                    chunk_kv=chosen.chunk_kv, num_chunks_kv=chosen.num_chunks_kv)

    @property
    def static_mask(self) -> Tuple[bool, Tuple[int, int]]:
        """``(causal, window)`` of the static schedule: none when runtime positions decide."""
        if self.segments is not None and self.segments.positions:
            return False, (-1, -1)
        return self.causal, self.window

    @property
    def schedule(self) -> "_schedule.BlockSchedule":
        """The static block schedule (cached by the planner)."""
        causal, window = self.static_mask
        return _schedule.plan(self.q_len, self.kv_len, self.chunk_q, self.chunk_kv,
                              causal=causal, window=window)

    @property
    def group_size(self) -> int:
        """r = G // Gk: the q groups that share one kv group (1 for multi-head attention)."""
        return self.groups // self.kv_groups

    @property
    def padded_q_len(self) -> int:
        """Lq rounded up to whole chunks."""
        return self.chunk_q * self.num_chunks_q

    @property
    def padded_kv_len(self) -> int:
        """Lkv rounded up to whole chunks."""
        return self.chunk_kv * self.num_chunks_kv
