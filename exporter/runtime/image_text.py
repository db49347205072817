"""An image-text export's three graphs run together by onnxruntime: vision -> embedding -> decoder.

``ImageTextModel`` owns the vision and embedding sessions and a ``Decoder`` of model.onnx (which takes
inputs_embeds): every call the decoder makes on token ids goes through the embedding graph first, with
the features of the images whose tokens those ids hold (queued by ``encode``), or with none (a
text-only prompt, a decode step). So the decoder's own cache handling (every variant, host arrays or
device buffers) drives an image prompt unchanged.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from exporter.contract import (
    EMBEDDING_FILE, IMAGE_FEATURES, INPUT_IDS, META_IMAGE_SIZE, META_IMAGE_TOKEN_ID, META_TOKENS_PER_IMAGE,
    PIXEL_VALUES, VISION_FILE, numpy_of_ort,
)
from exporter.runtime.session import Decoder


class ImageTextModel:
    def __init__(self, export_dir: Path, ep: str = "cpu", **decoder_options):
        """Sessions of ``export_dir``'s vision.onnx, embedding.onnx and model.onnx on ``ep``
        (``decoder_options``: Decoder's)."""
        export_dir = Path(export_dir)
        self.decoder = Decoder(export_dir, ep, **decoder_options)
        ort = self.decoder.ort
        options = ort.SessionOptions()
        options.log_severity_level = 3
        self.vision = ort.InferenceSession(str(export_dir / VISION_FILE), options, providers=self.decoder.providers)
        self.embedding = ort.InferenceSession(str(export_dir / EMBEDDING_FILE), options,
                                              providers=self.decoder.providers)
        meta = self.vision.get_modelmeta().custom_metadata_map
        self.tokens_per_image = int(meta[META_TOKENS_PER_IMAGE])
        self.image_token_id = int(meta[META_IMAGE_TOKEN_ID])
        self.image_size = int(meta[META_IMAGE_SIZE])
        features = next(i for i in self.embedding.get_inputs() if i.name == IMAGE_FEATURES)
        self.hidden = int(features.shape[-1])
        self.features_dtype = numpy_of_ort(features.type)
        self._queued = self.no_images()  # features of images whose tokens the decoder has not been fed yet
        self.decoder.embed = self._embed_queued

    def no_images(self) -> np.ndarray:
        return np.zeros((0, self.tokens_per_image, self.hidden), self.features_dtype)

    def image_features(self, pixel_values: np.ndarray) -> np.ndarray:
        """The vision graph: pixel_values [images, channels, size, size] fp32 -> [images, tokens, hidden]."""
        (features,) = self.vision.run(None, {PIXEL_VALUES: np.ascontiguousarray(pixel_values, np.float32)})
        return features

    def embed(self, input_ids: np.ndarray, features: np.ndarray | None = None) -> np.ndarray:
        """The embedding graph: ids [batch, seq] and the features of the images their tokens hold (none:
        text only) -> inputs_embeds [batch, seq, hidden]."""
        features = self.no_images() if features is None else features
        (embeds,) = self.embedding.run(None, {INPUT_IDS: np.asarray(input_ids, np.int64), IMAGE_FEATURES: features})
        return embeds

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


def image_text_decode(model: ImageTextModel, prompt: list[int], pixel_values: np.ndarray | None, steps: int,
                      feed: list[int] | None = None):
    """``parity.export_decode`` of an image prompt: the images encoded, the prompt prefilled through the
    embedding graph, then ``steps`` greedy steps (teacher-forced on ``feed``), each token embedded with
    no images."""
    from exporter.validation.parity import export_decode

    model.clear()
    model.encode(pixel_values)
    try:
        return export_decode(model.decoder, prompt, steps, feed)
    finally:
        model.clear()
