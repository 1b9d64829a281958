"""The native kernels' tests: skipped where the kernels cannot serve, given the loaded module."""

from __future__ import annotations

import pytest

from engine import native
from tests.support.cpu import kernels_supported


def pytest_collection_modifyitems(items):
    if not kernels_supported():
        skip = pytest.mark.skip(reason="mlxrt's CPU kernels are x86-64 AVX2 only")
        for item in items:
            if "tests/engine/native/" in str(item.fspath).replace("\\", "/"):
                item.add_marker(skip)


@pytest.fixture(scope="module")
def kernels():
    module = native.load()
    assert module is not None, "the kernels did not build or load here (the log's native_off says why)"
    return module
