"""Exp4b: QMoE CPU routing semantics (normalize_routing_weights 0/1, softmax?) and the router_weights input."""
import numpy as np
from common import *
rng = np.random.default_rng(4)
T, H, I, E, K = 6, 32, 32, 4, 2
x = rng.standard_normal((T, H)).astype(np.float32)
logits = rng.standard_normal((T, E)).astype(np.float32)
bits = 8
q1 = rng.integers(0, 256, (E, 2 * I, H)).astype(np.uint8); s1 = np.full((E, 2 * I), 0.002, np.float32)
q2 = rng.integers(0, 256, (E, H, I)).astype(np.uint8); s2 = np.full((E, H), 0.002, np.float32)
W1 = (q1.astype(np.float32) - 128) * s1[..., None]; W2 = (q2.astype(np.float32) - 128) * s2[..., None]
def ex(e, t):
    gu = W1[e] @ t; return W2[e] @ (silu(gu[0::2]) * gu[1::2])
P = softmax(logits)
def q(norm, probs, rw=None, k=K):
    a = dict(k=k, activation_type='swiglu', swiglu_fusion=1, normalize_routing_weights=norm, expert_weight_bits=8, weights_prepacked=0)
    ins = [('input', x), ('router_probs', probs), ('fc1', q1), ('fc1_scales', s1), ('', None), ('fc2', q2), ('fc2_scales', s2)]
    if rw is not None: ins += [('', None)] * 7 + [('router_weights', rw)]
    return try_run('QMoE', ins, a)
cands = {
  'softmax(all) top-k, no renorm': lambda p, kk: moe_ref(x, softmax(p), kk, ex, False),
  'softmax(all) top-k, renorm':    lambda p, kk: moe_ref(x, softmax(p), kk, ex, True),
  'raw probs top-k as weights':    lambda p, kk: moe_ref(x, p, kk, ex, False),
  'raw probs top-k, renorm by sum':lambda p, kk: moe_ref(x, p, kk, ex, True),
}
for src, p in [('logits', logits), ('softmax(logits)', P)]:
    for norm in (0, 1):
        for kk in (1, 2):
            y, e = q(norm, p, k=kk)
            if e: print(f"router_probs={src} norm={norm} k={kk}: FAIL {e}"); continue
            best = sorted((err(y, f(p, kk)), n) for n, f in cands.items())
            print(f"router_probs={src} norm={norm} k={kk}: best match '{best[0][1]}' err={best[0][0]:.2e} (next {best[1][0]:.2e} '{best[1][1]}')")
print("== router_weights input (index 14) ==")
rw = rng.random((T, E)).astype(np.float32) + 0.1
for norm in (0, 1):
    y, e = q(norm, logits, rw)
    if e: print(f"norm={norm}: FAIL {e}"); continue
    idx, _ = topk(logits, K)
    w = np.take_along_axis(rw, idx, -1)
    c = {'select by logits, mix by raw router_weights': moe_ref(x, logits, K, ex, False, weights_from=rw),
         'select by logits, mix by router_weights renormalized': moe_ref(x, logits, K, ex, True, weights_from=rw),
         'select by logits, mix by softmax(router_weights)': moe_ref(x, logits, K, ex, False, weights_from=softmax(rw)),
         'select by logits, mix by softmax(router_weights) renorm': moe_ref(x, logits, K, ex, True, weights_from=softmax(rw))}
    for n, r in c.items(): print(f"  norm={norm}: vs {n}: {err(y, r):.2e}")
