#!/usr/bin/env bash
# Create the virtual environment, install torch's CPU build first when no torch is present
# (a bare `torch` requirement would pull a multi-GB CUDA build), then Plexus with its test and example extras.
set -euo pipefail
venv="${1:-.venv}"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
    "$venv/bin/python" -m pip install -q torch==2.13.0
fi
"$venv/bin/python" -m pip install -q -e ".[test,albert]"
