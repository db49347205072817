"""Drive an exported model through its variant's own cache contract in ONNX Runtime.

One ``OnnxCausalLM.forward`` call is one step (a prompt, a prompt chunk, or one decode token);
the cache state lives between calls exactly as a serving runtime keeps it. Used by the tests,
validation and the benchmark, so all three exercise the contract of docs/graph-contracts.md.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import onnx

from exporter.build import META_PREFIX
from exporter.package import MODEL_FILE
from exporter.request import Variant
from exporter.task import cache_io_names

PROVIDERS = {"cpu": ["CPUExecutionProvider"], "cuda": [("CUDAExecutionProvider", {}), "CPUExecutionProvider"]}
_NP_DTYPES = {"fp32": np.float32, "fp16": np.float16}


def read_metadata(model_path: Path) -> dict:
    proto = onnx.load(str(model_path), load_external_data=False)
    meta = {p.key[len(META_PREFIX):]: p.value for p in proto.metadata_props if p.key.startswith(META_PREFIX)}
    meta["config"] = json.loads(meta["config"])
    return meta


def _ortvalue(array: np.ndarray):
    """numpy -> CPU OrtValue sharing its memory; bfloat16 (which ORT's numpy bridge lacks) via uint16."""
    import onnxruntime as ort

    array = np.ascontiguousarray(array)
    if array.dtype.name == "bfloat16":
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(array.view(np.uint16), onnx.TensorProto.BFLOAT16)
    return ort.OrtValue.ortvalue_from_numpy(array)


def run_numpy(session, feeds: dict[str, np.ndarray], output_shapes: dict[str, tuple]) -> dict[str, np.ndarray]:
    """session.run for graphs whose inputs or outputs are bfloat16.

    ORT's Python bridge cannot turn bfloat16 tensors into numpy arrays, so every output is bound to a
    preallocated host array of the dtype the graph declares, which ORT fills in place.
    """
    binding = session.io_binding()
    for name, array in feeds.items():
        binding.bind_ortvalue_input(name, _ortvalue(array))
    types = {o.name: o.type for o in session.get_outputs()}
    results = {}
    for name, shape in output_shapes.items():
        dtype = _OUTPUT_NP.get(types[name])
        if dtype is None:
            import ml_dtypes

            dtype = ml_dtypes.bfloat16
        results[name] = np.empty(shape, dtype=dtype)
        binding.bind_ortvalue_output(name, _ortvalue(results[name]))
    session.run_with_iobinding(binding)
    return results


_OUTPUT_NP = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64}


@dataclasses.dataclass
class CacheState:
    """What a runtime carries between steps: caches and how many tokens they hold (per batch row)."""

    keys: list
    values: list
    length: int


class OnnxCausalLM:
    def __init__(self, export_dir: Path, ep: str = "cpu", session_options=None, io_binding: bool = False):
        import onnxruntime as ort

        model_path = Path(export_dir) / MODEL_FILE
        if ep == "cuda" and "CUDAExecutionProvider" not in ort.get_available_providers():
            # ORT would quietly run on the CPU instead; a CUDA run that is not on CUDA proves nothing.
            raise RuntimeError(f"CUDAExecutionProvider is not available in this onnxruntime ({ort.__version__})")
        if session_options is None:
            session_options = ort.SessionOptions()
            # TensorScatter warns on every copy when caches are not bound in place; keep errors only.
            session_options.log_severity_level = 3
        meta = read_metadata(model_path)
        self.variant = Variant(meta["variant"])
        self.dtype = meta["dtype"]
        self.config = meta["config"]
        if self.dtype not in _NP_DTYPES:
            import ml_dtypes

            self.np_dtype = ml_dtypes.bfloat16
        else:
            self.np_dtype = _NP_DTYPES[self.dtype]
        self.session = ort.InferenceSession(str(model_path), session_options, providers=PROVIDERS[ep])
        self.input_names = {i.name for i in self.session.get_inputs()}
        self.io_binding = io_binding
        if io_binding and self.variant is not Variant.ATTN_STATIC:
            raise ValueError("in-place IO binding is the attn_static contract")

    @property
    def num_layers(self) -> int:
        return self.config["num_layers"]

    def new_state(self, batch: int = 1) -> CacheState:
        cfg = self.config
        if self.variant is Variant.ATTN_STATIC:  # [batch, positions, kv_heads*head_dim], allocated once
            shape = (batch, cfg["max_seq_len"], cfg["num_kv_heads"] * cfg["head_dim"])
        else:  # past_key_values: [batch, kv_heads, past, head_dim], empty before the prompt
            shape = (batch, cfg["num_kv_heads"], 0, cfg["head_dim"])
        keys = [np.zeros(shape, self.np_dtype) for _ in range(self.num_layers)]
        values = [np.zeros(shape, self.np_dtype) for _ in range(self.num_layers)]
        if self.io_binding:
            import onnxruntime as ort

            keys = [ort.OrtValue.ortvalue_from_numpy(k) for k in keys]
            values = [ort.OrtValue.ortvalue_from_numpy(v) for v in values]
        return CacheState(keys, values, 0)

    def forward(self, input_ids: np.ndarray, state: CacheState) -> np.ndarray:
        """Run ``input_ids`` [batch, seq] after ``state``'s tokens; returns logits, updates state."""
        batch, seq = input_ids.shape
        past = state.length
        feeds = {"input_ids": input_ids.astype(np.int64)}
        if "position_ids" in self.input_names:
            feeds["position_ids"] = np.tile(np.arange(past, past + seq, dtype=np.int64), (batch, 1))
        if "attention_mask" in self.input_names:
            feeds["attention_mask"] = np.ones((batch, past + seq), dtype=np.int64)
        if self.variant is Variant.ATTN_STATIC:
            if past + seq > self.config["max_seq_len"]:
                raise ValueError(f"{past + seq} tokens do not fit a {self.config['max_seq_len']}-token static cache")
            feeds.update(self.static_cache_counts(batch, past, seq))
        if self.io_binding:
            logits = self._run_bound(feeds, state)
        else:
            for i in range(self.num_layers):
                k_in, v_in, _, _ = cache_io_names(self.variant, i)
                feeds[k_in], feeds[v_in] = state.keys[i], state.values[i]
            if self.dtype == "bf16":
                outputs = run_numpy(self.session, feeds, self._output_shapes(batch, past + seq, seq))
            else:
                outputs = dict(zip([o.name for o in self.session.get_outputs()], self.session.run(None, feeds)))
            logits = outputs["logits"]
            for i in range(self.num_layers):
                _, _, k_out, v_out = cache_io_names(self.variant, i)
                state.keys[i], state.values[i] = outputs[k_out], outputs[v_out]
        state.length = past + seq
        return logits

    def _output_shapes(self, batch: int, total: int, seq: int) -> dict[str, tuple]:
        cfg = self.config
        if self.variant is Variant.ATTN_STATIC:
            cache = (batch, cfg["max_seq_len"], cfg["num_kv_heads"] * cfg["head_dim"])
        else:
            cache = (batch, cfg["num_kv_heads"], total, cfg["head_dim"])
        shapes = {"logits": (batch, seq, cfg["vocab_size"])}
        for i in range(self.num_layers):
            _, _, k_out, v_out = cache_io_names(self.variant, i)
            shapes[k_out] = shapes[v_out] = cache
        return shapes

    def static_cache_counts(self, batch: int, past: int, seq: int) -> dict[str, np.ndarray]:
        """write_indices = tokens already cached; nonpad_kv_seqlen = the count *after* this scatter.

        Counting before the scatter is the classic bug: the logits come out silently wrong.
        """
        return {
            "write_indices": np.full((batch,), past, dtype=np.int64),
            "nonpad_kv_seqlen": np.full((batch,), past + seq, dtype=np.int64),
        }

    def _run_bound(self, feeds: dict, state: CacheState) -> np.ndarray:
        """Bind each cache input and its updated output to the same buffer: the update is in place."""
        binding = self.session.io_binding()
        binding.bind_output("logits")  # first, so it is output 0
        for name, array in feeds.items():
            binding.bind_cpu_input(name, array)
        for i in range(self.num_layers):
            k_in, v_in, k_out, v_out = cache_io_names(self.variant, i)
            for name_in, name_out, buf in ((k_in, k_out, state.keys[i]), (v_in, v_out, state.values[i])):
                binding.bind_ortvalue_input(name_in, buf)
                binding.bind_ortvalue_output(name_out, buf)
        self.session.run_with_iobinding(binding)
        return binding.copy_outputs_to_cpu()[0]
