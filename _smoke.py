import sys, numpy as np
sys.path.insert(0, "tests/addons"); sys.path.insert(0, "/work/popxl-addons")
from standins import install_standins; install_standins()
from popxl_flash import emulator; emulator.install()
import popxl, popxl_addons as addons
from popxl import ops
import popxl_flash as pf
from popxl_flash.addons import FlashAttention, SelfAttention
G, L, D = 2, 8, 4
rng = np.random.default_rng(0)
q, k, v, do = (rng.standard_normal((G, L, D)).astype(np.float32) for _ in range(4))
ir = popxl.Ir()
with ir.main_graph:
    ts = [popxl.variable(a) for a in (q, k, v)]
    dot = popxl.variable(do)
    facts, graph = FlashAttention(num_chunks_q=2, num_chunks_kv=2).create_graph(*[t.spec for t in ts])
    print("cgi", len(graph.called_graphs_grad_info))
    dgraph = graph.autodiff()
    info = graph.bind(facts.init()).call_with_info(*ts)
    grads = dgraph.call(dot, args=dgraph.grad_graph_info.inputs_dict(info))
    outs = [info.outputs[0], *grads]
    streams = []
    for t in outs:
        s = popxl.d2h_stream(t.shape, t.dtype); ops.host_store(s, t); streams.append(s)
with popxl.Session(ir, "ipu_model") as sess:
    r = sess.run()
res = [r[s] for s in streams]
ref = pf.reference.attention(q, k, v, causal=True)[0]
refg = pf.reference.attention_grad(do, q, k, v, causal=True)
print(np.abs(res[0]-ref).max(), [float(np.abs(a-b).max()) for a, b in zip(res[1:], refg)])
