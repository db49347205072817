"""What Qwen3-VL's "deepstack" does in transformers, and whether the export carries it (issue 48): the vision tower hands
the language model, beside the merged image features, one more feature map per ``deepstack_visual_indexes`` entry (from
those vision layers, each through its own merger), and the language model ADDS map k to the hidden states at the
image-token positions after decoder layer k (``Qwen3VLTextModel._deepstack_process``). Neither consumer's decoder
(onnxruntime-genai 0.18, transformers.js 4.3.2) takes an input for them, so the export carries them inside the
embeddings: image_features and inputs_embeds are hidden x (1 + maps) wide, [merged | map 0 | ...], a text token's maps
zeros, and the decoder adds slice k + 1 after its layer k (exporter.contract.image_text_width).

    python benchmarks/qwen3_vl_deepstack.py --out benchmarks/results/qwen3_vl_deepstack_cpu.json

A tiny random Qwen3-VL (transformers' classes at small sizes), one image prompt, fp32 on the CPU: transformers' logits
with deepstack against the same forward with ``_deepstack_process`` returning the hidden states unchanged (what
dropping the maps would cost), and the export's (attn_dynamic, fp32, through exporter.runtime.image_text) last-position
prefill logits against transformers' with its maps as exported and with the map slices of inputs_embeds zeroed.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import numpy as np


def export_errors(model, ids, pixels, grid, want_last) -> dict:
    """The export of ``model`` (saved, exported attn_dynamic fp32, not validated) on one image prompt: its last-position
    prefill logits against transformers' ``want_last``, with its deepstack maps and with them zeroed, as shares of the
    logit range."""
    from exporter.pipeline import export_model
    from exporter.request import ExportRequest
    from exporter.runtime.image_text import open_image_text

    with tempfile.TemporaryDirectory() as work:
        source = Path(work) / "qwen3-vl"
        model.save_pretrained(source)
        export = export_model(ExportRequest(model=str(source), variant="attn_dynamic", max_seq_len=64),
                              Path(work) / "export", validate=False)
        runtime = open_image_text(export.out_dir, prepack=False, spin=False)
        embed = runtime.embed
        errors = {}
        for label, zeroed in (("export_with_deepstack", False), ("export_deepstack_zeroed", True)):
            def embedded(input_ids, features=None, zeroed=zeroed):
                embeds = embed(input_ids, features)
                if zeroed:
                    embeds[..., runtime.text_hidden:] = 0
                return embeds

            runtime.embed = embedded
            runtime.clear()
            runtime.encode(pixels, grid)
            logits = runtime.decoder.prefill([list(ids)], runtime.decoder.new_state(1))[0]
            errors[f"{label}_max_abs_error_of_range"] = float(np.abs(logits - want_last).max() / np.ptp(want_last))
            errors[f"{label}_next_token_equal"] = int(logits.argmax()) == int(want_last.argmax())
        errors["inputs_embeds_width"] = runtime.hidden
        return errors


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
                     "next_token_changed": int(full[-1].argmax()) != int(without[-1].argmax()),
                     **export_errors(model, ids[0].tolist(), pixels.numpy(), grid.numpy(), full[-1].numpy())})
        print(json.dumps(runs[-1]), flush=True)
    import onnxruntime

    result = {"benchmark": "qwen3_vl_deepstack", "command": "python benchmarks/qwen3_vl_deepstack.py --out " + str(args.out),
              "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": platform.machine(),
              "versions": {"transformers": transformers.__version__, "torch": torch.__version__,
                           "onnxruntime": onnxruntime.__version__},
              "what": "tiny random Qwen3-VL (4 text layers, deepstack from vision layers 0-2 into text layers 0-2), one "
                      "16-token image prompt, fp32 CPU: transformers' logits with its deepstack additions vs without; "
                      "the export's (attn_dynamic fp32, the maps in inputs_embeds 64 x 4 wide) last-position prefill "
                      "logits vs transformers', with its maps and with their slices zeroed",
              "runs": runs}
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
