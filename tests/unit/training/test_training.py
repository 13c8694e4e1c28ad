"""Shared training pieces: BatchNorm pooling across replicas, learning-rate schedules."""
import math

import pytest
import torch
from torch import nn

from sparkdl._internal.training.flat import FlatReplica, flatten_buffers, load_flat_buffers, pool_buffers
from sparkdl._internal.training.optim import learning_rate_at
from sparkdl.config import TrainConfig


def batchnorm_after(data: torch.Tensor, batch: int = 50) -> nn.Module:
    """A BatchNorm whose running statistics saw ``data`` (cumulative averages: momentum=None)."""
    model = nn.Sequential(nn.BatchNorm1d(3, momentum=None)).train()
    with torch.no_grad():
        for start in range(0, len(data), batch):
            model(data[start:start + batch])
    return model


def test_batchnorm_statistics_pool_with_the_between_shard_variance():
    torch.manual_seed(0)
    low, high = torch.randn(2000, 3), torch.randn(1000, 3) + 2.0     # shards with different means, var 1
    replicas = [batchnorm_after(low), batchnorm_after(high)]
    pooled_model = nn.Sequential(nn.BatchNorm1d(3, momentum=None))
    pooled = pool_buffers(pooled_model, [(flatten_buffers(r), n) for r, n in zip(replicas, (2000, 1000))])
    load_flat_buffers(pooled_model, pooled)
    union = torch.cat([low, high])
    bn = pooled_model[0]
    assert torch.allclose(bn.running_mean, union.mean(0), atol=0.02)
    assert torch.allclose(bn.running_var, union.var(0), atol=0.05)      # about 1.9, not the mean variance 1
    assert union.var(0).min() > 1.8
    assert int(bn.num_batches_tracked) == 40 + 20                        # batches of both replicas


def test_plain_buffers_are_sample_weighted_means():
    model = nn.Sequential(nn.Linear(2, 2))
    model.register_buffer("ema", torch.zeros(2))
    pooled = pool_buffers(model, [(torch.tensor([1.0, 1.0]), 3), (torch.tensor([5.0, 9.0]), 1)])
    assert torch.allclose(pooled, torch.tensor([2.0, 3.0]))


def test_warm_up_step_cosine_and_linear_scaling():
    base = TrainConfig(num_workers=4, learning_rate=0.1)
    assert learning_rate_at(base, 0, None) == 0.1
    warm = base.replace(lr_warmup_updates=10)
    assert [round(learning_rate_at(warm, v, None), 4) for v in (0, 4, 9, 10)] == [0.01, 0.05, 0.1, 0.1]
    step = base.replace(lr_schedule="step", lr_step_every=100, lr_step_gamma=0.5)
    assert [learning_rate_at(step, v, None) for v in (99, 100, 250)] == [0.1, 0.05, 0.025]
    cosine = base.replace(lr_schedule="cosine")
    assert learning_rate_at(cosine, 50, 100) == pytest.approx(0.05)
    assert learning_rate_at(cosine, 100, 100) == pytest.approx(0.0, abs=1e-12)
    # Goyal et al.: 4 gradients of 2 accumulated batches per update -> 8x the rate (sync, N = 4, s = 2)
    linear = base.replace(policy="sync", local_steps=2, lr_scaling="linear")
    assert learning_rate_at(linear, 0, None) == pytest.approx(0.8)
    assert math.isclose(learning_rate_at(linear.replace(lr_warmup_updates=8), 0, None), 0.1)


@pytest.mark.parametrize("settings", [dict(optimizer="sgd", momentum=0.9, weight_decay=0.01), dict(optimizer="sgd"),
                                      dict(optimizer="adam", weight_decay=0.01)])
def test_the_flat_optimizer_steps_exactly_like_torch_optim_and_shares_its_checkpoint_layout(settings):
    from sparkdl._internal.training.optim import FlatOptimizer

    config = TrainConfig(learning_rate=0.1, **settings)
    reference_weights = torch.nn.Parameter(torch.ones(50))
    reference = (torch.optim.SGD([reference_weights], lr=0.1, momentum=config.momentum,
                                 weight_decay=config.weight_decay) if config.optimizer == "sgd"
                 else torch.optim.Adam([reference_weights], lr=0.1, weight_decay=config.weight_decay))
    weights = torch.ones(50)
    optimizer = FlatOptimizer(config, weights)
    for step in range(4):
        gradient = torch.randn(50, generator=torch.Generator().manual_seed(step))
        reference_weights.grad = gradient / 4
        reference.step()
        optimizer.step(gradient.clone(), torch.tensor(4.0))     # grad_scale: the average in the same pass
    torch.testing.assert_close(weights, reference_weights.detach(), rtol=0, atol=1e-7)
    # a torch.optim checkpoint loads, and continues exactly
    resumed = FlatOptimizer(config, reference_weights.detach().clone())
    resumed.load_state_dict(reference.state_dict())
    gradient = torch.randn(50, generator=torch.Generator().manual_seed(99))
    reference_weights.grad = gradient.clone()
    reference.step()
    resumed.step(gradient.clone())
    # within two float32 ulps of weights near 1 (the fused and the loop kernels may round differently)
    torch.testing.assert_close(resumed.param, reference_weights.detach(), rtol=0, atol=2.5e-7)
    # plain SGD keeps no state; torch.optim's says momentum_buffer None there
    expected = {k for k, v in reference.state_dict()["state"].get(0, {}).items() if v is not None}
    assert set(optimizer.state_dict()["state"].get(0, {})) == expected


def test_released_gradients_are_written_once_and_equal_zeroed_accumulation():
    """release_grads drops the views; the next backward's gradients land in the flat buffer as zero + accumulate would."""
    def replica():
        torch.manual_seed(0)
        model = torch.nn.ModuleDict({"used": torch.nn.Linear(3, 2), "unused": torch.nn.Linear(2, 1)})
        return FlatReplica(model, torch.device("cpu"))

    def two_batches(flat, clear):
        flat.grads.fill_(7.0)             # what the last step left behind
        clear(flat)
        for seed in (1, 2):               # two mini-batches accumulate into one gradient
            torch.manual_seed(seed)
            flat.model["used"](torch.randn(4, 3)).pow(2).sum().backward()
            flat.ensure_grad_views()
        return flat.grads.clone()

    released, zeroed = replica(), replica()
    expected = two_batches(zeroed, FlatReplica.zero_grads)
    assert torch.equal(two_batches(released, FlatReplica.release_grads), expected)
    assert torch.equal(expected[-3:], torch.zeros(3))     # the unused layer's gradient is zero, not stale
    assert all(p.grad.data_ptr() == g.data_ptr() for p, g in released._views)   # views back for the next step
