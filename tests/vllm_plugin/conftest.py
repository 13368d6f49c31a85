"""CPU tests of sm7x's vLLM plugin against real vLLM Python (tests/vllm_plugin/run.sh installs the
pinned versions). Without vLLM (the plain test environment) the tests here skip.

vLLM's compiled extensions (vllm/_C*.so, vllm/vllm_flash_attn/_vllm_fa2_C*.so and the
others) are built for CUDA torch and do not load on CPU torch: each is replaced by an
empty module before vLLM is imported. Nothing
else of vLLM is touched; the modules these tests use never call those ops.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import types

import pytest

_spec = importlib.util.find_spec("vllm")
if _spec is not None:
    _vllm_dir = _spec.submodule_search_locations[0]
    for _root, _dirs, _files in os.walk(_vllm_dir):
        _package = os.path.relpath(_root, os.path.dirname(_vllm_dir)).replace(os.sep, ".")
        for _f in _files:
            if _f.endswith(".so"):
                _name = f"{_package}.{_f.split('.')[0]}"
                sys.modules.setdefault(_name, types.ModuleType(_name))


@pytest.fixture
def sm7x_log():
    """Records what the plugin logs on vLLM's logger (vLLM's handlers do not propagate
    to pytest's)."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    from sm7x.integrations.vllm import LOGGER

    logger = logging.getLogger(LOGGER)
    handler = Keep(level=logging.DEBUG)
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.DEBUG)
    yield records
    logger.removeHandler(handler)
    logger.setLevel(old)


@pytest.fixture
def fa2_libraries(tmp_path, monkeypatch):
    """Both FA2 libraries 'installed' (files where sm7x looks; nothing loads them here)."""
    from sm7x import _select

    for arch in _select.ARCHS:
        (tmp_path / _select.library_name(arch)).write_bytes(b"")
    monkeypatch.setenv(_select.LIBRARY_PATH_ENV, str(tmp_path))
    return tmp_path


@pytest.fixture
def custom_backend_clear():
    """CUSTOM unregistered before and after the test (the registry is process-global)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    AttentionBackendEnum.CUSTOM.clear_override()
    yield AttentionBackendEnum.CUSTOM
    AttentionBackendEnum.CUSTOM.clear_override()
