"""The opt-in import hook: `import hivemind...` gives Plexus, for code written against hivemind 1.1.12.

Theory of operation
-------------------
`install()` puts a finder first on `sys.meta_path`. Every module path under `hivemind` then
resolves to a *view*: a module registered under the hivemind name whose attributes are looked up,
on first use, in one or more Plexus modules (`VIEWS`; by default `hivemind.x.y` reads
`plexus.x.y`). The objects themselves are Plexus's, so `hivemind.DHT is plexus.DHT`; only the
module objects differ, which lets one hivemind path gather names that Plexus keeps in several places
(hivemind's `utils.timed_storage` holds `get_dht_time`, Plexus's `utils.timing` does) and keeps the
hivemind-only spellings (the older API, renamed helpers) in `plexus.compat` instead of spreading
them through the library. Views are packages, so `import hivemind.a.b` walks down through the hook.

A hivemind path with no Plexus counterpart raises ImportError naming the page that lists what
Plexus has instead. Installing while the real hivemind is already imported is refused: the two
would mix in one process.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types

from ..errors import UsageError

ROOT = "hivemind"
DOCS = "docs/coming-from-hivemind.md"

# hivemind module path -> the Plexus modules its names come from, searched in order. A path not
# listed reads the Plexus module of the same relative name (hivemind.optim -> plexus.optim).
VIEWS: dict[str, tuple[str, ...]] = {
    "hivemind": ("plexus", "plexus.compat.collaborative", "plexus.compat.decentralized"),
    "hivemind.optim": ("plexus.optim", "plexus.compat.collaborative", "plexus.compat.decentralized"),
    "hivemind.optim.collaborative": ("plexus.compat.collaborative",),
    "hivemind.optim.simple": ("plexus.compat.decentralized",),
    "hivemind.optim.performance_ema": ("plexus.utils.performance_ema",),
    "hivemind.dht.crypto": ("plexus.dht.crypto", "plexus.dht.rsa"),
    "hivemind.p2p": ("plexus.p2p", "plexus.compat.p2p"),
    "hivemind.p2p.p2p_daemon": ("plexus.compat.p2p",),
    "hivemind.p2p.p2p_daemon_bindings": ("plexus.compat.p2p",),
    "hivemind.p2p.p2p_daemon_bindings.control": ("plexus.compat.p2p",),
    "hivemind.p2p.p2p_daemon_bindings.datastructures": ("plexus.compat.p2p",),
    "hivemind.utils": ("plexus.utils", "plexus.compat.names", "plexus.compat.aio"),
    "hivemind.utils.asyncio": ("plexus.compat.aio",),
    "hivemind.utils.mpfuture": ("plexus.compat.names",),
    "hivemind.utils.crypto": ("plexus.dht.rsa",),
    "hivemind.utils.logging": ("plexus.utils.logging", "plexus.compat.names"),
    "hivemind.utils.timed_storage": (
        "plexus.utils.timed_storage",
        "plexus.utils.timing",
        "plexus.compat.names",
    ),
    "hivemind.utils.tensor_descr": ("plexus.compression.base", "plexus.moe.schema"),
    "hivemind.utils.streaming": ("plexus.compression.wire",),
    "hivemind.utils.multiaddr": ("plexus.p2p.multiaddr",),
    "hivemind.utils.multiaddr.multiaddr": ("plexus.p2p.multiaddr",),
    "hivemind.moe.server.dht_handler": ("plexus.moe.expert_registry",),
    "hivemind.moe.server.layers.lr_schedule": ("plexus.moe.server.layers.optim",),
    "hivemind.moe.client.expert": ("plexus.moe.client.expert", "plexus.moe.expert_registry"),
    "hivemind.proto": ("plexus.compat.proto",),
    "hivemind.proto.runtime_pb2": ("plexus.compat.proto",),
    "hivemind.hivemind_cli": ("plexus.cli",),
}


def sources_of(name: str) -> tuple[str, ...]:
    """The Plexus modules behind the hivemind module `name`."""
    return VIEWS.get(name, ("plexus" + name[len(ROOT) :],))


class HivemindView(types.ModuleType):
    """A hivemind module path backed by Plexus modules (see the module docstring)."""

    def __init__(self, name: str, sources: tuple[str, ...]):
        super().__init__(name, f"Plexus's counterpart of {name} (plexus.compat): from {', '.join(sources)}")
        self.__path__ = []  # a package, so that submodules import through the hook
        self.__plexus_sources__ = sources

    def _modules(self):
        for source in self.__plexus_sources__:
            yield importlib.import_module(source)

    def __getattr__(self, attr: str):
        if attr.startswith("__") and attr != "__version__":
            raise AttributeError(attr)  # module internals are the view's own, not its sources'
        for module in self._modules():
            try:
                value = getattr(module, attr)
            except AttributeError:
                continue
            if isinstance(value, types.ModuleType):  # a subpackage: hand out its hivemind view instead
                value = importlib.import_module(f"{self.__name__}.{attr}")
            setattr(self, attr, value)
            return value
        try:  # a submodule not imported yet: hivemind.dht.node after `import hivemind`
            return importlib.import_module(f"{self.__name__}.{attr}")
        except ImportError:
            pass
        raise AttributeError(
            f"module {self.__name__!r} (Plexus) has no attribute {attr!r}; {DOCS} lists "
            f"what Plexus offers for hivemind's names"
        )

    @property
    def __all__(self) -> list[str]:
        names: dict[str, None] = {}
        for module in self._modules():
            public = getattr(module, "__all__", None)
            if public is None:
                public = [
                    n
                    for n, v in vars(module).items()
                    if not n.startswith("_") and not isinstance(v, types.ModuleType)
                ]
            names.update(dict.fromkeys(public))
        return list(names)

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(self.__all__))


class HivemindFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `hivemind` and its submodules and builds their views."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != ROOT and not fullname.startswith(ROOT + "."):
            return None
        sources = sources_of(fullname)
        for source in sources:
            try:
                importlib.import_module(source)
            except ModuleNotFoundError as error:
                if error.name and (error.name == source or source.startswith(error.name + ".")):
                    raise ModuleNotFoundError(
                        f"{fullname} has no counterpart in Plexus (no module "
                        f"{source}); {DOCS} says what to use instead",
                        name=fullname,
                    ) from None
                raise
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        return HivemindView(spec.name, sources_of(spec.name))

    def exec_module(self, module):
        parent, _, child = module.__name__.rpartition(".")
        if parent and parent in sys.modules:
            setattr(sys.modules[parent], child, module)


_finder: HivemindFinder | None = None


def install() -> None:
    """Make `import hivemind` (and every `hivemind.x.y`) give Plexus from now on; idempotent."""
    global _finder
    if _finder is not None:
        return
    loaded = sys.modules.get(ROOT)
    if loaded is not None and not isinstance(loaded, HivemindView):
        raise UsageError(
            "the real hivemind is already imported in this process; call "
            "plexus.compat.install() before anything imports hivemind (or run the script "
            "with `python -m plexus.compat`)"
        )
    _finder = HivemindFinder()
    sys.meta_path.insert(0, _finder)


def uninstall() -> None:
    """Undo `install()`: forget the hook and the hivemind views imported so far."""
    global _finder
    if _finder is None:
        return
    sys.meta_path.remove(_finder)
    _finder = None
    for name in [name for name, module in sys.modules.items() if isinstance(module, HivemindView)]:
        del sys.modules[name]


def installed() -> bool:
    return _finder is not None
