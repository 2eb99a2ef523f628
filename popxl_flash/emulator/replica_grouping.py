"""``popxl.ReplicaGrouping``: how the replicas of an Ir are partitioned into groups (PopXL 3.4
``python_files/replica_grouping.py`` semantics, written from its documented behaviour).

A grouping assigns every replica ``r`` in ``range(ir.replication_factor)`` a group index
(``assignment[r]``). ``ir.replica_grouping(stride, group_size)`` builds a constant-stride one;
``ir.replica_grouping_from_assignments(assignment)`` any assignment whose groups are equally
sized and numbered 0, 1, ... in order of first appearance (one with a non-constant stride gets
``const_rg``, the coarsest constant-stride grouping refining it, plus the group maps between the
two, as PopXL computes them).
"""
import math
from functools import reduce

import numpy as np

from ._internal_ir import ReplicaGrouping as PbReplicaGrouping


class ReplicaGrouping:
    """A partition of an Ir's replicas into equally sized groups (use ``Ir.replica_grouping``)."""

    def __init__(self):
        raise RuntimeError("popxl.ReplicaGrouping cannot be constructed directly (use "
                           "`ir.replica_grouping`).")

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def _from_params(cls, ir, stride=1, group_size=None):
        """A constant-stride grouping of ``ir``'s replicas (``Ir.replica_grouping``)."""
        n = ir.replication_factor
        if group_size is None:
            group_size = n // stride
        if not 0 < stride <= n:
            raise ValueError("Stride must be greater than zero and less than or equal to number "
                             f"of replicas. Stride: {stride}. Replicas: {n}")
        if not (n / stride).is_integer():
            raise ValueError("Stride must be a factor of the number of replicas. "
                             f"Stride: {stride}. Replicas: {n}")
        if not 0 < group_size <= n:
            raise ValueError("Group size must be greater than zero and less than or equal to "
                             f"number of replicas. Group size: {group_size}. Replicas: {n}")
        stride = stride if group_size > 1 else 1  # a stride means nothing for singletons
        self = object.__new__(cls)
        self._ir, self._stride, self._group_size = ir, stride, group_size
        self._num_replicas, self._num_groups = n, n // group_size
        self._assignment = _const_assignment(n, stride, group_size)
        self.const_rg, self.to_device_map, self.to_host_map = self, None, None
        return self

    @classmethod
    def _from_assignment(cls, ir, assignment):
        """Any valid grouping (``Ir.replica_grouping_from_assignments``)."""
        n = ir.replication_factor
        groups, counts = np.unique(assignment, return_counts=True)
        if len(set(counts.tolist())) != 1:
            raise ValueError("All groups should have the same size but they dont. (Group, "
                             f"Sizes): {list(zip(groups.tolist(), counts.tolist()))}")
        if not np.array_equal(groups, np.arange(len(groups))):
            raise ValueError("The group numbers are not numbered consecutively and/or do not "
                             f"start at 0. Groups: {groups}")
        first_seen = list(dict.fromkeys(assignment))
        if first_seen != groups.tolist():
            raise ValueError("When ordered by first appearance, the group numbers are not "
                             f"monotonically increasing. Ordering: {np.array(first_seen)}")
        if len(assignment) != n:
            raise ValueError(f"The length of `assignment` ({len(assignment)}) does not equal the "
                             f"number of replicas ({n}).")
        strides = _strides(assignment)
        if len(strides) == 1:
            return ir.replica_grouping(stride=strides.pop(), group_size=int(counts[0]))
        self = object.__new__(cls)
        self._ir, self._stride, self._group_size = ir, None, int(counts[0])
        self._num_replicas, self._num_groups = n, len(counts)
        self._assignment = list(assignment)
        self.const_rg = _refining_const_grouping(ir, assignment)
        self.to_device_map, self.to_host_map = _group_maps(self.const_rg.assignment,
                                                           self._assignment)
        return self

    # -- properties --------------------------------------------------------------------------
    @property
    def is_const(self):
        """Returns: True when every group has one constant stride."""
        return self._stride is not None

    @property
    def stride(self):
        """Returns: the offset between consecutive replicas of a group."""
        if not self.is_const:
            raise NotImplementedError(
                "This ReplicaGrouping has a non-constant stride and has no PopART C++ "
                "representation. You can't use this ReplicaGrouping with GCL ops. ")
        return self._stride

    group_size = property(lambda self: self._group_size)
    num_groups = property(lambda self: self._num_groups)
    assignment = property(lambda self: self._assignment)

    def transpose(self):
        """Returns: the grouping whose k-th group holds the k-th member of every group."""
        if self.is_const and (self._stride == 1 or
                              self._stride * self._group_size == self._num_replicas):
            stride = 1 if self._stride > 1 else self._group_size
            return self._ir.replica_grouping(stride, self._num_groups)
        members = [[r for r, g in enumerate(self._assignment) if g == k]
                   for k in range(self._num_groups)]
        new = [0] * self._num_replicas
        for group in members:
            for position, replica in enumerate(group):
                new[replica] = position
        return self._ir.replica_grouping_from_assignments(new)

    @property
    def _pb_replica_grouping(self):
        """The C++ ``popart.ReplicaGrouping`` handed to collective ops (custom ops read it).
        Raises NotImplementedError for a non-constant grouping, as PopXL's."""
        return PbReplicaGrouping(self._num_replicas, self.stride, self._group_size)

    def __repr__(self):
        if self.is_const:
            return (f"ReplicaGrouping(num_replicas={self._num_replicas}, stride={self._stride}, "
                    f"group_size={self._group_size}, num_groups={self._num_groups})")
        return f"ReplicaGrouping(assignment={self._assignment})"

    def __eq__(self, other):
        if not isinstance(other, ReplicaGrouping):
            raise TypeError("Value must be of type popxl.ReplicaGrouping. Type: "
                            f"{type(other)}. Value: {other}.")
        return self._ir == other._ir and self._assignment == other._assignment

    __hash__ = None  # PopXL defines __eq__ only, so instances are unhashable there too


def _const_assignment(n, stride, group_size):
    """Fill groups greedily: group k starts at the first unassigned replica and takes every
    ``stride``-th replica, ``group_size`` of them (by list slice assignment, as PopXL does: a
    combination that does not tile the replicas raises ``ValueError`` from the extended slice,
    or leaves ``None`` entries for stride 1, as there)."""
    out = [None] * n
    start = 0
    for k in range(n // group_size):
        while out[start] is not None:
            start += 1
        out[start:start + group_size * stride:stride] = [k] * group_size
    return out


def _strides(assignment):
    """Returns: the set of distances between consecutive members of every group."""
    found = set()
    for g in set(assignment):
        members = [r for r, a in enumerate(assignment) if a == g]
        found.update(b - a for a, b in zip(members, members[1:]))
    return found


def _refining_const_grouping(ir, assignment):
    """The constant-stride grouping PopXL stores a non-constant one as: split every group where
    a gap exceeds the smallest stride, then take the gcd of the resulting group sizes."""
    min_stride = min(_strides(assignment))
    split = list(assignment)
    next_group = max(split)
    for g in sorted(set(assignment)):
        members = [r for r, a in enumerate(assignment) if a == g]
        moved = False
        for a, b in zip(members, members[1:]):
            if b - a > min_stride:
                moved, next_group = True, next_group + 1
            if moved:
                split[b] = next_group
    sizes = set(np.unique(split, return_counts=True)[1].tolist())
    size = reduce(math.gcd, sizes)
    return ir.replica_grouping(stride=min_stride if size > 1 else 1, group_size=size)


def _group_maps(const_assignment, assignment):
    """Returns: (to_device_map: for each const group, its group in ``assignment``;
    to_host_map: for each group of ``assignment``, its first const group)."""
    to_device, to_host, seen_c, seen_a = [], [], set(), set()
    for c, a in zip(const_assignment, assignment):
        if c not in seen_c:
            seen_c.add(c)
            to_device.append(a)
        if a not in seen_a:
            seen_a.add(a)
            to_host.append(c)
    return to_device, to_host
