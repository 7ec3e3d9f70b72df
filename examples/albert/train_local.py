#!/usr/bin/env python3
"""The single-peer baseline: a plain PyTorch loop (`python train_local.py --help` lists its flags).

The code is plexus/examples/albert/train_local.py, shipped with the package so that `plexus demo` works
from an installed wheel; this script runs it the same way as `python -m plexus.examples.albert.train_local`.
"""

from plexus.cli.errors import exit_with
from plexus.examples.albert.train_local import main

if __name__ == "__main__":
    exit_with(main)
