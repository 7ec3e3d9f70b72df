"""`python -m plexus`: the same as the `plexus` command."""

import sys

from .cli.main import run

sys.exit(run())
