"""Cutting a model into pipeline stages: which layers, parameters and buffers each stage holds.

A pipelined model is an ``nn.Sequential`` (cut automatically, balanced by parameter count,
or at explicit cut points) or a list of stage factories (one stage each).  Parameters and
buffers of a stage are one contiguous range of the whole model's flat vectors
(``training.flat``), so a stage is a key range on the parameter server.
"""
from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from sparkdl._internal.memory import require_address_space

log = logging.getLogger(__name__)

#: what a model factory may return: a module, or (pipelines) the factories of its stages
ModelFactory = Callable[[], Any]


def build_whole(model_fn: ModelFactory) -> tuple[nn.Module, bool]:
    """The whole model ``model_fn`` describes, and whether it returned stage factories (chained here
    in a Sequential) rather than a module."""
    built = model_fn()
    if isinstance(built, (list, tuple)):
        if not built or not all(callable(f) for f in built):
            raise ValueError("model_fn returned a list: it must hold one zero-argument stage factory per "
                             "pipeline stage")
        return nn.Sequential(*[_module(f(), f"stage factory {i}") for i, f in enumerate(built)]), True
    return _module(built, "model_fn"), False


def whole_model(model_fn: ModelFactory) -> nn.Module:
    """The whole model ``model_fn`` describes: its module, or the stages' modules chained in a Sequential."""
    return build_whole(model_fn)[0]


def _module(built: Any, what: str) -> nn.Module:
    if not isinstance(built, nn.Module):
        raise ValueError(f"{what} must return a torch.nn.Module, got {type(built).__name__}")
    return built


def balanced_cuts(sizes: Sequence[int], stages: int) -> list[int]:
    """Start indices of stages 1..P-1 cutting ``sizes`` into contiguous non-empty groups.

    Minimises the largest group's total (the stage holding the most parameters), then, among
    equal maxima, prefers earlier cuts; a linear-partition dynamic programme, O(P n^2).
    """
    n = len(sizes)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot cut {n} layers into {stages} non-empty stages")
    prefix = [0, *itertools.accumulate(sizes)]
    inf = float("inf")
    # best[p][i]: smallest largest-group total cutting the first i layers into p groups
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for p in range(1, stages + 1):
        for i in range(p, n + 1):
            for j in range(p - 1, i):
                value = max(best[p - 1][j], prefix[i] - prefix[j])
                if value < best[p][i]:
                    best[p][i], cut[p][i] = value, j
    cuts, i = [], n
    for p in range(stages, 0, -1):
        i = cut[p][i]
        cuts.append(i)
    return sorted(cuts)[1:]


def _balanced_layer_cuts(sizes: Sequence[int], stages: int) -> list[int]:
    """Balanced cuts that only fall before layers with parameters: a parameter-free layer (an
    activation, a reshape) stays with the layer before it, so that no stage is left without parameters."""
    units = [i for i, size in enumerate(sizes) if size] or [0]
    units[0] = 0   # leading parameter-free layers join the first stage
    if len(units) < stages:
        raise ValueError(f"pipeline_stages={stages} needs at least {stages} layers with parameters in the "
                         f"Sequential; it has {len(units)}")
    ends = [*units[1:], len(sizes)]
    unit_sizes = [sum(sizes[start:end]) for start, end in zip(units, ends, strict=True)]
    return [units[cut] for cut in balanced_cuts(unit_sizes, stages)]


def parse_cuts(text: str | None) -> list[int] | None:
    """``"3,6"`` -> [3, 6]; None stays None."""
    if text is None:
        return None
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"pipeline_cuts must be comma-separated layer indices such as '3,6', got {text!r}") from None


@dataclass(frozen=True)
class StageLayout:
    """Where a model is cut: the layers, parameter range and buffer range of every stage."""

    #: index of each stage's first layer in the Sequential, then the number of layers
    bounds: tuple[int, ...]
    #: (start, end) of every stage's parameters in the flat parameter vector
    param_spans: tuple[tuple[int, int], ...]
    #: (start, end) of every stage's buffers in the flat buffer vector
    buffer_spans: tuple[tuple[int, int], ...]
    #: the model factory returned stage factories (one per stage) rather than a Sequential
    from_factories: bool

    @property
    def num_stages(self) -> int:
        return len(self.param_spans)

    def layers(self, stage: int) -> range:
        return range(self.bounds[stage], self.bounds[stage + 1])

    def parameter_count(self, stage: int) -> int:
        start, end = self.param_spans[stage]
        return end - start


def lay_out_stages(model: nn.Module, stages: int, cuts: list[int] | None = None,
                   from_factories: bool = False) -> StageLayout:
    """Cut ``model`` into ``stages`` stages (``from_factories``: its layers are the stages already;
    see :func:`build_whole`)."""
    if not isinstance(model, nn.Sequential):
        raise ValueError(f"pipeline_stages={stages} needs model_fn to return an nn.Sequential (cut between its "
                         f"layers) or a list of {stages} stage factories; it returned a {type(model).__name__}")
    layers = list(model)
    if from_factories:
        if len(layers) != stages:
            raise ValueError(f"model_fn returned {len(layers)} stage factories for pipeline_stages={stages}")
        if cuts is not None:
            raise ValueError("pipeline_cuts applies to an nn.Sequential, not to a list of stage factories")
        starts = list(range(1, stages))
    elif cuts is not None:
        if len(cuts) != stages - 1 or cuts != sorted(set(cuts)) or not all(0 < c < len(layers) for c in cuts):
            raise ValueError(f"pipeline_cuts={cuts} must be {stages - 1} increasing layer indices in "
                             f"[1, {len(layers) - 1}] for pipeline_stages={stages} over {len(layers)} layers")
        starts = cuts
    else:
        if len(layers) < stages:
            raise ValueError(f"pipeline_stages={stages} needs at least {stages} layers in the Sequential; "
                             f"it has {len(layers)}")
        starts = _balanced_layer_cuts([_count(layer.parameters()) for layer in layers], stages)
    bounds = (0, *starts, len(layers))
    param_spans, buffer_spans = [], []
    param_at = buffer_at = 0
    for stage in range(stages):
        chunk = layers[bounds[stage]:bounds[stage + 1]]
        params = sum(_count(layer.parameters()) for layer in chunk)
        buffers = sum(_count(layer.buffers()) for layer in chunk)
        if params == 0:
            raise ValueError(f"pipeline stage {stage} (layers {bounds[stage]}..{bounds[stage + 1] - 1}) has no "
                             "parameters to train; choose other pipeline_cuts")
        param_spans.append((param_at, param_at + params))
        buffer_spans.append((buffer_at, buffer_at + buffers))
        param_at += params
        buffer_at += buffers
    return StageLayout(bounds, tuple(param_spans), tuple(buffer_spans), from_factories)


def _count(tensors) -> int:
    return sum(t.numel() for t in tensors)


def build_stage(model_fn: ModelFactory, layout: StageLayout, stage: int, device: torch.device) -> nn.Module:
    """Stage ``stage``'s layers on ``device``, with uninitialised values (the PS sends the weights).

    The model is built on the meta device, so a task never allocates the other stages'
    memory; a factory that cannot run there is built for real and the rest dropped, after a check
    that the whole model fits the task's memory limit (a clear error instead of a ``MemoryError``).
    """
    def build() -> nn.Module:
        built = model_fn()
        if layout.from_factories:
            return _module(built[stage](), f"stage factory {stage}")
        # the layout was cut from this factory's Sequential (lay_out_stages refuses any other module)
        layers = list(cast(nn.Sequential, _module(built, "model_fn")))
        return nn.Sequential(*layers[layout.bounds[stage]:layout.bounds[stage + 1]])

    try:
        with torch.device("meta"):
            module = build()
    except Exception as exc:   # e.g. a factory that loads weights from a file
        whole = 4 * layout.param_spans[-1][1]   # the whole model's float32 parameters, then sliced
        require_address_space(whole, f"the model factory cannot run on the meta device ({exc}), so pipeline "
                              f"stage {stage} is cut from the whole model built in memory, which",
                              "Make the factory build its layers under `with torch.device('meta')` (load no "
                              "weights from files in it), or give the Python workers more memory")
        log.warning("sparkdl: the model factory cannot run on the meta device (%s); stage %d is cut from a "
                    "whole model built in memory", exc, stage)
        return build().to(device)
    return module.to_empty(device=device)


@dataclass(frozen=True)
class PipelineSpec:
    """What a pipelined run adds to the job spec."""

    layout: StageLayout
    #: the whole model's initial float buffers (BatchNorm statistics ...); each stage takes its range
    float_buffers: np.ndarray
