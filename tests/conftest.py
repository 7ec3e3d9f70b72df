import sys
from pathlib import Path

# Make `tests.*` importable under a bare `pytest` too (not only `python -m pytest` from the repo
# root). Setting `pythonpath = ["."]` in pyproject's pytest options would make this line redundant.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.p2pd import p2pd_factory  # noqa: E402,F401  (the Go libp2p daemon as an interop fixture)
