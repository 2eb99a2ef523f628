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
* ``crossentropysharded_binding.CrossEntropyShardedOp`` (``cross_entropy_sharded.py``)
* ``grad_reduce_square_add_binding.GradReduceSquareAddOp`` (``grad_reduce_square_add.py``)

and one op of Graphcore's examples that has a popxl-addons op's file names but other semantics,
recognised by its sources (:data:`SOURCES`):

* the Dolly and Llama models' ``rotary_pos_embed_binding.RotaryPosEmbedOp``
  (``examples_rotary.py``: rotate-half layout)

These are popxl-addons' and the examples' ops, not PopXL's: nothing here is reachable from
``popxl``.
"""
import hashlib
import os
import re
import types

from . import (cross_entropy_sharded, examples_rotary, grad_reduce_square_add,
               layer_norm_distributed, rotary, tensor_parallel)

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
    "crossentropysharded_binding": {
        "CrossEntropyShardedOp": cross_entropy_sharded.CrossEntropyShardedOp},
    "grad_reduce_square_add_binding": {
        "GradReduceSquareAddOp": grad_reduce_square_add.GradReduceSquareAddOp},
}


#: C++ ops of other packages than popxl-addons that the emulator models, by the SHA-256 of
#: their sources (:func:`source_digest`): {digest: (binding module name, {class name: model},
#: what the sources are)}
SOURCES = {
    "4e0542f38b0222f21a7b04d37ef7d859d4960471ec35e32148b9cc2dd9ed73e1": (
        "rotary_pos_embed_binding", {"RotaryPosEmbedOp": examples_rotary.RotaryPosEmbedOp},
        "Graphcore's examples (sdk-release-3.4), Dolly's and Llama's rotary_pos_embed"),
}


def source_digest(path):
    """The SHA-256 (hex) that identifies a cppimport binding source: over the binding file at
    ``path``, the files its cppimport configuration compiles with it (``cfg['sources'] =
    [...]``) and the local headers (``#include "..."``) of all of them, in the order first
    named, each as its file name, a NUL, and its text with CRLF line ends made LF and trailing
    whitespace at the end of the file dropped. Returns: the digest, or None when a file is
    missing or unreadable."""
    folder, first = os.path.split(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        listed = re.search(r"cfg\['sources'\]\s*=\s*\[([^\]]*)\]", text)
        names = [first] + (re.findall(r"['\"]([^'\"]+)['\"]", listed.group(1)) if listed else [])
        h, done = hashlib.sha256(), []
        while names:
            name = names.pop(0)
            if name in done:
                continue
            done.append(name)
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                body = f.read().replace("\r\n", "\n").rstrip()
            names += re.findall(r'^#include "([^"]+)"', body, re.M)
            h.update(name.encode() + b"\0" + body.encode() + b"\0")
        return h.hexdigest()
    except (OSError, UnicodeDecodeError):
        return None


def binding(fullname, source=None):
    """Args: fullname: the binding module's full name
    (``popxl_addons.ops.rotary_pos_embed.rotary_pos_embed_binding``). source: the path of its
    ``.cpp`` file (cppimport's finder passes it). Returns: a new module holding the modelled op
    classes, or None when the emulator does not model it. popxl-addons' own bindings are
    modelled by name (a module of package ``popxl_addons.ops``); a C++ op of another package,
    by its sources only: one of :data:`SOURCES` (Graphcore's Dolly and Llama ship a
    ``rotary_pos_embed_binding`` of other semantics than popxl-addons' op of that name),
    anything else (an edited copy too) is not modelled."""
    package, _, leaf = fullname.rpartition(".")
    if not package.startswith("popxl_addons.ops."):
        known = SOURCES.get(source_digest(source)) if source else None
        if known is None or known[0] != leaf:
            return None
        mod = types.ModuleType(leaf, f"Emulator model of {known[2]} ({leaf}.cpp)")
        for name, cls in known[1].items():
            setattr(mod, name, cls)
        return mod
    classes = _BINDINGS.get(leaf)
    if classes is None:
        return None
    mod = types.ModuleType(leaf, f"Emulator model of popxl-addons' {leaf}.cpp")
    for name, cls in classes.items():
        setattr(mod, name, cls)
    return mod
