"""Options from a config file: every CLI takes `--config FILE` whose keys are its flag names.

Precedence: command line, then the config file, then the defaults. JSON and TOML files work out
of the box; YAML when PyYAML is installed. Unknown keys are an error that names them, so a typo in
a config file does not silently do nothing.
"""

import argparse
import json
from pathlib import Path

from ..errors import UsageError
from . import checks


def add_config_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="read options from a JSON, TOML or YAML file "
        "whose keys are the flag names (command-line flags win)",
    )


def parse_with_config(
    parser: argparse.ArgumentParser, argv=None, subparsers: dict | None = None
) -> argparse.Namespace:
    """Parse `argv`, taking defaults from `--config` (set on the chosen sub-command's parser)."""
    first, _ = parser.parse_known_args(argv)
    if getattr(first, "config", None):
        target = (subparsers or {}).get(getattr(first, "command", None), parser)
        options = load_config(first.config)
        known = {action.dest for action in target._actions}
        unknown = sorted(set(options) - known)
        if unknown:
            target.error(f"unknown option(s) in {first.config}: {', '.join(unknown)}")
        target.set_defaults(
            **{key: _checked(target, first.config, key, value) for key, value in options.items()}
        )
    return parser.parse_args(argv)


def _checked(parser: argparse.ArgumentParser, path: str, key: str, value):
    """`value` from the config file as the flag `key` would have parsed it (type and choices)."""
    action = next(action for action in parser._actions if action.dest == key)
    values = value if isinstance(value, list) else [value]
    try:
        convert = action.type
        if callable(convert):
            # as from the command line, where every value is a string
            values = [convert(str(item)) if isinstance(item, str | int | float) else item for item in values]
    except argparse.ArgumentTypeError as error:
        parser.error(f"{path}: {key}: {error}")
    for item in values:
        if action.choices is not None and item not in action.choices:
            parser.error(f"{path}: {key}: {item!r} is not one of {', '.join(map(str, action.choices))}")
    return values if isinstance(value, list) else values[0]


def load_config(path: str) -> dict:
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"config file {path} does not exist (--config)")
    text, kind = file.read_text(), file.suffix.lower()
    if kind in (".yml", ".yaml"):
        try:
            import yaml
        except ImportError:
            raise UsageError(
                f"reading {path} needs PyYAML (pip install pyyaml), or use a .json/.toml file"
            ) from None
        try:
            options = yaml.safe_load(text) or {}
        except yaml.YAMLError as error:
            raise UsageError(f"config file {path} is not valid YAML: {error}") from error
    elif kind in (".json", ".toml"):
        import tomllib

        try:
            options = json.loads(text) if kind == ".json" else tomllib.loads(text)
        except ValueError as error:  # both decoders' errors are ValueErrors that name the line
            raise UsageError(f"config file {path} is not valid {kind[1:].upper()}: {error}") from error
    else:
        raise UsageError(f"config file {path} should end in .json, .toml, .yml or .yaml")
    if not isinstance(options, dict):
        raise UsageError(f"config file {path} must hold a mapping of option names to values")
    return {key.replace("-", "_"): value for key, value in options.items()}


def add_peer_arguments(parser) -> None:
    """The flags every long-running peer takes: where to join, listen and announce, its identity,
    and whether to use relays (hivemind's names)."""
    parser.add_argument(
        "--initial_peers",
        nargs="*",
        type=checks.multiaddr,
        default=[],
        metavar="MADDR",
        help="multiaddrs of peers to join (…/p2p/<peer id>); none starts a new swarm",
    )
    parser.add_argument(
        "--host_maddrs",
        nargs="+",
        type=checks.multiaddr,
        default=["/ip4/0.0.0.0/tcp/0"],
        metavar="MADDR",
        help="addresses to listen on (default: all interfaces, port chosen by the OS)",
    )
    parser.add_argument(
        "--announce_maddrs",
        nargs="*",
        type=checks.multiaddr,
        default=[],
        metavar="MADDR",
        help="addresses to advertise instead of the listening ones (e.g. a public IP)",
    )
    parser.add_argument(
        "--identity_path",
        type=checks.file_to_write,
        help="file with this peer's private key (created when missing), "
        "so its peer id and address stay the same across restarts",
    )
    parser.add_argument(
        "--no_relay",
        action="store_true",
        help="do not dial peers through circuit relays (nor accept relayed connections)",
    )
    parser.add_argument(
        "--use_auto_relay",
        action="store_true",
        help="when other peers cannot dial this one (AutoNAT), reserve slots on relays and "
        "advertise relayed addresses",
    )
