"""What Qwen3-VL's "deepstack" does in transformers, measured (issue 48): the vision tower hands the language model,
beside the merged image features, one more feature map per ``deepstack_visual_indexes`` entry (from those vision
layers, each through its own merger), and the language model ADDS map k to the hidden states at the image-token
positions after decoder layer k (``Qwen3VLTextModel._deepstack_process``). An export needs a decoder input for them
(per layer, at the image positions); this measures how far transformers' own logits move without them.

    python benchmarks/qwen3_vl_deepstack.py --out benchmarks/results/qwen3_vl_deepstack_cpu.json

A tiny random Qwen3-VL (transformers' classes at small sizes), one image prompt, fp32 on the CPU: the logits with
deepstack against the same forward with ``_deepstack_process`` returning the hidden states unchanged.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()

    import torch
    import transformers
    from transformers.models.qwen3_vl import modeling_qwen3_vl as m

    text = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                 "mrope_interleaved": True})
    vision = dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, temporal_patch_size=2,
                  spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=16, deepstack_visual_indexes=[0, 1, 2])
    image_token = 250
    grid = torch.tensor([[1, 8, 8]])  # 64 patches, 16 image tokens after the 2 x 2 merge
    runs = []
    for seed in args.seeds:
        torch.manual_seed(seed)
        config = transformers.Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=image_token,
                                            video_token_id=image_token + 1, vision_start_token_id=image_token + 2,
                                            vision_end_token_id=image_token + 3)
        model = transformers.Qwen3VLForConditionalGeneration(config).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():  # larger than the init's 0.02: decisive logits
                if "norm" not in name and not name.endswith("bias"):
                    p.normal_(0.0, 0.2)
        ids = torch.tensor([[5, 9, image_token + 2] + [image_token] * 16 + [image_token + 3, 17, 33, 41, 8]])
        pixels = torch.randn(64, 3 * 2 * 4 * 4)
        kinds = (ids == image_token).int()  # mm_token_type_ids: 1 at image tokens (the processor's)
        with torch.no_grad():
            full = model(input_ids=ids, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=kinds).logits[0].float()
            original = m.Qwen3VLTextModel._deepstack_process
            m.Qwen3VLTextModel._deepstack_process = lambda self, hidden, masks, embeds: hidden
            try:
                without = model(input_ids=ids, pixel_values=pixels, image_grid_thw=grid,
                                mm_token_type_ids=kinds).logits[0].float()
            finally:
                m.Qwen3VLTextModel._deepstack_process = original
        spread = float(full.max() - full.min())
        after_image = slice(ids.shape[1] - 5, ids.shape[1])  # the text after the image
        runs.append({"seed": seed, "logit_range": spread,
                     "max_abs_change_of_range": float((full - without).abs().max()) / spread,
                     "text_after_image_max_abs_change_of_range": float((full[after_image] - without[after_image]).abs().max()) / spread,
                     "next_token_changed": int(full[-1].argmax()) != int(without[-1].argmax())})
        print(json.dumps(runs[-1]), flush=True)
    result = {"benchmark": "qwen3_vl_deepstack", "command": "python benchmarks/qwen3_vl_deepstack.py --out " + str(args.out),
              "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": platform.machine(),
              "versions": {"transformers": transformers.__version__, "torch": torch.__version__},
              "what": "tiny random Qwen3-VL (4 text layers, deepstack from vision layers 0-2 into text layers 0-2), one "
                      "16-token image prompt, fp32 CPU: transformers' logits with its deepstack additions vs without",
              "runs": runs}
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
