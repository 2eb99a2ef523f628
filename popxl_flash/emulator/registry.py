"""The op tables: one shape/dtype rule and one numpy implementation per op kind.

``SHAPE_RULES[kind](*input_tensors, **attrs) -> [(shape, dtype), ...]`` runs at op creation and
raises there. ``IMPLS[kind](*arrays, **attrs) -> array | tuple`` computes. Runtime-aware kinds
(``RUNTIME``: call, repeat, conditional, host IO) get ``(runtime, step_data, arrays)`` instead.
"""
from . import tiles
from .context import gcg
from .errors import PopartError
from .ir import Op, check_in_graph
from .tensor import Constant

SHAPE_RULES = {}
IMPLS = {}
ALIAS = {}
RUNTIME = set()
MULTI_OUTPUT = set()


def register(kind, rule, impl, alias=None, runtime=False, multi=False):
    """Register op ``kind``.

    Args:
        kind: op name. rule: shape/dtype rule. impl: numpy implementation.
        alias: None, "modify" (in place on input 0) or "view". runtime: impl takes the runtime.
        multi: impl returns a tuple of outputs.
    """
    SHAPE_RULES[kind], IMPLS[kind], ALIAS[kind] = rule, impl, alias
    if runtime:
        RUNTIME.add(kind)
    if multi:
        MULTI_OUTPUT.add(kind)


def emit(kind, tensors, attrs=None, names=None, modifies=None, subgraphs=()):
    """Create an op record in the current graph and return its output tensors.

    Args:
        kind: registered op kind. tensors: dict name -> input Tensor (order = input order).
        attrs: static attributes passed to rule and impl. names: output tensor names.
        modifies: input positions written (default: (0,) for "modify" ops).
        subgraphs: graphs the op calls.
    Returns:
        Tuple of output Tensors.
    """
    g = gcg()
    g.ir._check_mutable()
    check_in_graph(g, **tensors)
    tiles.check_tile_sets(kind, tensors)
    attrs = attrs or {}
    inputs = tuple(tensors.values())
    specs = SHAPE_RULES[kind](*inputs, **attrs)
    alias = ALIAS[kind]
    if alias == "modify" and modifies is None:
        modifies = (0,)
        _check_modifiable(inputs[0], kind)
    op = Op(kind, inputs, attrs, g, alias=alias, modifies=modifies or (), subgraphs=subgraphs)
    names = names or [f"{kind}_out"] * len(specs)
    g._add_op(op, specs, names)
    return op.outputs


def _check_modifiable(t, kind):
    if isinstance(t, Constant):
        raise NotImplementedError(f"{kind}: in-place modification of constant {t.id} is not "
                                  "supported by the emulator")


def ir_error(msg):
    """Args: msg: message. Returns: a PopartError (IR error raised at op creation)."""
    return PopartError(msg)

FLOPS = {}  # kind -> fn(op) -> FLOPs of one execution (static)
#: kind -> fn(op): raises PopartError for what PopART accepts when the op is created but the
#: Session's compilation (Poplar lowering) rejects, or leaves unspecified.
COMPILE_CHECKS = {}
PREPARE = {}  # runtime kind -> fn(op, plan_of) -> static step data (built at Session compile)
