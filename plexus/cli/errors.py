"""How every Plexus command line ends: a line or two for people, and a traceback only when asked for.

`run_cli(main)` runs a command's `main(argv)` and turns what escapes it into an exit status:

- `UsageError` (a bad flag, a missing file, a malformed config): `error: <what to change>`, status 2,
  the same status argparse uses for a flag it cannot parse;
- any other `PlexusError` (a bootstrap that failed, a peer that misbehaved, a deadline): status 1;
- an `OSError` about a file (`FileNotFoundError`, `PermissionError`, ...) or a port in use: the
  file or port and what to change, status 2; other `OSError`s (a refused connection): status 1;
- Ctrl+C: status 130, no traceback;
- anything else is a bug: its one-line summary and how to get the traceback, status 1.

`--debug` anywhere on the command line (it is taken out before `main` sees it) or
PLEXUS_LOGLEVEL=DEBUG prints the traceback as well.
"""

import argparse
import errno
import os
import sys
import traceback
from collections.abc import Callable

from ..errors import PlexusError, UsageError

DEBUG_FLAG = "--debug"
USAGE_STATUS = 2
FAILURE_STATUS = 1
INTERRUPTED_STATUS = 130


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, with its errors in two lines: what is wrong, and where the flags are listed
    (not the whole usage block, which for a peer's many flags buries the message)."""

    def error(self, message: str):
        self.exit(USAGE_STATUS, f"{self.prog}: error: {message}\n({self.prog} --help lists the options)\n")


def debug_requested(argv: list[str]) -> bool:
    return DEBUG_FLAG in argv or os.environ.get("PLEXUS_LOGLEVEL", "").upper() == "DEBUG"


def describe(error: BaseException) -> tuple[str, int]:
    """The message for people and the exit status for `error`."""
    if isinstance(error, UsageError):
        return f"error: {error}", USAGE_STATUS
    if isinstance(error, PlexusError):
        return f"error: {error}", FAILURE_STATUS
    if isinstance(error, OSError) and error.errno == errno.EADDRINUSE:
        where = str(error).replace("error while attempting to bind on address", "cannot listen on")
        return (
            f"error: {where}: another program uses that port; pick another one in --host_maddrs "
            f"(tcp/0 lets the system choose)",
            USAGE_STATUS,
        )
    if isinstance(error, OSError) and error.filename is not None:
        reason = error.strerror or str(error)
        return f"error: {error.filename}: {reason}", USAGE_STATUS
    if isinstance(error, OSError):
        return f"error: {error.strerror or error}", FAILURE_STATUS
    return (
        f"error: {type(error).__name__}: {error}\n"
        f"This looks like a bug in Plexus: run the command again with {DEBUG_FLAG} and report the traceback.",
        FAILURE_STATUS,
    )


def run_cli(main: Callable[[list[str]], int | None], argv: list[str] | None = None) -> int:
    """Run `main(argv)` (default: this process's arguments) and return its exit status; never raises
    except SystemExit (argparse's own usage errors and `--help` exit through it, status 2 and 0)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = debug_requested(argv)
    argv = [arg for arg in argv if arg != DEBUG_FLAG]
    try:
        return main(argv) or 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return INTERRUPTED_STATUS
    except Exception as error:  # the one place that turns failures into messages; nothing is swallowed
        message, status = describe(error)
        if debug:
            traceback.print_exc()
        print(message, file=sys.stderr)
        return status


def exit_with(main: Callable[[list[str]], int | None]) -> None:
    """`sys.exit(run_cli(main))`: the last line of a script."""
    sys.exit(run_cli(main))
