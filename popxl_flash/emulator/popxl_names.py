"""The public names of PopXL 3.4, namespace by namespace: what ``popxl_flash.emulator.popxl``
exposes (implemented, or a stub raising ``NotImplementedError``) and nothing more.

Taken from graphcore/popart sdk-release-3.4: ``python/popxl/__init__.py.in`` (``__all__`` plus
the submodules its imports bind), ``python/popxl/python_files/ops/__init__.py`` (every name it
imports, including ``floor``, ``log2`` and ``remote_code_load``, which are missing from its
``__all__``), ``ops/var_updates/__init__.py``, ``ops/collectives/__init__.py`` and
``transforms/__init__.py``. ``popxl.Variable`` and ``popxl.Constant`` are *not* top-level
names (PopXL's own docs write ``popxl.tensor.Variable``).
"""

TOP = (
    # context.py
    "get_current_graph", "get_main_graph", "get_ir", "gcg", "gmg", "gir", "in_sequence",
    "name_scope", "ipu", "io_tiles",
    # dtypes.py
    "dtype", "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "half", "float8_143", "float8_152", "float16", "float", "float32", "double", "float64",
    "complex64", "complex128",
    # graph.py, ir.py, module.py, random_seed.py, remote_buffer.py, replica_grouping.py
    "Graph", "Ir", "Module", "create_seeds", "RemoteBuffer", "remote_buffer", "ReplicaGrouping",
    # streams.py
    "HostToDeviceStream", "DeviceToHostStream", "h2d_stream", "d2h_stream",
    # tensor.py
    "Tensor", "variable", "remote_variable", "remote_replica_sharded_variable",
    "replica_sharded_variable", "replica_sharded_buffer", "constant", "graph_input",
    "graph_output", "TensorByRef", "TensorSpec",
    # tensorlocation.py
    "TensorStorage", "TensorLocation", "ReplicatedTensorSharding", "TileSet", "ExecutionContext",
    # session.py
    "Session",
)

#: Submodules bound as attributes of ``popxl`` by its imports (``remote_buffer`` is rebound to
#: the function of that name).
SUBMODULES = ("context", "dtypes", "graph", "ir", "module", "ops", "random_seed",
              "replica_grouping", "session", "streams", "tensor", "tensorlocation",
              "transforms", "utils", "errors", "typing_")

#: ``popxl.tensor`` names the emulator provides (the module holds more; the rest are stubs).
TENSOR = ("Tensor", "Variable", "Constant", "TensorSpec", "TensorByRef", "constant", "variable",
          "graph_input", "graph_output", "remote_variable", "remote_replica_sharded_variable",
          "replica_sharded_variable", "replica_sharded_buffer")

#: ``popxl.tensor``'s type aliases (``python_files/tensor.py``).
TENSOR_TYPES = ("ScalarType", "HostTensor", "host_tensor_types", "HostScalarTensor",
                "TensorLike")

OPS = (
    "CallSiteInfo", "PadType", "abs", "add", "add_", "argmax", "argmin", "average_pool",
    "batch_norm_inference", "call", "call_with_info", "cast", "ceil", "clamp", "clip",
    "collectives", "concat", "concat_", "conditional", "conditional_with_info", "conv",
    "conv_pow2scaled", "conv_transpose", "conv_transpose_pow2scaled", "cos", "cumsum",
    "detach", "detach_", "div", "dropout", "dynamic_slice", "dynamic_update", "dynamic_update_",
    "equal", "exp", "exp_", "flatten", "flatten_", "floor", "fmod", "gather", "gelu", "gelu_",
    "geluerf", "geluerf_", "greater", "group_norm", "groupedgather", "histogram", "host_load",
    "host_store", "identity", "increment_mod", "increment_mod_", "init", "interpolate",
    "io_tile_copy", "ipu_copy", "isfinite", "isinf", "isnan", "l1", "l2", "lamb_square",
    "layer_norm", "log", "log2", "logical_and", "logical_not", "logical_or", "logsum",
    "logsumexp", "matmul", "matmul_pow2scaled", "max", "max_pool", "maximum", "mean", "median",
    "min", "mul", "negate", "nll_loss", "nll_loss_with_softmax_grad", "onehot", "pow",
    "pow2scale_cast_from_fp8", "pow2scale_cast_to_fp8", "print_tensor", "prod",
    "random_normal", "random_uniform", "relu", "relu_", "remote_code_load", "remote_load",
    "remote_load_", "remote_store", "rename", "repeat", "repeat_with_info", "reshape",
    "reshape_", "roi_align", "scaled_add", "scaled_add_", "scatter", "scatter_reduce",
    "shaped_dropout", "sign", "sin", "slice", "slice_", "softmax", "split", "split_random_seed",
    "sqrt", "squeeze", "sub", "subsample", "sum", "sumsquare", "swish", "swish_", "tanh",
    "tied_gather", "topk", "transpose", "transpose_", "var_updates", "where",
)

#: ``popxl.ops`` names missing from its ``__all__`` in 3.4 (so ``from popxl.ops import *`` does
#: not bind them); the other packages' ``__all__`` list all their names, ``popxl``'s all but
#: ``replica_sharded_buffer``.
NOT_IN_ALL = {"popxl.ops": ("floor", "log2", "remote_code_load"),
              "popxl": ("replica_sharded_buffer",)}


def all_names(package, names):
    """``__all__`` of ``package`` (PopXL 3.4) given its public ``names``. Returns: list."""
    skip = NOT_IN_ALL.get(package, ())
    return [n for n in names if n not in skip]


VAR_UPDATES = (
    "accumulate_", "accumulate_mean_", "accumulate_moving_average_",
    "accumulate_moving_average_square_", "accumulate_square_", "accumulator_scale_",
    "accumulator_zero_", "adam_updater", "adam_var_update", "adamax_updater", "copy_var_update_",
    "lamb_updater", "sparse_accumulate_",
)

COLLECTIVES = (
    "CommGroup", "CommGroupType", "all_reduce", "all_reduce_identical_grad_inputs",
    "all_reduce_identical_inputs", "replica_sharded_slice", "replicated_all_gather",
    "replicated_all_reduce", "replicated_all_reduce_", "replicated_reduce_scatter",
    "replicated_slice",
)

TRANSFORMS = ("ExpectedConnectionType", "ExpectedConnection", "GradGraphInfo", "autodiff",
              "merge_exchange", "io_tile_exchange", "decompose_sum")

#: PopXL 3.4 modules (``python_files/**.py``) that ``install()`` registers as stub modules when
#: the emulator provides no implemented module of that name (any attribute raises
#: ``NotImplementedError``). Every ``popxl.ops.<file>`` is listed in ``OP_MODULES``.
STUB_SUBMODULES = tuple(f"popxl.{m}" for m in (
    "fp8_utils", "tensorlocation", "typing_", "testing",
    "ops.collectives.collectives", "ops.var_updates.utils"))

#: The files of ``popxl.ops.var_updates``, ``popxl.transforms`` and ``popxl.ops.collectives``
#: (PopXL 3.4; ``collectives.py`` has its own module in the installer), registered like
#: ``OP_MODULES``.
VAR_UPDATE_MODULES = ("accumulate", "adam_updater", "adam_var_update", "copy_var_update")
TRANSFORM_MODULES = ("decompose_sum", "merge_exchange")
COLLECTIVE_MODULES = ("all_reduce", "replicated_all_gather", "replicated_all_reduce",
                      "replicated_reduce_scatter")

#: The op modules of PopXL 3.4 (``python_files/ops/<name>.py``); ``install()`` registers each
#: as ``popxl.ops.<name>``, whose attributes are the ``popxl.ops`` names of that file.
OP_MODULES = (
    "abs", "add", "argminmax", "batch_norm", "call", "cast", "ceil", "clip", "code_copy",
    "concat", "conditional", "conv", "cos", "cumsum", "detach", "div", "dropout",
    "dynamic_slice", "dynamic_update", "equal", "exp", "floor", "fmod", "gather", "gelu",
    "geluerf", "greater", "group_norm", "histogram", "host_load", "host_store", "identity",
    "increment_mod", "init", "interpolate", "io_tile_copy", "ipu_copy", "isfinite", "isinf",
    "isnan", "l1", "l2", "lamb", "log", "logical_and", "logical_not", "logical_or", "logsum",
    "logsumexp", "matmul", "max", "mean", "median", "min", "mul", "negate",
    "negative_log_likelihood", "onehot", "pool", "pow", "print_tensor", "prod", "random",
    "random_seed", "relu", "remote_load", "remote_store", "repeat", "reshape", "roialign",
    "scaled_add", "scatter", "scatter_reduce", "shaped_dropout", "sign", "sin", "slice",
    "softmax", "split", "sqrt", "squeeze", "sub", "subsample", "sum", "sumsquare", "swish",
    "tanh", "topk", "transpose", "utils", "where")


#: The ``popxl.ops`` / ``var_updates`` / ``transforms`` names each PopXL 3.4 file holds (defines
#: or imports), where they are not just the file's own name: ``popxl.ops.add.matmul`` does not
#: exist, ``popxl.ops.host_load.init`` does. See :func:`file_names`.
FILE_NAMES = {
    "popxl.ops": {
        "add": ("add", "add_"),
        "argminmax": ("argmax", "argmin"),
        "batch_norm": ("batch_norm_inference",),
        "call": ("CallSiteInfo", "call", "call_with_info"),
        "cast": ("cast", "pow2scale_cast_from_fp8", "pow2scale_cast_to_fp8"),
        "clip": ("clamp", "clip"),
        "code_copy": ("remote_code_load",),
        "concat": ("concat", "concat_"),
        "conditional": ("CallSiteInfo", "conditional", "conditional_with_info"),
        "conv": ("PadType", "conv", "conv_pow2scaled", "conv_transpose",
            "conv_transpose_pow2scaled"),
        "detach": ("detach", "detach_"),
        "dynamic_update": ("dynamic_update", "dynamic_update_"),
        "exp": ("exp", "exp_"),
        "gather": ("gather", "groupedgather", "tied_gather"),
        "gelu": ("gelu", "gelu_"),
        "geluerf": ("geluerf", "geluerf_"),
        "group_norm": ("group_norm", "layer_norm"),
        "host_load": ("host_load", "init"),
        "identity": ("identity", "rename"),
        "increment_mod": ("increment_mod", "increment_mod_"),
        "isfinite": ("isfinite", "isinf", "isnan", "rename"),
        "lamb": ("lamb_square",),
        "log": ("log", "log2"),
        "matmul": ("matmul", "matmul_pow2scaled"),
        "max": ("max", "maximum"),
        "negative_log_likelihood": ("nll_loss", "nll_loss_with_softmax_grad"),
        "pool": ("PadType", "average_pool", "max_pool"),
        "random": ("random_normal", "random_uniform"),
        "random_seed": ("split_random_seed",),
        "relu": ("relu", "relu_"),
        "remote_load": ("init", "remote_load", "remote_load_"),
        "repeat": ("CallSiteInfo", "repeat", "repeat_with_info"),
        "reshape": ("flatten", "flatten_", "reshape", "reshape_"),
        "roialign": ("roi_align",),
        "scaled_add": ("scaled_add", "scaled_add_"),
        "slice": ("slice", "slice_"),
        "squeeze": ("reshape", "squeeze"),
        "swish": ("swish", "swish_"),
        "transpose": ("transpose", "transpose_"),
        "utils": (),
    },
    "popxl.ops.var_updates": {
        "accumulate": ("accumulate_", "accumulate_mean_", "accumulate_moving_average_",
            "accumulate_moving_average_square_", "accumulate_square_", "accumulator_scale_",
            "accumulator_zero_", "sparse_accumulate_"),
        "adam_updater": ("adam_updater", "adamax_updater", "lamb_updater"),
        "copy_var_update": ("copy_var_update_",),
    },
    "popxl.transforms": {
        "merge_exchange": ("io_tile_exchange", "merge_exchange"),
    },
    "popxl.ops.collectives": {
        "all_reduce": ("all_reduce", "all_reduce_identical_grad_inputs",
                       "all_reduce_identical_inputs"),
        "replicated_all_reduce": ("replicated_all_reduce", "replicated_all_reduce_"),
        "replicated_reduce_scatter": ("replica_sharded_slice", "replicated_reduce_scatter",
                                      "replicated_slice"),
    },
}


def file_names(package, name):
    """The names of file ``name`` of ``package`` (e.g. "popxl.ops", "add"). Returns: tuple."""
    return FILE_NAMES[package].get(name, (name,))
