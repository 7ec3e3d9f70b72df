"""`python -m plexus.compat script.py [args]` or `python -m plexus.compat -m module [args]`:
run hivemind code on Plexus with the import hook installed, the script itself left untouched."""

import os
import runpy
import sys

from .hook import install

USAGE = "usage: python -m plexus.compat SCRIPT [ARGS...]  |  python -m plexus.compat -m MODULE [ARGS...]"


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help") or (argv[0] == "-m" and len(argv) < 2):
        print(USAGE, file=sys.stderr)
        raise SystemExit(2)
    install()
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # as `python script.py` would
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
