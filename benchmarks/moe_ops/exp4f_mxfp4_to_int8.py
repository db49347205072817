"""Exp4f: lossless MXFP4 (gpt-oss checkpoint *_blocks/*_scales) -> QMoE int8 block_size=32 (CPU-supported):
code = 128 + 2*fp4_value/ (i.e. value*2 fits int8 exactly), scale = 2^(e-127) / 2. Verified against the fp32 dequant reference."""
import numpy as np
import exp4d_qmoe_mxfp4 as d
from common import try_run, err
LUT2 = (d.LUT * 2).astype(np.int32)           # {0,1,2,3,4,6,8,12} with sign
def mx_to_int8(blocks, scales):
    lo, hi = LUT2[blocks & 15], LUT2[blocks >> 4]
    v = np.empty(blocks.shape[:-1] + (32,), np.int32); v[..., 0::2] = lo; v[..., 1::2] = hi
    q = (v + 128).astype(np.uint8).reshape(*blocks.shape[:-2], -1)               # [E, N, K] uint8 codes, zero point 128 (default)
    s = (np.ldexp(1.0, scales.astype(np.int32) - 127) / 2).astype(np.float32)      # [E, N, K/32]
    return q, s
q1, s1 = mx_to_int8(d.gb, d.gs); q2, s2 = mx_to_int8(d.db, d.ds)
W1 = (q1.astype(np.float32) - 128) * np.repeat(s1, 32, -1)
print("int8 dequant == MXFP4 dequant exactly:", np.array_equal(W1, d.W1), np.array_equal((q2.astype(np.float32) - 128) * np.repeat(s2, 32, -1), d.W2))
A = dict(k=d.K, activation_type='swiglu', swiglu_fusion=1, normalize_routing_weights=1, expert_weight_bits=8, block_size=32, weights_prepacked=0,
         activation_alpha=1.702, activation_beta=1.0, swiglu_limit=7.0)
y, e = try_run('QMoE', [('input', d.x), ('router_probs', d.logits), ('fc1', q1), ('fc1_scales', s1), ('fc1_bias', d.b1), ('fc2', q2), ('fc2_scales', s2), ('fc2_bias', d.b2)], A)
print("QMoE int8 block32 from MXFP4:", e if e else f"maxerr={err(y, d.ref):.2e} (|ref|max={np.abs(d.ref).max():.2f})")
y, e = try_run('QMoE', [('input', d.x), ('router_probs', d.logits), ('fc1', q1), ('fc1_scales', s1), ('fc1_bias', d.b1), ('fc2', q2), ('fc2_scales', s2), ('fc2_bias', d.b2)], A, initializers=True)
print("same, weights as constant initializers (PrePack -> int8 activations for block-wise 8-bit):", e if e else f"maxerr={err(y, d.ref):.2e} rel={err(y, d.ref) / np.abs(d.ref).max():.1e}")
