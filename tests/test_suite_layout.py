"""The suite's layout: shared helpers live in `tests/support/`, and nothing else in `tests/` is imported.

Every `tests.*` import (absolute or relative, at module level or inside a function) and every
dotted `tests.*` string given to `monkeypatch.setattr`, `mock.patch` or `importlib.import_module`, must name
`tests.support` or something in it; every other Python file under `tests/` is a test module
(`test_*.py`), a `conftest.py` or an `__init__.py`. Read from the source with `ast`; the cases at
the end show the checks catch what they are meant to.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
SUPPORT = "tests.support"
# A dotted name under `tests` (not prose): `tests.x`, `tests.x.y`...
DOTTED = re.compile(r"tests(\.[A-Za-z_]\w*)+")
# Calls whose first argument names a module or an attribute by a dotted string.
NAMING_CALLS = {"setattr", "delattr", "patch", "import_module", "__import__"}


def _called(call: ast.Call) -> str:
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
    for node in ast.walk(ast.parse(source)):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node, module, is_package)
            # `from tests import support` names the package `tests.support`.
            targets = [f"{base}.{alias.name}" for alias in node.names] if base == "tests" else [base]
        elif isinstance(node, ast.Call) and _called(node) in NAMING_CALLS and node.args:
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


def _sources() -> list[Path]:
    return sorted(TESTS.rglob("*.py"))


def test_every_tests_import_names_tests_support():
    found = []
    for path in _sources():
        found += violations(path.read_text(), module_name(path), is_package=path.name == "__init__.py")
    assert not found, "import shared helpers from tests.support only:\n" + "\n".join(found)


def test_every_python_file_outside_support_is_a_test_module_or_conftest():
    assert len(_sources()) > 50  # the walk found the suite
    assert not misplaced(_sources()), "move shared helpers into tests/support/"


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
