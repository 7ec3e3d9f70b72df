"""`plexus` command line: one entry point, one sub-command per job.

    plexus demo      start two local peers and ping one from the other
"""

import argparse
import sys

from ..utils.logging import use_plexus_log_handler
from . import demo


COMMANDS = {"demo": demo}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="plexus", description="Train one neural network together over the internet.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in COMMANDS.items():
        module.add_arguments(subparsers.add_parser(name, help=module.HELP, description=module.__doc__,
                                                   formatter_class=argparse.RawDescriptionHelpFormatter))
    args = parser.parse_args(argv)
    use_plexus_log_handler()
    try:
        return COMMANDS[args.command].run(args) or 0
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
