"""Exp4: QMoE on CPU: 4/8-bit weights, packing (nibble order), scales layout (per-row / block-wise), zero points,
weights_prepacked, routing semantics, router_weights, fp16/bf16 activations."""
import numpy as np
from common import *
rng = np.random.default_rng(3)
T, H, I, E, K = 5, 64, 32, 4, 2   # H, I divisible by 16/32
x = rng.standard_normal((T, H)).astype(np.float32)
logits = rng.standard_normal((T, E)).astype(np.float32)

def quant_rand(N, Kd, bits, block):
    """Random codes q [E,N,Kd], scales [E,N] or [E,N,Kd/block], zero points same grid (as uint codes)."""
    q = rng.integers(0, 2 ** bits, (E, N, Kd)).astype(np.uint8)
    if block: s = ((rng.random((E, N, Kd // block)) * 0.02 + 0.01) / 2 ** (bits - 4)).astype(np.float32); zp = rng.integers(0, 2 ** bits, (E, N, Kd // block)).astype(np.uint8)
    else: s = ((rng.random((E, N)) * 0.02 + 0.01) / 2 ** (bits - 4)).astype(np.float32); zp = rng.integers(0, 2 ** bits, (E, N)).astype(np.uint8)
    return q, s, zp

def dequant(q, s, zp, bits, block):
    zz = np.full(s.shape, 2 ** (bits - 1), np.float32) if zp is None else zp.astype(np.float32)
    if block:
        return (q.astype(np.float32) - np.repeat(zz, block, -1)) * np.repeat(s, block, -1)
    return (q.astype(np.float32) - zz[..., None]) * s[..., None]

def pack(q, bits, low_first=True):
    if bits == 8: return q.copy()
    lo, hi = q[..., 0::2], q[..., 1::2]
    return (lo | (hi << 4)).astype(np.uint8) if low_first else (hi | (lo << 4)).astype(np.uint8)

def pack_zp(zp, bits, block, low_first=True):
    if bits == 8: return zp.copy()
    if zp.shape[-1] % 2: zp = np.concatenate([zp, np.zeros(zp.shape[:-1] + (1,), np.uint8)], -1)
    return pack(zp, bits, low_first)

def case(bits, block, use_zp, low_first=True, prepacked=0, norm=1, dtype=np.float32, verbose=True, extra=None):
    q1, s1, z1 = quant_rand(2 * I, H, bits, block)     # fc1 [E, 2I, H] interleaved gate/up rows
    q2, s2, z2 = quant_rand(H, I, bits, block)         # fc2 [E, H, I]
    W1 = dequant(q1, s1, z1 if use_zp else None, bits, block); W2 = dequant(q2, s2, z2 if use_zp else None, bits, block)
    def ex(e, t):
        gu = W1[e] @ t; return W2[e] @ (silu(gu[0::2]) * gu[1::2])
    ref = moe_ref(x, softmax(logits), K, ex, bool(norm))
    a = dict(k=K, activation_type='swiglu', swiglu_fusion=1, normalize_routing_weights=norm, expert_weight_bits=bits)
    if block: a['block_size'] = block
    if prepacked is not None: a['weights_prepacked'] = prepacked
    if extra: a.update(extra)
    inputs = [('input', x.astype(dtype)), ('router_probs', logits.astype(dtype)), ('fc1', pack(q1, bits, low_first)), ('fc1_scales', s1.astype(dtype)), ('', None),
              ('fc2', pack(q2, bits, low_first)), ('fc2_scales', s2.astype(dtype)), ('', None), ('', None), ('', None), ('', None),
              ('fc1_zp', pack_zp(z1, bits, block, low_first) if use_zp else None), ('fc2_zp', pack_zp(z2, bits, block, low_first) if use_zp else None)]
    y, e = try_run('QMoE', inputs, a, out_dtype=dtype)
    desc = f"bits={bits} block={block} zp={'yes' if use_zp else 'no(default 2^(b-1))'} nibble={'low-first' if low_first else 'high-first'} weights_prepacked={prepacked} norm={norm} dtype={np.dtype(dtype).name}"
    if e: print(f"  {desc}: FAIL {e}")
    else: print(f"  {desc}: maxerr={err(y, ref):.2e} rel={err(y, ref) / np.abs(ref).max():.1e}" + ("  <-- MISMATCH" if err(y, ref) / np.abs(ref).max() > 5e-3 else ""))
    return y, ref

print("== packing / layout ==")
for bits in (8, 4):
    for block in (0, 16):
        for use_zp in (False, True):
            case(bits, block, use_zp)
print("== nibble order (4-bit): high-first should be wrong ==")
case(4, 0, False, low_first=False); case(4, 16, True, low_first=False)
print("== weights_prepacked = -1 (default) / 1 / attribute omitted ==")
for pp in (-1, 1, None):
    case(4, 0, False, prepacked=pp); case(8, 16, True, prepacked=pp)
print("== routing: normalize_routing_weights=0 (reference = NO renorm; exp4b shows QMoE renormalizes anyway) ==")
case(8, 0, False, norm=0); case(4, 16, False, norm=0)
print("== activations: float16 / bfloat16 not tested here (numpy); float16 ==")
case(4, 16, False, dtype=np.float16); case(8, 0, True, dtype=np.float16)
print("== block_size 32 with weights_prepacked 0 / 1 ==")
for pp in (0, 1):
    case(4, 32, False, prepacked=pp); case(4, 32, True, prepacked=pp); case(8, 32, True, prepacked=pp)
print("== block_size 64 (I=32 not divisible by 64) and block_size 8: session/run outcome only ==")
for blk in (64, 8):
    q1 = rng.integers(0, 255, (E, 2 * I, H // 2), dtype=np.uint8); q2 = rng.integers(0, 255, (E, H, I // 2), dtype=np.uint8)
    s1 = np.full((E, 2 * I, max(H // blk, 1)), 0.01, np.float32); s2 = np.full((E, H, max(I // blk, 1)), 0.01, np.float32)
    y, e = try_run('QMoE', [('input', x), ('router_probs', logits), ('fc1', q1), ('fc1_scales', s1), ('', None), ('fc2', q2), ('fc2_scales', s2)],
                   dict(k=K, activation_type='swiglu', swiglu_fusion=1, expert_weight_bits=4, block_size=blk, weights_prepacked=0))
    print(f"  block_size={blk}:", e if e else "runs")
print("== accuracy_level=4 (int8 activations for 4-bit block-wise) ==")
case(4, 32, False, extra=dict(accuracy_level=4)); case(4, 16, False, extra=dict(accuracy_level=4))
