"""Exp5: save a tiny random model per MoE family; list checkpoint tensor names/shapes vs runtime module parameters;
check config.json keys; reload and check round trip."""
import json, os, sys, torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM
import os
WORK = os.environ.get('MOE_OPS_WORK', '/tmp/moe-ops')
os.makedirs(WORK, exist_ok=True)
torch.manual_seed(0)
common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=128)
FAM = {
 'mixtral':   dict(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2),
 'qwen2_moe': dict(intermediate_size=24, moe_intermediate_size=16, shared_expert_intermediate_size=20, num_experts=4,
                   num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=False),
 'qwen3_moe': dict(intermediate_size=24, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, head_dim=8,
                   norm_topk_prob=True, mlp_only_layers=[], decoder_sparse_step=1),
 'olmoe':     dict(intermediate_size=16, num_experts=4, num_experts_per_tok=2),
 'phimoe':    dict(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2),
 'granitemoe':dict(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2),
 'gpt_oss':   dict(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, head_dim=8, sliding_window=8),
}
out = {}
for fam, kw in FAM.items():
    cfg = AutoConfig.for_model(fam, **common, **kw)
    m = AutoModelForCausalLM.from_config(cfg).eval()
    d = f'{WORK}/ckpt/{fam}'
    m.save_pretrained(d)
    cj = json.load(open(f'{d}/config.json'))
    runtime = {n: tuple(p.shape) for n, p in m.named_parameters() if 'layers.0.' in n and ('mlp' in n or 'moe' in n)}
    saved = {}
    for f in sorted(os.listdir(d)):
        if f.endswith('.safetensors'):
            with safe_open(f'{d}/{f}', 'pt') as sf:
                for k in sf.keys():
                    if 'layers.0.' in k and ('mlp' in k or 'moe' in k or 'expert' in k): saved[k] = tuple(sf.get_slice(k).get_shape())
    print(f"\n===== {fam}: {type(m.model.layers[0].mlp if hasattr(m.model.layers[0], 'mlp') else m.model.layers[0].block_sparse_moe).__name__}")
    print("  config.json MoE keys:", {k: cj[k] for k in cj if any(s in k for s in ('expert', 'moe', 'topk', 'sparse', 'mlp_only', 'jitter', 'swiglu', 'layer_types', 'sliding', 'intermediate'))})
    print("  runtime params (layer 0):"); [print('    ', k, v) for k, v in runtime.items()]
    print("  saved safetensors (layer 0):"); [print('    ', k, v) for k, v in sorted(saved.items())]
    # round trip
    m2 = AutoModelForCausalLM.from_pretrained(d).eval()
    ids = torch.randint(0, 64, (1, 7))
    with torch.no_grad(): diff = (m(ids).logits - m2(ids).logits).abs().max().item()
    print("  reload round trip max |logits diff|:", diff)
    if fam == 'qwen2_moe':
        print("  layer1 (mlp_only) mlp type:", type(m.model.layers[1].mlp).__name__)
