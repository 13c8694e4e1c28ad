"""Gradient codecs: round-trip error, error feedback, identity bit-exactness."""
from __future__ import annotations

import pytest
import torch

from sparkdl._internal.ps.wire.compression import make_codec


def round_trip(name: str, grad: torch.Tensor, ratio: float = 0.01) -> tuple[torch.Tensor, int]:
    encoder = make_codec(name, grad.numel(), ratio)
    payload = encoder.encode(grad.clone())
    decoder = make_codec(name, grad.numel(), ratio)        # the PS side: a separate object
    out = torch.empty_like(grad)
    decoder.decode_into(payload.view(torch.uint8) if payload.dtype != torch.uint8 else payload, out)
    return out, payload.numel() * payload.element_size()


def test_identity_codec_is_bit_identical_and_zero_copy():
    grad = torch.randn(10_001) * 1e-3
    codec = make_codec("none", grad.numel())
    assert codec.encode(grad) is grad                  # the gradient itself goes on the wire
    out, size = round_trip("none", grad)
    assert torch.equal(out, grad) and size == 4 * grad.numel()


@pytest.mark.parametrize("name, bytes_per_value, tolerance", [("fp16", 2, 1e-3), ("int8", 1, 1 / 127)])
def test_quantizers_round_trip_within_their_error(name, bytes_per_value, tolerance):
    grad = torch.randn(50_000)
    out, size = round_trip(name, grad)
    assert size <= bytes_per_value * grad.numel() + 4
    relative = ((out - grad).abs().max() / grad.abs().max()).item()
    assert relative <= tolerance


def test_topk_sends_exactly_the_largest_entries():
    grad = torch.randn(100_000)
    out, size = round_trip("topk", grad, ratio=0.01)
    k = 1000
    assert size == 8 * k                              # 50x fewer bytes than float32
    sent = out.nonzero().flatten()
    assert len(sent) == k
    threshold = grad.abs().topk(k).values.min()
    assert (grad[sent].abs() >= threshold).all() and torch.equal(out[sent], grad[sent])


@pytest.mark.parametrize("name", ["fp16", "int8", "topk"])
def test_error_feedback_makes_sent_sum_converge_to_true_sum(name):
    torch.manual_seed(0)
    n, steps = 2_000, 400
    encoder = make_codec(name, n, 0.05)
    decoder = make_codec(name, n, 0.05)
    true_sum, sent_sum, out = torch.zeros(n), torch.zeros(n), torch.empty(n)
    for _ in range(steps):
        grad = torch.randn(n)
        true_sum += grad
        decoder.decode_into(encoder.encode(grad), out)
        sent_sum += out
    # what was not sent is exactly the residual, and it stays bounded while the sums grow
    assert torch.allclose(true_sum - sent_sum, encoder.residual, atol=1e-3)
    assert (true_sum - sent_sum).norm() / true_sum.norm() < 0.5 * (1 if name == "topk" else 0.01)
    assert encoder.residual.abs().max() < 50     # bounded, does not grow with the number of steps


def test_topk_refuses_indices_outside_the_model():
    decoder = make_codec("topk", 10, 0.2)
    payload = torch.zeros(16, dtype=torch.uint8)
    payload[:8].view(torch.int32)[:] = torch.tensor([3, 99], dtype=torch.int32)
    with pytest.raises(ValueError, match="outside the model"):
        decoder.decode_into(payload, torch.empty(10))


def test_int8_stochastic_rounding_is_unbiased_where_rounding_to_nearest_is_not():
    """A value below half a quantisation step: round-to-nearest always sends 0, QSGD's rounding sends it on average."""
    grad = torch.tensor([1.0] + [0.3 / 127] * 999)       # 0.3 of a step of the scale 1/127
    total = torch.zeros_like(grad)
    out = torch.empty_like(grad)
    trials = 400
    for seed in range(trials):                            # fresh codecs: no error feedback, just the rounding
        encoder, decoder = make_codec("int8", grad.numel(), seed=seed), make_codec("int8", grad.numel())
        decoder.decode_into(encoder.encode(grad.clone()), out)
        total += out
    mean = total[1:].mean() / trials
    assert mean == pytest.approx(0.3 / 127, rel=0.05)     # unbiased
    assert torch.round(grad[1:] * 127).abs().max() == 0    # what round-to-nearest would have sent


def test_int8_keeps_a_scale_per_tensor():
    big, small = torch.randn(1000), torch.randn(50) * 1e-3   # a layer 1000x smaller than the largest
    grad = torch.cat([big, small])
    encoder, decoder = (make_codec("int8", grad.numel(), tensor_sizes=[1000, 50]) for _ in range(2))
    out = torch.empty_like(grad)
    payload = encoder.encode(grad.clone())
    assert payload.numel() == grad.numel() + 4 * 2
    decoder.decode_into(payload, out)
    assert (out[1000:] != 0).float().mean() > 0.9                 # one shared scale would zero it
    assert ((out[1000:] - small).abs().max() / small.abs().max()) <= 1 / 127 + 1e-6


def test_topk_above_half_is_refused():
    with pytest.raises(ValueError, match="more bytes than the dense gradient"):
        make_codec("topk", 100, 0.6)


@pytest.mark.parametrize("name", ["fp16", "int8", "topk"])
def test_a_retried_task_starts_with_an_empty_residual(name):
    """Residuals are reset on purpose: a new task attempt's codec owes the PS nothing from the old one."""
    torch.manual_seed(1)
    first_attempt = make_codec(name, 1000, 0.05)
    for _ in range(5):
        first_attempt.encode(torch.randn(1000))
    assert first_attempt.residual.abs().sum() > 0          # the failed attempt still owed something
    retried, fresh = make_codec(name, 1000, 0.05), make_codec(name, 1000, 0.05)
    grad = torch.randn(1000)
    assert torch.equal(retried.encode(grad.clone()), fresh.encode(grad.clone()))
    assert torch.equal(retried.residual, fresh.residual)


@pytest.mark.parametrize("k", [1, 500, 20_000, 120_000])
@pytest.mark.parametrize("shape", ["normal", "heavy-tailed", "mostly-zero"])
def test_sampled_top_k_selects_exactly_what_a_full_top_k_selects(k, shape):
    from sparkdl._internal.ps.wire.compression import largest_magnitudes

    generator = torch.Generator().manual_seed(k)
    values = torch.randn(1_000_000, generator=generator)
    if shape == "heavy-tailed":
        values = values ** 5
    elif shape == "mostly-zero":
        values[:900_000] = 0.0
    chosen = largest_magnitudes(values, k, torch.Generator().manual_seed(1))
    expected = torch.topk(values.abs(), k).indices
    assert len(set(chosen.tolist())) == k
    # the same magnitudes (ties may pick different indices of equal value)
    assert torch.equal(values.abs()[chosen].sort().values, values.abs()[expected].sort().values)
