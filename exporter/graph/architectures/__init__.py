"""Registry of supported architectures, keyed by config.json ``model_type``."""

from exporter.graph.architectures import (
    gemma2, gemma3, gpt_oss, granite, granitemoe, llama, mistral, mixtral, olmo2, olmoe, phi3, phimoe, qwen2, qwen2_moe, qwen3, qwen3_moe,
    smollm3,
)
from exporter.graph.architectures.base import Architecture

ARCHITECTURES: dict[str, Architecture] = {
    m.ARCHITECTURE.model_type: m.ARCHITECTURE
    for m in (llama, mistral, qwen2, qwen3, phi3, gemma2, gemma3, granite, olmo2, smollm3,
              mixtral, qwen2_moe, qwen3_moe, olmoe, granitemoe, gpt_oss, phimoe)
}
