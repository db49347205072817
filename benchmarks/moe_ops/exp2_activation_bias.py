"""Exp2: MoE float32 CPU: activation_alpha/beta, swiglu_limit (gpt-oss clamped SwiGLU), fc1/fc2 biases,
non-gated activations, and which attribute combos fail at session creation."""
import numpy as np
from common import *
rng = np.random.default_rng(1)
T, H, I, E, K = 7, 16, 8, 4, 2
x = (rng.standard_normal((T, H)) * 3).astype(np.float32)     # large so the limit clamp matters
logits = rng.standard_normal((T, E)).astype(np.float32)
Wg = (rng.standard_normal((E, I, H)) * 0.8).astype(np.float32); Wu = (rng.standard_normal((E, I, H)) * 0.8).astype(np.float32)
Wd = (rng.standard_normal((E, H, I)) * 0.3).astype(np.float32)
bg = rng.standard_normal((E, I)).astype(np.float32); bu = rng.standard_normal((E, I)).astype(np.float32)
bd = rng.standard_normal((E, H)).astype(np.float32)
inter = np.empty((E, 2 * I, H), np.float32); inter[:, 0::2] = Wg; inter[:, 1::2] = Wu
b1 = np.empty((E, 2 * I), np.float32); b1[:, 0::2] = bg; b1[:, 1::2] = bu
probs = softmax(logits)

def gptoss_expert(e, xt, alpha=1.702, limit=7.0, bias=True):
    g = Wg[e] @ xt + (bg[e] if bias else 0); u = Wu[e] @ xt + (bu[e] if bias else 0)
    g = np.minimum(g, limit); u = np.clip(u, -limit, limit)
    glu = g * sigmoid(g * alpha)
    return Wd[e] @ ((u + 1) * glu) + (bd[e] if bias else 0)

def gen_expert(e, xt, alpha=1.0, beta=0.0, limit=None, bias=False):
    g = Wg[e] @ xt + (bg[e] if bias else 0); u = Wu[e] @ xt + (bu[e] if bias else 0)
    if limit is not None: g = np.minimum(g, limit); u = np.clip(u, -limit, limit)
    return Wd[e] @ (g * sigmoid(alpha * g) * (u + beta)) + (bd[e] if bias else 0)

# how much does clamping matter in this data?
gg = np.einsum('eih,th->tei', Wg, x); print(f"(pre-activation gate max {gg.max():.1f}, so limit=7 clamps; |output| max of the no-limit reference = {np.abs(moe_ref(x, probs, K, lambda e, t: gen_expert(e, t), True)).max():.0f}, so abs errors ~1e-5 are fp32 rounding)")

base = [('input', x), ('router_probs', logits), ('fc1', inter)]
print("== gpt-oss clamped SwiGLU: alpha=1.702, beta=1.0, swiglu_limit=7.0, fc1/fc2 biases, norm=1 ==")
A = dict(k=K, activation_type='swiglu', swiglu_fusion=1, normalize_routing_weights=1, activation_alpha=1.702, activation_beta=1.0, swiglu_limit=7.0)
y = run('MoE', base + [('fc1_bias', b1), ('fc2', Wd), ('fc2_bias', bd)], A)
print(f"  vs gpt-oss reference (with biases): {err(y, moe_ref(x, probs, K, gptoss_expert, True)):.2e}")
print(f"  vs same without limit: {err(y, moe_ref(x, probs, K, lambda e, t: gen_expert(e, t, 1.702, 1.0, None, True), True)):.2e}")
print("== SwiGLU alpha/beta/limit individually (no bias) ==")
for alpha, beta, limit in [(1.0, 0.0, None), (1.702, 0.0, None), (1.0, 1.0, None), (1.0, 0.0, 2.0), (1.702, 1.0, 7.0)]:
    a = dict(k=K, activation_type='swiglu', swiglu_fusion=1, normalize_routing_weights=1, activation_alpha=alpha, activation_beta=beta)
    if limit is not None: a['swiglu_limit'] = limit
    y = run('MoE', base + [('', None), ('fc2', Wd)], a)
    print(f"  alpha={alpha} beta={beta} limit={limit}: err={err(y, moe_ref(x, probs, K, lambda e, t: gen_expert(e, t, alpha, beta, limit), True)):.2e}")
print("== biases: only fc1 bias / only fc2 bias ==")
y = run('MoE', base + [('fc1_bias', b1), ('fc2', Wd)], dict(k=K, activation_type='swiglu', swiglu_fusion=1, normalize_routing_weights=1))
ref = moe_ref(x, probs, K, lambda e, t: Wd[e] @ (silu(Wg[e] @ t + bg[e]) * (Wu[e] @ t + bu[e])), True)
print(f"  fc1 bias interleaved like the weight rows: err={err(y, ref):.2e}")
y = run('MoE', base + [('', None), ('fc2', Wd), ('fc2_bias', bd)], dict(k=K, activation_type='swiglu', swiglu_fusion=1, normalize_routing_weights=1))
ref = moe_ref(x, probs, K, lambda e, t: Wd[e] @ (silu(Wg[e] @ t) * (Wu[e] @ t)) + bd[e], True)
print(f"  fc2 bias added per expert before weighting (weighted by routing weight): err={err(y, ref):.2e}")
print("== non-gated activations, fc1 [E,I,H] ==")
acts = {'relu': lambda v: np.maximum(v, 0), 'silu': silu, 'identity': lambda v: v,
        'gelu': lambda v: 0.5 * v * (1 + np.vectorize(__import__('math').erf)(v / np.sqrt(2)))}
for name, f in acts.items():
    y, e = try_run('MoE', [('input', x), ('router_probs', logits), ('fc1', Wg), ('', None), ('fc2', Wd)], dict(k=K, activation_type=name, normalize_routing_weights=1))
    print(f"  {name}: " + (e if e else f"err={err(y, moe_ref(x, probs, K, lambda e_, t: Wd[e_] @ f(Wg[e_] @ t), True)):.2e}"))
print("== attribute combos at session creation on CPU ==")
for desc, a in [('swiglu_limit_after_activation=1', dict(swiglu_limit_after_activation=1, swiglu_limit=7.0)),
                ('use_sparse_mixer=1 (k=2)', dict(use_sparse_mixer=1)),
                ('activation_type=geglu', dict(activation_type='geglu')),
                ('activation_type=relu2', dict(activation_type='relu2'))]:
    aa = dict(k=K, activation_type='swiglu', swiglu_fusion=1, normalize_routing_weights=1); aa.update(a)
    y, e = try_run('MoE', base + [('', None), ('fc2', Wd)], aa)
    print(f"  {desc}: " + (e if e else "runs"))
print("== float16 MoE on CPU ==")
y, e = try_run('MoE', [('input', x.astype(np.float16)), ('router_probs', logits.astype(np.float16)), ('fc1', inter.astype(np.float16)), ('', None), ('fc2', Wd.astype(np.float16))],
               dict(k=K, activation_type='swiglu', swiglu_fusion=1, normalize_routing_weights=1), out_dtype=np.float16)
print("  fp16:", e if e else "runs")
