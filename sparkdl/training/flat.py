"""A model's parameters as one contiguous float32 buffer.

The parameter server keeps the master weights as one flat tensor, and each worker's
replica stores its parameters (and their gradients) as views into one flat tensor, so the
bytes on the wire are those buffers themselves: no per-parameter copies on the hot path.

"Float buffers" here are a model's floating-point ``nn.Module`` buffers (BatchNorm running
statistics ...), which are not trained but averaged across replicas at the end.
"""
from __future__ import annotations

import torch
from torch import nn


def parameter_count(model: nn.Module) -> int:
    """Number of trainable values (the length of the flat parameter vector)."""
    return sum(p.numel() for p in model.parameters())


def flatten_parameters(model: nn.Module) -> torch.Tensor:
    """A new flat float32 CPU copy of the model's parameters, in ``model.parameters()`` order."""
    params = [p.detach().reshape(-1).to("cpu", torch.float32) for p in model.parameters()]
    if not params:
        raise ValueError("the model has no parameters to train")
    return torch.cat(params)


def floating_buffers(model: nn.Module) -> list[torch.Tensor]:
    """Buffers averaged across replicas at the end (e.g. BatchNorm running statistics)."""
    return [b for b in model.buffers() if b.is_floating_point()]


def flatten_buffers(model: nn.Module) -> torch.Tensor:
    """A new flat float32 CPU copy of the model's float buffers (empty when it has none)."""
    buffers = [b.detach().reshape(-1).to("cpu", torch.float32) for b in floating_buffers(model)]
    return torch.cat(buffers) if buffers else torch.zeros(0)


def load_flat_buffers(model: nn.Module, flat: torch.Tensor) -> None:
    """Copy a flat buffer into the model's float buffers."""
    offset = 0
    with torch.no_grad():
        for b in floating_buffers(model):
            n = b.numel()
            b.copy_(flat[offset:offset + n].view_as(b))
            offset += n


def load_flat_parameters(model: nn.Module, flat: torch.Tensor) -> None:
    """Copy a flat buffer into the model's parameters."""
    expected = parameter_count(model)
    if flat.numel() != expected:
        raise ValueError(f"flat buffer has {flat.numel()} values, the model has {expected} parameters")
    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            n = p.numel()
            p.copy_(flat[offset:offset + n].view_as(p))
            offset += n


class FlatReplica:
    """Binds a model's parameters and gradients to views of two flat buffers.

    ``weights`` and ``grads`` are contiguous float32 tensors on the model's device; the
    optimizer-free replica only ever reads weights and accumulates gradients into them.
    """

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.model = model.to(device)
        params = list(self.model.parameters())
        if any(p.dtype != torch.float32 for p in params):
            raise ValueError("sparkdl trains float32 parameters; call model.float() in the model factory")
        total = sum(p.numel() for p in params)
        self.weights = torch.empty(total, dtype=torch.float32, device=device)
        self.grads = torch.zeros(total, dtype=torch.float32, device=device)
        self._views: list[tuple[torch.Tensor, torch.Tensor]] = []
        offset = 0
        for p in params:
            n = p.numel()
            w_view = self.weights[offset:offset + n].view_as(p)
            w_view.copy_(p.detach())
            p.data = w_view
            g_view = self.grads[offset:offset + n].view_as(p)
            p.grad = g_view
            self._views.append((p, g_view))
            offset += n

    def ensure_grad_views(self) -> None:
        """Re-attach gradient views autograd replaced (it may allocate instead of accumulating)."""
        for p, g_view in self._views:
            if p.grad is None:
                g_view.zero_()
                p.grad = g_view
            elif p.grad.data_ptr() != g_view.data_ptr():
                g_view.copy_(p.grad)
                p.grad = g_view

    def zero_grads(self) -> None:
        self.grads.zero_()
