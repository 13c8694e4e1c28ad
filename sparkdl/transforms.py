"""Batch transforms: callables applied to every mini-batch on the workers (``TrainConfig.batch_transform``).

A batch transform is ``transform(features, generator) -> torch.Tensor``.  ``features`` is the
batch as read from the partition: a float tensor for numeric columns, a list of ``bytes`` for a
binary column of encoded images.  ``generator`` is a ``torch.Generator`` seeded from the run's
seed, the worker, the epoch and the step, so random augmentation is reproducible and the
same on a retried task; it is ``None`` when scoring and when validating, where the random
parts must be skipped.  Numeric features arrive where the partition is kept: on the GPU when it is
in device memory, on the CPU from disk; the generator is a CPU one, so draw on the CPU and move
the result to ``features.device`` (as the transforms here do).  Transforms run in the loader
thread, overlapping the previous batch's forward and backward.

>>> TrainConfig(batch_transform=Compose(DecodeImages(), RandomCrop(28, padding=2), Normalize([0.13], [0.31])))

The random parts here follow torchvision's definitions (``RandomCrop`` with zero padding,
``RandomHorizontalFlip``), drawn per sample from the batch's generator.
"""
from __future__ import annotations

import importlib
import io
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["Compose", "DecodeImages", "Normalize", "RandomCrop", "RandomHorizontalFlip"]

BatchTransform = Callable[[Any, "torch.Generator | None"], torch.Tensor]


def resolve_transform(value: BatchTransform | str | None, setting: str = "batch_transform") -> BatchTransform | None:
    """The configured callable (``setting``, a transform by default): as is, or a ``"module:qualname"`` text imported."""
    if value is None or callable(value):
        return value
    module, _, qualname = value.partition(":")
    try:
        target: Any = importlib.import_module(module)
        for part in qualname.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{setting} {value!r} cannot be imported on this worker ({exc})") from None
    if not callable(target):
        raise ValueError(f"{setting} {value!r} names a {type(target).__name__}, not a callable")
    return target


class Compose:
    """Apply ``steps`` in order, each with the same generator."""

    def __init__(self, *steps: BatchTransform) -> None:
        self.steps = steps

    def __call__(self, features: Any, generator: torch.Generator | None) -> torch.Tensor:
        for step in self.steps:
            features = step(features, generator)
        return features


class DecodeImages:
    """Encoded images (PNG, JPEG, ...; a list of ``bytes``) -> a float tensor [B, C, H, W] scaled to [0, 1].

    ``mode`` is Pillow's colour mode each image is converted to ("L": 1 channel, "RGB": 3).
    Every image of a batch must have the same size.  Needs Pillow (``pip install sparkdl[image]``).
    """

    def __init__(self, mode: str = "L") -> None:
        self.mode = mode

    def __call__(self, features: Any, generator: torch.Generator | None = None) -> torch.Tensor:
        try:
            from PIL import Image
        except ImportError:
            raise ImportError("DecodeImages needs Pillow on the executors: pip install 'sparkdl[image]'") from None
        import numpy as np

        arrays = []
        for i, data in enumerate(features):
            with Image.open(io.BytesIO(data)) as image:
                arrays.append(np.asarray(image.convert(self.mode)))
            if arrays[-1].shape != arrays[0].shape:
                raise ValueError(f"image {i} of the batch is {arrays[-1].shape[:2]} pixels, image 0 is "
                                 f"{arrays[0].shape[:2]}; resize the images to one size first")
        batch = torch.from_numpy(np.stack(arrays))
        batch = batch.unsqueeze(1) if batch.dim() == 3 else batch.permute(0, 3, 1, 2)
        return batch.float().div_(255.0)


class Normalize:
    """Per-channel ``(x - mean) / std`` of an image batch [B, C, H, W] (deterministic)."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        self.mean = torch.tensor(mean, dtype=torch.float32).reshape(1, -1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).reshape(1, -1, 1, 1)

    def __call__(self, features: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        return (features - self.mean.to(features.device)) / self.std.to(features.device)


class RandomCrop:
    """Zero-pad each image by ``padding`` pixels, then crop a ``size`` x ``size`` window at a random place.

    ``size`` None keeps the images' own size: each image is then shifted by up to ``padding``
    pixels in each direction.  Without a generator (scoring) the centre window is taken.
    """

    def __init__(self, size: int | None = None, padding: int = 0) -> None:
        self.size = size
        self.padding = padding

    def __call__(self, features: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        size_h, size_w = (self.size, self.size) if self.size else features.shape[-2:]
        padded = torch.nn.functional.pad(features, [self.padding] * 4) if self.padding else features
        height, width = padded.shape[-2:]
        if height < size_h or width < size_w:
            raise ValueError(f"RandomCrop({self.size}) needs images of at least that size after padding, "
                             f"got {height}x{width}")
        if generator is None:
            top, left = (height - size_h) // 2, (width - size_w) // 2
            return padded[..., top:top + size_h, left:left + size_w]
        tops = torch.randint(0, height - size_h + 1, (len(padded),), generator=generator).tolist()
        lefts = torch.randint(0, width - size_w + 1, (len(padded),), generator=generator).tolist()
        return torch.stack([image[..., top:top + size_h, left:left + size_w]
                            for image, top, left in zip(padded, tops, lefts, strict=True)])


class RandomHorizontalFlip:
    """Mirror each image left-right with probability ``p`` (nothing without a generator)."""

    def __init__(self, p: float = 0.5) -> None:
        self.p = p

    def __call__(self, features: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        if generator is None:
            return features
        flip = (torch.rand(len(features), generator=generator) < self.p).to(features.device)
        return torch.where(flip.reshape(-1, *[1] * (features.dim() - 1)), features.flip(-1), features)


#: encoded grayscale images -> [B, 1, H, W] in [0, 1]
decode_grayscale = DecodeImages("L")
#: encoded grayscale digits, each shifted by up to 2 pixels when training (MNIST-style augmentation);
#: ``batch_transform = "sparkdl.transforms:shifted_grayscale"`` in a job file
shifted_grayscale = Compose(DecodeImages("L"), RandomCrop(padding=2))
