"""How a batch's inputs reach the model's ``forward``: positionally, or as keyword arguments with their masks.

``inputArgs`` names one keyword argument per input column; a ragged input named ``ids`` also
hands its mask (bool ``[batch, length]``, True at real elements) as ``ids_mask`` when
``forward`` has a parameter of that name (``nn.Transformer`` users pass ``~ids_mask`` as
``key_padding_mask``; Hugging Face's ``attention_mask`` is ``ids_mask.long()``).
"""
from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


def forward_parameters(module: nn.Module) -> dict[str, inspect.Parameter]:
    """``forward``'s parameters by name (empty when the signature cannot be read)."""
    try:
        return dict(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return {}


@dataclass(frozen=True)
class ModelCall:
    """Calls a module with a batch's inputs: ``module(*inputs)``, or ``module(**{arg: input, arg_mask: mask})``."""

    args: tuple[str, ...] = ()
    #: per input: the keyword its mask goes to (None: the mask is not passed)
    mask_args: tuple[str | None, ...] = ()

    @classmethod
    def for_module(cls, module: nn.Module, args: Sequence[str] = ()) -> ModelCall:
        """The call for ``module``: masks go to ``<arg>_mask`` where its ``forward`` names that parameter."""
        if not args:
            return cls()
        accepted = forward_parameters(module)
        return cls(tuple(args), tuple(f"{arg}_mask" if f"{arg}_mask" in accepted else None for arg in args))

    def arguments(self, inputs: Sequence[Any], masks: Sequence[torch.Tensor | None] = ()
                  ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """(positional, keyword) arguments of the call."""
        if not self.args:
            return tuple(inputs), {}
        if len(inputs) != len(self.args):
            raise ValueError(f"the batch has {len(inputs)} inputs for the {len(self.args)} inputArgs {list(self.args)}; "
                             "a batchTransform must return one tensor per input column")
        kwargs = dict(zip(self.args, inputs, strict=True))
        for name, mask in zip(self.mask_args, masks, strict=False):
            if name is not None and mask is not None:
                kwargs[name] = mask
        return (), kwargs

    def __call__(self, module: nn.Module, inputs: Sequence[Any], masks: Sequence[torch.Tensor | None] = ()) -> Any:
        args, kwargs = self.arguments(inputs, masks)
        return module(*args, **kwargs)


#: ``module(*inputs)``: the call of a model with positional inputs
POSITIONAL = ModelCall()
