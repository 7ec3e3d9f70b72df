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
# The NAT tests (tests/test_nat.py) build network namespaces with iproute2 and nftables. Install them
# when missing and we are root with apt (as in CI); elsewhere those tests skip and say why.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! { command -v ip && command -v nft; } >/dev/null; then
    apt-get install -y -q iproute2 nftables >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q iproute2 nftables >/dev/null 2>&1; } \
        || echo "warning: could not install iproute2 and nftables; tests/test_nat.py needs them" >&2
fi
# The dashboard's browser test (tests/test_dashboard_browser.py) drives a headless Chromium. Install it
# and its driver when missing and we are root with apt; elsewhere that test skips and says why.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! { command -v chromium && command -v chromedriver; } >/dev/null; then
    apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium chromium-driver >/dev/null 2>&1; } \
        || echo "warning: could not install chromium and chromium-driver; tests/test_dashboard_browser.py needs them" >&2
fi
