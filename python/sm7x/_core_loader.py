"""Finds and loads sm7x's core op library, ``_core.abi3.so`` (package sm7x-core).

The library registers the ``torch.ops.sm7x.*`` operators when it is loaded into a
process that has torch (at least the floor, targets.json torch.min): it is built against
torch's stable ABI and links no torch library, so one file serves every torch from that
floor up and every Python >= 3.10. It is
not a Python module (no ``PyInit``): it is loaded with ``torch.ops.load_library``.

Search order (never the working directory; README, "The loader"):

1. each directory in ``$SM7X_LIBRARY_PATH`` (``os.pathsep``-separated; empty entries are
   ignored rather than meaning the working directory),
2. the installed package directory (``Path(sm7x.__file__).parent``),
3. where the package's own import machinery places ``sm7x._core`` (an editable install
   keeps built files apart from the sources; this is still the installed package).

Importing this module is cheap: torch is imported only by :func:`load`.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import threading
from pathlib import Path

from . import _install_hints, _libfile
from ._select import LIBRARY_PATH_ENV

LIBRARY_NAME = "_core.abi3.so"
PACKAGE = "sm7x-core"
NAMESPACE = "sm7x"
# An op the library defines: present in torch.ops.sm7x once the library is loaded.
_PROBE_OP = "rms_norm"

log = logging.getLogger("sm7x")

_lock = threading.Lock()
_loaded: Path | None = None


class MissingCoreLibraryError(ImportError):
    """_core.abi3.so is not installed (or cannot be loaded); the message says what to do."""


def _package_dir() -> Path:
    return Path(__file__).resolve().parent


def search_dirs() -> list[Path]:
    """The directories searched for the library, in order (see the module docstring)."""
    dirs = [Path(d).absolute() for d in os.environ.get(LIBRARY_PATH_ENV, "").split(os.pathsep) if d]
    dirs.append(_package_dir())
    return dirs


def core_library_path() -> Path | None:
    """Where ``_core.abi3.so`` lies, or None when it is not installed (directories that
    cannot be searched are skipped: :func:`core_library_search`)."""
    return core_library_search()[0]


def core_library_search() -> tuple[Path | None, list[str]]:
    """:func:`core_library_path` and the directories that could not be searched."""
    found, skipped = _libfile.search(search_dirs(), LIBRARY_NAME)
    if found is not None:
        return found, skipped
    # Editable installs (scikit-build-core's redirect mode) map sm7x._core to the built
    # file through the package's import hook. find_spec only locates: it loads nothing.
    try:
        spec = importlib.util.find_spec(f"{__package__}._core")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.origin:
        origin = Path(spec.origin)
        if origin.name == LIBRARY_NAME and origin.is_file():
            return origin, skipped
    return None, skipped


def loaded_path() -> Path | None:
    """The library this process loaded, or None if it has not been loaded (yet)."""
    return _loaded


def _registered(torch) -> bool:
    try:
        getattr(getattr(torch.ops, NAMESPACE), _PROBE_OP)
        return True
    except (AttributeError, RuntimeError):
        return False


def load() -> Path:
    """Loads the library into torch once per process (thread-safe); returns its path.

    Raises MissingCoreLibraryError when it is not installed or cannot be loaded.
    """
    global _loaded
    if _loaded is not None:
        return _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        import torch

        path, skipped = core_library_search()
        if path is None:
            if _registered(torch):
                # Someone loaded a build of it by hand (torch.ops.load_library): use it.
                _loaded = Path(f"<{NAMESPACE} ops registered outside sm7x>")
                return _loaded
            searched = ", ".join(str(d) for d in search_dirs())
            unread = (f"; could not search {'; '.join(skipped)}: fix the permissions or "
                      f"remove it from {LIBRARY_PATH_ENV}" if skipped else "")
            raise MissingCoreLibraryError(
                f"sm7x's core op library {LIBRARY_NAME} (package {PACKAGE}) is not installed "
                f"(searched {searched}{unread}; set {LIBRARY_PATH_ENV} to the directory of a "
                f"build): {_install_hints.install_hint(PACKAGE)}"
            )
        if _registered(torch):
            # Loading a second copy would fail: torch allows one definition per namespace.
            log.info("sm7x: torch.ops.%s already registered; not loading %s", NAMESPACE, path)
        else:
            bad = _libfile.problem(path)  # before dlopen: a truncated file is SIGBUS
            if bad is None:
                try:
                    torch.ops.load_library(str(path))
                except OSError as exc:
                    bad = _libfile.load_failure(exc, torch.__version__)
            if bad is not None:
                raise MissingCoreLibraryError(
                    f"cannot load {path}: {bad}. Copy the file again, or reinstall {PACKAGE} "
                    f"({_install_hints.install_hint(PACKAGE)})")
            log.info("sm7x: loaded %s into torch %s", path, torch.__version__)
        _loaded = path
        return _loaded
