"""Argument types for the command lines, so that a bad value is refused before any peer starts.

Each is an argparse `type=`: it returns the parsed value or raises `argparse.ArgumentTypeError`
with a message that says what is wrong, which argparse prints after the flag's name (exit status 2).
Values from a `--config` file go through the same functions (plexus/cli/config.py).
"""

import argparse
import ipaddress
import os

from ..errors import UsageError


def multiaddr(text: str) -> str:
    """A multiaddr such as /ip4/1.2.3.4/tcp/31337/p2p/12D3KooW... (kept as text)."""
    from ..p2p.multiaddr import Multiaddr, MultiaddrError

    try:
        Multiaddr(text)
    except MultiaddrError as error:
        raise argparse.ArgumentTypeError(
            f"{error} (a multiaddr looks like /ip4/1.2.3.4/tcp/31337/p2p/12D3KooW...)"
        ) from None
    return text


def peer_multiaddr(text: str) -> str:
    """A multiaddr that names its peer: it ends in /p2p/<peer id>."""
    from ..p2p.multiaddr import Multiaddr

    if Multiaddr(multiaddr(text)).peer_id is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} does not say which peer to expect: add /p2p/<peer id>, as printed by that peer's "
            f"--initial_peers line"
        )
    return text


def positive_int(text: str) -> int:
    value = _number(text, int, "a whole number")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = _number(text, int, "a whole number")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def positive_float(text: str) -> float:
    value = _number(text, float, "a number")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text}")
    return value


def ip_address(text: str) -> str:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an IP address (e.g. 127.0.0.1 or 0.0.0.0)"
        ) from None
    return text


def existing_file(text: str) -> str:
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(
            f"{text} is not a file" if os.path.exists(text) else f"{text} does not exist"
        )
    return text


def directory_to_use(text: str) -> str:
    """A directory: one that exists, or a path where nothing is yet (it is created when needed)."""
    if os.path.exists(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} exists and is not a directory")
    return text


def file_to_write(text: str) -> str:
    """A file that exists, or one to create (with its directories)."""
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a directory; give a file name")
    return text


def check_flag(flag: str, value, check):
    """`check(value)` for a value parsed elsewhere (dataclass flags, a config), as a `UsageError` that
    names `--flag`; lists are checked item by item."""
    try:
        if isinstance(value, list | tuple):
            return [check(item) for item in value]
        return check(value)
    except argparse.ArgumentTypeError as error:
        raise UsageError(f"--{flag}: {error}") from None


def _number(text, kind: type, what: str):
    if isinstance(text, kind) and not isinstance(text, bool):  # a value from a config file
        return text
    try:
        return kind(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
