# Two commands: `make demo` runs the main job, `make test` runs the whole suite.
# Both create their own virtual environment in .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test bench setup lint wheel-check

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml scripts/setup_env.sh
	bash scripts/setup_env.sh $(VENV)
	touch $@

# The demo: a monitor and four trainers pre-train a tiny ALBERT on 127.0.0.1 (examples/albert/README.md).
# Options go through DEMO_ARGS, e.g. make demo DEMO_ARGS="--steps 10 --trainers 2".
demo: setup
	$(VENV)/bin/plexus demo --data_dir examples/albert/data $(DEMO_ARGS)

test: setup lint
	$(PY) scripts/fetch_p2pd.py
	$(PY) -m pytest -ra --durations=15

bench: setup
	$(PY) benchmarks/transport.py

# The habits CI holds: lint rules and the formatter's layout (pyproject.toml's [tool.ruff]).
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The package as users get it: the wheel in a fresh venv outside the checkout, its commands, the demo
# and README.md's Python examples (scripts/check_wheel.sh; about 5 minutes, mostly the demo).
wheel-check:
	bash scripts/check_wheel.sh
