"""Exp1: MoE float32 CPU: fc1 layout for swiglu_fusion=1/2/0, x@W^T, routing semantics, normalize_routing_weights."""
import numpy as np
from common import *
rng = np.random.default_rng(0)
T, H, I, E, K = 6, 16, 6, 4, 2   # I != H/2 so transposed layouts have a different shape
x = rng.standard_normal((T, H)).astype(np.float32)
logits = rng.standard_normal((T, E)).astype(np.float32)
Wg = (rng.standard_normal((E, I, H)) * 0.3).astype(np.float32)   # gate  [E, I, H] (nn.Linear layout out x in)
Wu = (rng.standard_normal((E, I, H)) * 0.3).astype(np.float32)   # up
Wd = (rng.standard_normal((E, H, I)) * 0.3).astype(np.float32)   # down

def swiglu_expert(e, xt, alpha=1.0, beta=0.0, limit=None, bg=None, bu=None, bd=None):
    g = Wg[e] @ xt + (0 if bg is None else bg[e]); u = Wu[e] @ xt + (0 if bu is None else bu[e])
    if limit is not None: g = np.minimum(g, limit); u = np.clip(u, -limit, limit)
    h = g * sigmoid(alpha * g) * (u + beta)
    return Wd[e] @ h + (0 if bd is None else bd[e])

inter = np.empty((E, 2 * I, H), np.float32); inter[:, 0::2] = Wg; inter[:, 1::2] = Wu
inter_swapped = np.empty_like(inter); inter_swapped[:, 0::2] = Wu; inter_swapped[:, 1::2] = Wg
concat = np.concatenate([Wg, Wu], 1)

probs_sm = softmax(logits)
print("== routing semantics, swiglu_fusion=1 interleaved, router_probs = softmax(logits) ==")
for norm in (0, 1):
    y = run('MoE', [('input', x), ('router_probs', probs_sm), ('fc1', inter), ('', None), ('fc2', Wd)],
            dict(k=K, activation_type='swiglu', swiglu_fusion=1, normalize_routing_weights=norm))
    for name, ref in [('raw probs top-k (no renorm)', moe_ref(x, probs_sm, K, swiglu_expert, False)),
                      ('probs top-k renormalized', moe_ref(x, probs_sm, K, swiglu_expert, True)),
                      ('softmax(probs) top-k (no renorm)', moe_ref(x, softmax(probs_sm), K, swiglu_expert, False))]:
        print(f"  normalize_routing_weights={norm}: vs {name}: maxerr={err(y, ref):.2e}")

print("== router_probs = raw logits (NOT softmaxed) ==")
for norm in (0, 1):
    y = run('MoE', [('input', x), ('router_probs', logits), ('fc1', inter), ('', None), ('fc2', Wd)],
            dict(k=K, activation_type='swiglu', swiglu_fusion=1, normalize_routing_weights=norm))
    for name, ref in [('softmax(all logits) then top-k, no renorm', moe_ref(x, probs_sm, K, swiglu_expert, False)),
                      ('top-k logits then softmax over k (=renorm)', moe_ref(x, probs_sm, K, swiglu_expert, True)),
                      ('raw logits as weights', moe_ref(x, logits, K, swiglu_expert, False)),
                      ('raw logits renorm by sum', moe_ref(x, logits, K, swiglu_expert, True))]:
        print(f"  normalize_routing_weights={norm}: vs {name}: maxerr={err(y, ref):.2e}")

print("== fc1 layout for swiglu_fusion=1 (router_probs = logits, norm=1) ==")
ref = moe_ref(x, probs_sm, K, swiglu_expert, True)
for lname, w in [('interleaved gate even/up odd', inter), ('interleaved up even/gate odd', inter_swapped), ('concat [gate|up]', concat)]:
    y = run('MoE', [('input', x), ('router_probs', logits), ('fc1', w), ('', None), ('fc2', Wd)],
            dict(k=K, activation_type='swiglu', swiglu_fusion=1, normalize_routing_weights=1))
    print(f"  fc1={lname}: maxerr={err(y, ref):.2e}")
print("  fc2 transposed [E,I,H]:", try_run('MoE', [('input', x), ('router_probs', logits), ('fc1', inter), ('', None), ('fc2', np.ascontiguousarray(Wd.transpose(0,2,1)))],
            dict(k=K, activation_type='swiglu', swiglu_fusion=1, normalize_routing_weights=1))[1])
print("  fc1 transposed [E,H,2I] (interleaved, transposed):", try_run('MoE', [('input', x), ('router_probs', logits), ('fc1', np.ascontiguousarray(inter.transpose(0, 2, 1))), ('', None), ('fc2', Wd)],
            dict(k=K, activation_type='swiglu', swiglu_fusion=1, normalize_routing_weights=1))[1])

print("== swiglu_fusion=2 (concat) on CPU ==")
y, e = try_run('MoE', [('input', x), ('router_probs', logits), ('fc1', concat), ('', None), ('fc2', Wd)],
               dict(k=K, activation_type='swiglu', swiglu_fusion=2, normalize_routing_weights=1))
print("  ", e if e else f"maxerr vs concat ref={err(y, ref):.2e}")
print("== swiglu_fusion=0 (fc1=gate, fc3=up) on CPU ==")
y, e = try_run('MoE', [('input', x), ('router_probs', logits), ('fc1', Wg), ('', None), ('fc2', Wd), ('', None), ('fc3', Wu)],
               dict(k=K, activation_type='swiglu', swiglu_fusion=0, normalize_routing_weights=1))
print("  ", e if e else f"maxerr={err(y, ref):.2e}")
print("== 3D input [B,S,H] ==")
y, e = try_run('MoE', [('input', x.reshape(2, 3, H)), ('router_probs', logits), ('fc1', inter), ('', None), ('fc2', Wd)],
               dict(k=K, activation_type='swiglu', swiglu_fusion=1, normalize_routing_weights=1))
print("  ", e if e else f"shape={y.shape} maxerr={err(y.reshape(T, H), ref):.2e}")
print("== k=1 and k=E ==")
for kk in (1, E):
    for nn_ in (0, 1):
        y = run('MoE', [('input', x), ('router_probs', logits), ('fc1', inter), ('', None), ('fc2', Wd)],
                dict(k=kk, activation_type='swiglu', swiglu_fusion=1, normalize_routing_weights=nn_))
        print(f"  k={kk} norm={nn_} vs softmax-all/top-k/renorm={nn_}: {err(y, moe_ref(x, probs_sm, kk, swiglu_expert, bool(nn_))):.2e}")
print("== ties: router logits all equal, k=1 / k=2, norm=1 (which experts win?) ==")
pt = np.zeros((T, E), np.float32)
import itertools
for kk in (1, 2):
    y = run('MoE', [('input', x), ('router_probs', pt), ('fc1', inter), ('', None), ('fc2', Wd)],
            dict(k=kk, activation_type='swiglu', swiglu_fusion=1, normalize_routing_weights=1))
    for sel in itertools.combinations(range(E), kk):
        ref_ = np.stack([sum(swiglu_expert(e_, x[t]) for e_ in sel) / kk for t in range(T)])
        if err(y, ref_) < 1e-5: print(f"  k={kk}: all-equal logits selects experts {sel}")
