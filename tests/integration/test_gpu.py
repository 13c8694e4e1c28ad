"""Training on a real CUDA device (runs only where torch sees one)."""
from __future__ import annotations

import pytest
import torch

from sparkdl import TrainConfig, train

from ..conftest import ASYNC_ACCURACY, DIGITS_MLP

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_train_on_cuda(digits_rdd, digits):
    _, x_test, _, y_test = digits
    result = train(digits_rdd, DIGITS_MLP, TrainConfig(num_workers=2, policy="async", epochs=10, batch_size=16,
                                                       learning_rate=0.05, momentum=0.9, device="cuda"))
    assert {w["device"] for w in result.workers} == {"cuda:0"}
    assert result.accuracy(DIGITS_MLP, x_test, y_test) >= ASYNC_ACCURACY


class _OverflowBackward(torch.autograd.Function):
    """The identity forward, an infinite gradient backward: a step the loss scaler must skip."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


class OverflowOnce(torch.nn.Module):
    """The digits MLP whose fifth training step's gradient overflows."""

    def __init__(self):
        super().__init__()
        self.net = DIGITS_MLP()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        out = self.net(x)
        return _OverflowBackward.apply(out) if self.calls == 5 and self.training else out


@pytest.mark.parametrize("policy", ["sync", "allreduce"])
def test_16_mixed_skips_an_overflowed_step_without_failing_the_run(digits_rdd, digits, policy):
    _, x_test, _, y_test = digits
    result = train(digits_rdd, OverflowOnce, TrainConfig(num_workers=2, policy=policy, epochs=10, batch_size=16,
                                                         learning_rate=0.05, momentum=0.9, device="cuda",
                                                         precision="16-mixed", nonfinite="fail"))
    summary = result.summary
    # each worker's forced overflow (allreduce: both in the same step, counted once), and any early back-off
    assert summary["amp_skipped_steps"] >= (2 if policy == "sync" else 1)
    assert summary.get("rejected_nonfinite", 0) == 0
    assert all(torch.isfinite(value).all() for value in result.state_dict.values())
    assert result.accuracy(OverflowOnce, x_test, y_test) >= 0.93
