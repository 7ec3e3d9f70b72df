"""The API reference stays complete: every exported name has a docstring and an entry in docs/api/,
every `Optimizer` argument is explained, and the site builds with warnings as errors."""

import ast
import importlib
import inspect
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import plexus

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent
API_PAGES = ROOT / "docs" / "api"
# The packages whose exports the reference documents; plexus.errors has no __all__ (see below).
PACKAGES = (
    "plexus",
    "plexus.optim",
    "plexus.averaging",
    "plexus.dht",
    "plexus.p2p",
    "plexus.moe",
    "plexus.compression",
    "plexus.errors",
)
DIRECTIVE = re.compile(r"^::: ([\w.]+)\s*$", re.MULTILINE)


def exported_names(module_name: str) -> list[str]:
    module = importlib.import_module(module_name)
    if hasattr(module, "__all__"):
        return list(module.__all__)
    return [  # the classes and functions the module defines itself
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and (inspect.isclass(value) or inspect.isfunction(value))
        and value.__module__ == module_name
    ]


def resolve(path: str):
    """The object a `::: path` directive names: a module, or a name inside one."""
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError:
        module_name, _, name = path.rpartition(".")
        return getattr(importlib.import_module(module_name), name)


def directives() -> dict[str, object]:
    paths = [path for page in sorted(API_PAGES.glob("*.md")) for path in DIRECTIVE.findall(page.read_text())]
    return {path: resolve(path) for path in paths}


def own_docstring(obj) -> str | None:
    if inspect.isclass(obj):
        return vars(obj).get("__doc__")  # not a base class's
    return getattr(obj, "__doc__", None)


def attribute_docstring(path: str) -> str | None:
    """The string literal right after `NAME = ...` at the top of the module (how constants and type
    aliases are documented)."""
    module_name, _, name = path.rpartition(".")
    source = inspect.getsource(importlib.import_module(module_name))
    body = ast.parse(source).body
    for statement, following in zip(body, body[1:]):
        targets = statement.targets if isinstance(statement, ast.Assign) else []
        if isinstance(statement, ast.AnnAssign):
            targets = [statement.target]
        if any(isinstance(target, ast.Name) and target.id == name for target in targets):
            if isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant):
                return following.value.value if isinstance(following.value.value, str) else None
    return None


def docstring_of_entry(path: str, obj) -> str | None:
    defines_itself = (inspect.isclass(obj) or inspect.isfunction(obj) or inspect.ismodule(obj)) and (
        getattr(obj, "__name__", "").rpartition(".")[2] == path.rpartition(".")[2]
    )
    return own_docstring(obj) if defines_itself else attribute_docstring(path)


@pytest.mark.parametrize("module_name", PACKAGES)
def test_every_exported_name_has_a_documented_entry(module_name):
    entries = directives()
    missing, undocumented = [], []
    for name in exported_names(module_name):
        value = getattr(importlib.import_module(module_name), name)
        paths = [path for path, obj in entries.items() if obj is value and path.rpartition(".")[2] == name]
        if not paths:
            missing.append(name)
        elif not any((docstring_of_entry(path, value) or "").strip() for path in paths):
            undocumented.append(name)
    assert not missing, f"{module_name}: no `::: path` entry in docs/api/ for {missing}"
    assert not undocumented, f"{module_name}: no docstring for {undocumented}"


def test_every_name_in_plexus_all_has_a_docstring():
    for name in plexus.__all__:
        value = getattr(plexus, name)
        if inspect.isclass(value) or inspect.isfunction(value):
            assert (own_docstring(value) or "").strip(), f"plexus.{name} has no docstring"
    assert attribute_docstring("plexus.version.__version__")


def test_every_optimizer_argument_is_explained():
    doc = own_docstring(plexus.Optimizer) or ""
    args = doc.split("Args:", 1)[1] if "Args:" in doc else ""
    parameters = [name for name in inspect.signature(plexus.Optimizer.__init__).parameters if name != "self"]
    unexplained = [name for name in parameters if not re.search(rf"^\s+{name}:", args, re.MULTILINE)]
    assert not unexplained, f"plexus.Optimizer's docstring does not explain {unexplained}"


def test_the_checks_can_fail():
    """The helpers above notice a missing docstring and a missing entry."""

    class Bare:
        pass

    assert own_docstring(Bare) is None
    assert attribute_docstring("plexus.moe.expert_uid.UID_PATTERN") is None
    assert attribute_docstring("plexus.optim.grad_averager.GradientAveragerFactory")
    assert not [path for path, obj in directives().items() if obj is Bare]


def test_the_quickstart_runs():
    """The first script of docs/index.md (two peers, a record, one averaging round) does what it says."""
    page = (ROOT / "docs" / "index.md").read_text()
    script = re.search(r"```python\n(.*?)```", page, re.DOTALL).group(1)
    assert "127.0.0.1" in script  # tests stay on loopback
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=50
    )
    assert result.returncode == 0, result.stderr[-4000:]
    lines = result.stdout.splitlines()
    assert lines[1:3] == ["hello", "[2, 2]"], result.stdout
    assert lines[3] == "tensor([0.5000, 0.5000, 0.5000, 0.5000])", result.stdout


@pytest.mark.docs
@pytest.mark.timeout(240)
def test_the_site_builds_with_warnings_as_errors(tmp_path):
    for module in ("mkdocs", "material", "mkdocstrings_handlers.python"):
        pytest.importorskip(module, reason="the docs extra is not installed (pip install -e '.[docs]')")
    environment = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert (tmp_path / "site" / "api" / "optim" / "index.html").is_file()
    shutil.rmtree(tmp_path / "site")
