"""Seed-OSS (ByteDance): llama's layer with biased q / k / v (attention_bias) and an unbiased o_proj
(attention_out_bias false in every published config; a biased one is read where the checkpoint has it)."""

from exporter.graph.architectures.base import Architecture

ARCHITECTURE = Architecture(model_type="seed_oss")
