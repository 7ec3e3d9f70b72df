"""Architecture rules that are cheap to check mechanically (DESIGN.md: layers, sans-I/O cores)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "plexus"
FORBIDDEN_IN_CORES = {"asyncio", "socket", "time", "random", "os", "threading", "selectors"}


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


# State machines outside p2p/protocols that take time as a parameter and do no I/O either.
OTHER_CORES = (
    "averaging/reducer_core.py",
    "averaging/matchmaking_state.py",
    "dht/traverse.py",
    "moe/client/beam.py",
    "optim/epoch_policy.py",
)


def test_protocol_cores_do_no_io():
    cores = sorted((PACKAGE / "p2p" / "protocols").glob("*.py")) + [PACKAGE / core for core in OTHER_CORES]
    assert cores
    for path in cores:
        assert not imported_modules(path) & FORBIDDEN_IN_CORES, f"{path.name} imports I/O or clocks"


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
