"""Cutting a model into pipeline stages, and the checks a pipelined run makes before launch."""
import itertools
from pathlib import Path

import pytest
import torch
from torch import nn

from sparkdl import ClusterConfigError, TrainConfig
from sparkdl._internal.combinations import pipeline_refusal
from sparkdl._internal.modes.pipeline.worker import ideal_bubble
from sparkdl._internal.spark.preflight import check_task_memory
from sparkdl._internal.training.flat import flatten_buffers, flatten_parameters
from sparkdl._internal.training.pipeline_cuts import (
    balanced_cuts,
    build_stage,
    build_whole,
    lay_out_stages,
    parse_cuts,
    whole_model,
)
from tests.unit.conftest import refused_under_headroom


def brute_force_max(sizes, stages):
    """The smallest possible largest-stage total, trying every cut."""
    best = float("inf")
    for cuts in itertools.combinations(range(1, len(sizes)), stages - 1):
        bounds = (0, *cuts, len(sizes))
        best = min(best, max(sum(sizes[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


@pytest.mark.parametrize("sizes, stages", [([5, 1, 1, 1, 5], 2), ([9, 1, 1, 1], 2), ([3, 3, 3, 3, 3, 3], 4),
                                           ([1, 100, 1, 1, 1, 100], 3), ([7], 1), ([2, 2], 2)])
def test_balanced_cuts_minimise_the_largest_stage(sizes, stages):
    cuts = balanced_cuts(sizes, stages)
    bounds = (0, *cuts, len(sizes))
    assert len(cuts) == stages - 1 and list(bounds) == sorted(set(bounds))      # non-empty, in order
    assert max(sum(sizes[a:b]) for a, b in zip(bounds, bounds[1:])) == brute_force_max(sizes, stages)


def test_more_stages_than_layers_is_refused():
    with pytest.raises(ValueError, match="non-empty stages"):
        balanced_cuts([1, 2], 3)


def mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU(),
                         nn.Linear(16, 4))


def test_stage_ranges_tile_the_flat_parameters_and_buffers():
    model = mlp()
    plan = lay_out_stages(model, 3)
    params, buffers = flatten_parameters(model), flatten_buffers(model)
    assert plan.param_spans[0][0] == 0 and plan.param_spans[-1][1] == params.numel()
    assert plan.buffer_spans[-1][1] == buffers.numel()
    for (_, end), (start, _) in zip(plan.param_spans, plan.param_spans[1:]):
        assert end == start
    for stage in range(3):   # each range is exactly that stage's layers' values, in order
        layers = nn.Sequential(*[model[i] for i in plan.layers(stage)])
        start, end = plan.param_spans[stage]
        assert torch.equal(params[start:end], flatten_parameters(layers))
        start, end = plan.buffer_spans[stage]
        assert torch.equal(buffers[start:end], flatten_buffers(layers))


def test_parameter_free_layers_never_make_a_stage_of_their_own():
    layers = lambda: nn.Sequential(nn.Flatten(), nn.Linear(8, 8), nn.ReLU(), nn.Dropout(), nn.Linear(8, 8),
                                   nn.ReLU(), nn.Linear(8, 2))
    plan = lay_out_stages(layers(), 3)
    assert plan.bounds == (0, 4, 6, 7)    # cuts fall before Linear layers only
    assert all(plan.parameter_count(s) > 0 for s in range(3))


def test_explicit_cuts_and_their_checks():
    model = mlp()
    plan = lay_out_stages(model, 2, parse_cuts("3"))
    assert plan.bounds == (0, 3, 6)
    for bad in ("0", "6", "2,4"):
        with pytest.raises(ValueError, match="pipeline_cuts"):
            lay_out_stages(model, 2, parse_cuts(bad))
    with pytest.raises(ValueError, match="no parameters"):
        lay_out_stages(model, 3, parse_cuts("1,2"))     # stage 1 would be the lone ReLU
    with pytest.raises(ValueError, match="comma-separated"):
        parse_cuts("three")


def test_stage_factories_are_stages_and_chain_into_the_whole_model():
    factories = [lambda: nn.Linear(4, 8), lambda: nn.Sequential(nn.ReLU(), nn.Linear(8, 2))]
    model, from_factories = build_whole(lambda: factories)
    assert from_factories and whole_model(lambda: factories)(torch.zeros(3, 4)).shape == (3, 2)
    plan = lay_out_stages(model, 2, from_factories=True)
    assert plan.from_factories and plan.param_spans == ((0, 40), (40, 58))
    with pytest.raises(ValueError, match="2 stage factories for pipeline_stages=3"):
        lay_out_stages(model, 3, from_factories=True)
    with pytest.raises(ValueError, match="torch.nn.Module"):
        whole_model(lambda: [lambda: "not a module"])


def test_a_stage_is_built_without_the_other_stages_memory():
    model = mlp()
    plan = lay_out_stages(model, 2)
    built_on: list[str] = []

    def recording_mlp() -> nn.Module:
        built_on.append(torch.empty(0).device.type)   # where the factory's tensors are allocated
        return mlp()

    stage = build_stage(recording_mlp, plan, 1, torch.device("cpu"))
    assert built_on == ["meta"]                        # the whole model never took real memory
    assert [type(m) for m in stage] == [type(model[i]) for i in plan.layers(1)]
    assert all(p.device.type == "cpu" for p in stage.parameters())
    assert sum(p.numel() for p in stage.parameters()) == plan.parameter_count(1)


_META_REFUSING_SETUP = """
import torch
from torch import nn
from sparkdl._internal.training.pipeline_cuts import build_stage, lay_out_stages

def big():   # 2 x 50M parameters (400 MB): a factory that loads files, so it cannot run on meta
    if torch.empty(0).device.type == "meta":
        raise RuntimeError("cannot load weights on the meta device")
    return nn.Sequential(nn.Linear(10_000, 5_000), nn.Linear(5_000, 10_000))

with torch.device("meta"):
    plan = lay_out_stages(nn.Sequential(nn.Linear(10_000, 5_000), nn.Linear(5_000, 10_000)), 2)
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the address space from /proc (Linux)")
def test_a_factory_that_cannot_run_on_meta_is_refused_before_it_exceeds_the_task_memory():
    """The fallback builds the whole model: under a 200 MB address-space headroom (as
    spark.executor.pyspark.memory sets it) a 400 MB model is refused, naming the meta device, not a MemoryError."""
    printed = refused_under_headroom(_META_REFUSING_SETUP, 'build_stage(big, plan, 1, torch.device("cpu"))',
                                     headroom_mb=200)
    assert "cannot run on the meta device" in printed and "spark.executor.pyspark.memory" in printed


@pytest.mark.parametrize("settings, fragment", [
    ({"policy": "async"}, "policy='sync'"), ({"policy": "allreduce"}, "policy='sync'"),
    ({"compression": "fp16"}, "compression='none'"), ({"overlap_communication": True}, "overlap_communication"),
    ({"local_steps": 2}, "local_steps=1"), ({"validation_fraction": 0.2}, "validation_fraction"),
    ({"batch_size": 10, "micro_batches": 4}, "multiple of micro_batches"),
    ({"micro_batches": 2, "pipeline_stages": 4}, "micro_batches >= pipeline_stages")])
def test_what_a_pipeline_refuses(settings, fragment):
    config = TrainConfig(pipeline_stages=2, batch_size=32, micro_batches=4).replace(**settings)
    assert fragment in pipeline_refusal(config)


def test_what_a_pipeline_accepts():
    assert pipeline_refusal(TrainConfig(pipeline_stages=4, batch_size=32, micro_batches=4)) is None
    assert pipeline_refusal(TrainConfig(pipeline_stages=4, batch_size=32, micro_batches=2,
                                        pipeline_schedule="gpipe")) is None


def test_a_stage_too_large_for_a_task_is_refused_with_the_cure():
    check_task_memory([10_000_000], None, 1)   # no limit: nothing to check
    check_task_memory([1_000_000, 1_000_000], 64 << 20, 2)
    with pytest.raises(ClusterConfigError, match=r"pipeline_stages >= 3"):
        check_task_memory([10_000_000], 64 << 20, 1)    # 80 MB of weights and gradient in 64 MiB


def test_ideal_bubble_is_gpipes():
    assert ideal_bubble(1, 8) == 0.0
    assert ideal_bubble(4, 4) == pytest.approx(3 / 7)
