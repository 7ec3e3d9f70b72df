#!/usr/bin/env python3
"""The training monitor: the first peer, it logs and records each global step (`python run_training_monitor.py --help` lists its flags).

The code is plexus/examples/albert/run_training_monitor.py, shipped with the package so that `plexus demo` works
from an installed wheel; this script runs it the same way as `python -m plexus.examples.albert.run_training_monitor`.
"""

from plexus.cli.errors import exit_with
from plexus.examples.albert.run_training_monitor import main

if __name__ == "__main__":
    exit_with(main)
