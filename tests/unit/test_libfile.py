"""A native library that is there but cannot be loaded (truncated, empty, garbage,
unreadable) gives an error naming the file and the cause, checked before dlopen; an
unreadable SM7X_LIBRARY_PATH entry is skipped and named; doctor reports both."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sm7x import _libfile, _select, _targets


@pytest.fixture(scope="module")
def real_library() -> Path:
    """A real x86-64 shared library of this Python (an extension module)."""
    import _ctypes

    return Path(_ctypes.__file__)


def _cut(src: Path, dst: Path, size: int) -> Path:
    dst.write_bytes(src.read_bytes()[:size])
    return dst


def test_a_whole_library_passes(real_library):
    assert _libfile.problem(real_library) is None


@pytest.mark.parametrize("fraction", [0.01, 0.2, 0.5, 0.9, 0.999])
def test_truncated_library(real_library, tmp_path, fraction):
    size = max(64, int(real_library.stat().st_size * fraction))
    why = _libfile.problem(_cut(real_library, tmp_path / "lib.so", size))
    assert why and "truncated" in why and f"{size:,} bytes" in why


def test_one_byte_short(real_library, tmp_path):
    size = real_library.stat().st_size - 1
    assert "truncated" in _libfile.problem(_cut(real_library, tmp_path / "lib.so", size))


@pytest.mark.parametrize("content, why", [
    (b"", "empty"), (b"garbage" * 100, "not a shared library"),
    (b"\x7fELF\x02\x01", "not even a whole ELF header"),
    (b"\x7fELF\x01\x01" + b"\0" * 58, "64-bit")])
def test_empty_and_garbage(tmp_path, content, why):
    (tmp_path / "lib.so").write_bytes(content)
    assert why in _libfile.problem(tmp_path / "lib.so")


def test_unreadable(tmp_path):
    # root reads any file, so an unreadable one is made by what open() cannot read: a
    # directory in its place
    (tmp_path / "lib.so").mkdir()
    assert "cannot be read" in _libfile.problem(tmp_path / "lib.so")


def _lock_directory(monkeypatch, locked: Path) -> None:
    """Searching `locked` fails as a directory without x permission does (as root, chmod
    cannot make one)."""
    real_is_file = Path.is_file

    def is_file(self):
        if self.parent == locked:
            raise PermissionError(13, "Permission denied")
        return real_is_file(self)

    monkeypatch.setattr(Path, "is_file", is_file)


def test_search_skips_and_names_an_unsearchable_directory(tmp_path, monkeypatch):
    bad, good = tmp_path / "bad", tmp_path / "good"
    good.mkdir()
    (good / "x.so").write_bytes(b"")
    _lock_directory(monkeypatch, bad)
    assert _libfile.search([bad, good], "x.so") == (good / "x.so", [f"{bad}: Permission denied"])
    assert _libfile.search([bad], "x.so") == (None, [f"{bad}: Permission denied"])


def test_unsearchable_library_path_is_a_library_error(tmp_path, monkeypatch):
    """Before: a bare PermissionError from Path.is_file reached the ops."""
    _lock_directory(monkeypatch, tmp_path)
    monkeypatch.setenv(_select.LIBRARY_PATH_ENV, str(tmp_path))
    assert _select.library_search("sm75")[1] == [f"{tmp_path}: Permission denied"]
    sel = _select.Selection("sm75", "test")
    dev = _select.Device(0, "Tesla T4", (7, 5))
    err = _select.missing_library_error(sel, dev, _select.library_search("sm75")[1])
    assert isinstance(err, ImportError) and str(tmp_path) in str(err) and "permissions" in str(err)


# The loaders, in a child process: before the check, a truncated library killed the
# process with SIGBUS inside dlopen (torch.ops.load_library), with no message.
_LOAD = textwrap.dedent("""
    import sys
    from sm7x import _core_loader, _select
    from sm7x.fa2 import _loader
    try:
        if sys.argv[1] == "core":
            _core_loader.load()
        else:
            _loader.load(_select.Selection("sm75", "test", forced=True),
                         _select.Device(0, "Tesla T4", (7, 5)))
    except ImportError as exc:
        print("ERROR", type(exc).__name__, exc)
        sys.exit(3)
    print("LOADED")
""")


@pytest.mark.parametrize("which, name", [("core", "_core.abi3.so"),
                                         ("fa2", "_fa2_sm75.abi3.so")])
@pytest.mark.parametrize("cut", [1024, 300_000, "half", "garbage", "empty"])
def test_loaders_refuse_a_broken_library_with_its_name_and_cause(real_library, tmp_path, which,
                                                                  name, cut):
    pytest.importorskip("torch")
    src = real_library.read_bytes()
    data = {"half": src[:len(src) // 2], "garbage": b"not a library" * 100,
            "empty": b""}.get(cut, src[:cut] if isinstance(cut, int) else None)
    (tmp_path / name).write_bytes(data)
    env = {**os.environ, _select.LIBRARY_PATH_ENV: str(tmp_path)}
    env.pop(_select.FORCE_ENV, None)
    r = subprocess.run([sys.executable, "-c", _LOAD, which], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 3, (r.returncode, r.stdout, r.stderr[-2000:])
    assert str(tmp_path / name) in r.stdout
    assert any(w in r.stdout for w in ("truncated", "empty", "not a shared library"))


def test_doctor_reports_a_truncated_library(real_library, tmp_path, monkeypatch):
    from sm7x import doctor

    _cut(real_library, tmp_path / "_fa2_sm75.abi3.so", 2048)
    _cut(real_library, tmp_path / "_core.abi3.so", 4096)
    monkeypatch.setenv(_select.LIBRARY_PATH_ENV, str(tmp_path))
    monkeypatch.delenv(_select.FORCE_ENV, raising=False)
    info = doctor.collect([_select.Device(0, "Tesla T4", (7, 5))], package_dir=tmp_path)
    fa2 = info["gpus"][0]["fa2"]
    assert fa2["installed"] is False and "truncated" in fa2["problem"]
    assert "truncated" in info["core"]["problem"]
    text = doctor.render(info)
    assert "BROKEN at" in text and str(tmp_path / "_fa2_sm75.abi3.so") in text
    assert any("_core.abi3.so cannot be loaded" in w for w in info["warnings"])


def test_load_failure_blames_torch_only_for_missing_torch_symbols():
    old = OSError("_core.abi3.so: undefined symbol: aoti_torch_get_current_cuda_stream")
    assert f"torch >= {_targets.torch_min()}" in _libfile.load_failure(old, "2.9.1")
    other = OSError("_core.abi3.so: invalid ELF header")
    assert _libfile.load_failure(other, "2.13.0") == "_core.abi3.so: invalid ELF header"


@pytest.mark.parametrize("keep", [0.5, 0.95])
def test_full_size_but_zero_filled_tail(real_library, tmp_path, keep):
    """An interrupted copy onto a filesystem that had already set the size (preallocated or
    sparse): every length checks out, the tail is zeros."""
    data = real_library.read_bytes()
    cut = int(len(data) * keep)
    (tmp_path / "lib.so").write_bytes(data[:cut] + b"\0" * (len(data) - cut))
    assert "interrupted copy" in _libfile.problem(tmp_path / "lib.so")


def test_doctor_with_an_unsearchable_library_path_reports_it(tmp_path, monkeypatch):
    """Before: doctor crashed with a PermissionError traceback when a GPU was present."""
    from sm7x import doctor

    bad = tmp_path / "locked"
    _lock_directory(monkeypatch, bad)
    monkeypatch.setenv(_select.LIBRARY_PATH_ENV, str(bad))
    monkeypatch.delenv(_select.FORCE_ENV, raising=False)
    info = doctor.collect([_select.Device(0, "Tesla T4", (7, 5))], package_dir=tmp_path)
    assert any(f"cannot search {bad}: Permission denied" in w for w in info["warnings"])
    assert "cannot search" in doctor.render(info)
