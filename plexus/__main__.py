"""`python -m plexus`: the same as the `plexus` command."""

import sys

from .cli.main import main

sys.exit(main())
