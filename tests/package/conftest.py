"""Package tests install from ./channel (made by ./build.sh). Without it they skip,
except under CI, where a missing channel is an error."""

from __future__ import annotations

import os

import pytest

from pkgtest import CHANNEL


def pytest_collection_modifyitems(config, items):
    if (CHANNEL / "noarch" / "repodata.json").exists():
        return
    if os.environ.get("CI"):
        raise pytest.UsageError("./channel was not built: run ./build.sh before ./test.sh")
    skip = pytest.mark.skip(reason="./channel not built (run ./build.sh)")
    for item in items:
        if "tests/package/" in str(item.fspath):
            item.add_marker(skip)

