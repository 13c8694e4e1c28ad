"""Models TorchModel scores that were not fitted here: a user's module, or a TorchScript / torch.export file.

Each becomes the ``model`` Param's zero-argument factory, so scoring, saving and logging treat them as they
treat a fitted model's:

* :class:`ModuleTemplate` keeps a module's structure with meta tensors in place of those its state dict holds
  (the weights travel once, as the model's state dict, not twice);
* :class:`SavedProgram` keeps a TorchScript or ``torch.export`` file's bytes, weights included, and loads the
  program on each Python worker.
"""
from __future__ import annotations

import copy
import io
import zipfile
from typing import Any

import torch
from torch import nn

#: the formats :class:`SavedProgram` reads
PROGRAM_FORMATS = ("torchscript", "export")


def _twin(tensor: torch.Tensor, device: str) -> torch.Tensor:
    """An uninitialised tensor like ``tensor`` on ``device``, a Parameter where it is one."""
    twin = torch.empty_like(tensor, device=device)
    return nn.Parameter(twin, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else twin


class ModuleTemplate:
    """A zero-argument factory of copies of ``module`` whose state-dict tensors are uninitialised.

    The module is deep-copied with every tensor of its state dict (parameters and persistent buffers)
    replaced by a meta tensor of the same shape and dtype, so the template pickles without its weights;
    calling it materialises those on the CPU (tied parameters stay tied) for ``load_state_dict`` to fill.
    Tensors outside the state dict (non-persistent buffers, such as position ids) keep their values.
    """

    def __init__(self, module: nn.Module) -> None:
        state = module.state_dict(keep_vars=True)
        memo: dict[int, Any] = {}
        for tensor in state.values():
            if id(tensor) not in memo:
                memo[id(tensor)] = _twin(tensor, "meta")
        self.template = copy.deepcopy(module, memo)
        self.name = type(module).__name__

    def __call__(self) -> nn.Module:
        module = copy.deepcopy(self.template)
        made: dict[int, torch.Tensor] = {}

        for child in module.modules():
            groups: tuple[dict[str, Any], ...] = (child._parameters, child._buffers)
            for group in groups:
                for name, tensor in group.items():
                    if tensor is not None and tensor.is_meta:
                        if id(tensor) not in made:   # one twin per tensor: tied ones stay tied
                            made[id(tensor)] = _twin(tensor, "cpu")
                        group[name] = made[id(tensor)]
        return module

    def __repr__(self) -> str:
        return f"ModuleTemplate({self.name})"


def program_format(data: bytes) -> str:
    """"torchscript" or "export" for a file of either; a ValueError saying what it is otherwise."""
    try:
        names = zipfile.ZipFile(io.BytesIO(data)).namelist()
    except zipfile.BadZipFile:
        names = []
    if any(name.endswith("serialized_exported_program.json") or name.endswith("/archive_format")
           or name == "archive_format" for name in names):
        return "export"
    if any("/code/" in name for name in names) and any(name.endswith("constants.pkl") for name in names):
        return "torchscript"
    raise ValueError("this file is neither a TorchScript module (torch.jit.save) nor a torch.export program "
                     "(torch.export.save); for a state dict (torch.save(model.state_dict())) give the module that "
                     "takes it: TorchModel.from_module(factory, state_dict=path)")


def _batch_is_dynamic(program: Any) -> bool:
    """Every tensor input's first dimension is symbolic (the program takes any batch size)."""
    inputs = [node for node in program.graph.nodes if node.op == "placeholder"
              and node.name in set(program.graph_signature.user_inputs)]
    shapes = [node.meta["val"].shape for node in inputs if isinstance(node.meta.get("val"), torch.Tensor)]
    return all(len(shape) > 0 and not isinstance(shape[0], int) for shape in shapes)


class SavedProgram:
    """A zero-argument factory of the module a TorchScript or ``torch.export`` file holds, weights included."""

    def __init__(self, data: bytes, fmt: str | None = None) -> None:
        self.data = data
        self.format = fmt or program_format(data)
        if self.format not in PROGRAM_FORMATS:
            raise ValueError(f"a saved program's format is one of {PROGRAM_FORMATS}, got {self.format!r}")

    def check(self) -> None:
        """Load it once (on the driver): a clear error now for a file the workers could not use."""
        if self.format == "export":
            program = torch.export.load(io.BytesIO(self.data))
            if not _batch_is_dynamic(program):
                raise ValueError(
                    "this torch.export program was exported for one batch size; export it with a dynamic batch "
                    "dimension, e.g. torch.export.export(model, (x,), dynamic_shapes=({0: torch.export.Dim("
                    "'batch')},)), so that it scores batches of any size")
        else:
            torch.jit.load(io.BytesIO(self.data), map_location="cpu")

    def __call__(self) -> nn.Module:
        return self.module_on(torch.device("cpu"))

    def module_on(self, device: torch.device) -> nn.Module:
        """The program's module on ``device``, ready to score: a TorchScript module in eval mode; an exported
        program as it was exported (export the model in eval mode: its graph cannot be switched after)."""
        if self.format == "export":
            program = torch.export.load(io.BytesIO(self.data))
            if device.type != "cpu":
                from torch.export.passes import move_to_device_pass

                program = move_to_device_pass(program, device)
            return program.module()
        return torch.jit.load(io.BytesIO(self.data), map_location=device).eval()

    def __repr__(self) -> str:
        return f"SavedProgram({self.format}, {len(self.data)} bytes)"


def carries_weights(model_fn: Any) -> bool:
    """The factory's modules come with their weights (a saved program): no state dict is loaded into them."""
    return isinstance(model_fn, SavedProgram)
