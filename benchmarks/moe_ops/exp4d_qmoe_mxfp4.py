"""Exp4d: QMoE quant_type='fp4' (MXFP4, e8m0 block-32 scales) on CPU, fed in gpt-oss checkpoint layout
(*_blocks [E,N,K/32,16] uint8 low-nibble-first, *_scales [E,N,K/32] uint8 e8m0 biased by 127)."""
import numpy as np, onnx, onnxruntime as ort
from onnx import helper, TensorProto
from common import softmax, sigmoid, moe_ref, err
rng = np.random.default_rng(6)
T, H, I, E, K = 6, 64, 32, 4, 2
LUT = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)
def rand_mx(N, Kd):
    blocks = rng.integers(0, 256, (E, N, Kd // 32, 16)).astype(np.uint8)
    scales = rng.integers(122, 126, (E, N, Kd // 32)).astype(np.uint8)      # 2^-5..2^-2
    return blocks, scales
def deq(blocks, scales, low_first=True):      # == transformers integrations/mxfp4.py _convert_moe_packed_tensors before its final transpose
    lo, hi = LUT[blocks & 15], LUT[blocks >> 4]
    v = np.empty(blocks.shape[:-1] + (32,), np.float32)
    v[..., 0::2], v[..., 1::2] = (lo, hi) if low_first else (hi, lo)
    v = v * np.ldexp(1.0, scales.astype(np.int32) - 127)[..., None]
    return v.reshape(*blocks.shape[:-2], -1)          # [E, N, K]
gb, gs = rand_mx(2 * I, H); db, ds = rand_mx(H, I)
W1, W2 = deq(gb, gs), deq(db, ds)
b1 = rng.standard_normal((E, 2 * I)).astype(np.float32); b2 = rng.standard_normal((E, H)).astype(np.float32)
x = rng.standard_normal((T, H)).astype(np.float32); logits = rng.standard_normal((T, E)).astype(np.float32)
def ex(e, t, limit=7.0, alpha=1.702):
    gu = W1[e] @ t + b1[e]; g = np.minimum(gu[0::2], limit); u = np.clip(gu[1::2], -limit, limit)
    return W2[e] @ ((u + 1) * g * sigmoid(alpha * g)) + b2[e]
ref = moe_ref(x, softmax(logits), K, ex, True)
def init(name, arr, tp):
    return helper.make_tensor(name, tp, arr.shape, arr.tobytes(), raw=True)
def run(quant_attrs, scale_tp=TensorProto.FLOAT8E8M0, global_scale=True):
    inits = [init('fc1', gb.reshape(E, 2 * I, H // 2), TensorProto.UINT8), init('fc1_s', gs, scale_tp), init('fc1_b', b1, TensorProto.FLOAT),
             init('fc2', db.reshape(E, H, I // 2), TensorProto.UINT8), init('fc2_s', ds, scale_tp), init('fc2_b', b2, TensorProto.FLOAT)]
    ins = ['x', 'r', 'fc1', 'fc1_s', 'fc1_b', 'fc2', 'fc2_s', 'fc2_b', '', '', '', '', '', '', '']
    if global_scale:
        inits += [init('g1', np.ones(E, np.float32), TensorProto.FLOAT), init('g2', np.ones(E, np.float32), TensorProto.FLOAT)]
        ins += ['g1', 'g2']
    while ins[-1] == '': ins.pop()
    node = helper.make_node('QMoE', ins, ['y'], domain='com.microsoft', k=K, activation_type='swiglu', swiglu_fusion=1,
                            normalize_routing_weights=1, activation_alpha=1.702, activation_beta=1.0, swiglu_limit=7.0, **quant_attrs)
    g = helper.make_graph([node], 'g', [helper.make_tensor_value_info('x', TensorProto.FLOAT, [T, H]), helper.make_tensor_value_info('r', TensorProto.FLOAT, [T, E])],
                          [helper.make_tensor_value_info('y', TensorProto.FLOAT, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid('', 21), helper.make_opsetid('com.microsoft', 1)]); m.ir_version = 11
    so = ort.SessionOptions(); so.log_severity_level = 4; so.intra_op_num_threads = 1
    try:
        s = ort.InferenceSession(m.SerializeToString(), so, providers=['CPUExecutionProvider'])
        return s.run(None, {'x': x, 'r': logits})[0], None
    except Exception as e:
        return None, str(e).split('\n')[0][:300]
if __name__ == '__main__':
    for desc, qa, kw in [("quant_type=fp4, e8m0 scales, global scales=1", dict(quant_type='fp4', expert_weight_bits=4), {}),
                         ("quant_type=fp4 with weights_prepacked=0", dict(quant_type='fp4', expert_weight_bits=4, weights_prepacked=0), {}),
                         ("quant_type=fp4, no global scales", dict(quant_type='fp4', expert_weight_bits=4), dict(global_scale=False))]:
        y, e = run(qa, **kw)
        if e: print(desc, ": FAIL", e)
        else:
            print(desc, f": maxerr vs low-nibble-first dequant ref={err(y, ref):.2e} (|ref|max={np.abs(ref).max():.2f})")
