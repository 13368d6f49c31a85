"""ABI audit of native libraries, a build/test tool (not shipped in any sm7x package):
``PYTHONPATH=python python -m sm7x_tools.audit PATH...`` from the source tree.

Per shared object it reports
- the torch verdict: STABLE (imports only C shims of torch's stable ABI: aoti_torch_*,
  torch_*), UNSTABLE (imports libtorch/c10 C++ symbols, or C symbols of a torch library
  it links), NO-TORCH;
- the lowest torch whose shims it needs (imported, or named for dlsym), from
  torch-abi-audit's table of PyTorch's shim versions (``shims.py``);
- the abi3 verdict of ``*.abi3.so`` files: abi3audit when installed; a file that uses no
  Python API at all (sm7x's torch libraries) needs no list;
- whether the file name matches the file: PyInit_<name> vs the name, pybind11 and other
  non-limited-API modules SOABI-named, never ``.abi3.so`` (a module declared limited-API
  was once shipped as .abi3.so and failed to import).

Needs pyelftools (the recipe has it offline); abi3audit for the abi3 check of modules
that use the Python C API. Never imports torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from ._core import NO_TORCH, STABLE, UNSTABLE, Options, Record, audit_file, parse_name
from ._elf import is_elf
from ._inputs import InputError, expand

__all__ = ["STABLE", "UNSTABLE", "NO_TORCH", "Options", "Record", "audit_file",
           "audit_paths", "parse_name", "InputError"]


def audit_paths(paths: Iterable[str | Path], opts: Options | None = None) -> list[Record]:
    """Records for every shared object under paths. A path that cannot be read gives a
    failing record; a directory or package holding no shared object a skipped one."""
    opts = opts or Options()
    records: list[Record] = []
    for arg in map(str, paths):
        try:
            with expand(arg) as found:
                explicit = len(found) == 1 and found[0][1] == arg
                if not found:
                    records.append(Record(file=arg, path=arg,
                                          skipped="no shared objects (.so) inside"))
                for real, display in found:
                    if not explicit and not is_elf(real):
                        records.append(Record(file=display, path=str(real),
                                              skipped="not an ELF file"))
                        continue
                    records.append(audit_file(real, display, opts))
        except InputError as exc:
            records.append(Record(file=arg, path=arg, error=str(exc), failures=[str(exc)]))
    return records
