"""Spark Connect: fit, transform, save/load, Pipeline and CrossValidator through a real local Connect server.

A classic SparkSession and a Spark Connect session cannot share one Python process: pyspark
refuses to start the second one, and a Connect session makes pyspark's functions build Connect
columns for the whole process.  So when this module is collected together with the classic
tests it contributes one test, which runs the module again in a pytest process of its own
(``SPARKDL_CONNECT_TESTS=1``) and reports that run; the classic fit the Connect tests compare
with runs in the suite's own classic session around it (``connect_reference``).  To run the
Connect tests directly: ``SPARKDL_CONNECT_TESTS=1 python -m pytest tests/integration/test_connect.py``.
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ..connect_port import one_connect_server
from . import connect_reference

ROOT = Path(__file__).resolve().parents[2]
IN_OWN_PROCESS = os.environ.get("SPARKDL_CONNECT_TESTS") == "1"
#: a directory where the classic session left the data and its reference fit (under the whole suite)
SHARED = os.environ.get("SPARKDL_CONNECT_SHARED")


def connect_missing() -> str | None:
    """Why Spark Connect cannot run here (its client dependencies), or None."""
    try:
        from pyspark.sql.connect.utils import check_dependencies

        check_dependencies()
    except ImportError as exc:
        return f"Spark Connect client dependencies missing ({exc}); pip install 'sparkdl[connect]'"
    return None


def classic_env() -> dict[str, str]:
    """This process's environment without what makes pyspark start Spark Connect sessions."""
    return {k: v for k, v in os.environ.items()
            if k not in ("SPARK_REMOTE", "SPARK_CONNECT_MODE_ENABLED", "SPARK_LOCAL_REMOTE")
            and not k.startswith("PYSPARK_REMOTE_INIT_CONF")}


if not IN_OWN_PROCESS:
    @pytest.mark.slow
    def test_spark_connect_suite_in_its_own_process(spark, digits, tmp_path):
        reason = connect_missing()
        if reason:
            pytest.skip(reason)
        # the classic side, in this suite's session: the data and the fit the Connect run compares with
        connect_reference.write_digits(spark, digits, tmp_path)
        connect_reference.classic_run(spark, tmp_path)
        # no PYSPARK_PYTHON either: spark_session(remote=...) must set it for the Connect server
        env = {k: v for k, v in classic_env().items() if k not in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON")}
        env.update(SPARKDL_CONNECT_TESTS="1", SPARKDL_CONNECT_SHARED=str(tmp_path))
        started = time.monotonic()
        with one_connect_server():
            proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=0",
                                   str(Path(__file__).relative_to(ROOT))],
                                  cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
        report = proc.stdout[-6000:] + proc.stderr[-2000:]
        print(f"Spark Connect tests ({time.monotonic() - started:.0f} s):\n{report}")
        assert proc.returncode == 0, report
        # the model the Connect run saved, loaded and scored by classic Spark
        scored = json.loads(json.dumps(connect_reference.scored_by_classic(spark, tmp_path), default=float))
        saved = json.loads((tmp_path / "connect-model.json").read_text())
        assert scored["predictions"] == saved["predictions"], "classic Spark scores the Connect-saved model otherwise"
        assert scored["summary"] == saved["summary"], "the Connect-saved model's summary changed on loading"

else:
    from pyspark.ml import Pipeline, PipelineModel
    from pyspark.ml.evaluation import MulticlassClassificationEvaluator
    from pyspark.ml.feature import StandardScaler, VectorAssembler
    from pyspark.ml.linalg import DenseVector
    from pyspark.ml.tuning import CrossValidator, ParamGridBuilder
    from pyspark.sql import functions as F
    from torch import nn

    import sparkdl
    from sparkdl import ClusterConfigError, ParameterServerError, SparkDLError, TorchEstimator, TorchModel
    from sparkdl._internal.spark.backend import backend_for
    from sparkdl._internal.spark.preflight import probe_executor, ps_host
    from sparkdl.models import mlp

    DIGITS_MLP = connect_reference.DIGITS_MLP
    SETTINGS = connect_reference.SETTINGS

    def accuracy(frame) -> float:
        return frame.select(F.avg((F.col("prediction") == F.col("label")).cast("double"))).first()[0]

    def predictions(model: TorchModel, frame) -> list[float]:
        return [r.prediction for r in model.transform(frame).orderBy("id").select("prediction").collect()]

    @pytest.fixture(scope="module")
    def connect():
        reason = connect_missing()
        if reason:
            pytest.skip(reason)
        session = sparkdl.spark_session("sparkdl-connect-tests", remote="local[2]", conf={
            "spark.ui.enabled": "false", "spark.sql.shuffle.partitions": "4"})
        yield session
        session.stop()

    @pytest.fixture(scope="module")
    def digits_data(connect, digits, tmp_path_factory):
        """Digits as Parquet, the same files as the classic side's (written by it, or here)."""
        root = Path(SHARED) if SHARED else tmp_path_factory.mktemp("connect-data")
        if not SHARED:
            connect_reference.write_digits(connect, digits, root)
        return root, connect.read.parquet(str(root / "train")).cache(), connect.read.parquet(str(root / "test"))

    @pytest.fixture(scope="module")
    def fitted(digits_data):
        _, train, _ = digits_data
        return TorchEstimator(model=DIGITS_MLP, **SETTINGS).fit(train)

    @pytest.fixture(scope="module")
    def classic(digits_data, fitted):
        """(directory, the classic fit's reference.json, this model as saved here, as classic Spark scored it).

        Under the whole suite the classic session made the reference before this process, and
        scores the model saved here after it (the last value is then None); run on their own, the
        Connect tests start a classic process that does both now.
        """
        root, _, test = digits_data
        fitted.write().overwrite().save(str(root / "connect-model"))
        expected = {"predictions": predictions(fitted, test),
                    "summary": json.loads(json.dumps(fitted.summary, default=float))}
        scored = None
        if SHARED:
            (root / "connect-model.json").write_text(json.dumps(expected))
        else:
            subprocess.run([sys.executable, str(ROOT / "tests" / "integration" / "connect_reference.py"), str(root)],
                           check=True, timeout=600, cwd=ROOT, env=classic_env())
            scored = json.loads((root / "scored-by-classic.json").read_text())
        return root, json.loads((root / "reference.json").read_text()), expected, scored

    def test_session_executors_run_this_interpreter(connect):
        # the wrapper removed PYSPARK_PYTHON: spark_session(remote="local[2]") must set it for the server
        assert probe_executor(connect).python == sys.executable

    def test_fit_transform_digits(fitted, digits_data):
        _, _, test = digits_data
        scored = fitted.transform(test)
        assert scored.columns == ["id", "features", "label", "prediction", "probability"]
        assert accuracy(scored) >= 0.9
        first = scored.select("probability").first().probability
        assert isinstance(first, DenseVector) and len(first) == 10 and abs(first.toArray().sum() - 1) < 1e-5
        assert len(fitted.history) == fitted.summary["updates"] > 0
        assert fitted.summary["policy"] == "sync" and fitted.summary["task"] == "multiclass"

    def test_same_results_params_history_and_summary_as_classic(fitted, digits_data, classic):
        import torch

        root, reference, _, _ = classic
        _, _, test = digits_data
        weights = torch.load(root / "weights.pt", weights_only=True)
        assert weights.keys() == fitted.state_dict.keys()
        assert all(torch.allclose(weights[k], fitted.state_dict[k], atol=1e-6) for k in weights)
        assert predictions(fitted, test) == reference["predictions"]
        params = connect_reference.comparable_params(fitted)
        assert json.loads(json.dumps(params, default=str)) == reference["params"]
        assert sorted(fitted.summary) == reference["summary_keys"]
        assert list(fitted.history.columns) == reference["history_columns"]
        assert fitted.summary["updates"] == reference["updates"]

    def test_save_load_round_trip_and_across_modes(fitted, digits_data, classic, tmp_path):
        root, reference, saved, scored = classic
        _, _, test = digits_data
        expected = saved["predictions"]
        if scored is not None:   # saved here, loaded by classic Spark (under the whole suite: checked after this run)
            assert scored == saved
        # saved here, loaded here
        path = str(tmp_path / "model")
        fitted.write().overwrite().save(path)
        fitted.write().overwrite().save(path)       # overwrite replaces it
        with pytest.raises(FileExistsError, match="overwrite"):
            fitted.write().save(path)
        loaded = TorchModel.load(path)
        assert loaded.uid == fitted.uid and loaded.summary == fitted.summary
        assert loaded.history.equals(fitted.history)
        assert predictions(loaded, test) == expected
        # saved by classic Spark, loaded here
        classic_model = TorchModel.load(str(root / "classic-model"))
        assert predictions(classic_model, test) == reference["predictions"]
        # the estimator, unfitted
        estimator = TorchEstimator(model=DIGITS_MLP, **SETTINGS)
        estimator.write().overwrite().save(str(tmp_path / "estimator"))
        again = TorchEstimator.load(str(tmp_path / "estimator"))
        assert again.uid == estimator.uid and again.train_config() == estimator.train_config()

    def test_large_specs_travel_as_session_files(digits_data, monkeypatch, tmp_path):
        """Over the inline limit, job specs, scoring specs and saved rows go as session artifacts."""
        from sparkdl._internal.spark import backend

        _, train, test = digits_data
        uploads: list[int] = []
        upload = backend.SessionFile.upload
        monkeypatch.setattr(backend, "INLINE_LIMIT_BYTES", 1024)
        monkeypatch.setattr(backend.SessionFile, "upload",
                            classmethod(lambda cls, spark, data: uploads.append(len(data)) or upload(spark, data)))
        model = TorchEstimator(model=DIGITS_MLP, **{**SETTINGS, "epochs": 4, "updatePolicy": "async"}).fit(train)
        assert len(uploads) == 1                   # the job spec
        assert accuracy(model.transform(test)) >= 0.85
        model.write().overwrite().save(str(tmp_path / "model"))
        assert len(uploads) == 3                   # + the scoring spec, + the saved row
        assert predictions(TorchModel.load(str(tmp_path / "model")), test) == predictions(model, test)

    def test_pipeline_with_a_feature_stage(connect, digits, tmp_path):
        x_train, x_test, y_train, y_test = digits
        names = [f"p{i}" for i in range(64)]

        def frame(x, y):
            return connect.createDataFrame([(i, *map(float, row), int(label))
                                            for i, (row, label) in enumerate(zip(x, y))], ["id", *names, "label"])

        train, test = frame(x_train, y_train), frame(x_test, y_test)
        pipeline = Pipeline(stages=[
            VectorAssembler(inputCols=names, outputCol="raw"),
            StandardScaler(inputCol="raw", outputCol="features"),
            TorchEstimator(model=DIGITS_MLP, **SETTINGS)])
        fitted = pipeline.fit(train)
        assert isinstance(fitted.stages[-1], TorchModel)
        assert accuracy(fitted.transform(test)) >= 0.9
        fitted.write().overwrite().save(str(tmp_path / "pipeline"))
        reloaded = PipelineModel.load(str(tmp_path / "pipeline"))
        before = [r.prediction for r in fitted.transform(test).orderBy("id").select("prediction").collect()]
        after = [r.prediction for r in reloaded.transform(test).orderBy("id").select("prediction").collect()]
        assert before == after

    def test_two_pipeline_stages_under_connect(digits_data):
        _, train, test = digits_data
        deep = functools.partial(mlp, 64, (64, 32), 10)
        model = TorchEstimator(model=deep, **{**SETTINGS, "numWorkers": 1, "pipelineStages": 2,
                                              "microBatches": 4}).fit(train)
        assert model.summary["pipeline_stages"] == 2 and model.summary["updates"] > 0
        assert accuracy(model.transform(test)) >= 0.9

    def test_a_module_from_anywhere_and_the_sql_function_under_connect(connect, fitted, digits_data, tmp_path):
        """A TorchScript file scored through Connect, and the fitted model as a registered SQL function."""
        import torch

        from sparkdl import scoring_report
        from sparkdl.ml._scoring_report import WORKER_LOGGING

        _, _, test = digits_data
        module = fitted.torch_module()
        torch.jit.save(torch.jit.script(module), str(tmp_path / "digits.torchscript"))
        scripted = TorchModel.load_torch(tmp_path / "digits.torchscript", outputKind="multiclass")
        assert predictions(scripted, test) == predictions(fitted, test)
        connect.udf.register("digit", fitted.copy({fitted.probabilityCol: ""}).udf(connect))
        test.createOrReplaceTempView("connect_digits")
        by_sql = [r.p for r in connect.sql("SELECT id, digit(features) AS p FROM connect_digits ORDER BY id").collect()]
        assert by_sql == predictions(fitted, test)
        connect.conf.set(WORKER_LOGGING, "true")        # the scoring tasks' records, read through Connect
        try:
            connect.sql("SELECT digit(features) AS p FROM connect_digits").write.format("noop").mode("overwrite").save()
            report = scoring_report(connect)
        finally:
            connect.conf.unset(WORKER_LOGGING)
        assert report.rows == test.count() and report.model_seconds > 0

    def test_typed_inputs_under_connect(connect, tmp_path):
        """Ids as int64 and ragged token ids with their mask: the same data path through Connect."""
        import pandas as pd

        from sparkdl.models import BagOfEmbeddings

        rng = np.random.default_rng(0)
        lengths = rng.integers(1, 12, 600)
        ids = [list(rng.integers(2, 40, n)) for n in lengths]
        labels = [int(np.mean(row) < 21) for row in ids]     # most tokens small: what a bag of embeddings sees
        pd.DataFrame({"ids": ids, "label": labels}).to_parquet(tmp_path / "tokens.parquet")
        frame = connect.read.parquet(str(tmp_path / "tokens.parquet"))
        model = TorchEstimator(model=functools.partial(BagOfEmbeddings, 40, 16, 16, 2), inputCols=["ids"],
                               inputArgs=["ids"], loss="cross_entropy", optimizer="adam", learningRate=0.01,
                               batchSize=32, epochs=5, numWorkers=2).fit(frame)
        assert model.getInputCols() == ["ids"] and model.summary["updates"] > 0
        scored = model.transform(frame).select(F.avg((F.col("prediction") == F.col("label")).cast("double")))
        assert scored.first()[0] > 0.75       # a majority guess is about 0.5

    def test_user_functions_under_connect(digits_data):
        """sparkdl.TorchDistributor and sparkdl.run with a PS optimizer over a Connect DataFrame."""
        import torch

        # defined here, so they travel by value (the Connect server cannot import the test modules)
        def ddp_sum(scale):
            import torch.distributed as dist

            dist.init_process_group()
            value = torch.tensor([float(dist.get_rank() + 1)])
            dist.all_reduce(value)
            dist.destroy_process_group()
            return value.item() * scale

        def async_loop(epochs):
            ctx = sparkdl.context()
            model = DIGITS_MLP()
            optimizer = ctx.ps_optimizer(model)
            for epoch in range(epochs):
                for batch in ctx.batches(epoch):
                    torch.nn.functional.cross_entropy(model(*batch.inputs), batch.labels).backward()
                    optimizer.step()
            return optimizer.accepted

        _, train, _ = digits_data
        assert sparkdl.TorchDistributor(num_processes=2, use_gpu=False).run(ddp_sum, 2.0) == 6.0
        result = sparkdl.run(async_loop, args=(2,), data=train, input_cols=["features"],
                             config=sparkdl.TrainConfig(num_workers=2, policy="async", batch_size=16,
                                                        learning_rate=0.05))
        assert result.spaces[0].summary["updates"] == sum(result) > 0

    def test_ps_shards_on_the_executors_under_connect(digits_data, fitted):
        _, train, test = digits_data
        model = TorchEstimator(model=DIGITS_MLP, **{**SETTINGS, "psShards": 2, "psHosts": "executors"}).fit(train)
        summary = model.summary
        assert summary["ps_hosts"] == "executors" and summary["ps_shards"] == 2
        assert summary["updates"] == fitted.summary["updates"]
        assert summary["driver_bytes"] < 0.1 * fitted.summary["driver_bytes"]
        assert accuracy(model.transform(test)) >= 0.9

    def test_work_units_under_connect(digits_data):
        """max_workers: the frame's epochs of units, built with Connect's own frames (a union of the copies)."""
        _, train, test = digits_data
        model = TorchEstimator(model=DIGITS_MLP, **{**SETTINGS, "updatePolicy": "async", "elastic": True,
                                                    "numWorkers": 1, "maxWorkers": 2, "epochs": 3}).fit(train)
        summary = model.summary
        assert summary["work_units"] == 8 and summary["attempts"] == 1
        assert summary["samples_consumed"] == summary["sample_budget"] == 3 * train.count()
        assert accuracy(model.transform(test)) >= 0.85

    def test_cross_validator_with_a_tiny_grid(digits_data):
        _, train, _ = digits_data
        # sync: deterministic, so the scores do not depend on how the two workers interleave
        est = TorchEstimator(model=DIGITS_MLP, optimizer="sgd", momentum=0.9, batchSize=16, epochs=5, numWorkers=2,
                             updatePolicy="sync", seed=3)
        grid = ParamGridBuilder().addGrid(est.learningRate, [1e-5, 0.05]).build()
        cv = CrossValidator(estimator=est, estimatorParamMaps=grid, numFolds=2, seed=1,
                            evaluator=MulticlassClassificationEvaluator(metricName="accuracy"))
        result = cv.fit(train)
        assert grid[int(np.argmax(result.avgMetrics))][est.learningRate] == 0.05
        assert max(result.avgMetrics) > 0.8 > min(result.avgMetrics)
        assert isinstance(result.bestModel, TorchModel)

    def test_rdd_api_points_to_the_dataframe_api(digits_data, digits):
        _, train, _ = digits_data
        with pytest.raises(TypeError, match=r"Spark Connect has no RDDs.*TorchEstimator"):
            sparkdl.train(train, DIGITS_MLP)
        x_train, _, y_train, _ = digits
        with pytest.raises(TypeError, match="Spark Connect has no RDDs"):
            sparkdl.train(list(zip(x_train, y_train)), DIGITS_MLP)

    def test_ps_address_under_connect(connect):
        backend = backend_for(connect)
        assert backend.connect and backend.master == "local[2]"
        assert ps_host(backend) == "127.0.0.1"            # local master, server on this machine
        assert ps_host(backend, "10.0.0.7") == "10.0.0.7"

    def test_unreachable_ps_host_says_so_and_names_ps_host(digits_data):
        _, train, _ = digits_data
        started = time.monotonic()
        # 192.0.2.0/24 (TEST-NET-1) is reserved for documentation: no parameter server is there
        with pytest.raises(ParameterServerError) as info:
            TorchEstimator(model=DIGITS_MLP, epochs=1, numWorkers=2, psHost="192.0.2.123", timeout=5,
                           maxAttempts=1).fit(train)
        message = str(info.value)
        assert "192.0.2.123" in message and "ps_host" in message and "Spark Connect client" in message
        assert time.monotonic() - started < 90

    def test_too_many_workers_is_refused_before_launch(digits_data):
        _, train, _ = digits_data
        with pytest.raises(ClusterConfigError, match=r"num_workers=3 needs 3 free task slots.*has 2"):
            TorchEstimator(model=DIGITS_MLP, epochs=1, numWorkers=3, timeout=20).fit(train)

    def test_watchdog_cancels_tasks_that_never_reach_the_ps(digits_data):
        """Tasks stuck before their hello: the watchdog fails the PS after timeout_s and interrupts the stage."""
        _, train, _ = digits_data

        def stuck_on_executors() -> nn.Module:
            from pyspark import TaskContext

            if TaskContext.get() is not None:
                time.sleep(120)
            return DIGITS_MLP()

        started = time.monotonic()
        with pytest.raises(SparkDLError, match="no training task reached the parameter server"):
            TorchEstimator(model=stuck_on_executors, epochs=1, numWorkers=2, timeout=4, maxAttempts=1).fit(train)
        assert time.monotonic() - started < 60     # not the 120 s the tasks would sleep
