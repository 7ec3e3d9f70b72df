#!/usr/bin/env python3
"""Builds the offline demo corpus from installed documentation (`python make_demo_corpus.py --help` lists its flags).

The code is plexus/examples/albert/make_demo_corpus.py, shipped with the package so that `plexus demo` works
from an installed wheel; this script runs it the same way as `python -m plexus.examples.albert.make_demo_corpus`.
"""

from plexus.cli.errors import exit_with
from plexus.examples.albert.make_demo_corpus import main

if __name__ == "__main__":
    exit_with(main)
