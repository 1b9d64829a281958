"""The suite's layout: shared helpers live in `tests/support/`, and nothing else in `tests/` is imported.

Every `tests.*` import (absolute or relative, at module level or inside a function) and every
dotted `tests.*` string given to `monkeypatch.setattr`, `mock.patch` or `importlib.import_module`, must name
`tests.support` or something in it; every other Python file under `tests/` is a test module
(`test_*.py`), a `conftest.py` or an `__init__.py`. And a test that starts a server (directly, through
a helper of its module or through a fixture) is marked `server`, so `make test-fast` leaves it out.
Read from the source with `ast`; the cases at the end show the checks catch what they are meant to.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
SUPPORT = "tests.support"
# A dotted name under `tests` (not prose): `tests.x`, `tests.x.y`...
DOTTED = re.compile(r"tests(\.[A-Za-z_]\w*)+")
# Calls whose first argument names a module or an attribute by a dotted string.
NAMING_CALLS = {"setattr", "delattr", "patch", "import_module", "__import__"}


def _called_name(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def module_name(path: Path) -> str:
    parts = path.relative_to(TESTS.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _allowed(target: str) -> bool:
    return target == SUPPORT or target.startswith(SUPPORT + ".")


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module a `from ... import` names (relative imports resolved against `module`)."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """Each import of, or dotted string naming, a `tests` module outside `tests.support`."""
    found = []
    for node in ast.walk(_tree(source)):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node, module, is_package)
            # `from tests import support` names the package `tests.support`.
            targets = [f"{base}.{alias.name}" for alias in node.names] if base == "tests" else [base]
        elif isinstance(node, ast.Call) and _called_name(node) in NAMING_CALLS and node.args:
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str) and DOTTED.fullmatch(first.value):
                targets = [first.value]
        for target in targets:
            if (target == "tests" or target.startswith("tests.")) and not _allowed(target):
                found.append(f"{module}:{node.lineno}: {target}")
    return found


def misplaced(paths: list[Path]) -> list[Path]:
    """Python files under tests/ that are neither test modules, conftests, packages nor support."""
    return [
        path
        for path in paths
        if path.suffix == ".py"
        and path.relative_to(TESTS).parts[0] != "support"
        and not (path.name.startswith("test_") or path.name in ("conftest.py", "__init__.py"))
    ]


# What starts a server (tests/support/serve.py, tests/support/http_serving.py, a module's own).
SERVER_STARTERS = {"serving", "running_server", "start_server", "ServerProcess"}
# The HTTP round trip kept in `make test-fast` on purpose (docs/tests.md).
FAST_SERVER_TESTS = {"tests.net.test_http_chat::test_streamed_greedy_tokens_equal_the_in_process_stream"}


def _called(node: ast.AST) -> set[str]:
    """The names of the functions `node` calls."""
    return {_called_name(call) for call in ast.walk(node) if isinstance(call, ast.Call)}


def _marks(node: ast.AST) -> set[str]:
    """`X` of every `pytest.mark.X` in `node`."""
    return {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute) and n.value.attr == "mark"}


def unmarked_server_tests(source: str, module: str) -> list[str]:
    """Tests that start a server, directly or through their module's helpers and fixtures, without
    the `server` mark (on the test or the module's `pytestmark`)."""
    tree = _tree(source)
    functions = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    starters = set(SERVER_STARTERS)
    while grown := {name for name, fn in functions.items() if name not in starters and _called(fn) & starters}:
        starters |= grown
    module_marks = set().union(
        *(_marks(n.value) for n in tree.body if isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in n.targets))
    )
    found = []
    for name, fn in functions.items():
        if not name.startswith("test_") or f"{module}::{name}" in FAST_SERVER_TESTS:
            continue
        fixtures = {arg.arg for arg in fn.args.args}  # a fixture of the module that starts one counts
        marks = module_marks.union(*(_marks(decorator) for decorator in fn.decorator_list))
        if (_called(fn) | fixtures) & starters and "server" not in marks:
            found.append(f"{module}::{name}")
    return found


def _sources() -> list[Path]:
    return sorted(TESTS.rglob("*.py"))


@functools.cache
def _text(path: Path) -> str:
    return path.read_text()


@functools.cache
def _tree(source: str) -> ast.Module:
    return ast.parse(source)  # (read, never changed: parsed once for every check)


def test_every_tests_import_names_tests_support():
    found = []
    for path in _sources():
        found += violations(_text(path), module_name(path), is_package=path.name == "__init__.py")
    assert not found, "import shared helpers from tests.support only:\n" + "\n".join(found)


def test_every_python_file_outside_support_is_a_test_module_or_conftest():
    assert len(_sources()) > 50  # the walk found the suite
    assert not misplaced(_sources()), "move shared helpers into tests/support/"


def test_every_test_that_starts_a_server_is_marked_server():
    found = []
    for path in _sources():
        if path.name.startswith("test_"):
            found += unmarked_server_tests(_text(path), module_name(path))
    assert not found, "mark these @pytest.mark.server (or the module's pytestmark):\n" + "\n".join(found)


# -- the checks are able to fail ----------------------------------------------------


@pytest.mark.parametrize(
    ("source", "module"),
    [
        ("from tests.engine.test_engine import Driver", "tests.engine.test_speculation"),
        ("import tests.integration.reference", "tests.net.test_x"),
        ("import tests.support, tests.conftest", "tests.net.test_x"),
        ("from tests.conftest import make_config", "tests.net.test_x"),
        ("from tests import conftest", "tests.net.test_x"),
        ("from .test_engine import _admit", "tests.engine.test_speculation"),
        ("from ..integration import server_helpers", "tests.net.test_x"),
        ("def test_a():\n    from tests.net.http_support import serving\n", "tests.integration.test_x"),
        ("def test_b(monkeypatch):\n    monkeypatch.setattr('tests.net.test_http.LIMIT', 1)\n", "tests.net.test_y"),
        ("from tests.supporting import x", "tests.net.test_x"),
        ("import importlib\nhelpers = importlib.import_module('tests.integration.reference')", "tests.net.test_x"),
        ("from unittest import mock\nwith mock.patch('tests.net.test_http.serving'):\n    pass\n", "tests.net.test_x"),
    ],
    ids=[
        "from-test-module",
        "import",
        "one-of-two",
        "conftest",
        "from-package",
        "relative",
        "relative-parent",
        "in-function",
        "string-target",
        "prefix",
        "import-module",
        "mock-patch",
    ],
)
def test_an_import_of_another_test_file_is_caught(source, module):
    assert len(violations(source, module)) == 1


@pytest.mark.parametrize(
    ("source", "module", "is_package"),
    [
        ("from tests.support.config import make_config\nimport tests.support.events", "tests.net.test_x", False),
        ("from tests import support", "tests.net.test_x", False),
        ("from .config import CHUNK", "tests.support.serve", False),
        ("from . import config", "tests.support", True),
        ("import testsuite\nfrom testing import x\nx = 'tests.support.wire.RawConnection'", "tests.net.test_x", False),
        ('"""Helpers, once tests.conftest. was read: prose"""\nx = "tests.net.test_http"', "tests.net.test_x", False),
        ("monkeypatch.setattr('tests.support.serve.READY_TIMEOUT_S', 1)", "tests.net.test_x", False),
    ],
    ids=["support", "support-package", "relative-in-support", "package-relative", "other-names", "prose", "support-string-target"],
)
def test_imports_of_tests_support_pass(source, module, is_package):
    assert violations(source, module, is_package) == []


def test_a_helper_module_outside_support_is_caught():
    paths = [TESTS / p for p in ("net/http_support.py", "net/test_http.py", "conftest.py", "support/serve.py", "engine/__init__.py", "data/x.txt")]
    assert misplaced(paths) == [TESTS / "net/http_support.py"]


SERVING = "from tests.support.http_serving import serving\n"


@pytest.mark.parametrize(
    "source",
    [
        SERVING + "async def test_a():\n    async with serving() as served:\n        pass\n",
        "def helper(tmp_path):\n    return start_server(tmp_path)\n\ndef test_b(tmp_path):\n    helper(tmp_path).stop()\n",
        "@pytest.fixture\ndef server(tmp_path):\n    with running_server(tmp_path) as s:\n        yield s\n\ndef test_c(server):\n    pass\n",
        "pytestmark = pytest.mark.slow\n\n@pytest.mark.distributed\ndef test_d(tmp_path):\n    ServerProcess(tmp_path, tmp_path, tmp_path)\n",
    ],
    ids=["direct", "through-a-helper", "through-a-fixture", "other-marks"],
)
def test_an_unmarked_server_test_is_caught(source):
    assert len(unmarked_server_tests(source, "tests.net.test_x")) == 1


@pytest.mark.parametrize(
    "source",
    [
        SERVING + "@pytest.mark.server\nasync def test_a():\n    async with serving() as served:\n        pass\n",
        SERVING + "pytestmark = [pytest.mark.server, pytest.mark.slow]\n\nasync def test_a():\n    async with serving() as served:\n        pass\n",
        "def test_e(tiny_config):\n    assert tiny_config\n",
    ],
    ids=["marked", "module-marked", "no-server"],
)
def test_marked_or_serverless_tests_pass(source):
    assert unmarked_server_tests(source, "tests.net.test_x") == []
