"""Give a traced graph's weights back their checkpoint sources, as lazy recipes.

transformers' exporter hands back a graph whose initializers are tensors in memory, some under the
model's parameter names, some renamed, transposed or packed by onnxscript's optimizer
(``packed_matmul_43`` = Q, K and V transposed side by side). The rest of the pipeline knows weights
as ``CheckpointTensor`` recipes: the weight gate checks each slice against its checkpoint tensor by
value, the quantize pass quantizes a ``MatMul`` on a transposed recipe, the manifest lists where
every initializer came from, and the writer streams it from the safetensors. This pass finds, for
every floating initializer, checkpoint tensors whose rows (or, transposed, columns) make it up,
converted to its dtype exactly as the recipe will convert them, and swaps the in-memory tensor for
that recipe. Nothing is assumed from a name: a match is bit for bit, and an initializer that matches
nothing (a rotary frequency buffer, a constant the optimizer folded) stays as it was and is
listed as computed.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import onnx_ir as ir

from exporter.graph.passes.dtype import make_initializer
from exporter.graph.passes.fold_concat import _packed_name
from exporter.packaging.checkpoint import Checkpoint, CheckpointTensor, WeightPart, convert

FLOATING = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
# A 1-D tensor is indexed by its first few values (a norm's weights all near 1.0 would collide on one).
KEY_VALUES = 16


def _bits(array: np.ndarray) -> np.ndarray:
    """The array's bytes as unsigned integers of its width: equality bit for bit (NaN, -0.0 included)."""
    return array.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[array.dtype.itemsize])


@dataclasses.dataclass
class _Candidate:
    name: str
    shape: tuple[int, ...]


class _RowIndex:
    """Checkpoint tensors (1-D and 2-D floating ones) by the bits of their first row, converted to one dtype."""

    def __init__(self, checkpoint: Checkpoint, dtype: ir.DataType):
        self.checkpoint, self.dtype = checkpoint, dtype
        self.by_key: dict[tuple, list[_Candidate]] = collections.defaultdict(list)
        self.stacked: dict[tuple, list[_Candidate]] = collections.defaultdict(list)  # 3-D ones, by expert 0's first row
        for name in checkpoint.names():
            stored = checkpoint.stored_dtype(name)
            shape = tuple(checkpoint.shape(name))
            if stored is None or stored not in (*FLOATING, ir.DataType.DOUBLE) or len(shape) not in (1, 2, 3) or not all(shape):
                continue
            if len(shape) == 3:
                row = convert(np.ascontiguousarray(checkpoint.array(name)[0, :1]), stored, dtype).reshape(-1)
                self.stacked[self._key(row)].append(_Candidate(name, shape))
            else:
                self.by_key[self._key(self._first_row(name, shape))].append(_Candidate(name, shape))

    def _first_row(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        rows = self.checkpoint.rows(name, 0, 1) if len(shape) == 2 else self.checkpoint.array(name)[:KEY_VALUES]
        return convert(np.ascontiguousarray(rows), self.checkpoint.stored_dtype(name), self.dtype).reshape(-1)

    @staticmethod
    def _key(row: np.ndarray) -> tuple:
        return row.shape, _bits(np.ascontiguousarray(row)).tobytes()

    def converted(self, name: str) -> np.ndarray:
        """The whole tensor in the index's dtype, as the recipe's writer will convert it (read again at
        each comparison: a match is compared once, and a kept copy of every weight would double memory)."""
        array = np.ascontiguousarray(self.checkpoint.array(name))
        return convert(array, self.checkpoint.stored_dtype(name), self.dtype)

    def parts_of(self, rows: np.ndarray, prefer: str = "") -> list[str] | None:
        """Checkpoint tensors whose rows, one after the other, are exactly ``rows`` (2-D, or 1-D
        values); None where no sequence of them is. ``prefer``: the name tried first on a tie."""
        found, at = [], 0
        while at < rows.shape[0]:
            head = rows[at] if rows.ndim == 2 else rows[at:at + KEY_VALUES]
            options = sorted(self.by_key.get(self._key(head), ()), key=lambda c: c.name != prefer)
            for option in options:
                n = option.shape[0]
                if rows.ndim != len(option.shape) or at + n > rows.shape[0] or rows.shape[1:] != option.shape[1:]:
                    continue
                if np.array_equal(_bits(np.ascontiguousarray(rows[at:at + n])), _bits(self.converted(option.name))):
                    found.append(option.name)
                    at += n
                    break
            else:
                return None
        return found


@dataclasses.dataclass(frozen=True)
class _Recipe:
    """Checkpoint tensors making up an initializer: rows concatenated (``transposed``: then transposed),
    or, for ``experts`` E, E experts' rows stacked along a new first axis (each part read transposed
    where ``WeightPart.transposed`` says)."""

    parts: tuple[WeightPart, ...]
    transposed: bool = False
    experts: int | None = None

    def name(self, traced_name: str) -> str:
        """The hand-built graphs' names: the checkpoint tensor, or the packed one's (``...q_k_v_proj.weight``,
        fold_concat's rule), ``.T`` when stored transposed (docs/graph-contracts.md, Weights); stacked experts
        keep transformers' own name for them."""
        if self.experts:
            return traced_name
        names = [p.name for p in self.parts]
        return (names[0] if len(names) == 1 else _packed_name(names)) + (".T" if self.transposed else "")

    def tensor(self, checkpoint: Checkpoint, dtype: ir.DataType, name: str) -> CheckpointTensor:
        return CheckpointTensor(checkpoint, self.parts, dtype, transposed=self.transposed, name=name,
                                experts=self.experts)

    def to_dict(self) -> dict:
        return {"parts": [p.name for p in self.parts], "transposed": self.transposed,
                **({"experts": self.experts} if self.experts else {})}


class CheckpointSourcesPass(ir.passes.InPlacePass):
    """Every floating initializer that is checkpoint tensors (rows concatenated, maybe transposed, or
    experts stacked) becomes a ``CheckpointTensor`` recipe over them, named as the hand-built graphs
    name their weights; ``computed`` lists the initializers left as they were."""

    def __init__(self, checkpoint: Checkpoint):
        super().__init__()
        self.checkpoint = checkpoint
        self.computed: list[str] = []
        self.sourced: dict[str, dict] = {}  # new initializer name -> its recipe

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        indexes: dict[ir.DataType, _RowIndex] = {}
        groups: dict[str, list[ir.Value]] = collections.defaultdict(list)  # recipe name -> initializers it is
        recipes: dict[str, tuple[_Recipe, ir.DataType]] = {}
        for value in list(graph.initializers.values()):
            tensor = value.const_value
            if tensor is None or tensor.dtype not in FLOATING or len(tensor.shape) not in (1, 2, 3) or tensor.size < 2 \
                    or isinstance(tensor, CheckpointTensor):
                continue
            index = indexes.get(tensor.dtype) or indexes.setdefault(tensor.dtype, _RowIndex(self.checkpoint, tensor.dtype))
            recipe = _recipe(index, tensor.numpy(), value.name)
            if recipe is None:
                self.computed.append(value.name)
                continue
            name = recipe.name(value.name)
            groups[name].append(value)
            recipes[name] = (recipe, tensor.dtype)
        for name, values in groups.items():
            recipe, dtype = recipes[name]
            # One initializer per recipe (a tied table gathered by one node and multiplied by another is stored
            # once): the one already named so keeps its place, else a new one; the others' uses move to it.
            keeper = next((v for v in values if v.name == name), None)
            if keeper is not None:
                keeper.const_value = recipe.tensor(self.checkpoint, dtype, name)
            else:
                if name in graph.initializers:  # an unrelated initializer holds the name (it matched nothing)
                    name = f"{name}.checkpoint"
                keeper = make_initializer(graph, recipe.tensor(self.checkpoint, dtype, name), name)
            for value in values:
                if value is not keeper:
                    value.replace_all_uses_with(keeper)
                    graph.initializers.pop(value.name)
            self.sourced[keeper.name] = recipe.to_dict()
        return ir.passes.PassResult(model, modified=bool(groups))


def _recipe(index: _RowIndex, array: np.ndarray, name: str) -> _Recipe | None:
    """The checkpoint tensors making up ``array``: its rows as stored (a norm, a bias, an embedding, GPT-2's
    [in, out] Conv1D weight), else its columns (a Linear's [out, in] weight the optimizer pre-transposed for
    MatMul, maybe several packed side by side); a 3-D one expert by expert (transformers 5 stacks experts
    stored one by one: gate and up concatenated, or one tensor read transposed)."""
    if array.ndim == 3:
        return _experts_recipe(index, array, name)
    parts = index.parts_of(array, prefer=name)
    if parts is not None:
        return _Recipe(tuple(WeightPart(p) for p in parts))
    if array.ndim == 2:
        parts = index.parts_of(np.ascontiguousarray(array.T), prefer=name)
        if parts is not None:
            return _Recipe(tuple(WeightPart(p) for p in parts), transposed=True)
    return None


def _experts_recipe(index: _RowIndex, array: np.ndarray, name: str) -> _Recipe | None:
    for option in index.stacked.get(index._key(np.ascontiguousarray(array[0, 0])), ()):  # stored stacked already
        if option.shape == array.shape and np.array_equal(_bits(np.ascontiguousarray(array)),
                                                          _bits(index.converted(option.name))):
            return _Recipe(tuple(WeightPart(option.name, expert=e) for e in range(len(array))), experts=len(array))
    parts: list[WeightPart] = []
    for expert in array:
        found = index.parts_of(np.ascontiguousarray(expert), prefer=name)
        if found is not None:
            parts += [WeightPart(p) for p in found]
            continue
        found = index.parts_of(np.ascontiguousarray(expert.T), prefer=name)
        if found is None or len(found) != 1:  # [gate^T | up^T] side by side: no recipe reads columns of two parts
            return None
        parts.append(WeightPart(found[0], transposed=True))
    return _Recipe(tuple(parts), experts=len(array))
