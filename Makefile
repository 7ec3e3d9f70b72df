# Two commands: `make demo` runs the main job, `make test` runs the whole suite (`make docs` builds the site).
# Both create their own virtual environment in .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test bench setup lint typecheck docs wheel-check

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml scripts/setup_env.sh
	bash scripts/setup_env.sh $(VENV)
	touch $@

# The demo: a monitor and four trainers pre-train a tiny ALBERT on 127.0.0.1 (examples/albert/README.md).
# Options go through DEMO_ARGS, e.g. make demo DEMO_ARGS="--steps 10 --trainers 2".
demo: setup
	$(VENV)/bin/plexus demo --data_dir examples/albert/data $(DEMO_ARGS)

test: setup lint $(VENV)/.docs-installed
	$(PY) scripts/fetch_p2pd.py
	$(PY) -m pytest -ra --durations=15

bench: setup
	$(PY) benchmarks/transport.py

# The habits CI holds: lint rules and the formatter's layout (pyproject.toml's [tool.ruff]), and types.
lint: setup typecheck
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The documentation site (mkdocs.yml) into site/, warnings as errors. Installs the docs extra on first use.
docs: $(VENV)/.docs-installed
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

$(VENV)/.docs-installed: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[docs]"
	touch $@

# mypy over the package (pyproject.toml's [tool.mypy]: what it checks, and the baseline it spares).
typecheck: setup
	$(PY) -m mypy

# The package as users get it: the wheel in a fresh venv outside the checkout, its commands, the demo
# and README.md's Python examples (scripts/check_wheel.sh; about 5 minutes, mostly the demo).
wheel-check:
	bash scripts/check_wheel.sh
