#!/usr/bin/env bash
# Check the package as users get it: build the wheel, install it in a fresh virtual environment
# outside the checkout (torch's CPU build first, then the wheel with its dependencies), and from an
# empty folder run `plexus --version`, `plexus --help`, the two-peer ping, the smallest ALBERT demo,
# and every Python snippet of README.md as a script of its own. Usage: scripts/check_wheel.sh
# (PYTHON picks the interpreter; KEEP=1 leaves the folder with the venv and the logs).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-python3}"
work="$(mktemp -d "${TMPDIR:-/tmp}/plexus-wheel-check.XXXXXX")"
[ "${KEEP:-0}" = 1 ] || trap 'rm -rf "$work"' EXIT
started=$SECONDS
step() { echo "== $* ($((SECONDS - started)) s)"; }

step "building the wheel"
"$python" -m pip wheel -q --no-deps -w "$work/dist" "$root"
wheel="$(ls "$work"/dist/plexus-*.whl)"
"$python" -c 'import sys, zipfile; sys.exit("plexus/examples/albert/run_demo.py" not in zipfile.ZipFile(sys.argv[1]).namelist())' "$wheel" \
    || { echo "the wheel lacks the demo (plexus/examples/albert)" >&2; exit 1; }

step "installing torch's CPU build, then $(basename "$wheel")[albert] in a fresh venv"
"$python" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q torch==2.13.0
"$work/venv/bin/python" -m pip install -q "$wheel[albert]"

mkdir "$work/run" && cd "$work/run"  # nothing of the checkout is importable from here
export PATH="$work/venv/bin:$PATH"
unset PYTHONPATH PYTHONHOME
origin="$(python -c 'import plexus, os; print(os.path.dirname(plexus.__file__))')"
case "$origin" in "$work/venv/"*) ;; *) echo "plexus comes from $origin, not the venv" >&2; exit 1 ;; esac
version="$(python -c 'import plexus; print(plexus.__version__)')"

step "plexus --version, python -m plexus --version, plexus --help"
[ "$(plexus --version)" = "plexus $version" ]
[ "$(python -m plexus --version)" = "plexus $version" ]
plexus --help | grep -q "doctor"

step "plexus demo --ping-only"
plexus demo --ping-only --pings 2 2>&1 | grep "ping 2/2"

step "plexus demo --steps 2 --trainers 2 --client_trainers 0 --target_batch_size 64"
plexus demo --steps 2 --trainers 2 --client_trainers 0 --target_batch_size 64 > demo.log 2>&1 \
    || { tail -40 demo.log; exit 1; }
grep "Summary: 2 global steps" demo.log
[ -s data/demo_run/loss.csv ]

step "the Python snippets of README.md, each as a complete script"
python - "$root/README.md" <<'PY'
import re, sys
blocks = re.findall(r"```python\n(.*?)```", open(sys.argv[1]).read(), re.S)
for index, block in enumerate(blocks, 1):
    open(f"readme_{index}.py", "w").write(block)
print(f"{len(blocks)} snippets")
PY
for snippet in readme_*.py; do
    echo "-- $snippet"
    timeout 300 python "$snippet"
done

step "all passed"
