"""Exp4c: QMoE CPU with gpt-oss clamped SwiGLU (alpha, beta, swiglu_limit) and fc1/fc2 biases; other activations; sparse mixer."""
import numpy as np
from common import *
rng = np.random.default_rng(5)
T, H, I, E, K = 6, 64, 32, 4, 2
x = (rng.standard_normal((T, H)) * 3).astype(np.float32)
logits = rng.standard_normal((T, E)).astype(np.float32)
blk = 32
q1 = rng.integers(0, 16, (E, 2 * I, H)).astype(np.uint8); s1 = (rng.random((E, 2 * I, H // blk)) * 0.1 + 0.05).astype(np.float32)
q2 = rng.integers(0, 16, (E, H, I)).astype(np.uint8); s2 = (rng.random((E, H, I // blk)) * 0.02 + 0.01).astype(np.float32)
W1 = (q1.astype(np.float32) - 8) * np.repeat(s1, blk, -1); W2 = (q2.astype(np.float32) - 8) * np.repeat(s2, blk, -1)
b1 = rng.standard_normal((E, 2 * I)).astype(np.float32); b2 = rng.standard_normal((E, H)).astype(np.float32)
pk = lambda q: (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
def gptoss(e, t, alpha=1.702, limit=7.0):
    gu = W1[e] @ t + b1[e]; g = np.minimum(gu[0::2], limit); u = np.clip(gu[1::2], -limit, limit)
    return W2[e] @ ((u + 1) * g * sigmoid(alpha * g)) + b2[e]
print(f"(gate pre-activation max {max((W1[e] @ x[t])[0::2].max() for e in range(E) for t in range(T)):.1f} -> limit 7 clamps)")
A = dict(k=K, activation_type='swiglu', swiglu_fusion=1, normalize_routing_weights=1, expert_weight_bits=4, block_size=blk,
         weights_prepacked=0, activation_alpha=1.702, activation_beta=1.0, swiglu_limit=7.0)
ins = [('input', x), ('router_probs', logits), ('fc1', pk(q1)), ('fc1_scales', s1), ('fc1_bias', b1), ('fc2', pk(q2)), ('fc2_scales', s2), ('fc2_bias', b2)]
y, e = try_run('QMoE', ins, A)
ref = moe_ref(x, softmax(logits), K, gptoss, True)
print("gpt-oss QMoE int4 block32 + biases + alpha/beta/limit:", e if e else f"maxerr={err(y, ref):.2e} rel={err(y, ref)/np.abs(ref).max():.1e}")
print("== other activations in QMoE (fc1 [E,I,H]) ==")
for act, f in [('silu', silu), ('relu', lambda v: np.maximum(v, 0)), ('identity', lambda v: v), ('gelu', lambda v: 0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v ** 3))))]:
    y, e = try_run('QMoE', [('input', x), ('router_probs', logits), ('fc1', pk(q1[:, :I])), ('fc1_scales', s1[:, :I]), ('', None), ('fc2', pk(q2)), ('fc2_scales', s2)],
                   dict(k=K, activation_type=act, normalize_routing_weights=1, expert_weight_bits=4, block_size=blk, weights_prepacked=0))
    print(f"  {act}:", e if e else f"maxerr={err(y, moe_ref(x, softmax(logits), K, lambda e_, t: W2[e_] @ f(W1[e_, :I] @ t), True)) / 1:.2e}")
print("== QMoE swiglu_fusion 0/2, use_sparse_mixer on CPU ==")
for desc, a in [('swiglu_fusion=2', dict(swiglu_fusion=2)), ('swiglu_fusion=0', dict(swiglu_fusion=0)), ('use_sparse_mixer=1', dict(use_sparse_mixer=1)),
                ('swiglu_limit_after_activation=1', dict(swiglu_limit_after_activation=1))]:
    aa = dict(A); aa.update(a)
    y, e = try_run('QMoE', ins, aa)
    print(f"  {desc}:", e if e else f"runs; err vs interleaved/softmax-topk-renorm ref={err(y, ref):.2e}")
