"""Exp7: negative controls for exp6 — show that the extra graph pieces are needed (the naive mapping is measurably wrong):
 * phimoe without the in-graph sparsemixer (op's plain softmax/top-2/renormalize)
 * qwen2_moe/olmoe (norm_topk_prob=False) on QMoE without router_weights (QMoE renormalizes anyway)
 * gpt_oss without swiglu_limit
 and that a finite fill (-1e30) works as well as -inf for the phimoe log-weight router."""
import json, numpy as np, torch, onnxruntime as ort
from safetensors.numpy import load_file
from transformers import AutoModelForCausalLM
from moe_export_ref import build_moe_block
import os
WORK = os.environ.get('MOE_OPS_WORK', '/tmp/moe-ops')
os.makedirs(WORK, exist_ok=True)
ort.set_default_logger_severity(4); torch.manual_seed(1)
def check(key, fam, **kw):
    d = f'{WORK}/ckpt6/{key}'; sd = load_file(f'{d}/model.safetensors'); cj = json.load(open(f'{d}/config.json'))
    model = AutoModelForCausalLM.from_pretrained(d).eval()
    block = model.model.layers[0].block_sparse_moe if fam == 'granitemoe' else model.model.layers[0].mlp
    x = torch.randn(1, 16, 64) * (3.0 if fam == 'gpt_oss' else 1.0)
    with torch.no_grad(): r = block(x); r = (r[0] if isinstance(r, tuple) else r).numpy()
    run = lambda m: ort.InferenceSession(m.SerializeToString(), providers=['CPUExecutionProvider']).run(None, {'X': x.numpy()})[0]
    y = run(build_moe_block(fam, sd, cj, **kw)[0])
    if 'quant' in kw:   # compare with the correct mapping at the same quantization (isolates the routing difference)
        r = run(build_moe_block(fam, sd, cj, quant=kw['quant'])[0]); what = 'correct QMoE mapping'
    else: what = 'transformers'
    print(f"{key:18s} {kw}: rel err vs {what} = {np.abs(y - r).max() / np.abs(r).max():.1e}")
check('phimoe', 'phimoe', naive=True)
check('phimoe+jitter0.2', 'phimoe', naive=True)
check('phimoe', 'phimoe', neg_fill=-1e30)
check('qwen2_moe', 'qwen2_moe', quant=(4, 32), naive=True)
check('olmoe', 'olmoe', quant=(4, 32), naive=True)
check('qwen2_moe', 'qwen2_moe', naive=True)       # float MoE: naive is already correct (normalize_routing_weights=0 honoured)
check('gpt_oss', 'gpt_oss', no_limit=True)
