"""``popxl.random_seed``: host-side seed helpers (PopXL 3.4 ``python_files/random_seed.py``,
pure numpy; no device involved).

``create_seeds`` draws ``batches_per_step * gradient_accumulation_factor * replicas`` uint64
values from numpy's ``default_rng(seed + offset)`` over the whole uint64 range, splits each
into its high and low 32-bit words and returns them as uint32 of shape
``[batches_per_step, gradient_accumulation_factor, replicas, 2]`` with the dims of size 1
squeezed away, as PopXL does.
"""
import numpy as np

MAX_UINT64 = 2 ** 64 - 1
_WORD = (1 << 32) - 1


def create_seeds(seed, offset=0, batches_per_step=1, gradient_accumulation_factor=1,
                 replicas=1):
    """Seed tensors (two uint32 words each) from a parent seed.

    Args:
        seed: int. offset: int added to ``seed``. batches_per_step,
            gradient_accumulation_factor, replicas: counts (ints).
    Returns:
        uint32 ndarray, ``[batches_per_step, gradient_accumulation_factor, replicas, 2]``
        squeezed.
    """
    count = batches_per_step * gradient_accumulation_factor * replicas
    draws = np.random.default_rng(seed + offset).integers(
        0, MAX_UINT64, size=count, dtype=np.uint64, endpoint=True)
    words = np.array([uint64_to_two_uint32(int(d)) for d in draws], np.uint32).reshape(count, 2)
    shape = (batches_per_step, gradient_accumulation_factor, replicas, 2)
    return np.squeeze(words.reshape(shape))


def uint64_to_two_uint32(num):
    """Returns: ``(high, low)`` 32-bit words of ``num``. Raises: ValueError unless
    ``0 <= num <= MAX_UINT64``."""
    if num < 0 or num > MAX_UINT64:
        raise ValueError(f"Number is negative or cannot be represented as a uint64: {num}")
    return num >> 32, num & _WORD


def two_uint32_to_uint64(a, b):
    """Returns: the uint64 with high word ``a`` and low word ``b``. Raises: ValueError unless
    both are in ``[0, 2**32)``."""
    if not (0 <= a <= _WORD and 0 <= b <= _WORD):
        raise ValueError("Either `a` or `b` are negative or cannot be represented as a uint32: "
                         f"{a}, {b}")
    return (a << 32) | b
