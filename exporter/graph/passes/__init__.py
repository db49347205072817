"""Graph passes in onnx-ir's style: one class per idea, ``call(model)`` -> ``PassResult``."""
