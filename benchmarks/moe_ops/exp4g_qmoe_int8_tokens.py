"""Exp4g: QMoE CPU accuracy vs bits / block / accuracy_level / token count, with weights fed as graph inputs vs as constant
initializers (initializers enable PrePack, which for block-wise 8-bit uses int8-activation kernels)."""
import numpy as np
from common import *
from moe_export_ref import quantize
rng = np.random.default_rng(7)
H, I, E, K = 64, 64, 8, 2
W1 = (rng.standard_normal((E, 2 * I, H)) * 0.15).astype(np.float32); W2 = (rng.standard_normal((E, H, I)) * 0.15).astype(np.float32)
for (bits, block, acc), const in [(c, i) for i in (False, True) for c in [(8, 32, 0), (8, 0, 0), (4, 32, 0), (4, 32, 4), (4, 0, 0), (4, 64, 0), (8, 64, 0), (4, 16, 0), (8, 16, 0), (8, 0, 4)]]:
    if block:
        q1, s1, d1 = quantize(W1, bits, block); q2, s2, d2 = quantize(W2, bits, block)
    else:  # per-row (column-wise in ORT terms): scales [E, N]
        q1, s1, d1 = quantize(W1, bits, H); q2, s2, d2 = quantize(W2, bits, I); s1, s2 = s1[..., 0], s2[..., 0]
    line = []
    for T in (1, 4, 8, 9, 16, 64):
        x = rng.standard_normal((T, H)).astype(np.float32); logits = rng.standard_normal((T, E)).astype(np.float32)
        ex = lambda e, t: d2[e] @ (silu((d1[e] @ t)[0::2]) * (d1[e] @ t)[1::2])
        ref = moe_ref(x, softmax(logits), K, ex, True)
        a = dict(k=K, activation_type='swiglu', swiglu_fusion=1, normalize_routing_weights=1, expert_weight_bits=bits, weights_prepacked=0, accuracy_level=acc)
        if block: a['block_size'] = block
        y, e = try_run('QMoE', [('input', x), ('router_probs', logits), ('fc1', q1), ('fc1_scales', s1), ('', None), ('fc2', q2), ('fc2_scales', s2)], a, initializers=const)
        line.append(f"T={T}: " + ("FAIL" if e else f"{err(y, ref) / np.abs(ref).max():.0e}"))
    print(f"weights={'initializers' if const else 'graph inputs'} bits={bits} block={block or 'none(per-row)'} accuracy_level={acc}: rel err " + ", ".join(line))
