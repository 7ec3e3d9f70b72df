"""`plexus` command line: one entry point, one sub-command per job.

plexus demo      a local swarm pre-training a tiny ALBERT (--ping-only: two peers and a ping)
plexus dht       run a DHT peer that others can bootstrap from
plexus server    serve mixture-of-experts experts and announce them in the DHT
plexus doctor    check this machine's addresses, NAT, reachability, relays and clock skew

Only the module of the command being run is imported (`plexus --help` loads none of them, nor
torch), so that the command answers at once.
"""

import argparse
import importlib
import sys

from ..utils.logging import use_plexus_log_handler
from ..version import __version__
from .config import parse_with_config
from .errors import DEBUG_FLAG, ArgumentParser, run_cli

# command -> (module in plexus.cli, one-line help)
COMMANDS = {
    "demo": (
        "demo",
        "pre-train a tiny ALBERT with a local swarm (monitor, 3 trainers, 1 client-mode trainer)",
    ),
    "dht": ("dht", "run a DHT peer that others can bootstrap from"),
    "server": ("server", "serve mixture-of-experts experts and announce them in the DHT"),
    "doctor": ("doctor", "check this machine's addresses, NAT, reachability, relays and clock skew"),
}


def chosen_command(argv: list[str]) -> str | None:
    """The sub-command on the command line: the first word that is not an option."""
    for arg in argv:
        if not arg.startswith("-"):
            return arg if arg in COMMANDS else None
    return None


def build_parser(command: str | None) -> tuple[argparse.ArgumentParser, dict]:
    """The `plexus` parser, with the flags of `command` only (the others list their help line)."""
    parser = ArgumentParser(prog="plexus", description="Train one neural network together over the internet.")
    parser.add_argument("--version", action="version", version=f"plexus {__version__}")
    parser.add_argument(
        DEBUG_FLAG,
        action="store_true",
        help="print the traceback of an error, not just its message (anywhere on the line; "
        "PLEXUS_LOGLEVEL=DEBUG does it too)",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parsers = {}
    for name, (module_name, help_line) in COMMANDS.items():
        if name != command:
            subparsers.add_parser(name, help=help_line)
            continue
        module = importlib.import_module(f"{__package__}.{module_name}")
        parsers[name] = subparsers.add_parser(
            name,
            help=help_line,
            description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(parsers[name])
    return parser, parsers


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` and run the command; errors propagate (`run` turns them into messages)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = chosen_command(argv)
    parser, parsers = build_parser(command)
    args = parse_with_config(parser, argv, parsers)
    use_plexus_log_handler()
    return importlib.import_module(f"{__package__}.{COMMANDS[args.command][0]}").run(args) or 0


def run(argv: list[str] | None = None) -> int:
    """The `plexus` executable: `main` with errors as short messages and exit statuses."""
    return run_cli(main, argv)


if __name__ == "__main__":
    sys.exit(run())
