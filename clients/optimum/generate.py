"""Greedy generation from hf-layout exports with optimum's ORTModelForCausalLM, as a user calls it:
    python generate.py REPO REQUEST.json [REPO REQUEST.json ...]
REQUEST.json: {"input_ids": [[...]], "attention_mask": [[...]], "max_new_tokens": N} (rows left-padded).
Prints one line per pair, {"repo": REPO, "sequences": [[...], ...]}: one process for many models, since
importing torch, transformers and optimum costs more than a tiny model's generation. Runs in
clients/optimum's own environment (requirements.txt)."""
import json, sys
import torch
from optimum.onnxruntime import ORTModelForCausalLM

args = sys.argv[1:]
if not args or len(args) % 2:
    sys.exit("usage: python generate.py REPO REQUEST.json [REPO REQUEST.json ...]")
for repo, request_path in zip(args[::2], args[1::2]):
    request = json.load(open(request_path))
    file_name = json.load(open(f"{repo}/manifest.json"))["layout"]["model_file"]
    sub, name = file_name.split("/")
    model = ORTModelForCausalLM.from_pretrained(repo, subfolder=sub, file_name=name, use_cache=True, use_io_binding=False)
    # optimum 2.x sizes the first step's empty cache from config.json by model type, and for types it does not
    # list (phi3, gemma2, olmo2, ...) takes num_attention_heads for the KV heads (its issue 2379). The graph
    # declares the cache shape: [batch, kv_heads, past, head_dim].
    past = next(i for i in model.session.get_inputs() if i.name.startswith("past_key_values."))
    model.num_key_value_heads, model.embed_size_per_head = past.shape[1], past.shape[3]
    out = model.generate(input_ids=torch.tensor(request["input_ids"]), attention_mask=torch.tensor(request["attention_mask"]),
                         max_new_tokens=request["max_new_tokens"], min_new_tokens=request["max_new_tokens"], do_sample=False)
    print(json.dumps({"repo": repo, "sequences": out.tolist()}), flush=True)
