"""Training on a real CUDA device (runs only where torch sees one)."""
from __future__ import annotations

import pytest
import torch

from sparkdl import TrainConfig, train

from ..conftest import DIGITS_MLP

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_train_on_cuda(digits_rdd, digits):
    _, x_test, _, y_test = digits
    result = train(digits_rdd, DIGITS_MLP, TrainConfig(num_workers=2, policy="async", epochs=10, batch_size=16,
                                                       learning_rate=0.05, momentum=0.9, device="cuda"))
    assert {w["device"] for w in result.workers} == {"cuda:0"}
    assert result.accuracy(DIGITS_MLP, x_test, y_test) >= 0.93
