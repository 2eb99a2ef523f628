"""Host IO ops: host_load, host_store (runtime ops; the Session owns the stream buffers)."""
from ..context import gcg
from ..ir import DeviceToHostStream, HostToDeviceStream, check_in_graph
from ..registry import PREPARE, emit, register


def _load_rule(stream):
    return [(stream.shape, stream.dtype)]


def _load(rt, stream, args):
    return [rt.load(stream)]


def _store_rule(t, stream):
    return []


def _store(rt, stream, args):
    rt.store(stream, args[0])
    return []


register("host_load", _load_rule, _load, runtime=True)
register("host_store", _store_rule, _store, runtime=True)
PREPARE["host_load"] = PREPARE["host_store"] = lambda op, plan_of: op.attrs["stream"]


def _check_stream(stream, cls, what):
    if not isinstance(stream, cls):
        raise TypeError(f"{what}: expected a {cls.__name__}, got {stream!r}")
    if stream._ir is not gcg().ir:
        raise ValueError(f"{what}: stream {stream.tensor_id} belongs to another Ir")


def host_load(h2d_stream, name=None):
    """Args: h2d_stream: HostToDeviceStream. name: output name.
    Returns: tensor holding the next entry of the stream's buffer."""
    _check_stream(h2d_stream, HostToDeviceStream, "host_load")
    out = emit("host_load", {}, {"stream": h2d_stream},
               names=[name or h2d_stream.tensor_id.split("__s")[0] + "_hostload"])[0]
    h2d_stream._used = True
    return out


def host_store(d2h_stream, t):
    """Args: d2h_stream: DeviceToHostStream. t: tensor of the stream's dtype and shape."""
    check_in_graph(gcg(), t=t)
    _check_stream(d2h_stream, DeviceToHostStream, "host_store")
    if d2h_stream.dtype != t.dtype:
        raise ValueError(f"dtype of stream {d2h_stream.tensor_id} `{d2h_stream.dtype}` does not "
                         f"match dtype of provided tensor `{t.dtype}`")
    if d2h_stream.shape != t.shape:
        raise ValueError(f"shape of stream {d2h_stream.tensor_id} `{d2h_stream.shape}` does not "
                         f"match shape of provided tensor `{t.shape}`")
    emit("host_store", {"t": t}, {"stream": d2h_stream})
    d2h_stream._used = True
