"""Gradient codecs for the push direction: function-like objects with small picklable state.

* ``none``  - raw float32; bit-identical to not compressing (the bytes on the wire are the gradient).
* ``fp16``  - half precision, 2 bytes per value.
* ``int8``  - one scale per model tensor (max |g| / 127 of that tensor) + one signed byte per
              value, rounded stochastically (QSGD-style, Alistarh et al. 2017): each value
              rounds up with probability equal to its fractional part, so the decoded
              gradient is unbiased; a tensor 1000x smaller than the largest keeps its own scale.
* ``topk``  - the k = ceil(ratio * n) largest-magnitude entries as (int32 index, float32 value).

Lossy codecs use **error feedback** (1-bit SGD, Deep Gradient Compression): what a push did
not transmit is kept as a residual on the worker and added to the next gradient, so over
time every gradient component is sent.  The worker checks a gradient for NaN/Inf *before*
encoding it (such a gradient is never encoded, so the residual stays clean; the PS handles it
per ``nonfinite``).  Residuals live in the task: a retried task starts with a zero residual
(what the failed attempt had not yet sent is dropped on purpose; it is bounded by one
gradient's quantisation error).  Encoders write into a preallocated byte buffer;
the decoder on the PS writes into a preallocated float32 buffer.
"""
from __future__ import annotations

import math

import torch

CODECS = ("none", "fp16", "int8", "topk")


class Codec:
    """Encode a flat float32 gradient for the wire and decode it back (one per worker / PS connection)."""

    name = "none"
    lossy = False

    def __init__(self, num_values: int) -> None:
        self.num_values = num_values

    def encoded_bytes(self) -> int:
        """Size of every encoded gradient (fixed per job, so the PS can check it)."""
        return 4 * self.num_values

    def encode(self, grad: torch.Tensor) -> torch.Tensor:
        """The wire payload for ``grad`` (a view of ``grad`` or of a reused buffer)."""
        return grad

    def decode_into(self, payload: torch.Tensor, out: torch.Tensor) -> None:
        """Write the gradient carried by ``payload`` (uint8 bytes) into ``out``."""
        out.copy_(payload.view(torch.float32))


class _ErrorFeedback(Codec):
    """Shared error-feedback bookkeeping: compress g + residual, keep what was not sent."""

    lossy = True

    def __init__(self, num_values: int) -> None:
        super().__init__(num_values)
        # encoder state, allocated on first use (the PS side only decodes)
        self.residual: torch.Tensor | None = None
        self.buffer: torch.Tensor | None = None
        self._decoded: torch.Tensor | None = None

    def encode(self, grad: torch.Tensor) -> torch.Tensor:
        if self.residual is None:
            self.residual = torch.zeros(self.num_values)
            self.buffer = torch.empty(self.encoded_bytes(), dtype=torch.uint8)
            self._decoded = torch.empty(self.num_values)
        assert self.buffer is not None and self._decoded is not None   # allocated with the residual
        self.residual.add_(grad)                       # g + residual: what we owe the PS
        self._encode(self.residual, self.buffer)
        self.decode_into(self.buffer, self._decoded)
        self.residual.sub_(self._decoded)              # what was not transmitted stays local
        return self.buffer

    def _encode(self, values: torch.Tensor, out: torch.Tensor) -> None:
        raise NotImplementedError


class Fp16Codec(_ErrorFeedback):
    name = "fp16"

    def encoded_bytes(self) -> int:
        return 2 * self.num_values

    def _encode(self, values: torch.Tensor, out: torch.Tensor) -> None:
        out.view(torch.float16).copy_(values)

    def decode_into(self, payload: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(payload.view(torch.float16))


class Int8Codec(_ErrorFeedback):
    name = "int8"

    def __init__(self, num_values: int, tensor_sizes: list[int] | None = None, seed: int = 0) -> None:
        super().__init__(num_values)
        sizes = list(tensor_sizes) if tensor_sizes else [num_values]
        if sum(sizes) != num_values or any(n <= 0 for n in sizes):
            raise ValueError(f"tensor sizes {sizes[:8]}... do not partition {num_values} values")
        self.tensor_sizes = sizes
        self._sizes = torch.tensor(sizes)
        self._generator = torch.Generator().manual_seed(seed)

    def encoded_bytes(self) -> int:
        return 4 * len(self.tensor_sizes) + self.num_values

    def _encode(self, values: torch.Tensor, out: torch.Tensor) -> None:
        count = len(self.tensor_sizes)
        chunks = values.split(self.tensor_sizes)
        # the largest magnitude of each tensor, without a temporary of its size
        peaks = torch.stack([torch.linalg.vector_norm(chunk, float("inf")) for chunk in chunks])
        scales = torch.where(peaks > 0, peaks / 127.0, torch.ones_like(peaks))
        out[:4 * count].view(torch.float32).copy_(scales)
        noise = torch.rand(self.num_values, generator=self._generator)
        quantized = out[4 * count:].view(torch.int8)
        # per tensor, in place: floor(x / s + u), u ~ U[0, 1), rounds up with probability frac(x / s): E[q] = x / s
        for chunk, shifted, target, scale in zip(chunks, noise.split(self.tensor_sizes),
                                                 quantized.split(self.tensor_sizes), scales, strict=True):
            target.copy_(torch.floor_(shifted.addcdiv_(chunk, scale)).clamp_(-127, 127))

    def decode_into(self, payload: torch.Tensor, out: torch.Tensor) -> None:
        count = len(self.tensor_sizes)
        scales = payload[:4 * count].view(torch.float32)
        if not bool(torch.isfinite(scales).all()):
            raise ValueError("int8 payload holds a non-finite scale")
        for quantized, target, scale in zip(payload[4 * count:].view(torch.int8).split(self.tensor_sizes),
                                            out.split(self.tensor_sizes), scales, strict=True):
            torch.mul(quantized, scale, out=target)


class TopKCodec(_ErrorFeedback):
    name = "topk"

    def __init__(self, num_values: int, ratio: float) -> None:
        if not 0 < ratio <= 0.5:
            raise ValueError(f"topk ratio must be in (0, 0.5], got {ratio}: above 0.5 the (index, value) pairs "
                             "take more bytes than the dense gradient; use compression='fp16' or 'none'")
        self.k = max(1, math.ceil(ratio * num_values))
        self._generator = torch.Generator().manual_seed(0)     # only picks the threshold's sample
        super().__init__(num_values)

    def encoded_bytes(self) -> int:
        return 8 * self.k

    def _encode(self, values: torch.Tensor, out: torch.Tensor) -> None:
        index = largest_magnitudes(values, self.k, self._generator)
        out[:4 * self.k].view(torch.int32).copy_(index)
        out[4 * self.k:].view(torch.float32).copy_(values[index])

    def decode_into(self, payload: torch.Tensor, out: torch.Tensor) -> None:
        index = payload[:4 * self.k].view(torch.int32)
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= self.num_values):
            raise ValueError("top-k payload holds an index outside the model")
        out.zero_()
        out[index.long()] = payload[4 * self.k:].view(torch.float32)


#: values sampled to estimate the k-th largest magnitude, and the margin kept below that estimate
TOPK_SAMPLE = 65_536
TOPK_MARGIN = 2.0


def largest_magnitudes(values: torch.Tensor, k: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Indices of the ``k`` entries of largest magnitude: exactly ``torch.topk(values.abs(), k)``'s set.

    A full top-k over millions of values is slow on the CPU (0.2 s for 10M).  A random sample
    estimates a threshold a little below the k-th magnitude; the (few) entries above it are the
    candidates, and an exact top-k among them gives the answer.  When the candidates are fewer
    than k (the estimate was too high) the full top-k runs: the result never changes.
    """
    magnitudes = values.abs()
    n = magnitudes.numel()
    if n <= 4 * TOPK_SAMPLE or k * TOPK_MARGIN * 4 >= n:
        return torch.topk(magnitudes, k, sorted=False).indices
    # a private generator: drawing from the global one would shift the model's own randomness (dropout)
    sample = magnitudes[torch.randint(n, (TOPK_SAMPLE,), generator=generator)]
    # the sample's quantile for TOPK_MARGIN * k of n entries: on average TOPK_MARGIN * k candidates
    rank = max(1, TOPK_SAMPLE - int(TOPK_SAMPLE * TOPK_MARGIN * k / n))
    threshold = torch.kthvalue(sample, rank).values
    candidates = torch.nonzero(magnitudes >= threshold).squeeze(1)
    if len(candidates) < k:
        return torch.topk(magnitudes, k, sorted=False).indices
    return candidates[torch.topk(magnitudes[candidates], k, sorted=False).indices]


def make_codec(name: str, num_values: int, topk_ratio: float = 0.01, tensor_sizes: list[int] | None = None,
               seed: int = 0) -> Codec:
    """A codec for ``num_values`` float32 values; ``tensor_sizes`` (the model's parameter sizes in
    flat order) give int8 its per-tensor scales, ``seed`` its stochastic rounding."""
    if name == "none":
        return Codec(num_values)
    if name == "fp16":
        return Fp16Codec(num_values)
    if name == "int8":
        return Int8Codec(num_values, tensor_sizes, seed)
    if name == "topk":
        return TopKCodec(num_values, topk_ratio)
    raise ValueError(f"unknown compression {name!r}; choose one of {CODECS}")
