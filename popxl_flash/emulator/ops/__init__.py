"""``popxl.ops`` for the emulator. Ops not listed here raise ``NotImplementedError``."""
from . import var_updates
from ..unsupported import namespace, stub
from .control import (CallSiteInfo, ConditionalSiteInfo, RepeatSiteInfo, call, call_with_info,
                      conditional, conditional_with_info, repeat, repeat_with_info)
from .dynamic import dynamic_slice, dynamic_update, dynamic_update_
from .elementwise import (abs, add, add_, cast, ceil, cos, div, equal, exp, exp_, floor, fmod,
                          greater, isfinite, isinf, isnan, log, log2, logical_and, logical_not,
                          logical_or, maximum, mul, negate, pow, relu, relu_, sign, sin, sqrt,
                          sub, tanh, where)
from .fused import increment_mod, increment_mod_, scaled_add, scaled_add_
from .io import host_load, host_store
from .matmul import matmul
from .misc import init
from .nn import gelu, gelu_, group_norm, layer_norm
from .reduce import max, mean, min, prod, softmax, sum
from .shape import (concat, detach, detach_, flatten, flatten_, gather, identity, reshape,
                    reshape_, slice, slice_, split, squeeze, subsample, transpose, transpose_)

_NOT_IMPLEMENTED = {
    "average_pool", "max_pool", "batch_norm_inference", "pow2scale_cast_to_fp8",
    "pow2scale_cast_from_fp8", "concat_", "conv", "conv_transpose", "remote_code_load", "cumsum",
    "roi_align", "argmin", "argmax", "interpolate", "dropout", "onehot", "topk",
    "groupedgather", "tied_gather", "geluerf", "geluerf_", "histogram", "io_tile_copy",
    "ipu_copy", "l1", "l2", "lamb_square", "logsum",
    "logsumexp", "matmul_pow2scaled", "median", "nll_loss", "nll_loss_with_softmax_grad",
    "print_tensor", "split_random_seed", "random_uniform", "random_normal", "remote_load",
    "remote_load_", "remote_store", "scatter", "scatter_reduce", "shaped_dropout", "sumsquare",
    "swish", "swish_", "rename", "clip", "clamp",
}
for _name in _NOT_IMPLEMENTED:
    globals()[_name] = stub(f"popxl.ops.{_name}")
collectives = namespace("popxl.ops.collectives", (
    "replicated_all_reduce", "replicated_all_reduce_", "replicated_all_gather",
    "replicated_reduce_scatter", "replica_sharded_slice", "replicated_slice", "all_reduce",
    "all_reduce_identical_inputs", "all_reduce_identical_grad_inputs", "CommGroup",
    "CommGroupType"))
