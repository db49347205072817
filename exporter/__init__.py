"""Hugging Face decoder-only checkpoint -> ONNX, as a pure library.

- ``contract``: the graph contract (I/O names, dims, cache layouts, metadata, files, dtypes).
- ``graph``: config -> components -> architectures -> task -> onnx-ir model, and its folds.
- ``packaging``: checkpoint reading, source resolution, the streamed model files, the manifest,
  the onnxruntime-genai package.
- ``validation``: the gates (structure, weights by value, parity against transformers, the runtime
  probe) and the parity report.
- ``runtime``: the one ONNX Runtime driver, the decode benchmark, attention-kernel logs.
- ``reports``: the benchmark plot and summary, the diff between two exports.
- ``cache``: where computed artifacts (rope tables, reference runs) are kept between runs.

``pipeline`` runs the stages (``build_export``, ``validate_built``; ``export_model`` for the CLI).
This package imports no celery, fastapi, boto3 or sqlalchemy.
"""

__version__ = "0.1.0"
