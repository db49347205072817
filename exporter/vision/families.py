"""The image-text families the vision builder takes, keyed by config.json's model_type: which
projector each uses, where its modules live in the checkpoint, and its one or two differences."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from exporter.errors import ExportError
from exporter.graph.components.graph import GraphBuilder
from exporter.packaging.checkpoint import Checkpoint
from exporter.vision import pixtral, qwen2_5_vl, qwen3_5
from exporter.vision.config import VisionConfig
from exporter.vision.projectors import gemma3_projector, llava_projector, pixel_shuffle_projector


@dataclasses.dataclass(frozen=True)
class ModuleNames:
    """Where a checkpoint keeps the three modules, each a name prefix ending in a dot. Found from the
    names themselves: hub checkpoints and transformers 5's save_pretrained nest them differently
    (``vision_tower.vision_model.`` vs ``vision_tower.``, ``language_model.model.`` vs ``model.language_model.``)."""

    tower: str
    projector: str
    embed_tokens: str  # the text embedding table's full name


@dataclasses.dataclass(frozen=True)
class VisionFamily:
    model_type: str
    projector: Callable[[GraphBuilder, list[ir.Value], VisionConfig, str], ir.Value]
    projector_module: str  # the projector's module name (its weights' common part)
    # Rows of the position table each patch reads, where they are not 0..n-1 (None: they are).
    position_ids: Callable[[VisionConfig], np.ndarray | None] = lambda cfg: None
    patch_embedding: str = "embeddings.patch_embedding.weight"  # the tower's weight whose prefix names the tower
    # A dynamic-resolution family's tower and merger as one graph: (builder, pixels [patches, patch_dim],
    # image_grid_thw, cfg, tower prefix, merger prefix) -> the merged tokens. None: a ViT (encoder.vision_tower)
    # of one image size, then ``projector``.
    patch_sequence_tower: Callable[[GraphBuilder, ir.Value, ir.Value, VisionConfig, str, str], ir.Value] | None = None
    # A tower over images of their own sizes padded into one batch, with its projector, as one graph: (builder,
    # pixel_values [images, channels, H, W], image_sizes [images, 2], cfg, tower prefix, projector prefix) -> the
    # images' tokens (mistral3's Pixtral). None: not such a tower.
    padded_images_tower: Callable[[GraphBuilder, ir.Value, ir.Value, VisionConfig, str, str], ir.Value] | None = None
    tower_layers: str = "encoder.layers."  # the tower's layer i is ``{tower}{tower_layers}{i}.`` (its unread ones listed)

    def module_names(self, checkpoint: Checkpoint) -> ModuleNames:
        names = checkpoint.names()
        tower = _one({n.removesuffix(self.patch_embedding) for n in names if n.endswith(self.patch_embedding)},
                     "vision tower patch embedding")
        module = f"{self.projector_module}."
        projector = _one({n[: n.index(module) + len(module)] for n in names if module in n}, f"{module} projector")
        embed = _one({n for n in names if n.endswith("embed_tokens.weight") and not n.startswith(tower)},
                     "text embedding (embed_tokens.weight)")
        return ModuleNames(tower=tower, projector=projector, embed_tokens=embed)


def _one(found: set[str], what: str) -> str:
    """The one name (or prefix) found; none or several refused by name."""
    if len(found) != 1:
        listed = f": {', '.join(sorted(found))}" if found else ""
        raise ExportError(f"the checkpoint holds {len(found) or 'no'} {what} weights{listed}, where the image-text "
                          "checkpoint config.json describes has one: is config.json from this checkpoint?")
    return found.pop()


def idefics3_position_ids(cfg: VisionConfig) -> np.ndarray | None:
    """Idefics3VisionEmbeddings' position ids for a whole image (no padded patches), computed as
    transformers computes them: bucketized float coordinates, which for some grids (19, 25, 29, ...)
    are not 0..n^2-1 but repeat a row or column. torch is used because the float32 ``arange`` under
    them rounds by torch's own (CPU-vectorized) rule."""
    import torch

    n = cfg.grid
    boundaries = torch.arange(1 / n, 1.0, 1 / n)
    step = 1.0 / torch.tensor([n])
    coords = torch.clamp(torch.arange(n, dtype=torch.float32)[None] * step[:, None], max=1.0 - 1e-6)
    buckets = torch.bucketize(coords, boundaries, right=True)[0]
    ids = (buckets[:, None] * n + buckets[None, :]).reshape(-1).numpy()
    return None if np.array_equal(ids, np.arange(n * n)) else ids


FAMILIES: dict[str, VisionFamily] = {
    family.model_type: family
    for family in (
        VisionFamily("gemma3", gemma3_projector, "multi_modal_projector"),
        VisionFamily("llava", llava_projector, "multi_modal_projector"),
        VisionFamily("idefics3", pixel_shuffle_projector, "connector", idefics3_position_ids),
        VisionFamily("smolvlm", pixel_shuffle_projector, "connector", idefics3_position_ids),
        # The tower and merger are one graph (patch_sequence_tower); the merger is inside the tower module.
        VisionFamily("qwen2_5_vl", qwen2_5_vl.patch_merger, "merger", patch_embedding="patch_embed.proj.weight",
                     patch_sequence_tower=qwen2_5_vl.qwen2_5_vl_tower),
        # Qwen3-VL's tower is Qwen3.5's with its deepstack mergers (VisionConfig.deepstack_layers).
        *(VisionFamily(model_type, qwen3_5.patch_merger, "merger", patch_embedding="patch_embed.proj.weight",
                       patch_sequence_tower=qwen3_5.qwen3_5_tower)
          for model_type in ("qwen3_5", "qwen3_5_moe", "qwen3_vl", "qwen3_vl_moe")),
        # Pixtral and its projector as one graph (padded_images_tower), on pixel_values and image_sizes.
        VisionFamily("mistral3", None, "multi_modal_projector", patch_embedding="patch_conv.weight",
                     padded_images_tower=pixtral.pixtral_tower, tower_layers="transformer.layers."),
    )
}
