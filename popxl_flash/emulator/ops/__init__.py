"""The emulator's op implementations. ``popxl.ops`` (in ``../popxl.py``) exposes these under
PopXL's names; PopXL ops not implemented here are stubs there. Importing this package binds
it as the op module Tensor's methods and operators call (``tensor.bind_ops``)."""
import sys as _sys

from . import collectives, var_updates
from .control import (CallSiteInfo, ConditionalSiteInfo, RepeatSiteInfo, call, call_with_info,
                      conditional, conditional_with_info, repeat, repeat_with_info)
from .dynamic import dynamic_slice, dynamic_update, dynamic_update_
from .elementwise import (abs, add, add_, cast, ceil, cos, div, equal, exp, exp_, floor, fmod,
                          greater, isfinite, isinf, isnan, log, log2, logical_and, logical_not,
                          logical_or, maximum, mul, negate, pow, relu, relu_, sign, sin, sqrt,
                          sub, tanh, where)
from .fused import increment_mod, increment_mod_, scaled_add, scaled_add_
from .io import host_load, host_store
from .loss import nll_loss, nll_loss_with_softmax_grad
from .matmul import matmul
from .misc import init, io_tile_copy
from .nn import gelu, gelu_, group_norm, layer_norm, swish, swish_
from .random import dropout, random_normal, random_uniform, split_random_seed
from .reduce import argmax, argmin, logsumexp, max, mean, min, prod, softmax, sum
from .shape import (concat, concat_, detach, detach_, flatten, flatten_, gather, identity,
                    rename, reshape, reshape_, slice, slice_, split, squeeze, subsample,
                    transpose, transpose_)
from ..remote import remote_load, remote_load_, remote_store  # noqa: E402
from ..tensor import bind_ops as _bind_ops  # noqa: E402

_bind_ops(_sys.modules[__name__])
