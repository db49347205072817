"""Registry of supported architectures, keyed by config.json ``model_type``."""

from exporter.graph.architectures import (
    apertus, cohere2, deepseek_v2, deepseek_v3, glm4_moe_lite, ernie4_5, ernie4_5_moe, exaone4, falcon_h1, glm4_moe, hunyuan_v1_dense, llama4_text, ministral3, olmo3, seed_oss, gemma2, gemma3, gemma4_text, gpt_oss, granite, granitemoe, granitemoehybrid, lfm2, llama, mistral, mixtral, nemotron_h, olmo2,
    olmoe, phi3, phimoe, qwen2, qwen2_moe, qwen3, qwen3_5, qwen3_5_moe, qwen3_moe, qwen3_next, smollm3,
)
from exporter.graph.architectures.base import Architecture

ARCHITECTURES: dict[str, Architecture] = {
    m.model_type: m
    for m in (*(f.ARCHITECTURE for f in (llama, mistral, qwen2, qwen3, phi3, gemma2, gemma3, granite, olmo2, smollm3,
                                         mixtral, qwen2_moe, qwen3_moe, olmoe, granitemoe, gpt_oss, phimoe)),
              # Hybrids: recurrent layers (gated DeltaNet, short convolution, Mamba2) beside attention layers.
              qwen3_next.ARCHITECTURE, qwen3_5.TEXT, qwen3_5.ARCHITECTURE, qwen3_5_moe.TEXT, qwen3_5_moe.ARCHITECTURE,
              lfm2.ARCHITECTURE, lfm2.MOE, granitemoehybrid.ARCHITECTURE,
              nemotron_h.ARCHITECTURE, falcon_h1.ARCHITECTURE,
              # Grouped sigmoid routing and multi-head latent attention (DeepSeek-V3's).
              glm4_moe.ARCHITECTURE, deepseek_v3.ARCHITECTURE, ernie4_5_moe.ARCHITECTURE, deepseek_v2.ARCHITECTURE,
              glm4_moe_lite.ARCHITECTURE,
              # The 2025-26 dense families.
              seed_oss.ARCHITECTURE, ernie4_5.ARCHITECTURE, olmo3.ARCHITECTURE, exaone4.ARCHITECTURE,
              ministral3.ARCHITECTURE, hunyuan_v1_dense.ARCHITECTURE, cohere2.ARCHITECTURE, apertus.ARCHITECTURE,
              llama4_text.ARCHITECTURE, gemma4_text.ARCHITECTURE, gemma4_text.IMAGE_TEXT)
}
