"""What TorchModel.transform adds to each row: the kinds of model output, their columns, and their Arrow form.

A model's output is read as one of :data:`OUTPUT_KINDS`: the classifier kinds add a prediction and a
probability (and, on request, the ``k`` likeliest classes), the regression kinds a number or a Vector, and
``"embedding"`` the raw output as ``array<float>`` (one column per output of a model with several).  Any
kind can add the raw output as a Vector (``rawPredictionCol``, Spark ML's name for it).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from pyspark.sql import types as T

#: how a model's output becomes columns (TorchModel's ``outputKind``; "auto" reads it off the fitted loss)
OUTPUT_KINDS = ("multiclass", "binary", "multilabel", "regression", "multioutput", "embedding")
#: kinds with a probability column
CLASSIFIERS = ("multiclass", "binary", "multilabel")
#: kinds whose prediction is a Vector (one value per output), not one number
VECTOR_KINDS = ("multilabel", "multioutput")

#: Arrow layout of a dense pyspark.ml Vector (VectorUDT's struct)
VECTOR_TYPE = pa.struct([pa.field("type", pa.int8(), nullable=False), pa.field("size", pa.int32()),
                         pa.field("indices", pa.list_(pa.field("element", pa.int32(), nullable=False))),
                         pa.field("values", pa.list_(pa.field("element", pa.float64(), nullable=False)))])


def prediction_task(loss: Any, output_width: int) -> str:
    """The output kind a fitted loss implies: "multiclass", "binary", "multilabel" (bce_with_logits with
    several outputs), "regression" or "multioutput" (mse with several outputs)."""
    if loss == "cross_entropy":
        return "multiclass"
    if loss == "bce_with_logits":
        return "multilabel" if output_width > 1 else "binary"
    if loss == "mse":
        return "multioutput" if output_width > 1 else "regression"
    return "multiclass" if output_width > 1 else "regression"


@dataclass(frozen=True)
class OutputSpec:
    """The columns a transform adds, and from which part of the model's output."""

    kind: str
    prediction_col: str
    probability_col: str | None = None      # classifiers only; None: not added
    raw_prediction_col: str | None = None   # the raw output as a Vector; None: not added
    top_k: int = 0                          # > 0: the k likeliest classes, likeliest first (classifiers)
    top_k_col: str = "topK"
    #: "embedding" of a model returning several outputs (a tuple, list or dict): one array column per output,
    #: named here (a dict's outputs by key, a sequence's in order); empty: the output (or its first) in prediction
    output_cols: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in OUTPUT_KINDS:
            raise ValueError(f"outputKind must be one of {', '.join(map(repr, ('auto', *OUTPUT_KINDS)))}, "
                             f"got {self.kind!r}")
        if self.top_k < 0:
            raise ValueError(f"topK must be 0 (no top-k column) or a number of classes, got {self.top_k}")
        if self.top_k and self.kind not in ("multiclass", "multilabel"):
            raise ValueError(f"topK ranks classes: it needs outputKind 'multiclass' or 'multilabel', not {self.kind!r}")
        if self.output_cols and self.kind != "embedding":
            raise ValueError(f"outputCols names the outputs of an 'embedding' model, not of a {self.kind!r} one: "
                             "set outputKind='embedding' or leave outputCols empty")

    @property
    def names(self) -> list[str]:
        """The added columns' names, in order."""
        if self.output_cols:
            return list(self.output_cols)
        names = [self.prediction_col]
        if self.probability_col and self.kind in CLASSIFIERS:
            names.append(self.probability_col)
        if self.raw_prediction_col:
            names.append(self.raw_prediction_col)
        if self.top_k:
            names.append(self.top_k_col)
        return names

    def fields(self, vectors_as_arrays: bool = False) -> list[T.StructField]:
        """The added columns as Spark fields (nullable: ``handleInvalid="keep"`` leaves invalid rows' empty);
        ``vectors_as_arrays``: Vectors as ``array<double>`` (what a SQL function returns)."""
        return [T.StructField(name, self._spark_type(name, vectors_as_arrays), True) for name in self.names]

    def _spark_type(self, name: str, vectors_as_arrays: bool = False) -> T.DataType:
        kind = self._column_type(name)
        if kind is not None:
            return kind
        if vectors_as_arrays:
            return T.ArrayType(T.DoubleType(), containsNull=False)
        # imported here: pyspark.ml's package import costs a Python worker about a second, and the workers
        # only write a Vector's Arrow layout
        from pyspark.ml.linalg import VectorUDT
        return VectorUDT()

    def _column_type(self, name: str) -> T.DataType | None:
        """Column ``name``'s Spark type; None for a Vector."""
        if name in self.output_cols or (name == self.prediction_col and self.kind == "embedding"):
            return T.ArrayType(T.FloatType(), containsNull=False)
        if name == self.prediction_col:
            return None if self.kind in VECTOR_KINDS else T.DoubleType()
        if self.top_k and name == (self.top_k_col):
            return T.ArrayType(T.IntegerType(), containsNull=False)
        return None      # probability, raw prediction

    def empty(self, name: str) -> np.ndarray:
        """The values of column ``name`` for no rows, in its dtype."""
        kind = self._column_type(name)
        if isinstance(kind, T.ArrayType):
            return np.zeros((0, 0), np.int32 if isinstance(kind.elementType, T.IntegerType) else np.float32)
        return np.zeros(0) if isinstance(kind, T.DoubleType) else np.zeros((0, 0))

    def columns_of(self, output: Any) -> dict[str, torch.Tensor]:
        """One model batch's output as the added columns' values (on the output's device, one row per sample)."""
        if self.output_cols:
            return dict(zip(self.output_cols, _several(output, self.output_cols), strict=True))
        out = first_output(output)
        rows = len(out)
        flat = out.reshape(rows, -1)
        values: dict[str, torch.Tensor] = {}
        if self.kind == "embedding":
            values[self.prediction_col] = flat.float()
        else:
            logits = flat.float()
            if self.kind == "multiclass":
                probability = torch.softmax(logits, dim=1)
                values[self.prediction_col] = logits.argmax(dim=1).double()
            elif self.kind == "binary":
                p = torch.sigmoid(logits[:, 0])
                values[self.prediction_col] = (p > 0.5).double()
                probability = torch.stack([1 - p, p], dim=1)
            elif self.kind == "multilabel":     # one probability per label; predicted labels as a 0/1 Vector
                probability = torch.sigmoid(logits)
                values[self.prediction_col] = (probability > 0.5).double()
            elif self.kind == "multioutput":
                values[self.prediction_col] = logits.double()
            else:
                values[self.prediction_col] = logits[:, 0].double()
            if self.probability_col and self.kind in CLASSIFIERS:
                values[self.probability_col] = probability.double()
            if self.top_k:
                k = min(self.top_k, probability.shape[1])
                values[self.top_k_col] = probability.topk(k, dim=1).indices.int()
        if self.raw_prediction_col:
            values[self.raw_prediction_col] = flat.double()
        return values

    def to_arrow(self, values: Mapping[str, np.ndarray], missing: np.ndarray | None,
                 null_numbers: bool = False, vectors_as_arrays: bool = False) -> list[pa.Array]:
        """The added columns of one Arrow batch, null where ``missing`` (a double NaN, as Spark ML's transformers
        leave it, unless ``null_numbers``); ``vectors_as_arrays`` as in :meth:`fields`."""
        arrays = []
        for name in self.names:
            data = values[name]
            kind = self._column_type(name)
            if isinstance(kind, T.DoubleType):
                mask = missing if null_numbers and missing is not None and missing.any() else None
                arrays.append(pa.array(_spread(data.reshape(len(data)), missing), pa.float64(), mask=mask))
            elif isinstance(kind, T.ArrayType):
                arrays.append(fixed_width_lists(data, missing, double=isinstance(kind.elementType, T.DoubleType)))
            elif vectors_as_arrays:
                arrays.append(fixed_width_lists(data, missing, double=True))
            else:
                arrays.append(dense_vectors(data, missing))
        return arrays


def first_output(output: Any) -> torch.Tensor:
    """The output a single-output kind reads: the tensor, or the first of a tuple, list or dict (logits first, as
    most libraries return them)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping) and output:
        return first_output(next(iter(output.values())))
    if isinstance(output, Sequence) and not isinstance(output, str | bytes) and output:
        return first_output(output[0])
    raise TypeError(f"the model returned {type(output).__name__}, not a tensor (or a tuple, list or dict of them)")


def _several(output: Any, names: tuple[str, ...]) -> list[torch.Tensor]:
    """The outputs ``names`` takes: a dict's by key, a tuple's or list's in order; each flattened per row."""
    if isinstance(output, Mapping):
        missing = [name for name in names if name not in output]
        if missing:
            raise ValueError(f"outputCols names {missing}, which the model's output does not have; it has "
                             f"{list(output)}")
        chosen = [output[name] for name in names]
    elif isinstance(output, Sequence) and not isinstance(output, str | bytes):
        if len(output) != len(names):
            raise ValueError(f"the model returned {len(output)} outputs and outputCols names {len(names)}: name "
                             "one column per output")
        chosen = list(output)
    else:
        raise ValueError(f"outputCols names {len(names)} outputs, but the model returned one "
                         f"{type(output).__name__}: leave outputCols empty for a model with a single output")
    tensors = [first_output(value) for value in chosen]
    return [tensor.reshape(len(tensor), -1).float() for tensor in tensors]


def _spread(values: np.ndarray, missing: np.ndarray | None) -> np.ndarray:
    """The valid rows' ``values`` in their places among all rows (NaN at the missing ones)."""
    if missing is None or not missing.any():
        return values
    out = np.full((len(missing), *values.shape[1:]), np.nan)
    out[~missing] = values
    return out


def _matrix(values: np.ndarray) -> np.ndarray:
    """One row per sample (an empty batch's values as 0 x 0)."""
    return values.reshape(len(values), -1) if values.size else values.reshape(len(values), 0)


def _row_offsets(rows: int, width: int, missing: np.ndarray | None) -> tuple[pa.Array, pa.Array | None]:
    """List offsets of ``rows`` lists of ``width`` values where only the valid rows hold values, and the mask."""
    if missing is None or not missing.any():
        return pa.array(np.arange(rows + 1, dtype=np.int32) * width), None
    lengths = np.where(missing, 0, width).astype(np.int32)
    return pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)), pa.array(missing)


def fixed_width_lists(values: np.ndarray, missing: np.ndarray | None = None, double: bool = False) -> pa.ListArray:
    """A matrix of the valid rows as an Arrow list column (float32, float64 with ``double``, or int32 values), null
    where ``missing``."""
    rows = len(missing) if missing is not None else len(values)
    flat = _matrix(values)
    offsets, mask = _row_offsets(rows, flat.shape[1], missing)
    element = pa.float64() if double else pa.float32() if flat.dtype.kind == "f" else pa.int32()
    items = pa.array(flat.reshape(-1).astype(element.to_pandas_dtype(), copy=False))
    lists = pa.ListArray.from_arrays(offsets, items, mask=mask)
    return lists.cast(pa.list_(pa.field("element", element, nullable=False)))


def dense_vectors(values: np.ndarray, missing: np.ndarray | None = None) -> pa.StructArray:
    """The valid rows of a matrix as an Arrow column of dense Spark ML vectors, null where ``missing``."""
    rows = len(missing) if missing is not None else len(values)
    flat = _matrix(values)
    offsets, mask = _row_offsets(rows, flat.shape[1], missing)
    lists = pa.ListArray.from_arrays(offsets, pa.array(flat.reshape(-1).astype(np.float64, copy=False)))
    return pa.StructArray.from_arrays(
        [pa.array(np.ones(rows, dtype=np.int8)), pa.nulls(rows, pa.int32()),
         pa.nulls(rows, VECTOR_TYPE.field("indices").type), lists.cast(VECTOR_TYPE.field("values").type)],
        fields=list(VECTOR_TYPE), mask=mask)
