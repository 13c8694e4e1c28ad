"""The one table of settings that must agree: each rule is checked, at its moment, naming the settings in conflict."""
import pytest

from sparkdl._internal.combinations import RULES, check_combinations
from sparkdl.config import TrainConfig

#: a configuration breaking each rule, and what its refusal says
BROKEN = {
    ("overlap_communication",): ({"overlap_communication": True, "compression": "int8"},
                                 "TrainConfig.overlap_communication cannot be used here: a streamed gradient is sent"),
    ("pipeline_stages",): ({"pipeline_stages": 2, "policy": "async"},
                           "TrainConfig.pipeline_stages=2 cannot be used here: policy='async'"),
    ("ps_shards", "ps_hosts"): ({"ps_shards": 2},
                                "TrainConfig.ps_shards=2, ps_hosts='driver' cannot be used here: shards hosted by the "
                                "driver"),
    ("grad_clip_norm", "ps_shards", "ps_hosts"): (
        {"grad_clip_norm": 1.0, "ps_shards": 2, "ps_hosts": "executors"},
        "TrainConfig.grad_clip_norm=1.0, ps_shards=2, ps_hosts='executors' cannot be used here: clipping needs the "
        "norm of the whole gradient"),
    ("precision", "pipeline_stages"): ({"precision": "bf16-mixed", "pipeline_stages": 2},
                                       "TrainConfig.precision='bf16-mixed', pipeline_stages=2 cannot be used here: "
                                       "pipeline stages train in float32"),
    ("callbacks", "policy", "ps_hosts"): ({"callbacks": ["mymodule:Stop"], "policy": "allreduce"},
                                          "TrainConfig.callbacks=('mymodule:Stop',), policy='allreduce', "
                                          "ps_hosts='driver' cannot be used here: callbacks are called by the "
                                          "parameter server on the driver, and allreduce has none"),
    ("train_step", "pipeline_stages"): ({"train_step": "mymodule:step", "pipeline_stages": 2},
                                        "TrainConfig.train_step='mymodule:step', pipeline_stages=2 cannot be used "
                                        "here: pipeline stages compute the loss on the last stage's output"),
    ("elastic", "policy", "ps_hosts", "sample_budget"): (
        {"elastic": True, "policy": "sync"},
        "TrainConfig.elastic, policy='sync', ps_hosts='driver', sample_budget='global' cannot be used here: "
        "policy='sync' needs every worker in each round"),
    ("min_workers", "elastic", "num_workers", "ssp_bound", "resume_from"): (
        {"min_workers": 1, "policy": "async"},
        "TrainConfig.min_workers=1, elastic=False, num_workers=2, ssp_bound=None, resume_from=None cannot be used "
        "here: only an elastic run starts before every worker"),
    ("max_workers", "elastic", "num_workers", "min_workers", "policy", "resume_from", "ssp_bound"): (
        {"max_workers": 4, "policy": "async"},
        "TrainConfig.max_workers=4, elastic=False, num_workers=2, min_workers=None, policy='async', resume_from=None, "
        "ssp_bound=None cannot be used here: only an elastic run's workers come and go"),
    ("shared_tables", "policy", "ps_hosts", "ps_shards", "ps_transport"): (
        {"shared_tables": True, "policy": "sync"},
        "TrainConfig.shared_tables, policy='sync', ps_hosts='driver', ps_shards=1, ps_transport='auto' cannot be "
        "used here: workers step shared tables as they compute"),
    ("policy", "pipeline_stages", "compression", "local_update", "overlap_communication", "precision",
     "validation_fraction", "checkpoint_dir", "resume_from", "local_steps"): (
        {"policy": "fsdp", "validation_fraction": 0.1},
        "TrainConfig.policy='fsdp', pipeline_stages=1, compression='none', local_update='accumulate', "
        "overlap_communication=False, precision='32', validation_fraction=0.1, checkpoint_dir=None, resume_from=None, "
        "local_steps=1 cannot be used here: validation_fraction is not available with fsdp yet"),
    ("implicit_momentum", "policy", "optimizer"): ({"implicit_momentum": "compensate", "policy": "sync"},
                                                   "TrainConfig.implicit_momentum='compensate', policy='sync', "
                                                   "optimizer='sgd' cannot be used here: the momentum asynchrony "
                                                   "adds is modelled for workers"),
}


@pytest.mark.parametrize("settings", sorted(BROKEN))
def test_a_launch_rule_refuses_naming_its_settings(settings):
    values, message = BROKEN[settings]
    config = TrainConfig(num_workers=2, **values)         # a mode's rules wait for the launch
    check_combinations(config, "config")
    with pytest.raises(ValueError) as refused:
        check_combinations(config, "launch")
    assert str(refused.value).startswith(message)


def test_every_rule_of_a_mode_is_in_the_table_and_checked_at_launch():
    launch = {rule.settings for rule in RULES if rule.at == "launch"}
    assert launch == set(BROKEN)


@pytest.mark.parametrize("values, message", [
    ({"backup_workers": 2}, r"backup_workers \(2\) must be below num_workers \(2\)"),
    ({"policy": "softsync", "softsync_size": 3}, r"softsync_size \(3\) must be between 1 and num_workers \(2\)"),
    ({"early_stopping_patience": 2}, "early_stopping_patience needs validation data"),
    ({"tls_cert": "/c.pem"}, "tls_cert and tls_key must be given together"),
    ({"precision": "16-mixed", "device": "cpu"}, "precision='16-mixed' needs a CUDA device"),
])
def test_values_that_never_go_together_are_refused_when_the_config_is_made(values, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(num_workers=2, **values)


def test_late_joins_are_refused_with_ssp_resume_and_more_starters_than_workers():
    elastic = TrainConfig(num_workers=2, policy="async", elastic=True)
    check_combinations(elastic.replace(min_workers=1), "launch")
    with pytest.raises(ValueError, match=r"min_workers \(3\) cannot exceed num_workers \(2\)"):
        check_combinations(elastic.replace(min_workers=3), "launch")
    with pytest.raises(ValueError, match="a worker that joins late would hold every other one"):
        check_combinations(elastic.replace(min_workers=1, ssp_bound=2), "launch")
    with pytest.raises(ValueError, match="set min_workers=None to resume"):
        check_combinations(elastic.replace(min_workers=1, resume_from="/tmp/checkpoints"), "launch")


def test_work_units_are_refused_below_num_workers_and_with_softsync_ssp_and_resume():
    elastic = TrainConfig(num_workers=2, policy="async", elastic=True)
    check_combinations(elastic.replace(max_workers=4, min_workers=1), "launch")
    with pytest.raises(ValueError, match=r"max_workers \(1\) cannot be below num_workers \(2\)"):
        check_combinations(elastic.replace(max_workers=1), "launch")
    with pytest.raises(ValueError, match="n-softsync's step takes c = lambda/n gradients"):
        check_combinations(elastic.replace(max_workers=4, policy="softsync_nodes"), "launch")
    with pytest.raises(ValueError, match="a work unit's task starts after the others"):
        check_combinations(elastic.replace(max_workers=4, ssp_bound=2), "launch")
    with pytest.raises(ValueError, match="epochs x 4 x max_workers = 80000 passes the wire's 65536"):
        check_combinations(elastic.replace(max_workers=200, epochs=100), "launch")
    with pytest.raises(ValueError, match="one data position per worker, not per work unit"):
        check_combinations(elastic.replace(max_workers=4, resume_from="/tmp/checkpoints"), "launch")


def test_float16_loss_scaling_is_refused_with_streamed_gradients():
    config = TrainConfig(num_workers=2, precision="16-mixed", overlap_communication=True)
    with pytest.raises(ValueError, match="overlap_communication cannot be used here: precision='16-mixed'"):
        check_combinations(config, "launch")
    check_combinations(config.replace(precision="bf16-mixed"), "launch")   # autocast alone streams as usual


def test_allreduce_overlaps_its_one_backward_with_float16_too_but_not_accumulated_steps():
    config = TrainConfig(num_workers=2, policy="allreduce", overlap_communication=True, precision="16-mixed")
    check_combinations(config, "launch")   # the buckets stay scaled while reduced and are unscaled after, as without
    for settings in ({"local_steps": 2}, {"local_update": "sgd", "local_steps": 2}):
        with pytest.raises(ValueError, match="allreduce reduces gradients in buckets during the one backward"):
            check_combinations(config.replace(**settings), "launch")


def test_clipping_with_one_executor_hosted_shard_or_a_driver_pipeline_is_accepted():
    # one PS (or one driver PS assembling a pipeline's parts) sees the whole gradient
    check_combinations(TrainConfig(num_workers=2, grad_clip_norm=1.0, ps_hosts="executors"), "launch")
    check_combinations(TrainConfig(num_workers=2, grad_clip_norm=1.0, pipeline_stages=2), "launch")


def test_the_defaults_pass_every_rule():
    check_combinations(TrainConfig(), "config")
    check_combinations(TrainConfig(), "launch")


@pytest.mark.parametrize("values, message", [
    ({"policy": "allreduce"}, "policy='allreduce' needs every worker"),
    ({"policy": "async", "ps_hosts": "executors", "ps_shards": 2}, "executor-hosted PS shards live in the stage's"),
    ({"policy": "softsync", "sample_budget": "per_worker"}, "set sample_budget='global'"),
])
def test_elastic_runs_refuse_what_needs_every_worker_at_once(values, message):
    with pytest.raises(ValueError, match=message):
        check_combinations(TrainConfig(num_workers=2, elastic=True, **values), "launch")


@pytest.mark.parametrize("policy", ["async", "softsync", "softsync_nodes"])
def test_elastic_asynchronous_policies_are_accepted(policy):
    check_combinations(TrainConfig(num_workers=2, elastic=True, policy=policy), "launch")
