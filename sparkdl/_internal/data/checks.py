"""Row checks before any update: NaN/Inf values, negative ids, rows too long, bad labels or weights.

The tasks run them as they load their partitions (Arrow batches or RDD rows), against the
:class:`DataRules` the driver learned from the first row and the model.  Messages name the
row by its position in the partition, the column, the count, and what to do.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sparkdl._internal.data.block import Ragged, RowBlock, is_encoded
from sparkdl._internal.data.columns import ColumnSpec
from sparkdl.errors import DataError


@dataclass(frozen=True)
class DataRules:
    """What the driver learned (from the schema or the first row, and the model) for every task to check rows against.

    The tasks check their partitions while loading them, before any update: the driver need not scan
    the data first (one Spark job fewer per fit).
    """

    width: int | None = None        # feature values per row (featuresCol/featuresCols)
    classes: int | None = None      # a classifier's labels: integers in [0, classes)
    max_length: int | None = None   # ragged inputs: elements per row at most


def check_block(block: RowBlock, spec: ColumnSpec, rules: DataRules, first_row: int = 0) -> None:
    """Refuse rows no update may see: NaN/Inf values, negative ids, rows too long, bad labels or weights."""
    last = first_row + len(block) - 1
    labels = block.labels if block.labels is not None else np.zeros(0)
    # featuresCols are glued into one input
    names = spec.input_columns if spec.typed else [", ".join(spec.input_columns)]
    for name, field in zip(names, block.inputs, strict=True):
        if is_encoded(field):
            continue
        if isinstance(field, Ragged):
            values, starts = field.values, field.offsets
            _check_length(field, name, rules, first_row)
        else:
            values, starts = field.reshape(len(field), -1), None
            if not spec.typed and rules.width is not None and values.shape[1] != rules.width:
                raise DataError(f"rows {first_row} to {last} of the partition have {values.shape[1]} feature values, "
                                f"where {rules.width} are expected (the first row's count, or the schema's: "
                                "featuresShape, the Vector column's size)")

        def row_of(position: int, starts: np.ndarray | None = starts) -> int:
            """The row holding ``values``' entry ``position``."""
            return position if starts is None else int(np.searchsorted(starts, position, side="right")) - 1

        if values.dtype.kind == "f":
            bad = ~np.isfinite(values.reshape(len(values), -1)).all(axis=1)
            if bad.any():
                if not spec.typed:      # the message of one float matrix, with the row's values
                    check_finite(values, labels, first_row)
                raise DataError(f"row {first_row + row_of(int(np.argmax(bad)))} of the partition has NaN or infinite "
                                f"values (as float32) in column {name!r} ({int(bad.sum())} such values among its rows "
                                f"{first_row} to {last}); drop, clip or impute them before training")
        elif values.dtype.kind == "i" and spec.typed and values.size and values.min() < 0:
            flat = values.reshape(-1)
            position = int(np.argmin(flat))
            # dense values are [rows, width], ragged ones flat
            row = row_of(position) if starts is not None else position // values.shape[1]
            raise DataError(f"row {first_row + row} of the partition has the id {int(flat[position])} in column "
                            f"{name!r} ({int((flat < 0).sum())} negative values); integer inputs reach the model as "
                            "int64 ids (an nn.Embedding index), which must be >= 0: map them with StringIndexer, or "
                            "cast the column to double if it is a number rather than an id")
    check_finite(np.zeros((len(block), 0), np.float32), labels, first_row)
    if block.labels is not None and rules.classes is not None:
        check_class_labels_of(block.labels, rules.classes, first_row)
    if block.weights is not None:
        bad = ~np.isfinite(block.weights) | (block.weights < 0)
        if bad.any():
            i = int(np.argmax(bad))
            raise DataError(f"row {first_row + i} of the partition has the weight {block.weights[i]:g} in column "
                            f"{spec.weight_col!r} ({int(bad.sum())} such rows); weights must be finite and >= 0")


def _check_length(field: Ragged, name: str, rules: DataRules, first_row: int) -> None:
    if rules.max_length is None or not len(field):
        return
    lengths = field.lengths
    if lengths.max() > rules.max_length:
        row = int(np.argmax(lengths))
        raise DataError(f"row {first_row + row} of the partition holds {int(lengths[row])} elements in column "
                        f"{name!r}, more than sequence_length={rules.max_length} allows "
                        f"({int((lengths > rules.max_length).sum())} such rows); truncate them "
                        f"(F.slice({name!r}, 1, {rules.max_length})) or raise the bound")


def check_class_labels_of(labels: np.ndarray, classes: int, first_row: int = 0) -> None:
    """A classifier's labels must be integers in [0, classes): they index the model's outputs."""
    values = labels.reshape(len(labels), -1)[:, 0].astype(np.float64, copy=False)
    bad = (values != np.floor(values)) | (values < 0) | (values >= classes)
    if bad.any():
        i = int(np.argmax(bad))
        raise DataError(f"row {first_row + i} of the partition has the label {values[i]:g} ({int(bad.sum())} such rows); "
                        f"class labels must be integers in [0, {classes})")


def check_finite(features: np.ndarray, labels: np.ndarray, first_row: int = 0) -> None:
    """Refuse NaN/Inf in features or labels, naming the first offending row of the partition (or partition).

    One vectorized pass over the stacked arrays; a non-finite row would otherwise only show up
    as gradients the parameter server skips, and the run would "succeed" on part of the data.
    """
    finite_rows = np.isfinite(features.reshape(len(features), -1)).all(axis=1)
    if not finite_rows.all():
        i = int(np.argmin(finite_rows))
        # one line: the driver reads a task's error from the last line of its traceback
        values = np.array2string(features[i].reshape(-1), threshold=8, edgeitems=3, max_line_width=1 << 30)
        raise DataError(f"row {first_row + i} of the partition has NaN or infinite feature values (as float32) "
                         f"({int((~finite_rows).sum())} such rows among its rows {first_row} to "
                         f"{first_row + len(features) - 1}; row {first_row + i}: {values}); "
                         "drop, clip or impute them before training")
    if labels.dtype.kind in "fc":          # integer and boolean labels are always finite
        finite_labels = np.isfinite(labels.reshape(len(labels), -1)).all(axis=1)
        if not finite_labels.all():
            i = int(np.argmin(finite_labels))
            raise DataError(f"row {first_row + i} of the partition has a NaN or infinite label "
                             f"({labels[i].tolist()!r}; {int((~finite_labels).sum())} such rows among its rows "
                             f"{first_row} to {first_row + len(labels) - 1}); drop or fix them "
                             "before training")

