import numpy as np, onnx, onnxruntime as ort
from onnx import helper, TensorProto, numpy_helper
ort.set_default_logger_severity(4)   # keep ORT's own error log lines out of the .out files (exceptions are still caught and printed)

NP2TP = {np.float32: TensorProto.FLOAT, np.float16: TensorProto.FLOAT16, np.uint8: TensorProto.UINT8}

def build(op, inputs, attrs, out_dtype=np.float32, initializers=False):
    """inputs: list of (name, ndarray or None). None -> empty optional input ''.
    initializers=False: all non-None inputs become graph inputs (fed at run time).
    initializers=True: everything except the first two (input, router_probs) becomes a constant initializer
    (as in a real export; this enables the kernels' PrePack paths)."""
    names, vis, feeds, inits = [], [], {}, []
    for j, (n, a) in enumerate(inputs):
        if a is None:
            names.append(''); continue
        names.append(n)
        if initializers and j >= 2:
            inits.append(numpy_helper.from_array(a, n)); continue
        vis.append(helper.make_tensor_value_info(n, NP2TP[a.dtype.type], list(a.shape)))
        feeds[n] = a
    # strip trailing empty names
    while names and names[-1] == '': names.pop()
    node = helper.make_node(op, names, ['out'], domain='com.microsoft', **attrs)
    out = helper.make_tensor_value_info('out', NP2TP[np.dtype(out_dtype).type], None)
    g = helper.make_graph([node], 'g', vis, [out], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid('', 21), helper.make_opsetid('com.microsoft', 1)])
    m.ir_version = 10
    return m, feeds

def run(op, inputs, attrs, out_dtype=np.float32, initializers=False):
    m, feeds = build(op, inputs, attrs, out_dtype, initializers)
    so = ort.SessionOptions(); so.intra_op_num_threads = 1; so.inter_op_num_threads = 1
    so.log_severity_level = 4
    s = ort.InferenceSession(m.SerializeToString(), so, providers=['CPUExecutionProvider'])
    return s.run(None, feeds)[0]

def try_run(op, inputs, attrs, out_dtype=np.float32, initializers=False):
    try:
        return run(op, inputs, attrs, out_dtype, initializers), None
    except Exception as e:
        return None, (type(e).__name__ + ': ' + str(e).split('\n')[0][:400])

def softmax(x, axis=-1):
    x = x - x.max(axis=axis, keepdims=True); e = np.exp(x); return e / e.sum(axis=axis, keepdims=True)
def sigmoid(x): return 1 / (1 + np.exp(-x))
def silu(x): return x * sigmoid(x)

def topk(p, k):
    idx = np.argsort(-p, axis=-1, kind='stable')[:, :k]
    return idx, np.take_along_axis(p, idx, -1)

def moe_ref(x, probs, k, expert_fn, normalize=False, weights_from=None):
    """Reference: top-k selection on probs, mixing weights = probs values at selected (or weights_from),
    optionally renormalized to sum 1."""
    T = x.shape[0]
    idx, w = topk(probs, k)
    if weights_from is not None: w = np.take_along_axis(weights_from, idx, -1)
    if normalize: w = w / w.sum(-1, keepdims=True)
    y = np.zeros_like(x, dtype=np.float64)
    for t in range(T):
        for j in range(k):
            y[t] += w[t, j] * expert_fn(idx[t, j], x[t])
    return y

def err(a, b): return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
