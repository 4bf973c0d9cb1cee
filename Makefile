# specdec: the two commands a new user needs are `make demo` and `make test`.
# Both create .venv and install what they need (Python packages from PyPI;
# for the tests also Debian's prometheus package for prometheus/promtool).

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: demo test soak lint format up setup system-deps bench analyze protos clean

setup: $(VENV)/.installed

$(VENV)/.installed: requirements.txt requirements-dev.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -r requirements-dev.txt
	$(VENV)/bin/pip install -q --no-deps -e .
	touch $@

# Prometheus' binaries for the observability tests (a real server, not a mock).
# The package may also start a system Prometheus service: it is left alone (the
# tests start their own on free ports and stop only that, by its process id).
system-deps:
	@command -v promtool >/dev/null && command -v prometheus >/dev/null || \
	  ( $(SUDO) apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends prometheus )

# Start draft, target and orchestrator on the bundled demo pair, generate, stop.
demo: setup
	$(VENV)/bin/specdec demo

# Run the three services until Ctrl-C (then: .venv/bin/specdec generate "...").
up: setup
	$(VENV)/bin/specdec up

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

test: setup system-deps lint
	$(PY) -m pytest -q -p no:cacheprovider --durations=10

# The opt-in long runs: the exactness monitor quiet over 50,000 checked tokens.
soak: setup
	$(PY) -m pytest -q -p no:cacheprovider -m soak

bench: setup
	$(PY) -m benchmarks.run

analyze: setup
	$(PY) -m benchmarks.analyze

protos: setup
	$(PY) -m specdec.protogen

clean:
	rm -rf $(VENV) results .pytest_cache .ruff_cache
