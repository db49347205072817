"""Reference implementation (for the design doc) of checkpoint -> com.microsoft::MoE / QMoE for each family.
Pure numpy + onnx.helper; reads the *saved checkpoint* names (what save_pretrained writes / hub checkpoints use)."""
import numpy as np
from onnx import helper, TensorProto, numpy_helper

# ---------------- checkpoint -> per-expert gate/up/down in nn.Linear layout ([out, in]) ----------------
def experts_from_ckpt(fam, sd, pfx, cfg):
    """Returns gate [E,I,H], up [E,I,H], down [E,H,I], optional gate/up bias [E,I] x2, down bias [E,H],
    router weight [E,H], router bias [E] or None.  pfx = 'model.layers.{i}.'"""
    E = cfg.get('num_local_experts', cfg.get('num_experts'))
    st = lambda fmt: np.stack([sd[fmt.format(e)] for e in range(E)])
    if fam in ('mixtral', 'phimoe'):
        m = pfx + 'block_sparse_moe.'
        return dict(gate=st(m + 'experts.{}.w1.weight'), up=st(m + 'experts.{}.w3.weight'), down=st(m + 'experts.{}.w2.weight'),
                    router_w=sd[m + 'gate.weight'])
    if fam in ('qwen2_moe', 'qwen3_moe', 'olmoe'):
        m = pfx + 'mlp.'
        return dict(gate=st(m + 'experts.{}.gate_proj.weight'), up=st(m + 'experts.{}.up_proj.weight'), down=st(m + 'experts.{}.down_proj.weight'),
                    router_w=sd[m + 'gate.weight'])
    if fam == 'granitemoe':
        m = pfx + 'block_sparse_moe.'
        il = sd[m + 'input_linear.weight']; I = il.shape[1] // 2           # [E, 2I, H]: rows [0,I) gate, [I,2I) up
        return dict(gate=il[:, :I], up=il[:, I:], down=sd[m + 'output_linear.weight'], router_w=sd[m + 'router.layer.weight'])
    if fam == 'gpt_oss':
        m = pfx + 'mlp.'
        gu = sd[m + 'experts.gate_up_proj']                                  # [E, H, 2I] (x @ W), columns interleaved g0,u0,g1,u1..
        gub = sd[m + 'experts.gate_up_proj_bias']                            # [E, 2I] interleaved the same way
        return dict(gate=gu[:, :, 0::2].transpose(0, 2, 1), up=gu[:, :, 1::2].transpose(0, 2, 1),
                    down=sd[m + 'experts.down_proj'].transpose(0, 2, 1),     # [E, I, H] -> [E, H, I]
                    gate_b=gub[:, 0::2], up_b=gub[:, 1::2], down_b=sd[m + 'experts.down_proj_bias'],
                    router_w=sd[m + 'router.weight'], router_b=sd[m + 'router.bias'])
    raise ValueError(fam)

def interleave_rows(gate, up):
    """[E,I,H] x2 -> fc1 [E,2I,H] with row 2j = gate_j, row 2j+1 = up_j (what swiglu_fusion=1 expects). Works for biases [E,I] too."""
    out = np.empty(gate.shape[:1] + (2 * gate.shape[1],) + gate.shape[2:], gate.dtype)
    out[:, 0::2] = gate; out[:, 1::2] = up
    return out

# ---------------- blockwise symmetric int quantization in QMoE raw layout (weights_prepacked=0) ----------------
def quantize(w, bits, block):
    """w [E,N,K] float -> (packed uint8 [E,N,K*bits/8], scales [E,N,K/block] (block=None: per-row scales [E,N]), dequantized [E,N,K]).
    Codes are unsigned with implicit zero point 2^(bits-1); 4-bit packs element 2j in the LOW nibble of byte j."""
    E, N, K = w.shape
    if block is None:
        q, s, deq = quantize(w, bits, K)
        return q, s[..., 0].copy(), deq
    qmax = 2 ** (bits - 1) - 1
    wb = w.reshape(E, N, K // block, block)
    s = np.abs(wb).max(-1) / qmax; s[s == 0] = 1.0
    q = np.clip(np.rint(wb / s[..., None]), -qmax - 1, qmax).astype(np.int32) + 2 ** (bits - 1)
    deq = ((q - 2 ** (bits - 1)) * s[..., None]).reshape(E, N, K).astype(np.float32)
    q = q.reshape(E, N, K).astype(np.uint8)
    if bits == 4: q = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    return q, s.astype(np.float32), deq

# ---------------- tiny graph builder ----------------
class G:
    def __init__(self): self.nodes, self.inits, self.n = [], [], 0
    def c(self, arr, name=None):
        self.n += 1; name = name or f'c{self.n}'
        self.inits.append(numpy_helper.from_array(np.asarray(arr), name)); return name
    def op(self, t, ins, domain='', **a):
        self.n += 1; o = f'{t.lower()}_{self.n}'
        self.nodes.append(helper.make_node(t, ins, [o], domain=domain, **a)); return o

def phimoe_sparsemixer(g, S, E, eps):
    """transformers phimoe sparsemixer (eval): returns (sel1, w1, sel2, w2); sel* bool [T,E] one-hot, w* [T,1]."""
    ninf = g.c(np.array(-np.inf, np.float32)); two_eps = g.c(np.array(2 * eps, np.float32))
    ar = g.c(np.arange(E, dtype=np.int64).reshape(1, E)); ax = g.c(np.array([-1], np.int64))
    absS = g.op('Abs', [S])
    def step(Sm):
        m = g.op('ReduceMax', [Sm, ax], keepdims=1)
        i = g.op('ArgMax', [Sm], axis=-1, keepdims=1)
        factor = g.op('Max', [absS, m])                                       # scores.abs().clamp(min=max)
        mask = g.op('Greater', [g.op('Div', [g.op('Sub', [m, S]), factor]), two_eps])
        p = g.op('Softmax', [g.op('Where', [mask, ninf, Sm])], axis=-1)
        return g.op('Equal', [ar, i]), g.op('GatherElements', [p, i], axis=-1)
    sel1, w1 = step(S)
    sel2, w2 = step(g.op('Where', [sel1, ninf, S]))                          # scatter(-inf) at the first choice
    return sel1, w1, sel2, w2

def build_moe_block(fam, sd, cfg, layer=0, quant=None, neg_fill=-np.inf, naive=False, no_limit=False):
    """ONNX model: X [B,S,H] -> MoE block output [B,S,H] (no residual), for decoder layer `layer`.
    quant=None -> float MoE; quant=(bits, block) -> QMoE with blockwise symmetric weights. Returns (model, dequantized experts or None)."""
    pfx = f'model.layers.{layer}.'
    w = experts_from_ckpt(fam, sd, pfx, cfg)
    E, I, H = w['gate'].shape
    k = cfg['num_experts_per_tok']
    g = G()
    X = g.op('Reshape', ['X', g.c(np.array([-1, H], np.int64))])          # token-major [T, H] (MoE also takes 3D, but scales/routers are per token)
    logits = g.op('MatMul', [X, g.c(w['router_w'].T.copy())])
    if 'router_b' in w: logits = g.op('Add', [logits, g.c(w['router_b'])])
    logits2d = logits
    fc1 = interleave_rows(w['gate'], w['up'])
    fc1_b = interleave_rows(w['gate_b'], w['up_b']) if 'gate_b' in w else None
    fc2, fc2_b = w['down'], w.get('down_b')
    attrs = dict(k=k, activation_type='swiglu', swiglu_fusion=1)
    if fam == 'gpt_oss':
        attrs.update(activation_alpha=float(cfg.get('swiglu_alpha', 1.702)), activation_beta=1.0)
        if not no_limit: attrs['swiglu_limit'] = float(cfg['swiglu_limit'])
    # routing
    norm = {'mixtral': 1, 'granitemoe': 1, 'gpt_oss': 1, 'phimoe': 1}.get(fam, int(bool(cfg.get('norm_topk_prob', False))))
    router_probs, router_weights, post_scale = logits2d, None, None
    if naive:   # CONTROL ONLY: feed logits and rely on the op's own softmax/top-k/normalize
        pass
    elif fam == 'phimoe':
        assert k == 2
        sel1, w1, sel2, w2 = phimoe_sparsemixer(g, logits2d, E, cfg.get('router_jitter_noise', 0.01))
        neg = g.c(np.array(neg_fill, np.float32))
        if quant is None:      # MoE: softmax(log w) restricted to the 2 picks and renormalized = w/sum(w); multiply sum(w) back
            router_probs = g.op('Where', [sel1, g.op('Log', [w1]), g.op('Where', [sel2, g.op('Log', [w2]), neg])])
            post_scale = g.op('Add', [w1, w2])
        else:                  # QMoE: select with router_probs, mix with raw router_weights (normalize_routing_weights=0)
            zero = g.c(np.array(0, np.float32))
            router_probs = router_weights = g.op('Where', [sel1, w1, g.op('Where', [sel2, w2, zero])])
            norm = 0
    elif quant is not None and norm == 0:
        router_weights = g.op('Softmax', [logits2d], axis=-1)      # QMoE always renormalizes without router_weights
    attrs['normalize_routing_weights'] = norm
    deq = None
    if quant is None:
        ins = [X, router_probs, g.c(fc1), g.c(fc1_b) if fc1_b is not None else '', g.c(fc2), g.c(fc2_b) if fc2_b is not None else '']
        while ins[-1] == '': ins.pop()
        y = g.op('MoE', ins, domain='com.microsoft', **attrs)
    else:
        bits, block = quant
        q1, s1, d1 = quantize(fc1, bits, block); q2, s2, d2 = quantize(fc2, bits, block)
        deq = dict(gate=d1[:, 0::2], up=d1[:, 1::2], down=d2)
        attrs.update(expert_weight_bits=bits, weights_prepacked=0)
        if block is not None: attrs['block_size'] = block
        ins = [X, router_probs, g.c(q1), g.c(s1), g.c(fc1_b) if fc1_b is not None else '', g.c(q2), g.c(s2),
               g.c(fc2_b) if fc2_b is not None else '', '', '', '', '', '', '', router_weights or '']
        while ins[-1] == '': ins.pop()
        y = g.op('QMoE', ins, domain='com.microsoft', **attrs)
    if post_scale is not None:   # [T,1] broadcast over [T,H]
        y = g.op('Mul', [y, post_scale])
    if fam == 'qwen2_moe':       # shared expert: down(silu(gate x) * up x) * sigmoid(x @ shared_expert_gate^T)
        m = pfx + 'mlp.'
        gx = g.op('MatMul', [X, g.c(sd[m + 'shared_expert.gate_proj.weight'].T.copy())])
        ux = g.op('MatMul', [X, g.c(sd[m + 'shared_expert.up_proj.weight'].T.copy())])
        h = g.op('Mul', [g.op('Mul', [gx, g.op('Sigmoid', [gx])]), ux])
        sh = g.op('MatMul', [h, g.c(sd[m + 'shared_expert.down_proj.weight'].T.copy())])
        gate = g.op('Sigmoid', [g.op('MatMul', [X, g.c(sd[m + 'shared_expert_gate.weight'].T.copy())])])
        y = g.op('Add', [y, g.op('Mul', [sh, gate])])
    y = g.op('Reshape', [y, g.op('Shape', ['X'])])
    g.nodes[-1].output[0] = 'Y'
    graph = helper.make_graph(g.nodes, fam, [helper.make_tensor_value_info('X', TensorProto.FLOAT, ['B', 'S', H])],
                              [helper.make_tensor_value_info('Y', TensorProto.FLOAT, ['B', 'S', H])], g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid('', 21), helper.make_opsetid('com.microsoft', 1)])
    model.ir_version = 10
    return model, deq
