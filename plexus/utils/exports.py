"""Public names of a package that are imported on first use, so importing the package stays cheap.

A package's `__init__` lists its names and the modules that define them, and installs the
`__getattr__`/`__dir__` this returns:

    _EXPORTS = {"DHT": ".dht", "DHTNode": ".node"}
    __all__ = list(_EXPORTS)
    __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
"""

import importlib
import sys
from collections.abc import Callable, Mapping


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[Callable, Callable]:
    """`__getattr__` and `__dir__` for `package`, whose name `n` lives in module `exports[n]`
    (relative to the package, like ".dht"); a name mapped to its own module (`"rpc": ".rpc"`) is
    that submodule."""

    def __getattr__(name: str):
        module_name = exports.get(name)
        if module_name is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(module_name, package)
        value = module if module_name == "." + name else getattr(module, name)
        setattr(sys.modules[package], name, value)  # later lookups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
