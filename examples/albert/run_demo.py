#!/usr/bin/env python3
"""The demo: a monitor and four trainers pre-train a tiny ALBERT on this machine (`python run_demo.py --help` lists its flags).

The code is plexus/examples/albert/run_demo.py, shipped with the package so that `plexus demo` works
from an installed wheel; this script runs it the same way as `python -m plexus.examples.albert.run_demo`.
"""

from plexus.cli.errors import exit_with
from plexus.examples.albert.run_demo import main

if __name__ == "__main__":
    exit_with(main)
