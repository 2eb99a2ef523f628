"""CPU models of popxl-addons' custom C++ ops (graphcore/popxl-addons sdk-release-3.4,
``popxl_addons/ops/*/*.cpp``), for popxl-addons' Python builders to create when the emulator
stands in for cppimport (``standins.py``).

popxl-addons compiles each op's ``<name>_binding.cpp`` with cppimport and calls
``<name>_binding.<Op>.createOpInGraph(pb_graph, inputs, outputs, *attributes, settings)``.
:func:`binding` gives, for the binding modules modelled here, a module with that class whose
``createOpInGraph`` creates an emulator op with the C++ op's setup checks, forward values,
gradient op and replica behaviour:

* ``replicated_all_reduce_TP_binding.ReplicatedAllReduceTPOp`` (``tensor_parallel.py``)
* ``replicated_all_gather_strided_binding.ReplicatedAllGatherStridedOp``,
  ``replicated_reduce_scatter_strided_binding.ReplicatedReduceScatterStridedOp``,
  ``replicated_all_reduce_strided_binding.ReplicatedAllReduceStridedOp``
  (``tensor_parallel.py``)
* ``rotary_pos_embed_binding.RotaryPosEmbedOp`` (``rotary.py``)
* ``layer_norm_distributed_binding.LayerNormDistributedOp`` (``layer_norm_distributed.py``)

These are popxl-addons' ops, not PopXL's: nothing here is reachable from ``popxl``.
"""
import types

from . import layer_norm_distributed, rotary, tensor_parallel

_BINDINGS = {
    "replicated_all_reduce_TP_binding": {
        "ReplicatedAllReduceTPOp": tensor_parallel.ReplicatedAllReduceTPOp},
    "replicated_all_gather_strided_binding": {
        "ReplicatedAllGatherStridedOp": tensor_parallel.ReplicatedAllGatherStridedOp},
    "replicated_reduce_scatter_strided_binding": {
        "ReplicatedReduceScatterStridedOp": tensor_parallel.ReplicatedReduceScatterStridedOp},
    "replicated_all_reduce_strided_binding": {
        "ReplicatedAllReduceStridedOp": tensor_parallel.ReplicatedAllReduceStridedOp},
    "rotary_pos_embed_binding": {"RotaryPosEmbedOp": rotary.RotaryPosEmbedOp},
    "layer_norm_distributed_binding": {
        "LayerNormDistributedOp": layer_norm_distributed.LayerNormDistributedOp},
}


def binding(fullname):
    """Args: fullname: the binding module's full name
    (``popxl_addons.ops.rotary_pos_embed.rotary_pos_embed_binding``). Returns: a new module
    holding the modelled op classes, or None when the emulator does not model it. Only
    popxl-addons' own bindings are modelled: another package's C++ op of the same file name
    (Graphcore's Dolly ships a ``rotary_pos_embed_binding`` of other semantics) is not."""
    package, _, leaf = fullname.rpartition(".")
    classes = _BINDINGS.get(leaf)
    if classes is None or not package.startswith("popxl_addons.ops."):
        return None
    mod = types.ModuleType(leaf, f"Emulator model of popxl-addons' {leaf}.cpp")
    for name, cls in classes.items():
        setattr(mod, name, cls)
    return mod
