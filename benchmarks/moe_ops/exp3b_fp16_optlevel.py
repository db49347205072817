"""Exp3b: does fp16 MoE on CPU still run (via inserted Casts) with graph optimizations disabled?  And bf16?"""
import numpy as np, onnxruntime as ort
from common import build
ort.set_default_logger_severity(4)
rng = np.random.default_rng(0); T, H, I, E = 4, 16, 8, 4
x = rng.standard_normal((T, H)).astype(np.float16); r = rng.standard_normal((T, E)).astype(np.float16)
w1 = (rng.standard_normal((E, 2 * I, H)) * .3).astype(np.float16); w2 = (rng.standard_normal((E, H, I)) * .3).astype(np.float16)
m, feeds = build('MoE', [('input', x), ('router_probs', r), ('fc1', w1), ('', None), ('fc2', w2)], dict(k=2, activation_type='swiglu', swiglu_fusion=1), np.float16)
for lvl in (ort.GraphOptimizationLevel.ORT_DISABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_ALL):
    so = ort.SessionOptions(); so.graph_optimization_level = lvl; so.log_severity_level = 4
    try:
        y = ort.InferenceSession(m.SerializeToString(), so, providers=['CPUExecutionProvider']).run(None, feeds)[0]
        print(lvl, "fp16 MoE runs, out dtype", y.dtype)
    except Exception as e: print(lvl, "FAIL", str(e)[:200])
