"""Registry of supported architectures, keyed by config.json ``model_type``."""

from exporter.graph.architectures import gemma2, gemma3, granite, llama, mistral, olmo2, phi3, qwen2, qwen3, smollm3
from exporter.graph.architectures.base import Architecture

ARCHITECTURES: dict[str, Architecture] = {
    m.ARCHITECTURE.model_type: m.ARCHITECTURE
    for m in (llama, mistral, qwen2, qwen3, phi3, gemma2, gemma3, granite, olmo2, smollm3)
}
