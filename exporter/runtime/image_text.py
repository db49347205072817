"""An image-text export's three graphs run together by onnxruntime: vision -> embedding -> decoder.

``ImageTextModel`` owns the vision and embedding sessions and a ``Decoder`` of model.onnx (which takes
inputs_embeds): every call the decoder makes on token ids goes through the embedding graph first, with
the features of the images whose tokens those ids hold (queued by ``encode``), or with none (a
text-only prompt, a decode step). So the decoder's own cache handling (every variant, host arrays or
device buffers) drives an image prompt unchanged. Features and embeddings cross between the sessions as host arrays
of the graphs' own element type, bfloat16 included (``session.run_declared``: IO binding, as onnxruntime's numpy
bridge has no bfloat16).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from exporter.contract import (
    EMBEDDING_FILE, IMAGE_FEATURES, IMAGE_GRID_THW, IMAGE_SIZES, INPUT_IDS, INPUTS_EMBEDS, META_DEEPSTACK,
    META_IMAGE_SIZE, META_IMAGE_TOKEN_ID, META_PATCH_SIZE, META_SPATIAL_MERGE_SIZE, META_TOKENS_PER_IMAGE, PIXEL_VALUES,
    VISION_FILE, numpy_of_ort,
)
from exporter.runtime.session import Decoder, run_declared


# The bench's image where a family's token count follows the image's size (patch-sequence, padded-images): a square of
# this many tokens a side (256 tokens: Qwen2.5-VL's 448 x 448 pixels, Pixtral's 512 x 512).
TIMING_IMAGE_SIDE = 16


def timing_side(max_tokens: int) -> int:
    """The timing image's side in tokens: TIMING_IMAGE_SIDE, or the largest square of at most ``max_tokens`` tokens
    (an export whose max_seq_len is below 256 tokens and the prompt's text)."""
    return max(1, min(TIMING_IMAGE_SIDE, math.isqrt(max(max_tokens, 1))))


class ImageTextModel:
    def __init__(self, export_dir: Path, ep: str = "cpu", **decoder_options):
        """Sessions of ``export_dir``'s vision.onnx, embedding.onnx and model.onnx on ``ep``
        (``decoder_options``: Decoder's)."""
        export_dir = Path(export_dir)
        self.decoder = Decoder(export_dir, ep, **decoder_options)
        ort = self.decoder.ort
        options = ort.SessionOptions()
        options.log_severity_level = 3
        if not decoder_options.get("spin", True):  # as the decoder's (session.Decoder): no spinning beside other work
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.vision = ort.InferenceSession(str(export_dir / VISION_FILE), options, providers=self.decoder.providers)
        self.embedding = ort.InferenceSession(str(export_dir / EMBEDDING_FILE), options,
                                              providers=self.decoder.providers)
        meta = self.vision.get_modelmeta().custom_metadata_map
        self.tokens_per_image = int(meta[META_TOKENS_PER_IMAGE])
        self.image_token_id = int(meta[META_IMAGE_TOKEN_ID])
        self.image_size = int(meta[META_IMAGE_SIZE])
        features = next(i for i in self.embedding.get_inputs() if i.name == IMAGE_FEATURES)
        self.hidden = int(features.shape[-1])  # the rows' width: qwen3_vl's carry its deepstack maps too
        self.deepstack = int(meta.get(META_DEEPSTACK, 0))  # maps beside the merged features (contract.image_text_width)
        self.text_hidden = self.hidden // (1 + self.deepstack)
        self.features_dtype = numpy_of_ort(features.type)
        self._queued = self.no_images()  # features of images whose tokens the decoder has not been fed yet
        self.decoder.embed = self._embed_queued

    def no_images(self) -> np.ndarray:
        return np.zeros((0, self.tokens_per_image, self.hidden), self.features_dtype)

    def _vision(self, feeds: dict, rows: int) -> np.ndarray:
        """The vision graph on ``feeds``: its ``rows`` feature rows [rows, hidden], in the graph's own type (bf16 too:
        run_declared). The rows are counted here, as they must be to queue each image's, so that onnxruntime writes
        them into a host array of that shape: a graph that gives another count fails the run."""
        return run_declared(self.vision, feeds, {IMAGE_FEATURES: (rows, self.hidden)})[IMAGE_FEATURES]

    def image_features(self, pixel_values: np.ndarray) -> np.ndarray:
        """The vision graph: pixel_values [images, channels, size, size] fp32 -> [images, tokens, hidden]
        (the graph gives the rows 2-D, image after image)."""
        features = self._vision({PIXEL_VALUES: pixel_values}, len(pixel_values) * self.tokens_per_image)
        return features.reshape(len(pixel_values), self.tokens_per_image, self.hidden)

    def embed(self, input_ids: np.ndarray, features: np.ndarray | None = None) -> np.ndarray:
        """The embedding graph: ids [batch, seq] and the features of the images their tokens hold (none:
        text only) -> inputs_embeds [batch, seq, hidden], in the graph's type (bf16 as ml_dtypes' bfloat16)."""
        features = (self.no_images() if features is None else features).reshape(-1, self.hidden)
        input_ids = np.asarray(input_ids)
        return run_declared(self.embedding, {INPUT_IDS: input_ids, IMAGE_FEATURES: features},
                            {INPUTS_EMBEDS: (*input_ids.shape, self.hidden)})[INPUTS_EMBEDS]

    def encode(self, pixel_values: np.ndarray | None) -> np.ndarray:
        """Run the vision graph and queue its features for the image tokens the decoder is fed next."""
        features = self.image_features(pixel_values) if pixel_values is not None and len(pixel_values) else self.no_images()
        self._queued = np.concatenate([self._queued, features]) if len(self._queued) else features
        return features

    def _embed_queued(self, input_ids: np.ndarray) -> np.ndarray:
        """The decoder's ``embed``: whole images' tokens take the queued features in order; an image token
        with none queued (one the model generated) is embedded as transformers embeds it without images."""
        count = int(np.count_nonzero(np.asarray(input_ids) == self.image_token_id))
        images = count // self.tokens_per_image
        if count and count % self.tokens_per_image == 0 and images <= len(self._queued):
            features, self._queued = self._queued[:images], self._queued[images:]
            return self.embed(input_ids, features)
        if count and len(self._queued):
            raise ValueError(f"{count} image tokens take whole images of {self.tokens_per_image} tokens each, and "
                             f"{len(self._queued)} image(s) are queued: feed each image's tokens in one call")
        return self.embed(input_ids)

    def clear(self) -> None:
        """Drop queued features (a new sequence)."""
        self._queued = self.no_images()

    def timing_image(self, max_tokens: int) -> tuple[dict, int, dict]:
        """What the bench times an image by: (``encode``'s / ``image_features``' arguments for one blank image of at most
        ``max_tokens`` tokens, its image tokens, what the bench reports of it). Here the model's one image size."""
        pixels = np.zeros((1, 3, self.image_size, self.image_size), np.float32)
        return {"pixel_values": pixels}, self.tokens_per_image, {"image_size": self.image_size}


def image_text_decode(model: ImageTextModel, prompt: list[int], pixel_values: np.ndarray | None, steps: int,
                      feed: list[int] | None = None, image_grid_thw: np.ndarray | None = None,
                      image_sizes: np.ndarray | None = None):
    """``parity.export_decode`` of an image prompt: the images encoded, the prompt prefilled through the
    embedding graph, then ``steps`` greedy steps (teacher-forced on ``feed``), each token embedded with
    no images. ``image_grid_thw``: a patch-sequence export's grids (PatchSequenceModel); ``image_sizes``: a padded
    images export's sizes (PaddedImagesModel)."""
    from exporter.validation.parity import export_decode

    model.clear()
    extra = {name: value for name, value in (("image_grid_thw", image_grid_thw), ("image_sizes", image_sizes))
             if value is not None}
    model.encode(pixel_values, **extra)
    try:
        return export_decode(model.decoder, prompt, steps, feed)
    finally:
        model.clear()


class PatchSequenceModel(ImageTextModel):
    """qwen2_5_vl's export: the vision graph takes the processor's flattened patches with ``image_grid_thw`` and gives
    each image t * h * w / merge^2 feature rows; the decoder takes M-RoPE ``position_ids`` [3, batch, seq], which
    ``rope_index`` computes here as transformers' ``get_rope_index`` does, step by step: per row the offset between
    the next text token's 3-D position and its 1-D one (transformers' rope_deltas) is kept for the steps after."""

    def __init__(self, export_dir: Path, ep: str = "cpu", **decoder_options):
        super().__init__(export_dir, ep, **decoder_options)
        self.spatial_merge_size = int(self.vision.get_modelmeta().custom_metadata_map[META_SPATIAL_MERGE_SIZE])
        self._grids: list[tuple[int, int, int]] = []  # (t, h, w) of each queued image, in order
        self._deltas: list[int] = []  # per row: rope_deltas
        self._prefilled = False  # the last call started every row's sequence (attn_static prefills rows one by one)
        self.decoder.positions = self._positions
        self.decoder.on_new_sequence = self._new_sequence

    def no_images(self) -> np.ndarray:
        return np.zeros((0, self.hidden), self.features_dtype)

    def image_tokens(self, grid) -> int:
        """Feature rows (image tokens) of one image of ``grid`` (t, h, w)."""
        t, h, w = (int(v) for v in grid)
        return t * h * w // self.spatial_merge_size ** 2

    def image_features(self, pixel_values: np.ndarray, image_grid_thw: np.ndarray | None = None) -> np.ndarray:
        """The vision graph: patches [patches, patch_dim] fp32 + grids [images, 3] -> [image tokens, hidden]."""
        if image_grid_thw is None:
            raise ValueError("a patch-sequence vision graph takes image_grid_thw beside pixel_values")
        return self._vision({PIXEL_VALUES: pixel_values, IMAGE_GRID_THW: image_grid_thw},
                            sum(self.image_tokens(g) for g in np.asarray(image_grid_thw)))

    def encode(self, pixel_values: np.ndarray | None, image_grid_thw: np.ndarray | None = None) -> np.ndarray:
        features = self.no_images()
        if pixel_values is not None and len(pixel_values):
            features = self.image_features(pixel_values, image_grid_thw)
            self._grids += [tuple(int(v) for v in g) for g in np.asarray(image_grid_thw)]
        self._queued = np.concatenate([self._queued, features])
        return features

    def _embed_queued(self, input_ids: np.ndarray) -> np.ndarray:
        count = int(np.count_nonzero(np.asarray(input_ids) == self.image_token_id))
        images = whole_images(count, [self.image_tokens(g) for g in self._grids])
        if images:
            features, self._queued, self._grids = self._queued[:count], self._queued[count:], self._grids[images:]
            return self.embed(input_ids, features)
        return self.embed(input_ids)

    def _positions(self, input_ids: np.ndarray, positions: np.ndarray, attention_mask: np.ndarray | None) -> np.ndarray:
        """The decoder's ``positions``: this step's 1-D positions (each real token's count of real tokens before it)
        -> [3, batch, seq]; padding at 0."""
        from exporter.runtime.session import DYNAMIC, GQA, STATIC

        input_ids, positions = np.asarray(input_ids), np.asarray(positions)
        batch, seq = input_ids.shape
        real = np.ones((batch, seq), bool)
        if self.decoder.mode == DYNAMIC:  # left padding: the mask's last seq columns
            real = np.asarray(attention_mask)[:, -seq:] == 1
        elif self.decoder.mode == GQA:  # right padding: a row's tokens up to its length
            real = positions < np.asarray(attention_mask).sum(axis=1, keepdims=True)
        starts = [int(positions[r][real[r]][0]) if real[r].any() else 0 for r in range(batch)]
        fresh = not any(starts)  # every row starts its sequence
        if fresh and not (self._prefilled and self.decoder.mode == STATIC):  # (attn_static: row after row)
            self._deltas = []
        if fresh:
            self._deltas += [0] * batch
        elif len(self._deltas) != batch:
            raise ValueError(f"a step of {batch} rows continues {len(self._deltas)} prefilled ones")
        first = len(self._deltas) - batch  # this call's rows among the deltas
        self._prefilled = fresh
        out = np.zeros((3, batch, seq), np.int64)
        grids = iter(self._grids)
        for r in range(batch):
            if not real[r].any():
                continue
            ids = input_ids[r][real[r]]
            position_ids = rope_index(ids, grids, self.image_token_id, self.spatial_merge_size,
                                      starts[r] + self._deltas[first + r])
            out[:, r, real[r]] = position_ids
            self._deltas[first + r] = int(position_ids.max()) + 1 - (starts[r] + len(ids))  # transformers' rope_deltas
        return out

    def _new_sequence(self) -> None:
        """New caches: the rows prefilled next start sequences of their own (not the rows after those of the caches
        before: the bench prefills twice on fresh caches, an attn_static batch row after row on one)."""
        self._deltas, self._prefilled = [], False

    def clear(self) -> None:
        super().clear()
        self._grids, self._deltas, self._prefilled = [], [], False

    def timing_image(self, max_tokens: int) -> tuple[dict, int, dict]:
        """One frame of TIMING_IMAGE_SIDE x TIMING_IMAGE_SIDE tokens (each token merge x merge patches), or the largest
        square within ``max_tokens``."""
        side = timing_side(max_tokens) * self.spatial_merge_size
        patch_dim = self.vision.get_inputs()[0].shape[1]
        grid = np.array([[1, side, side]], np.int64)
        inputs = {"pixel_values": np.zeros((side * side, patch_dim), np.float32), "image_grid_thw": grid}
        return inputs, self.image_tokens(grid[0]), {"image_grid_thw": grid[0].tolist()}


def whole_images(count: int, queued: list[int]) -> int:
    """How many of the queued images (``queued``: each one's token count, in order) ``count`` image tokens of one call
    are: 0 where there are no image tokens or none queued (tokens the model generated, embedded without features);
    a ValueError where they split an image."""
    images, rows = 0, 0
    while count and images < len(queued) and rows < count:
        rows += queued[images]
        images += 1
    if count and rows == count:
        return images
    if count and queued:
        raise ValueError(f"{count} image tokens are not whole images of the {len(queued)} queued (their tokens: "
                         f"{queued}): feed each image's tokens in one call")
    return 0


class PaddedImagesModel(ImageTextModel):
    """mistral3's export: the vision graph takes pixel_values of images of their own sizes padded to the largest, with
    ``image_sizes`` (each image's height and width in pixels), and gives each image (height // (patch x merge)) x
    (width // (patch x merge)) feature rows: its [IMG] tokens, which a prompt interleaves with [IMG_BREAK] at each row's
    end and [IMG_END] (ordinary tokens, embedded as text). The decoder is a text decoder's."""

    def __init__(self, export_dir: Path, ep: str = "cpu", **decoder_options):
        super().__init__(export_dir, ep, **decoder_options)
        meta = self.vision.get_modelmeta().custom_metadata_map
        self.token_pixels = int(meta[META_PATCH_SIZE]) * int(meta[META_SPATIAL_MERGE_SIZE])  # pixels per token side
        self._tokens: list[int] = []  # image tokens of each queued image, in order

    def no_images(self) -> np.ndarray:
        return np.zeros((0, self.hidden), self.features_dtype)

    def token_grid(self, size) -> tuple[int, int]:
        """(rows, columns) of image tokens of an image of ``size`` (height, width) pixels."""
        height, width = (int(v) for v in size)
        return height // self.token_pixels, width // self.token_pixels

    def image_tokens(self, size) -> int:
        rows, cols = self.token_grid(size)
        return rows * cols

    def image_features(self, pixel_values: np.ndarray, image_sizes: np.ndarray | None = None) -> np.ndarray:
        """The vision graph: pixel_values [images, channels, H, W] fp32 (+ image_sizes [images, 2]; None: each image
        is the whole array) -> [image tokens, hidden]."""
        pixel_values = np.asarray(pixel_values)
        sizes = image_sizes if image_sizes is not None else np.tile(pixel_values.shape[2:], (len(pixel_values), 1))
        sizes = np.asarray(sizes, np.int64)
        padded = np.array(pixel_values.shape[2:])
        if sizes.shape != (len(pixel_values), 2) or (sizes > padded).any() or (sizes < 1).any():
            raise ValueError(f"image_sizes {sizes.tolist()} are not one (height, width) per image within pixel_values' "
                             f"{list(pixel_values.shape[2:])}")
        return self._vision({PIXEL_VALUES: pixel_values, IMAGE_SIZES: sizes}, sum(self.image_tokens(s) for s in sizes))

    def encode(self, pixel_values: np.ndarray | None, image_sizes: np.ndarray | None = None) -> np.ndarray:
        features = self.no_images()
        if pixel_values is not None and len(pixel_values):
            features = self.image_features(pixel_values, image_sizes)
            sizes = image_sizes if image_sizes is not None else [pixel_values.shape[2:]] * len(pixel_values)
            self._tokens += [self.image_tokens(size) for size in sizes]
        self._queued = np.concatenate([self._queued, features])
        return features

    def _embed_queued(self, input_ids: np.ndarray) -> np.ndarray:
        count = int(np.count_nonzero(np.asarray(input_ids) == self.image_token_id))
        images = whole_images(count, self._tokens)
        if images:
            features, self._queued, self._tokens = self._queued[:count], self._queued[count:], self._tokens[images:]
            return self.embed(input_ids, features)
        return self.embed(input_ids)

    def clear(self) -> None:
        super().clear()
        self._tokens = []

    def timing_image(self, max_tokens: int) -> tuple[dict, int, dict]:
        """A square image of TIMING_IMAGE_SIDE x TIMING_IMAGE_SIDE tokens, or the largest within ``max_tokens``."""
        side = timing_side(max_tokens) * self.token_pixels
        channels = self.vision.get_inputs()[0].shape[1]
        inputs = {"pixel_values": np.zeros((1, channels, side, side), np.float32),
                  "image_sizes": np.array([[side, side]], np.int64)}
        return inputs, self.image_tokens((side, side)), {"image_size": side}


def rope_index(ids: np.ndarray, grids, image_token_id: int, merge: int, start: int = 0) -> np.ndarray:
    """transformers' Qwen2.5-VL ``get_rope_index`` for one row's real tokens ``ids`` (numpy): [3, len(ids)] positions
    from ``start``. A run of text tokens counts up on all three streams; a run of image tokens takes the next grid
    (t, h, w) from ``grids`` and places its t x h/merge x w/merge tokens at start + (frame, row, column), after
    which text continues at start + max(h, w) / merge. An image token with no grid left (one the model generated)
    counts as text, as transformers' decode steps place it."""
    out, pos, i = [], start, 0
    is_image = ids == image_token_id
    while i < len(ids):
        j = i
        while j < len(ids) and is_image[j] == is_image[i]:
            j += 1
        grid = next(grids, None) if is_image[i] else None
        if grid is None:
            out.append(np.broadcast_to(np.arange(pos, pos + j - i), (3, j - i)))
            pos += j - i
        else:
            t, h, w = int(grid[0]), int(grid[1]) // merge, int(grid[2]) // merge
            if t * h * w != j - i:
                raise ValueError(f"a run of {j - i} image tokens where the next image's grid {list(grid)} holds "
                                 f"{t * h * w}: each image's tokens in one run, the images in order")
            frames, rows, cols = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
            out.append(np.stack([frames, rows, cols]).reshape(3, -1) + pos)
            pos += max(h, w)
        i = j
    return np.concatenate(out, axis=1).astype(np.int64)


def open_image_text(export_dir: Path, ep: str = "cpu", **decoder_options) -> ImageTextModel:
    """The runtime of an image-text export: PatchSequenceModel where its vision graph takes image_grid_thw
    (qwen2_5_vl, qwen3_5, qwen3_vl: its rows carry the deepstack maps, which pass through as they are), PaddedImagesModel
    where it takes image_sizes (mistral3), else ImageTextModel."""
    import onnx

    vision = onnx.load(str(Path(export_dir) / VISION_FILE), load_external_data=False)
    inputs = {i.name for i in vision.graph.input}
    kind = (PatchSequenceModel if IMAGE_GRID_THW in inputs else PaddedImagesModel if IMAGE_SIZES in inputs
            else ImageTextModel)
    return kind(export_dir, ep, **decoder_options)
