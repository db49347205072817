"""Registry of supported architectures, keyed by config.json ``model_type``."""

from exporter.architectures import llama, mistral, phi3, qwen2, qwen3
from exporter.architectures.base import Architecture

ARCHITECTURES: dict[str, Architecture] = {
    m.ARCHITECTURE.model_type: m.ARCHITECTURE for m in (llama, mistral, qwen2, qwen3, phi3)
}
