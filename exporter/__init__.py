"""Hugging Face decoder-only checkpoint -> ONNX, as a pure library.

Stages, each one module with one entry function: ``resolve`` (source -> local checkpoint),
``build`` (config + weights -> onnx-ir model), ``fold`` (initializer folds), ``package``
(streamed model.onnx + model.onnx.data + manifest). ``pipeline.export_model`` runs them in order.
This package imports no celery, fastapi, boto3 or sqlalchemy.
"""

__version__ = "0.1.0"
