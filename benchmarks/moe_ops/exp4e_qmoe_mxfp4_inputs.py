"""Exp4e: same as exp4d but e8m0 scales fed as graph inputs (OrtValue with onnx element type) instead of initializers."""
import numpy as np, onnxruntime as ort
from onnx import helper, TensorProto
import exp4d_qmoe_mxfp4 as d
print("ortvalue_from_numpy_with_onnx_type:", hasattr(ort.OrtValue, 'ortvalue_from_numpy_with_onnx_type'))
E, H, I, T, K = d.E, d.H, d.I, d.T, d.K
ins = ['x', 'r', 'fc1', 'fc1_s', 'fc1_b', 'fc2', 'fc2_s', 'fc2_b', '', '', '', '', '', '', '', 'g1', 'g2']
vis = [helper.make_tensor_value_info('x', TensorProto.FLOAT, [T, H]), helper.make_tensor_value_info('r', TensorProto.FLOAT, [T, E]),
       helper.make_tensor_value_info('fc1_s', TensorProto.FLOAT8E8M0, list(d.gs.shape)), helper.make_tensor_value_info('fc2_s', TensorProto.FLOAT8E8M0, list(d.ds.shape))]
inits = [d.init('fc1', d.gb.reshape(E, 2 * I, H // 2), TensorProto.UINT8), d.init('fc1_b', d.b1, TensorProto.FLOAT),
         d.init('fc2', d.db.reshape(E, H, I // 2), TensorProto.UINT8), d.init('fc2_b', d.b2, TensorProto.FLOAT),
         d.init('g1', np.ones(E, np.float32), TensorProto.FLOAT), d.init('g2', np.ones(E, np.float32), TensorProto.FLOAT)]
node = helper.make_node('QMoE', ins, ['y'], domain='com.microsoft', k=K, activation_type='swiglu', swiglu_fusion=1, normalize_routing_weights=1,
                        activation_alpha=1.702, activation_beta=1.0, swiglu_limit=7.0, quant_type='fp4', expert_weight_bits=4)
g = helper.make_graph([node], 'g', vis, [helper.make_tensor_value_info('y', TensorProto.FLOAT, None)], inits)
m = helper.make_model(g, opset_imports=[helper.make_opsetid('', 21), helper.make_opsetid('com.microsoft', 1)]); m.ir_version = 11
so = ort.SessionOptions(); so.log_severity_level = 4; so.intra_op_num_threads = 1
try:
    s = ort.InferenceSession(m.SerializeToString(), so, providers=['CPUExecutionProvider'])
    print("session created")
    feeds = {'x': d.x, 'r': d.logits,
             'fc1_s': ort.OrtValue.ortvalue_from_numpy_with_onnx_type(d.gs, TensorProto.FLOAT8E8M0),
             'fc2_s': ort.OrtValue.ortvalue_from_numpy_with_onnx_type(d.ds, TensorProto.FLOAT8E8M0)}
    y = s.run_with_ort_values(['y'], {k: (v if isinstance(v, ort.OrtValue) else ort.OrtValue.ortvalue_from_numpy(v)) for k, v in feeds.items()})[0].numpy()
    print(f"runs: maxerr vs dequant ref={d.err(y, d.ref):.2e} (|ref|max={np.abs(d.ref).max():.2f})")
except Exception as e:
    print("FAIL", str(e).split('\n')[0][:400])
