"""Where the dashboard listens: `--dashboard [HOST:]PORT`, on 127.0.0.1 unless a host is given.

Binding to localhost by default keeps a peer's dashboard private; `0.0.0.0:8080` (or `[::]:8080`)
shows it to the network, read-only.
"""

import argparse
import re

from ..errors import UsageError

DEFAULT_HOST = "127.0.0.1"
_HOSTNAME = re.compile(r"[A-Za-z0-9.\-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\]")


def parse_bind_address(text: str) -> tuple[str, int]:
    """`PORT`, `HOST:PORT` or `[IPV6]:PORT` -> (host, port); port 0 picks a free one."""
    host, sep, port = text.strip().rpartition(":")
    if not sep:
        host = DEFAULT_HOST
    elif not _HOSTNAME.fullmatch(host):
        raise UsageError(f"bad dashboard address {text!r}: expected [HOST:]PORT, e.g. 8080 or 0.0.0.0:8080")
    if not re.fullmatch(r"[0-9]{1,5}", port) or int(port) > 65535:
        raise UsageError(f"bad dashboard port in {text!r}: expected a number from 0 to 65535")
    return host.removeprefix("[").removesuffix("]"), int(port)


def add_dashboard_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The `--dashboard [HOST:]PORT` flag; its value is (host, port) or None."""

    def bind_address(text: str) -> tuple[str, int]:
        try:
            return parse_bind_address(text)
        except UsageError as error:
            raise argparse.ArgumentTypeError(str(error)) from error

    parser.add_argument(
        "--dashboard",
        type=bind_address,
        default=None,
        metavar="[HOST:]PORT",
        help="serve a live read-only dashboard of the swarm over HTTP here (127.0.0.1 unless a host "
        "is given; needs pip install plexus[dashboard])",
    )
