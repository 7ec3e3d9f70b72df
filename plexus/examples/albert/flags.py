"""Settings as plain module variables, overridable by flags of the same names.

Each script keeps its settings at the top as `name = default  # help text`, then calls
`apply_flags(globals(), __doc__)`. Every lower-case name bound to an int, float, str or bool becomes a
flag `--name`, and its trailing comment (if any) its help. No exec, no config files.
"""

import argparse
import inspect
import re

_SETTING_LINE = re.compile(r"^(\w+)\s*=\s*[^#]*#\s*(.*)$")


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def apply_flags(namespace: dict, doc: str, argv: list[str] | None = None) -> argparse.Namespace:
    """Parse flags named after the settings in `namespace` and write the values back into it."""
    source = inspect.getsource(inspect.getmodule(inspect.stack()[1].frame))
    helps = {m.group(1): m.group(2) for m in map(_SETTING_LINE.match, source.splitlines()) if m}
    from plexus.cli.errors import ArgumentParser  # short errors: the problem, then where --help is

    parser = ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, value in list(namespace.items()):
        if name.startswith("_") or name.isupper() or not isinstance(value, (bool, int, float, str)):
            continue  # constants, modules, functions and private names are not settings
        if isinstance(value, bool):  # `--flag` alone means true; `--flag false` also works
            parser.add_argument(
                f"--{name}",
                type=_parse_bool,
                nargs="?",
                const=True,
                default=value,
                metavar="BOOL",
                help=f"{helps.get(name, '')} (default: {value})",
            )
        else:
            parser.add_argument(
                f"--{name}",
                type=type(value),
                default=value,
                metavar=type(value).__name__.upper(),
                help=f"{helps.get(name, '')} (default: {value!r})",
            )
    args = parser.parse_args(argv)
    namespace.update(vars(args))
    return args
