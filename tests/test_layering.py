"""Architecture rules that are cheap to check mechanically (docs/design.md: layers, sans-I/O cores)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "plexus"
FORBIDDEN_IN_CORES = {"asyncio", "socket", "time", "random", "os", "threading", "selectors"}


# Through the plexus modules a core imports, nothing may reach the network or another thread.
FORBIDDEN_BEHIND_CORES = {"asyncio", "socket", "threading", "selectors"}


def module_path(name: str) -> Path | None:
    """The file of plexus module `name` (a package's __init__.py), or None if it is not a module."""
    path = PACKAGE.parent.joinpath(*name.split("."))
    for candidate in (path / "__init__.py", path.with_suffix(".py")):
        if candidate.exists():
            return candidate
    return None


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> tuple[set[str], set[Path]]:
    """Top-level names of the outside modules `path` imports, and the plexus module files it imports."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    outside, inside = set(), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level:
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            module = ".".join(base + ([node.module] if node.module else []))
            names = [module] + [f"{module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            if name.split(".")[0] == "plexus":
                if (found := module_path(name)) is not None:
                    inside.add(found)
            else:
                outside.add(name.split(".")[0])
    return outside, inside


def imported_modules(path: Path) -> set[str]:
    return imports_of(path)[0]


def reached_from(path: Path) -> dict[str, set[str]]:
    """Each outside module reached through `path`'s plexus imports, with the plexus modules importing it."""
    reached: dict[str, set[str]] = {}
    seen, todo = set(), [path]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        outside, inside = imports_of(current)
        for name in outside:
            reached.setdefault(name, set()).add(module_name(current))
        todo.extend(inside)
    return reached


# State machines outside p2p/protocols that take time as a parameter and do no I/O either.
OTHER_CORES = (
    "averaging/reducer_core.py",
    "averaging/matchmaking_state.py",
    "dht/protocol.py",
    "dht/traverse.py",
    "moe/client/beam.py",
    "optim/epoch_policy.py",
)


def sans_io_cores() -> list[Path]:
    return sorted((PACKAGE / "p2p" / "protocols").glob("*.py")) + [PACKAGE / core for core in OTHER_CORES]


def test_protocol_cores_do_no_io():
    cores = sans_io_cores()
    assert cores
    for path in cores:
        assert not imported_modules(path) & FORBIDDEN_IN_CORES, f"{path.name} imports I/O or clocks"


def test_protocol_cores_reach_no_io_through_other_modules():
    for path in sans_io_cores():
        reached = reached_from(path)
        offending = {name: sorted(reached[name]) for name in FORBIDDEN_BEHIND_CORES & reached.keys()}
        assert not offending, f"{module_name(path)} reaches I/O through {offending}"


def test_leaves_do_not_import_networking():
    for leaf in ("compression", "utils"):
        for path in (PACKAGE / leaf).glob("*.py"):
            text = path.read_text()
            for layer in ("p2p", "dht", "averaging", "optim", "moe"):
                assert f"from ..{layer}" not in text and f"plexus.{layer}" not in text, (
                    f"{path} imports {layer}"
                )


def test_the_layers_below_the_distributed_one_do_not_import_it():
    """plexus/distributed/ sits on top of the Optimizer: only the CLI and examples may use it."""
    for layer in ("p2p", "dht", "averaging", "optim", "moe", "compression", "utils"):
        for path in (PACKAGE / layer).rglob("*.py"):
            text = path.read_text()
            assert "from ..distributed" not in text and "plexus.distributed" not in text, f"{path} imports it"
