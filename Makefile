# Everything from nothing: `make test` builds the virtual environment, fetches the Kafka broker
# jars, starts PostgreSQL when it is installed, and runs the suite against a real broker.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: venv test test-unit demo lint postgres kafka-jars clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $@

kafka-jars: venv
	$(BIN)/python -c "from pipeline.core.config import load_config; from pipeline.kafka_local import LocalBroker, ensure_jars; c = load_config(); ensure_jars(LocalBroker.from_config(c), c.kafka.version)"

# PostgreSQL from Debian's packages (root only); prints the test database URL.
postgres:
	@bash scripts/postgres.sh

# The import layers, ruff's lint and format, and mypy on pipeline/core (see pyproject.toml).
lint: venv
	$(BIN)/lint-imports
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# The unit layer alone (tests/unit): no broker, no PostgreSQL, no subprocess.
test-unit: venv
	$(BIN)/pytest -q tests/unit

# PostgreSQL: RTRL_TEST_POSTGRES if set, else scripts/postgres.sh installs/starts one (as root).
# Two processes, each taking whole modules (its module-scoped servers start once): the integration
# tests mostly wait on brokers, servers and subprocesses, so two share the machine's cores well.
test: venv kafka-jars lint
	RTRL_TEST_POSTGRES="$${RTRL_TEST_POSTGRES:-$$(bash scripts/postgres.sh)}" $(BIN)/pytest -q -n 2 --dist loadfile --durations=15

# The main job on embedded defaults: local Kafka, SQLite, a local MLflow store, a tiny model.
demo: venv kafka-jars
	$(BIN)/rtrl demo

clean:
	rm -rf $(VENV) build *.egg-info
