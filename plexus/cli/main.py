"""`plexus` command line: one entry point, one sub-command per job.

plexus demo      a local swarm pre-training a tiny ALBERT (--ping-only: two peers and a ping)
plexus dht       run a DHT peer that others can bootstrap from
plexus server    serve mixture-of-experts experts and announce them in the DHT
plexus doctor    check this machine's addresses, NAT, reachability, relays and clock skew
"""

import argparse
import logging
import sys

from ..errors import PlexusError
from ..utils.logging import use_plexus_log_handler
from . import demo, dht, doctor, server
from .config import parse_with_config

COMMANDS = {"demo": demo, "dht": dht, "server": server, "doctor": doctor}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="plexus", description="Train one neural network together over the internet."
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parsers = {}
    for name, module in COMMANDS.items():
        parsers[name] = subparsers.add_parser(
            name,
            help=module.HELP,
            description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(parsers[name])
    args = parse_with_config(parser, argv, parsers)
    use_plexus_log_handler()
    try:
        return COMMANDS[args.command].run(args) or 0
    except KeyboardInterrupt:
        return 130
    except PlexusError as error:  # a bootstrap that failed, a bad option: the message says what to do
        logging.getLogger("plexus.cli").error(f"{type(error).__name__}: {error}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
