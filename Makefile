# Two commands: `make demo` runs the main job, `make test` runs the whole suite.
# Both create their own virtual environment in .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test bench setup

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml scripts/setup_env.sh
	bash scripts/setup_env.sh $(VENV)
	touch $@

demo: setup
	$(VENV)/bin/plexus demo

test: setup
	$(PY) scripts/fetch_p2pd.py
	$(PY) -m pytest -ra --durations=15

bench: setup
	$(PY) benchmarks/transport.py
