"""How PopART 3.4 lowers each PopXL op kind, as data: one table, below the emulator and the planner.

Each row says what one execution of an op of that kind costs on an IPU as PopART lowers it
under PopXL (in-placing off: ``Session`` uses ``PatternsLevel.Minimal``):

* ``compute_sets``: Poplar compute sets executed (each a fixed cost: a vertex launch on every tile
  that holds part of the tensor; exchanges and syncs between them are folded into that cost);
* ``work``: which elements are vector work (``"output"``: the output's elements, ``"input"``:
  input 0's, ``"update"``: input 2's, ``None``: none) times ``factor``, at the rate class
  ``rate`` (``"arithmetic"``, ``"transcendental"`` or ``"cast"``) of the op's dtype;
* ``copied``: which bytes a Copy program moves (``"output"``, ``"input"``, ``"update"``,
  ``"base_update"`` (input 0's and input 2's), ``None``);
* ``source``: the PopART / poplibs source (branch ``sdk-release-3.4``) that settles the row.

Matmul FLOPs are priced apart (``matmul``'s work is its FLOPs); ``repeat`` runs
``per_iteration`` compute sets each iteration (``LoopOpx``'s exit and iterator updates); the
copies at call, branch and loop boundaries are the emulator's copy model (``copies.py``), not
rows here. Host and streaming-memory transfers are not priced (``priced=False``).

The table is data, not code: :func:`row` looks a kind up, nothing else branches on kinds. Change
a row only with a cited source, and say so in ``docs/design.md``. The prices (cycles per compute
set, elements per tile-cycle per rate class and dtype, FLOPs and bytes per tile-cycle) are in
:mod:`popxl_flash.ipu_model`.

This module imports nothing from the package: the emulator and the planner both read it.
"""
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Lowering:
    """One op kind's lowering (see the module docstring).

    Attributes:
        compute_sets: compute sets per execution.
        work: ``"output"``, ``"input"``, ``"update"`` or ``None``: whose elements are vector work.
        factor: vector work = ``factor`` x those elements.
        rate: ``"arithmetic"``, ``"transcendental"``, ``"cast"`` or ``None``.
        copied: ``"output"``, ``"input"``, ``"update"``, ``"base_update"`` or ``None``.
        per_iteration: compute sets per loop iteration (``repeat`` only).
        priced: ``False`` for host and streaming-memory transfers.
        source: where the row comes from.
    """

    compute_sets: int
    work: Optional[str]
    factor: int
    rate: Optional[str]
    copied: Optional[str]
    source: str
    per_iteration: int = 0
    priced: bool = True


def _rows(kinds, *fields, **named):
    return {k: Lowering(*fields, **named) for k in kinds.split()}


_MAP = ("poplibs lib/popops/ElementWise.cpp:1604-1750 (popops::map: one compute set per "
        "expression); popart willow/src/popx/op/elementwisex.cpp")
_VIEW = ("popart willow/src/popx/op/reshapex.cpp:27, transposex.cpp:38, slicex.cpp:61, "
         "concatx.cpp:79 (outplace: cloneNcopy of the output, a Copy program; PopXL's Session "
         "uses PatternsLevel.Minimal, inplaceEnabled=false: session.py:98-100, "
         "patterns.cpp:136-146)")
_INPLACE_VIEW = ("popart willow/src/popx/op/reshapex.cpp, transposex.cpp, slicex.cpp, "
                 "concatx.cpp (ReshapeInplaceOpx etc.: the output is a view, no program)")
_REDUCE = ("poplibs lib/popops/reduction/ReductionPlan.cpp, ReductionConnection.cpp:1404-1406 "
           "(2 compute sets when the rows are spread over tiles, as a matmul's output is); "
           "popart reducemaxx.cpp:41-48, reducesumx.cpp:36-43")
_RANDOM = "popart willow/src/popx/op/randomuniformx.cpp, dropoutx.cpp (poprand: seed set + draw)"
_COLLECTIVE = "popart willow/src/popx/op/collectives/*.cpp (gcl: sync + exchange of the input)"
_HOST = "host / streaming-memory transfer (stream copies with a host sync): not priced"

#: ``{op kind: Lowering}``: PopART 3.4's lowering of every kind the emulator runs.
TABLE = {
    **_rows("add sub mul div fmod negate abs sign floor ceil relu relu_ greater equal "
            "logical_and logical_or logical_not where init increment_mod increment_mod_ "
            "scaled_add scaled_add_ add_ maximum isnan isinf isfinite accumulate_ "
            "accumulate_square_ accumulate_mean_ accumulate_moving_average_ "
            "accumulate_moving_average_square_ accumulator_scale_ accumulator_zero_ "
            "copy_var_update_ modify_random_seed", 1, "output", 1, "arithmetic", None, _MAP),
    **_rows("exp exp_ log log2 sqrt tanh sin cos pow gelu gelu_ gelu_grad swish swish_ "
            "swish_grad", 1, "output", 1, "transcendental", None,
            _MAP + "; rates: popops/popopsCycleEstimators.cpp:63-85"),
    "cast": Lowering(1, "output", 1, "cast", None,
                     "popart castx.cpp:27 (popops::cast); rate: poplibs "
                     "lib/popops/PerformanceEstimation.cpp:287-311"),
    **_rows("max min sum mean prod argmax argmin", 2, "input", 1, "arithmetic", None, _REDUCE),
    "softmax": Lowering(9, "input", 5, "arithmetic", "input",
                        "popart willow/src/popx/op/softmaxx.cpp:77,100 (cloneNcopy of the "
                        "input); poplibs lib/popnn/NonLinearity.cpp:94-141 (max, sub, exp, "
                        "sum, inv, cast, mul: 5 + 2R compute sets, R = 2)"),
    "logsumexp": Lowering(6, "input", 3, "transcendental", None,
                          "popart willow/src/popx/op/reducelogsumexpx.cpp:42-85 (max, "
                          "exp(x - max), sum, log + max: 2 + 2R compute sets, R = 2)"),
    "matmul": Lowering(3, None, 0, None, None,
                       "poplibs lib/poplin/Convolution.cpp:2164-2260 (transpose/pre, convolve, "
                       "reduce or cast: 2-5 compute sets); popart matmulx.cpp:412-520; its "
                       "work is its FLOPs"),
    "dynamic_slice": Lowering(2, None, 0, None, "output",
                              "popart dynamicslicex.cpp:44-75; poplibs "
                              "lib/popops/DynamicSlice.cpp:559-701 (index cast + slice)"),
    "dynamic_update_": Lowering(2, None, 0, None, "update",
                                "popart dynamicupdatex.cpp:51-80 (in place: no clone of the "
                                "base); poplibs lib/popops/DynamicSlice.cpp:1468-1500"),
    "dynamic_update": Lowering(2, None, 0, None, "base_update",
                               "popart dynamicupdatex.cpp:51-80 (cloneNcopy of the base, then "
                               "the update)"),
    **_rows("gather gather_grad subsample", 2, None, 0, None, "output",
            "popart gatherx.cpp, subsamplex.cpp (popops::multiSlice / strided copy)"),
    **_rows("random_uniform random_normal dropout", 2, "output", 1, "arithmetic", None,
            _RANDOM),
    **_rows("replicated_all_gather replicated_reduce_scatter replicated_all_reduce "
            "replicated_all_reduce_", 2, None, 0, None, "input", _COLLECTIVE),
    **_rows("reshape transpose slice concat detach split identity io_tile_copy", 1, None, 0,
            None, "output", _VIEW),
    **_rows("reshape_ transpose_ slice_ concat_ detach_", 0, None, 0, None, None,
            _INPLACE_VIEW),
    "repeat": Lowering(0, None, 0, None, None,
                       "popart willow/src/popx/op/loopx.cpp:420-485 (exit and iterator "
                       "updates per iteration; the carried copies are the copy model's)",
                       per_iteration=2),
    **_rows("call conditional", 0, None, 0, None, None,
            "popart callx.cpp:94-201, ifx.cpp (the boundary copies are the copy model's)"),
    **_rows("group_norm group_norm_grad", 6, "input", 5, "arithmetic", None,
            "popart groupnormx.cpp; poplibs lib/popnn/Norms.cpp (statistics: 2 reductions, "
            "whitening maps; estimate)"),
    **_rows("nll_loss nll_grad nll_loss_with_softmax_grad", 4, "input", 2, "arithmetic", None,
            "popart nllx.cpp (gather of the labels' probabilities, log, reduction; estimate)"),
    **_rows("host_load host_store remote_load remote_load_ remote_store", 0, None, 0, None,
            None, _HOST, priced=False),
    # popxl-addons' and Graphcore examples' custom C++ ops (their own codelets; estimates):
    **_rows("addons_replicated_all_reduce addons_replicated_all_gather_strided "
            "addons_replicated_reduce_scatter_strided", 2, None, 0, None, "input",
            _COLLECTIVE + " (popxl-addons' strided and tensor-parallel variants)"),
    **_rows("addons_rotary_pos_embed addons_rotary_pos_embed_grad examples_rotary_pos_embed "
            "examples_rotary_pos_embed_grad", 1, "output", 3, "arithmetic", None,
            "popxl-addons ops/rotary_pos_embed (one custom vertex per tile; estimate)"),
    **_rows("addons_layer_norm_distributed addons_layer_norm_distributed_grad "
            "addons_cross_entropy_sharded addons_cross_entropy_sharded_grad", 6, "input", 5,
            "arithmetic", None,
            "popxl-addons ops (statistics reductions, a collective and maps; estimate)"),
    "addons_grad_reduce_square_add": Lowering(2, "input", 1, "arithmetic", None, _REDUCE),
    "adam_updater": Lowering(1, "output", 4, "arithmetic", None,
                             _MAP + " (AdamUpdater: one fused map; estimate)"),
}

#: Rate classes (keys of ``IpuConstants.vector_rates`` with a dtype).
RATE_CLASSES = ("arithmetic", "transcendental", "cast")


def row(kind) -> Lowering:
    """The lowering of op ``kind``.

    Args:
        kind: an op kind (``"add"``, ``"softmax"``, ...).
    Returns:
        :class:`Lowering`.
    Raises:
        KeyError: a kind the table does not know (every emulator kind has a row; a test holds it).
    """
    return TABLE[kind]


def rate_key(rate, dtype) -> str:
    """The vector-rate key of rate class ``rate`` for an op of ``dtype``: ``"<rate>.float16"``
    for float16 and ``"<rate>.float32"`` for anything else (float32, integers, bool), or
    ``"cast"`` (one rate whatever the dtypes)."""
    if rate == "cast":
        return "cast"
    return f"{rate}.{'float16' if str(dtype) == 'float16' else 'float32'}"


#: The vector-rate keys :func:`rate_key` returns.
RATE_KEYS = ("arithmetic.float16", "arithmetic.float32", "transcendental.float16",
             "transcendental.float32", "cast")
