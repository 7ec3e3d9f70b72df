#!/usr/bin/env python3
"""A trainer that joins the swarm (`python run_trainer.py --help` lists its flags).

The code is plexus/examples/albert/run_trainer.py, shipped with the package so that `plexus demo` works
from an installed wheel; this script runs it the same way as `python -m plexus.examples.albert.run_trainer`.
"""

from plexus.cli.errors import exit_with
from plexus.examples.albert.run_trainer import main

if __name__ == "__main__":
    exit_with(main)
