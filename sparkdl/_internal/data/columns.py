"""Which DataFrame columns hold the model's inputs, the label and the row weights."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ColumnSpec:
    """Which columns hold the model's inputs, the label and the row weights, and how to shape them."""

    features_col: str | None = "features"
    features_cols: tuple[str, ...] = ()
    label_col: str | None = "label"
    features_shape: tuple[int, ...] | None = None
    #: one model input per column, each in its own dtype (instead of featuresCol/featuresCols)
    input_cols: tuple[str, ...] = ()
    #: per input column: the shape one row is reshaped to (None: as it comes)
    input_shapes: tuple[tuple[int, ...] | None, ...] = ()
    weight_col: str | None = None
    #: keyword argument names of ``forward``, one per input column (empty: positional ``model(*inputs)``)
    input_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.features_col and not self.features_cols and not self.input_cols:
            raise ValueError("set featuresCol, featuresCols or inputCols")
        if self.input_cols and self.features_cols:
            raise ValueError("set either inputCols (one model input per column) or featuresCols (one float input "
                             "assembled from the columns), not both")
        if len(set(self.input_cols)) != len(self.input_cols):
            raise ValueError(f"inputCols names a column twice: {list(self.input_cols)}")
        if self.input_args and len(self.input_args) != len(self.input_cols):
            raise ValueError(f"inputArgs names {len(self.input_args)} arguments for {len(self.input_cols)} inputCols; "
                             "give one argument name per input column")
        if len(set(self.input_args)) != len(self.input_args):
            raise ValueError(f"inputArgs names an argument twice: {list(self.input_args)}")
        if self.input_shapes and len(self.input_shapes) != len(self.input_cols):
            raise ValueError(f"inputShapes has {len(self.input_shapes)} entries for {len(self.input_cols)} inputCols")
        for shape in [self.features_shape, *self.input_shapes]:
            if shape is not None and any(int(d) < 1 for d in shape):
                raise ValueError(f"a row shape must hold positive sizes, got {list(shape)}")

    @property
    def typed(self) -> bool:
        """One model input per column (``inputCols``), not one float matrix."""
        return bool(self.input_cols)

    @property
    def input_columns(self) -> list[str]:
        if self.input_cols:
            return list(self.input_cols)
        return list(self.features_cols) if self.features_cols else [self.features_col]  # type: ignore[list-item]

    @property
    def columns(self) -> list[str]:
        extra = [c for c in (self.label_col, self.weight_col) if c]
        return self.input_columns + extra

    def shape_of(self, index: int) -> tuple[int, ...] | None:
        return self.input_shapes[index] if self.input_shapes else None
