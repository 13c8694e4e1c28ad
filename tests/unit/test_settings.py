"""The settings table in sparkdl/config.py drives TrainConfig, the estimator's Params, the job and the docs.

A TorchEstimator is plain Python until ``fit``: none of these tests needs a SparkSession.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
from pathlib import Path

import pytest

from sparkdl import TorchEstimator, TrainConfig
from sparkdl._internal.settings_page import REGENERATE, SETTINGS_PAGE, replace_settings_block
from sparkdl.config import settings
from sparkdl.ml._params import ESTIMATOR_PARAMS

ROOT = Path(__file__).resolve().parents[2]
FIELDS = [field.name for field in dataclasses.fields(TrainConfig)]
PARAM_SPECS = [spec for spec in settings() if spec.param]
#: the estimator's Params that say where the data is and how to score, not how to train
DATA_PARAMS = {"model", "featuresCol", "featuresCols", "featuresShape", "inputCols", "inputArgs", "inputShapes",
               "labelCol", "weightCol", "predictionCol", "probabilityCol", "inferenceBatchSize", "handleInvalid",
               "outputKind", "rawPredictionCol", "topK", "topKCol", "outputCols"}

#: every field away from its default (and from BASE), all valid together
NON_DEFAULT = TrainConfig(
    num_workers=4, epochs=7, batch_size=8, policy="softsync", softsync_size=3, local_steps=2,
    staleness_lr="inverse", max_staleness=5, optimizer="adam", learning_rate=0.2, momentum=0.5, weight_decay=1e-4,
    loss="mse", seed=11, shuffle=False, timeout_s=42.0, ps_host="10.1.2.3", ps_port=5555, ps_shards=3, ps_hosts="executors", shard_snapshot_every=7, device="cpu", compression="topk",
    topk_ratio=0.1, checkpoint_dir="/data/ckpt", checkpoint_every=10, checkpoint_keep=5, resume_from="/data/old",
    max_attempts=1, elastic=True, min_workers=2, max_workers=6, nonfinite="fail", tls_cert="/etc/ps/cert.pem", tls_key="/etc/ps/key.pem", verbose=True,
    ps_memory_limit_mb=512.0, local_update="sgd", ssp_bound=2, backup_workers=1, sample_budget="per_worker",
    lr_schedule="cosine", lr_warmup_updates=10, lr_step_every=50, lr_step_gamma=0.5, lr_scaling="linear",
    validation_fraction=0.1, validation_every=2, early_stopping_patience=3, early_stopping_min_delta=0.01,
    restore_best_weights=False, data_cache="disk", batch_transform="sparkdl.transforms:DecodeImages",
    ps_transport="tcp", ps_threads=2, shared_tables=True, overlap_communication=True, pipeline_stages=3, micro_batches=6, pipeline_schedule="gpipe",
    pipeline_cuts="2,4", pad_value=-1.0, sequence_length=64, decay_all_parameters=True, grad_clip_norm=5.0,
    precision="bf16-mixed", train_step="sparkdl.models:mlp", callbacks=("mypackage.callbacks:StopAtAccuracy",),
    implicit_momentum="compensate", embedding_optimizer="adagrad", shard_blocks="TransformerBlock")
#: the defaults, but with TLS and validation on, so that settings which need a partner can each change alone
BASE = TrainConfig(tls_cert="base-cert.pem", tls_key="base-key.pem", validation_fraction=0.2)


def load_job_module():
    spec = importlib.util.spec_from_file_location("sparkdl_job_train", ROOT / "jobs" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def toml_text(value) -> str:
    if isinstance(value, tuple):
        return json.dumps(list(value))
    return json.dumps(value) if isinstance(value, (str, bool)) else repr(value)


def accessor(param: str) -> str:
    return param[0].upper() + param[1:]


def changed_fields(config: TrainConfig, reference: TrainConfig) -> set[str]:
    return {name for name in FIELDS if getattr(config, name) != getattr(reference, name)}


def test_the_fixtures_change_every_field():
    assert changed_fields(NON_DEFAULT, TrainConfig()) == set(FIELDS)
    assert changed_fields(NON_DEFAULT, BASE) == set(FIELDS)


# ----------------------------------------------------------------- (a) every field is reachable
def test_every_field_is_declared_once_as_a_param_or_as_internal():
    assert [spec.name for spec in settings()] == FIELDS
    for spec in settings():
        assert (spec.param is None) != (spec.internal is None), spec.name
        assert spec.help, spec.name


def test_the_estimator_params_are_the_table_plus_the_data_params():
    estimator = TorchEstimator()
    training = {spec.param for spec in PARAM_SPECS}
    assert {param.name for param in estimator.params} == training | DATA_PARAMS
    assert set(ESTIMATOR_PARAMS) == training | DATA_PARAMS
    assert [spec.param for spec in PARAM_SPECS if spec.scoring] == ["loss", "device", "precision", "batchTransform",
                                                                         "padValue", "sequenceLength"]


def test_existing_param_names_are_kept():
    # saved models store these names
    names = {spec.name: spec.param for spec in PARAM_SPECS}
    assert {name: names[name] for name in ("policy", "timeout_s", "seed", "learning_rate", "num_workers",
                                           "max_staleness", "checkpoint_dir", "topk_ratio")} == {
        "policy": "updatePolicy", "timeout_s": "timeout", "seed": "seed", "learning_rate": "learningRate",
        "num_workers": "numWorkers", "max_staleness": "maxStaleness", "checkpoint_dir": "checkpointDir",
        "topk_ratio": "topkRatio"}


@pytest.mark.parametrize("name", FIELDS)
def test_every_field_can_be_set_from_the_job(tmp_path, name):
    job = load_job_module()
    path = tmp_path / "job.toml"
    # TLS and validation on in the file, so that settings which need a partner can change alone
    path.write_text('[data]\ntrain = "t"\ntest = "s"\n[model]\nname = "mlp"\n'
                    '[train]\ntls_cert = "base-cert.pem"\ntls_key = "base-key.pem"\nvalidation_fraction = 0.2\n')
    value = getattr(NON_DEFAULT, name)
    settings_ = job.load_job_config(path, [f"train.{name}={toml_text(value)}"])["train"]
    config = TrainConfig.from_mapping(settings_)
    assert getattr(config, name) == value


def test_unquoted_job_strings_reach_the_config(tmp_path):
    job = load_job_module()
    path = ROOT / "conf" / "digits_async.toml"
    train = job.load_job_config(path, ["train.compression=int8", "train.tls_cert=/etc/c.pem",
                                       "train.tls_key=/etc/k.pem", "train.shuffle=false"])["train"]
    config = TrainConfig.from_mapping(train)
    assert (config.compression, config.tls_cert, config.tls_key, config.shuffle) == (
        "int8", "/etc/c.pem", "/etc/k.pem", False)


def test_the_job_builds_its_estimator_from_the_whole_config(monkeypatch, tmp_path):
    job = load_job_module()

    class Fitted(Exception):
        pass

    def fit(self, dataset):
        raise Fitted(self)

    monkeypatch.setattr(TorchEstimator, "fit", fit)
    with pytest.raises(Fitted) as info:
        job.train_with_estimator(None, None, {}, print, NON_DEFAULT, tmp_path)
    estimator = info.value.args[0]
    assert estimator.train_config() == NON_DEFAULT and estimator.getModel() is print


# ----------------------------------------------------------------- (b) round trips
def test_config_to_params_and_back():
    assert TorchEstimator.from_train_config(NON_DEFAULT, model=print).train_config() == NON_DEFAULT
    assert TorchEstimator(**{spec.param: getattr(NON_DEFAULT, spec.name) for spec in PARAM_SPECS}
                          ).train_config() == NON_DEFAULT
    assert TorchEstimator().train_config() == TrainConfig()


@pytest.mark.parametrize("spec", PARAM_SPECS, ids=lambda spec: spec.param)
def test_each_param_changes_exactly_its_field(spec):
    value = getattr(NON_DEFAULT, spec.name)
    estimator = TorchEstimator.from_train_config(BASE)
    getattr(estimator, f"set{accessor(spec.param)}")(value)
    assert getattr(estimator, f"get{accessor(spec.param)}")() == value
    assert changed_fields(estimator.train_config(), BASE) == {spec.name}
    by_keyword = TorchEstimator.from_train_config(BASE).setParams(**{spec.param: value})
    assert changed_fields(by_keyword.train_config(), BASE) == {spec.name}


@pytest.mark.parametrize("spec", [spec for spec in PARAM_SPECS if spec.value_type], ids=lambda spec: spec.param)
def test_param_converters_follow_the_field_type(spec):
    with pytest.raises(TypeError, match=spec.param):
        TorchEstimator(**{spec.param: object()})
    if spec.optional:
        estimator = TorchEstimator.from_train_config(NON_DEFAULT)
        getattr(estimator, f"set{accessor(spec.param)}")(None)
        if spec.name not in ("tls_cert", "tls_key"):    # the two go together
            assert getattr(estimator.train_config(), spec.name) is None


def test_unknown_params_are_named_with_the_known_ones():
    with pytest.raises(TypeError, match=r"no Param\(s\) \['learning_rate'\]; learning_rate is the Param "
                                        r"'learningRate'; known: \[.*'updatePolicy'"):
        TorchEstimator(learning_rate=0.1)
    with pytest.raises(TypeError, match="learnignRate"):
        TorchEstimator().setParams(learnignRate=0.1)


@pytest.mark.parametrize("spec", [spec for spec in settings() if spec.value_type], ids=lambda spec: spec.name)
def test_a_value_of_the_wrong_type_is_refused_with_the_field_named(spec):
    with pytest.raises(ValueError, match=f"TrainConfig.{spec.name} must be"):
        TrainConfig(**{spec.name: object()})


@pytest.mark.parametrize("spec", [spec for spec in PARAM_SPECS if spec.check], ids=lambda spec: spec.param)
def test_a_value_the_field_refuses_is_refused_when_the_param_is_set(spec):
    bad = "nope" if spec.value_type in (str, None) else -1
    with pytest.raises(ValueError) as by_config:
        TrainConfig(**{spec.name: bad})
    with pytest.raises(ValueError) as by_keyword:
        TorchEstimator(**{spec.param: bad})
    estimator = TorchEstimator()
    with pytest.raises(ValueError) as by_setter:
        getattr(estimator, f"set{accessor(spec.param)}")(bad)
    assert str(by_keyword.value) == str(by_setter.value) == str(by_config.value)
    left = getattr(estimator, f"get{accessor(spec.param)}")()
    assert (tuple(left) if isinstance(left, list) else left) == spec.default     # left as it was


def test_an_unknown_optimizer_is_refused_at_construction_naming_the_allowed_ones():
    message = r"TrainConfig.optimizer must be one of \('sgd', 'adam', 'adamw'\), got 'nope'"
    with pytest.raises(ValueError, match=message):
        TorchEstimator(optimizer="nope")
    with pytest.raises(ValueError, match=message):
        TorchEstimator().setOptimizer("nope")
    assert TorchEstimator(optimizer="adamw").train_config().optimizer == "adamw"


# ----------------------------------------------------------------- (c) JSON
def my_loss(output, target):
    return (output - target).abs().mean()


def test_to_json_dict_has_every_field_as_json(tmp_path):
    values = NON_DEFAULT.to_json_dict()
    assert list(values) == FIELDS
    assert TrainConfig.from_mapping(json.loads(json.dumps(values))) == NON_DEFAULT
    assert TrainConfig(loss=my_loss).to_json_dict()["loss"] == f"{__name__}:my_loss"
    assert TrainConfig(loss=functools.partial(my_loss)).to_json_dict()["loss"] == f"{__name__}:my_loss"
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_text("CERTIFICATE-BYTES")
    key.write_text("PRIVATE-KEY-BYTES")
    text = json.dumps(TrainConfig(tls_cert=cert, tls_key=str(key)).to_json_dict())
    assert str(cert) in text and str(key) in text and "BYTES" not in text


# ----------------------------------------------------------------- (d) the docs' settings table
def test_the_docs_settings_table_is_up_to_date():
    text = (ROOT / SETTINGS_PAGE).read_text(encoding="utf-8")
    assert replace_settings_block(text) == text, f"{SETTINGS_PAGE}: settings table out of date; run `{REGENERATE}`"
