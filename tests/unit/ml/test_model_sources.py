"""Modules from anywhere: a module's weightless template, TorchScript and torch.export files."""
from __future__ import annotations

import io

import pytest
import torch
from pyspark import cloudpickle
from torch import nn

from sparkdl.ml._model_sources import ModuleTemplate, SavedProgram, carries_weights


class Tied(nn.Module):
    """Tied weights, a persistent and a non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(1000, 64)
        self.out = nn.Linear(64, 1000, bias=False)
        self.out.weight = self.embed.weight
        self.register_buffer("scale", torch.full((64,), 0.5))
        self.register_buffer("offset", torch.arange(64.0), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.embed(ids) * self.scale + self.offset)


def test_a_template_pickles_without_the_weights_and_builds_the_module_they_fill():
    torch.manual_seed(0)
    module = Tied().eval()
    template = ModuleTemplate(module)
    state_bytes = 1000 * 64 * 4
    assert len(cloudpickle.dumps(template)) < state_bytes / 10       # the weights are not in it
    built = cloudpickle.loads(cloudpickle.dumps(template))()
    assert built.out.weight is built.embed.weight                     # still tied
    assert torch.equal(built.offset, torch.arange(64.0))              # outside the state dict: kept
    built.load_state_dict(module.state_dict())
    ids = torch.tensor([[1, 5, 999]])
    assert torch.equal(built.eval()(ids), module(ids))
    assert not module.embed.weight.is_meta and not carries_weights(template)


def saved(save, module) -> bytes:
    buffer = io.BytesIO()
    save(module, buffer)
    return buffer.getvalue()


MLP = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).eval()
X = torch.randn(5, 4)


def test_torchscript_and_dynamic_batch_export_programs_load_with_their_weights():
    scripted = SavedProgram(saved(torch.jit.save, torch.jit.script(MLP)))
    exported = SavedProgram(saved(torch.export.save, torch.export.export(
        MLP, (X,), dynamic_shapes=({0: torch.export.Dim("batch")},))))
    assert (scripted.format, exported.format) == ("torchscript", "export")
    for program in (scripted, exported):
        program.check()
        assert carries_weights(program)
        rebuilt = cloudpickle.loads(cloudpickle.dumps(program))()
        assert torch.allclose(rebuilt(X[:2]), MLP(X[:2])) and torch.allclose(rebuilt(X), MLP(X))


def test_a_program_for_one_batch_size_and_a_state_dict_are_refused_with_what_to_do():
    static = SavedProgram(saved(torch.export.save, torch.export.export(MLP, (X,))))
    with pytest.raises(ValueError, match="exported for one batch size.*dynamic_shapes"):
        static.check()
    with pytest.raises(ValueError, match=r"neither a TorchScript module .* TorchModel.from_module\(factory, "
                                         r"state_dict=path\)"):
        SavedProgram(saved(torch.save, MLP.state_dict()))
