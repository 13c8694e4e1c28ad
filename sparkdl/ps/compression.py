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
        peaks = torch.stack([chunk.abs().max() for chunk in values.split(self.tensor_sizes)])
        scales = torch.where(peaks > 0, peaks / 127.0, torch.ones_like(peaks))
        out[:4 * count].view(torch.float32).copy_(scales)
        scaled = values / torch.repeat_interleave(scales, self._sizes)
        noise = torch.rand(self.num_values, generator=self._generator)
        # floor(x + u), u ~ U[0, 1): rounds up with probability frac(x), so E[q] = x
        out[4 * count:].view(torch.int8).copy_(torch.floor(scaled.add_(noise)).clamp_(-127, 127))

    def decode_into(self, payload: torch.Tensor, out: torch.Tensor) -> None:
        count = len(self.tensor_sizes)
        scales = payload[:4 * count].view(torch.float32)
        if not bool(torch.isfinite(scales).all()):
            raise ValueError("int8 payload holds a non-finite scale")
        torch.mul(payload[4 * count:].view(torch.int8), torch.repeat_interleave(scales, self._sizes), out=out)


class TopKCodec(_ErrorFeedback):
    name = "topk"

    def __init__(self, num_values: int, ratio: float) -> None:
        if not 0 < ratio <= 0.5:
            raise ValueError(f"topk ratio must be in (0, 0.5], got {ratio}: above 0.5 the (index, value) pairs "
                             "take more bytes than the dense gradient; use compression='fp16' or 'none'")
        self.k = max(1, math.ceil(ratio * num_values))
        super().__init__(num_values)

    def encoded_bytes(self) -> int:
        return 8 * self.k

    def _encode(self, values: torch.Tensor, out: torch.Tensor) -> None:
        _, index = torch.topk(values.abs(), self.k, sorted=False)
        out[:4 * self.k].view(torch.int32).copy_(index)
        out[4 * self.k:].view(torch.float32).copy_(values[index])

    def decode_into(self, payload: torch.Tensor, out: torch.Tensor) -> None:
        index = payload[:4 * self.k].view(torch.int32)
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= self.num_values):
            raise ValueError("top-k payload holds an index outside the model")
        out.zero_()
        out[index.long()] = payload[4 * self.k:].view(torch.float32)


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
