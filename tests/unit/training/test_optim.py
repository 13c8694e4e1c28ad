"""AdamW's decay rule, gradient clipping and mixed precision: the flat optimizer, the PS core and the worker step."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from sparkdl._internal.combinations import check_combinations
from sparkdl._internal.data.block import Batch
from sparkdl._internal.ps.server.core import PSCore, PushMeta
from sparkdl._internal.training.flat import FlatReplica, flatten_parameters
from sparkdl._internal.training.loop import backward_step
from sparkdl._internal.training.losses import resolve_loss
from sparkdl._internal.training.optim import (
    FlatOptimizer,
    clip_layout,
    compensated_momentum,
    server_momentum,
    tensor_layout,
)
from sparkdl._internal.training.precision import MixedPrecision, worker_precision
from sparkdl.config import TrainConfig
from sparkdl.errors import ClusterConfigError


def small_model() -> nn.Module:
    """Matrices, biases and a LayerNorm's weight and bias: both sides of AdamW's decay rule."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.ReLU(), nn.Linear(5, 3))


def gradients(model: nn.Module, step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return [torch.randn(p.shape, generator=generator) for p in model.parameters()]


# ----------------------------------------------------------------- AdamW
@pytest.mark.parametrize("decay_all", [False, True], ids=["1-D-excluded", "decay-all"])
def test_adamw_steps_like_torch_adamw_with_a_no_decay_group_for_1d_parameters(decay_all):
    lr, wd = 0.05, 0.2
    model = small_model()
    reference = copy.deepcopy(model)
    params = list(reference.parameters())
    groups = ([{"params": params, "weight_decay": wd}] if decay_all else
              [{"params": [p for p in params if p.ndim > 1], "weight_decay": wd},
               {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}])
    torch_adamw = torch.optim.AdamW(groups, lr=lr)
    config = TrainConfig(optimizer="adamw", learning_rate=lr, weight_decay=wd, decay_all_parameters=decay_all)
    flat = flatten_parameters(model).clone()
    optimizer = FlatOptimizer(config, flat, tensor_layout(model.parameters()))
    for step in range(5):
        grads = gradients(model, step)
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        torch_adamw.step()
        # grad_scale: the PS's average, divided out in the same fused pass
        optimizer.step(torch.cat([g.flatten() for g in grads]) * 4, torch.tensor(4.0))
    torch.testing.assert_close(flat, flatten_parameters(reference), rtol=0, atol=1e-6)


def test_the_decay_rule_changes_the_result_and_the_state_round_trips():
    lr, wd = 0.05, 0.2
    model = small_model()
    layout = tensor_layout(model.parameters())
    config = TrainConfig(optimizer="adamw", learning_rate=lr, weight_decay=wd)
    excluded, everything = flatten_parameters(model).clone(), flatten_parameters(model).clone()
    first = FlatOptimizer(config, excluded, layout)
    second = FlatOptimizer(config.replace(decay_all_parameters=True), everything, layout)
    for step in range(3):
        grad = torch.cat([g.flatten() for g in gradients(model, step)])
        first.step(grad.clone())
        second.step(grad.clone())
    assert (excluded - everything).abs().max() > 1e-3      # the biases and the LayerNorm kept their scale
    # a checkpoint of the flat optimizer loads and continues exactly
    state = first.state_dict()
    assert state["param_groups"][0]["decoupled_weight_decay"] is True
    resumed_weights = excluded.clone()
    resumed = FlatOptimizer(config, resumed_weights, layout)
    resumed.load_state_dict(state)
    grad = torch.cat([g.flatten() for g in gradients(model, 9)])
    first.step(grad.clone())
    resumed.step(grad.clone())
    assert torch.equal(resumed_weights, excluded)


def test_a_shard_range_decays_exactly_its_part_of_the_whole_model():
    model = small_model()
    layout = tensor_layout(model.parameters())
    assert [decays for _, decays in layout] == [True, False, False, False, True, False]
    assert clip_layout(((3, True), (2, False), (4, True)), (2, 7)) == ((1, True), (2, False), (2, True))
    config = TrainConfig(optimizer="adamw", learning_rate=0.05, weight_decay=0.2)
    whole = flatten_parameters(model).clone()
    cut = whole.numel() // 2 + 1                 # through the middle of a tensor
    halves = [whole[:cut].clone(), whole[cut:].clone()]
    optimizers = [FlatOptimizer(config, whole, layout),
                  FlatOptimizer(config, halves[0], clip_layout(layout, (0, cut))),
                  FlatOptimizer(config, halves[1], clip_layout(layout, (cut, whole.numel())))]
    for step in range(3):
        grad = torch.cat([g.flatten() for g in gradients(model, step)])
        optimizers[0].step(grad.clone())
        optimizers[1].step(grad[:cut].clone())
        optimizers[2].step(grad[cut:].clone())
    assert torch.equal(torch.cat(halves), whole)


# ----------------------------------------------------------------- gradient clipping on the PS
def clipping_core(policy: str, clip: float | None) -> tuple[PSCore, list[int]]:
    config = TrainConfig(num_workers=2, policy=policy, optimizer="sgd", learning_rate=0.1, grad_clip_norm=clip)
    core = PSCore(config, torch.zeros(6))
    return core, [core.hello(w, 0, 64) for w in range(2)]


@pytest.mark.parametrize("policy", ["async", "sync"])
def test_the_ps_clips_the_averaged_gradient_it_applies(policy):
    lr, clip = 0.1, 1.0
    core, tokens = clipping_core(policy, clip)
    generator = torch.Generator().manual_seed(3)
    for scale in (1000.0, 30.0, 0.05):   # the last update's mean gradient is below the bound
        before = core.weights()
        pushes = [(torch.randn(6, generator=generator) * scale, samples) for samples in (8, 24)]
        for worker, (grad, samples) in enumerate(pushes if policy == "sync" else pushes[:1]):
            core.push(worker, tokens[worker], PushMeta(core.version, samples, 1.0, 0), grad.clone(), True)
        mean = (pushes[0][0] * 8 + pushes[1][0] * 24) / 32 if policy == "sync" else pushes[0][0]
        step = (core.weights() - before).norm().item()
        assert step <= lr * clip + 1e-6
        if mean.norm() > clip:
            assert step == pytest.approx(lr * clip, abs=1e-6)
        else:   # below the bound the update is the plain SGD step
            torch.testing.assert_close(core.weights() - before, -lr * mean, rtol=0, atol=1e-7)


def test_without_clipping_a_large_gradient_moves_the_weights_that_far():
    core, tokens = clipping_core("async", None)
    core.push(0, tokens[0], PushMeta(0, 8, 1.0, 0), torch.full((6,), 100.0), True)
    assert core.weights().norm().item() == pytest.approx(0.1 * 100.0 * 6 ** 0.5, rel=1e-6)


# ----------------------------------------------------------------- implicit momentum (Mitliagkas et al. 2016)
@pytest.mark.parametrize("workers, setting, expected", [(2, "compensate", 0.8), (4, "compensate", 0.6),
                                                         (12, "compensate", 0.0), (2, "ignore", 0.9),
                                                         (2, "auto", 0.8)])
def test_the_async_server_steps_with_the_momentum_left_after_asynchronys(workers, setting, expected):
    """The PS's updates are torch SGD's with 1 - N (1 - momentum): asynchrony's 1 - 1/N makes up the rest."""
    config = TrainConfig(num_workers=workers, policy="async", learning_rate=0.1, momentum=0.9,
                         implicit_momentum=setting)
    core = PSCore(config, torch.zeros(6))
    tokens = [core.hello(w, 0, 64) for w in range(workers)]
    reference = torch.zeros(6, requires_grad=True)
    sgd = torch.optim.SGD([reference], lr=0.1, momentum=expected)
    generator = torch.Generator().manual_seed(5)
    for step in range(4):
        grad = torch.randn(6, generator=generator)
        core.push(step % workers, tokens[step % workers], PushMeta(core.version, 8, 1.0, 0), grad.clone(), True)
        reference.grad = grad
        sgd.step()
    torch.testing.assert_close(core.weights(), reference.detach(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("policy, optimizer", [("sync", "sgd"), ("softsync", "sgd"), ("async", "adam")])
def test_auto_leaves_the_momentum_as_set_where_compensation_does_not_apply(policy, optimizer):
    """The default compensates async SGD only: sync's steps carry no implicit momentum, Adam has none to lower,
    and neither combination is refused (a run that worked with the old default still starts)."""
    config = TrainConfig(num_workers=2, policy=policy, optimizer=optimizer, momentum=0.9)
    assert config.implicit_momentum == "auto"
    check_combinations(config, "launch")
    assert server_momentum(config) == 0.9


def test_compensation_counts_the_workers_that_train_at_once():
    """With work units an elastic run trains up to max_workers at once, more than the num_workers it starts with."""
    config = TrainConfig(num_workers=2, policy="async", elastic=True, max_workers=4, momentum=0.9,
                         implicit_momentum="compensate")
    assert server_momentum(config) == pytest.approx(compensated_momentum(0.9, 4)) == pytest.approx(0.6)
    assert PSCore(config, torch.zeros(2)).optimizer.momentum == pytest.approx(0.6)


# ----------------------------------------------------------------- gradients of weight 0 (skipped float16 steps)
@pytest.mark.parametrize("policy", ["async", "sync"])
def test_a_push_of_weight_zero_is_averaged_in_as_nothing(policy):
    config = TrainConfig(num_workers=2, policy=policy, optimizer="adam", learning_rate=0.1, nonfinite="fail")
    core = PSCore(config, torch.zeros(4))
    tokens = [core.hello(w, 0, 64) for w in range(2)]
    core.push(1, tokens[1], PushMeta(0, 8, 1.0, 0, weight=0.0), torch.zeros(4), True)
    if policy == "async":        # an update of its own that leaves weights and Adam's state alone
        assert core.version == 1 and torch.equal(core.weights(), torch.zeros(4))
        assert core.optimizer.exp_avg is None
        return
    core.push(0, tokens[0], PushMeta(0, 8, 1.0, 0), torch.ones(4), True)
    alone = PSCore(config, torch.zeros(4))
    alone.optimizer.step(torch.ones(4))
    assert core.version == 1 and torch.equal(core.weights(), alone.weights())   # not the mean with a zero
    assert core.failure is None and core.stats.rejected_nonfinite == 0


# ----------------------------------------------------------------- mixed precision in the worker's step
class DtypeRecorder(nn.Module):
    """Records the dtype its linear layer computes in."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.dtypes: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        self.dtypes.append(out.dtype)
        return out


def one_batch() -> Batch:
    generator = torch.Generator().manual_seed(0)
    return Batch((torch.randn(8, 4, generator=generator),), (None,), torch.randint(0, 3, (8,), generator=generator))


@pytest.mark.parametrize("precision, dtype", [("32", torch.float32), ("bf16-mixed", torch.bfloat16)])
def test_bf16_mixed_runs_the_forward_in_bfloat16_and_keeps_float32_gradients(precision, dtype):
    replica = FlatReplica(DtypeRecorder(), torch.device("cpu"))
    mixed = MixedPrecision(precision, torch.device("cpu"), replica.model.parameters())
    loss = backward_step(replica, resolve_loss("cross_entropy"), one_batch(), precision=mixed)
    assert replica.model.dtypes == [dtype]
    assert replica.grads.dtype == torch.float32 and replica.grads.abs().sum() > 0 and loss > 0
    assert all(p.dtype == torch.float32 for p in replica.model.parameters())
    assert mixed.unscale() and mixed.skipped_steps == 0


def test_the_loss_scaler_unscales_and_skips_an_overflowed_step():
    # GradScaler's logic is the same on the CPU; training refuses float16 there (worker_precision)
    replica = FlatReplica(DtypeRecorder(), torch.device("cpu"))
    mixed = MixedPrecision("16-mixed", torch.device("cpu"), replica.model.parameters())
    scale = float(mixed.scale(torch.ones(())))
    expected = torch.randn(replica.grads.numel(), generator=torch.Generator().manual_seed(1))
    replica.grads.copy_(expected * scale)
    assert mixed.unscale() and mixed.skipped_steps == 0
    torch.testing.assert_close(replica.grads, expected)
    replica.grads.fill_(1.0)
    replica.grads[3] = float("inf")
    assert not mixed.unscale() and mixed.skipped_steps == 1
    assert mixed.scaler is not None and mixed.scaler.get_scale() == scale / 2     # the scaler backs off


def test_float16_is_refused_on_a_cpu_task():
    with pytest.raises(ClusterConfigError, match="precision='16-mixed' needs a CUDA device"):
        worker_precision("16-mixed", torch.device("cpu"), [])
    assert worker_precision("bf16-mixed", torch.device("cpu"), []).dtype == torch.bfloat16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_16_mixed_on_cuda_runs_the_forward_in_float16_and_unscales():
    device = torch.device("cuda", 0)
    replica = FlatReplica(DtypeRecorder(), device)
    mixed = worker_precision("16-mixed", device, replica.model.parameters())
    batch = one_batch()
    batch = Batch((batch.inputs[0].to(device),), (None,), batch.labels.to(device))
    backward_step(replica, resolve_loss("cross_entropy"), batch, precision=mixed)
    scaled = replica.grads.clone()
    assert replica.model.dtypes == [torch.float16] and replica.grads.dtype == torch.float32
    assert mixed.unscale() and mixed.skipped_steps == 0
    torch.testing.assert_close(replica.grads * mixed.scaler.get_scale(), scaled)
