"""Exp1b: does MoE CPU also accept the legacy transposed layout fc1 [E,H,2I] + fc2 [E,I,H] (detected by shape)?"""
import numpy as np
from common import *
rng = np.random.default_rng(0)
T, H, I, E, K = 6, 16, 6, 4, 2
x = rng.standard_normal((T, H)).astype(np.float32)
logits = rng.standard_normal((T, E)).astype(np.float32)
Wg = (rng.standard_normal((E, I, H)) * 0.3).astype(np.float32); Wu = (rng.standard_normal((E, I, H)) * 0.3).astype(np.float32)
Wd = (rng.standard_normal((E, H, I)) * 0.3).astype(np.float32)
inter = np.empty((E, 2 * I, H), np.float32); inter[:, 0::2] = Wg; inter[:, 1::2] = Wu
def ex(e, xt):
    g = Wg[e] @ xt; u = Wu[e] @ xt; return Wd[e] @ (silu(g) * u)
ref = moe_ref(x, softmax(logits), K, ex, True)
A = dict(k=K, activation_type='swiglu', swiglu_fusion=1, normalize_routing_weights=1)
y, e = try_run('MoE', [('input', x), ('router_probs', logits), ('fc1', np.ascontiguousarray(inter.transpose(0, 2, 1))), ('', None),
                       ('fc2', np.ascontiguousarray(Wd.transpose(0, 2, 1)))], A)
print("fc1 [E,H,2I] + fc2 [E,I,H] (both transposed):", e if e else f"runs; maxerr vs ref={err(y, ref):.2e}")
y, e = try_run('MoE', [('input', x), ('router_probs', logits), ('fc1', inter), ('', None), ('fc2', Wd)], A)
print("fc1 [E,2I,H] + fc2 [E,H,I] (schema layout):", e if e else f"runs; maxerr vs ref={err(y, ref):.2e}")
