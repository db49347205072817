"""Exp6 (weights are constant initializers, as in a real export; int8 block-wise therefore runs with int8 activations -> ~1e-2, tolerance 5e-2): end-to-end check, per family, of checkpoint -> MoE/QMoE mapping (moe_export_ref.py) against the transformers
MoE block of decoder layer 0 (and the dense/mlp_only rule for qwen2_moe). Tiny random models, weights re-randomized
so routing is decisive and gpt-oss's clamp is active."""
import json, sys, numpy as np, torch, onnxruntime as ort
from safetensors.numpy import load_file
from transformers import AutoConfig, AutoModelForCausalLM
from moe_export_ref import build_moe_block
import os
WORK = os.environ.get('MOE_OPS_WORK', '/tmp/moe-ops')
os.makedirs(WORK, exist_ok=True)
ort.set_default_logger_severity(4)
torch.manual_seed(0)
common = dict(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
FAM = {
 'mixtral':    dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2),
 'qwen2_moe':  dict(intermediate_size=48, moe_intermediate_size=32, shared_expert_intermediate_size=40, num_experts=8, num_experts_per_tok=3, norm_topk_prob=False, mlp_only_layers=[1]),
 'qwen2_moe+norm': dict(intermediate_size=48, moe_intermediate_size=32, shared_expert_intermediate_size=40, num_experts=8, num_experts_per_tok=3, norm_topk_prob=True),
 'qwen3_moe':  dict(intermediate_size=48, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=3, head_dim=16, norm_topk_prob=True),
 'qwen3_moe-nonorm':  dict(intermediate_size=48, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=3, head_dim=16, norm_topk_prob=False),
 'olmoe':      dict(intermediate_size=32, num_experts=8, num_experts_per_tok=3, norm_topk_prob=False),
 'phimoe':     dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2),
 'phimoe+jitter0.2': dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, router_jitter_noise=0.2),
 'granitemoe': dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=3),
 'gpt_oss':    dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=3, head_dim=16, sliding_window=8),
}
only = sys.argv[1:]
for key, kw in FAM.items():
    if only and key not in only: continue
    fam = key.split('+')[0].split('-')[0]
    cfg = AutoConfig.for_model(fam, **common, **kw)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if 'layers.0.' in n and ('mlp' in n or 'moe' in n):
                p.copy_(torch.randn_like(p) * (0.5 if fam == 'gpt_oss' else 0.15))
    d = f'{WORK}/ckpt6/{key}'; model.save_pretrained(d)
    sd = load_file(f'{d}/model.safetensors'); cj = json.load(open(f'{d}/config.json'))
    block = model.model.layers[0].block_sparse_moe if fam == 'granitemoe' else model.model.layers[0].mlp
    x = torch.randn(2, 7, 64) * (3.0 if fam == 'gpt_oss' else 1.0)
    with torch.no_grad():
        ref = block(x); ref = (ref[0] if isinstance(ref, tuple) else ref).numpy()
    so = ort.SessionOptions(); so.intra_op_num_threads = 1
    res = []
    for quant, tol in ((None, 1e-5), ((4, 32), 1e-5), ((4, None), 1e-5), ((8, None), 1e-5), ((8, 32), 5e-2)):
        m, deq = build_moe_block(fam, sd, cj, quant=quant)
        y = ort.InferenceSession(m.SerializeToString(), so, providers=['CPUExecutionProvider']).run(None, {'X': x.numpy()})[0]
        if deq is None:
            r = ref
        else:   # reference = the transformers block with its expert weights replaced by the dequantized ones
            q = AutoModelForCausalLM.from_pretrained(d).eval()
            qb = q.model.layers[0].block_sparse_moe if fam == 'granitemoe' else q.model.layers[0].mlp
            gt, up, dn = (torch.from_numpy(deq[n]) for n in ('gate', 'up', 'down'))
            with torch.no_grad():
                if fam == 'gpt_oss':
                    gu = torch.empty_like(qb.experts.gate_up_proj); gu[:, :, 0::2] = gt.transpose(1, 2); gu[:, :, 1::2] = up.transpose(1, 2)
                    qb.experts.gate_up_proj.copy_(gu); qb.experts.down_proj.copy_(dn.transpose(1, 2))
                else:
                    qb.experts.gate_up_proj.copy_(torch.cat([gt, up], 1)); qb.experts.down_proj.copy_(dn)
                r = qb(x); r = (r[0] if isinstance(r, tuple) else r).numpy()
        e = float(np.abs(y - r).max()); rel = e / float(np.abs(r).max())
        res.append(f"{'MoE fp32' if quant is None else f'QMoE int{quant[0]} ' + (f'blk{quant[1]}' if quant[1] else 'per-row')}: rel={rel:.0e}{' FAIL' if rel > tol else ''}")
    print(f"{key:18s} k={cfg.num_experts_per_tok} | " + " | ".join(res))
    if fam == 'qwen2_moe' and 'mlp_only_layers' in kw:
        print(f"{'':18s} layer 1 (in mlp_only_layers) is {type(model.model.layers[1].mlp).__name__}")
