"""PopART's alias model of one graph: which tensors share storage, and which elements.

PopXL builds in-place views (``reshape_``, ``transpose_``, ``slice_``, ``concat_``,
``detach_``, and ``flatten_``/``squeeze_``-style reshapes) and in-place modifiers (``add_``,
``var_updates``...). PopART models them with poprithms' alias graph (``Op::growAliasModel``:
``willow/src/op/{reshape,transpose,slice,concat}.cpp``; ``ConcatInplaceOp``'s output aliases
*every* input, ``willow/include/popart/op/concat.hpp``). Two tensors alias when they share at
least one element (poprithms ``memory/alias/graph.cpp``, ``Graph::allAliases``): disjoint
``slice_`` regions of one tensor do not alias each other.

* :class:`Aliases`: storage groups (union-find over view and modifier outputs; ``concat_``
  joins all its inputs into one group) and the bytes the group owns.
* :meth:`Aliases.overlap`: whether two tensors of one group share an element, computed on
  flat element indices (the view op's own numpy implementation applied to the indices of its
  inputs, as the alias graph applies the view change to regions);
  :meth:`Aliases.read_elements`: the elements an op reads (a slice: its region).
"""
from collections import defaultdict

import numpy as np

from .registry import IMPLS


class Aliases:
    """Storage groups of one graph's tensors.

    A "view" op's output joins the group of every input; a "modify" op's output joins its
    input 0 (the modified tensor). Other tensors own their storage.

    Args:
        graph: emulator Graph.
    """

    def __init__(self, graph):
        self.graph, self.parent, self.producer = graph, {}, {}
        for op in graph._ops:
            if not op.alias:
                continue
            sources = op.inputs if op.alias == "view" else op.inputs[:1]
            root = self.find(sources[0])
            for s in sources[1:]:
                other = self.find(s)
                if other is not root:
                    self.parent[id(other)] = root
            self.parent[id(op.outputs[0])] = root
            self.producer[id(op.outputs[0])] = op
        self._owners, self._index = None, {}

    def find(self, t):
        """Returns: the representative tensor of ``t``'s storage group."""
        while id(t) in self.parent:
            t = self.parent[id(t)]
        return t

    def owners(self, root):
        """Returns: the tensors of ``root``'s group that own storage (not alias outputs)."""
        if self._owners is None:
            self._owners = defaultdict(list)
            for t in self.graph._tensors.values():
                if id(t) not in self.producer:
                    self._owners[id(self.find(t))].append(t)
        return self._owners[id(root)]

    def nbytes(self, root):
        """Returns: bytes of storage the group of ``root`` owns (views and in-place outputs
        allocate nothing)."""
        key = ("bytes", id(root))
        if key not in self._index:
            self._index[key] = sum(t._nbytes for t in self.owners(root))
        return self._index[key]

    def elements(self, t):
        """Flat indices of ``t``'s elements in its group's storage (owners laid end to end).

        Returns: int64 array of ``t``'s shape.
        """
        key = id(t)
        if key not in self._index:
            op = self.producer.get(key)
            if op is None:
                start = 0
                for o in self.owners(self.find(t)):
                    if o is t:
                        break
                    start += o.nelms
                idx = np.arange(start, start + t.nelms, dtype=np.int64).reshape(t.shape)
            elif op.alias == "modify":
                idx = self.elements(op.inputs[0])
            else:
                idx = np.asarray(IMPLS[op.kind](*[self.elements(s) for s in op.inputs],
                                                **op.attrs))
            self._index[key] = idx
        return self._index[key]

    def read_elements(self, op, pos):
        """The elements of ``op``'s input ``pos`` that ``op`` reads, as flat indices.

        PopART models a view op (inplace or outplace) as a poprithms view change followed by
        an alias gate (``AliasModel::insertViewChange``, ``willow/src/alias/aliasmodel.cpp``)
        and a gate is never a pure view (``AliasGate::isView``, poprithms ``memory/inplace/
        ops.hpp``): the gate reads what the view change selects. So a slice or subsample reads
        its region and every other op its whole input.
        """
        t = op.inputs[pos]
        if op.kind in _REGION_READS:
            return np.asarray(IMPLS[op.kind](self.elements(t), **op.attrs))
        return self.elements(t)

    def overlap(self, a, b, b_elements=None):
        """Returns: whether tensors ``a`` and ``b`` share at least one element of storage
        (``b_elements``: the elements of ``b`` to compare, default all of them)."""
        if self.find(a) is not self.find(b) or not a.nelms or not b.nelms:
            return False
        eb = self.elements(b) if b_elements is None else b_elements
        return bool(self._mask(a)[eb].any())

    def _mask(self, t):
        """Returns: bool array over ``t``'s group storage, True at ``t``'s elements (cached)."""
        key = ("mask", id(t))
        if key not in self._index:
            mask = np.zeros(sum(o.nelms for o in self.owners(self.find(t))), bool)
            mask[self.elements(t)] = True
            self._index[key] = mask
        return self._index[key]


_REGION_READS = ("slice", "slice_", "subsample")  # ops reading a region of their input
