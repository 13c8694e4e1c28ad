"""A model's parameters as one contiguous float32 buffer.

The parameter server keeps the master weights as one flat tensor, and each worker's
replica stores its parameters (and their gradients) as views into one flat tensor, so the
bytes on the wire are those buffers themselves: no per-parameter copies on the hot path.

"Buffers" here are a model's ``nn.Module`` buffers (BatchNorm running statistics and batch
counters ...), which are not trained but pooled across replicas at the end; they travel as
float32 (counters are exact up to 2**24).
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
    # empty for a model made only of embedding tables (the PS holds them as rows)
    return torch.cat(params) if params else torch.zeros(0)


def flatten_buffers(model: nn.Module) -> torch.Tensor:
    """A new flat float32 CPU copy of the model's buffers (empty when it has none)."""
    buffers = [b.detach().reshape(-1).to("cpu", torch.float32) for b in model.buffers()]
    return torch.cat(buffers) if buffers else torch.zeros(0)


def load_flat_buffers(model: nn.Module, flat: torch.Tensor) -> None:
    """Copy a flat buffer into the model's buffers (integer counters rounded back)."""
    offset = 0
    with torch.no_grad():
        for b in model.buffers():
            n = b.numel()
            values = flat[offset:offset + n].view_as(b)
            b.copy_(values if b.is_floating_point() else values.round())
            offset += n


def pool_buffers(model: nn.Module, reported: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
    """The replicas' flat buffers pooled into one, each replica weighted by its samples.

    A buffer is the samples-weighted mean, except for BatchNorm's statistics: the running
    variance follows the law of total variance, ``sum_i w_i (var_i + (mean_i - mean)^2)``, so
    replicas whose partitions have different means add their between-partition variance (a plain
    mean of the variances drops it), and ``num_batches_tracked`` is the sum of the replicas'.
    """
    weights = torch.tensor([max(samples, 1) for _, samples in reported], dtype=torch.float64)
    weights /= weights.sum()
    stacked = torch.stack([flat for flat, _ in reported]).to(torch.float64)
    pooled = (stacked * weights[:, None]).sum(0)
    offsets: dict[int, tuple[int, int]] = {}
    offset = 0
    for b in model.buffers():
        offsets[id(b)] = (offset, b.numel())
        offset += b.numel()
    for module in model.modules():
        if not isinstance(module, nn.modules.batchnorm._BatchNorm) or module.running_mean is None:
            continue
        (m0, n), (v0, _) = offsets[id(module.running_mean)], offsets[id(module.running_var)]
        means, variances = stacked[:, m0:m0 + n], stacked[:, v0:v0 + n]
        between = (means - pooled[m0:m0 + n]) ** 2
        pooled[v0:v0 + n] = ((variances + between) * weights[:, None]).sum(0)
        if module.num_batches_tracked is not None:
            c0, _ = offsets[id(module.num_batches_tracked)]
            pooled[c0] = stacked[:, c0].sum()
    return pooled.to(torch.float32)


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
        self._position = {id(p): i for i, p in enumerate(params)}

    def rebind(self, weights: torch.Tensor, grads: torch.Tensor) -> None:
        """Move the parameters and their gradients onto two other flat buffers (shared memory, say).

        The current values are copied over; the model then trains in the new buffers.
        """
        if weights.shape != self.weights.shape or grads.shape != self.grads.shape:
            raise ValueError("rebind needs buffers of the replica's size")
        weights.copy_(self.weights)
        grads.copy_(self.grads)
        self.weights, self.grads = weights, grads
        views = []
        offset = 0
        for p, _ in self._views:
            n = p.numel()
            p.data = weights[offset:offset + n].view_as(p)
            g_view = grads[offset:offset + n].view_as(p)
            p.grad = g_view
            views.append((p, g_view))
            offset += n
        self._views = views

    def use_weights(self, weights: torch.Tensor) -> None:
        """Point the parameters at another flat buffer as it is (no copy): double buffering."""
        self.weights = weights
        offset = 0
        for p, _ in self._views:
            p.data = weights[offset:offset + p.numel()].view_as(p)
            offset += p.numel()

    def use_grads(self, grads: torch.Tensor) -> None:
        """Point the gradients at another flat buffer as it is (no copy): double buffering."""
        self.grads = grads
        views = []
        offset = 0
        for p, _ in self._views:
            g_view = grads[offset:offset + p.numel()].view_as(p)
            p.grad = g_view
            views.append((p, g_view))
            offset += p.numel()
        self._views = views

    @property
    def parameters(self) -> list[torch.Tensor]:
        """The model's parameters, in flat order."""
        return [p for p, _ in self._views]

    def adopt_grad(self, param: torch.Tensor) -> None:
        """``param``'s gradient into its view of the flat buffer, where autograd allocated a new one."""
        p, g_view = self._views[self._position[id(param)]]
        if p.grad is not None and p.grad.data_ptr() != g_view.data_ptr():
            g_view.copy_(p.grad)
            p.grad = g_view

    def ensure_grad_views(self) -> None:
        """Re-attach gradient views autograd replaced (it may allocate instead of accumulating)."""
        for p, g_view in self._views:
            if p.grad is None:
                if p.requires_grad:   # a frozen parameter's view is zero already (and may be under a collective)
                    g_view.zero_()
                p.grad = g_view
            elif p.grad.data_ptr() != g_view.data_ptr():
                g_view.copy_(p.grad)
                p.grad = g_view

    def zero_grads(self) -> None:
        self.grads.zero_()

    def release_grads(self) -> None:
        """Start the next gradient without a pass over the flat buffer: the parameters drop their views.

        Autograd then hands each parameter a fresh gradient, which :meth:`ensure_grad_views` copies into the
        flat buffer once (and re-attaches, so later mini-batches accumulate in place): one write, where
        zeroing the buffer and accumulating into it costs a write and then a read-add-write.  The buffer's old
        values stay until then (a push of them is still readable)."""
        for p, _ in self._views:
            p.grad = None
