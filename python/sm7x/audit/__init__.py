"""ABI audit of native libraries: ``python -m sm7x.audit PATH...``.

Per shared object it reports
- the torch verdict: STABLE (imports only C shims of torch's stable ABI: aoti_torch_*,
  torch_*), UNSTABLE (imports libtorch/c10 C++ symbols), NO-TORCH;
- the lowest torch whose shims it needs, from a table generated from torch's shim
  headers (``gen_tables.py``);
- the abi3 verdict of ``*.abi3.so`` files (abi3audit, limited API of Python 3.10);
- whether the file name matches the file: PyInit_<name> vs the name, pybind11 and other
  non-limited-API modules SOABI-named, never ``.abi3.so`` (shared seed 000).

A build/test tool: needs pyelftools (abi3audit for the authoritative abi3 check, rich for
a nicer table), never torch. ``import sm7x`` does not import it.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from ._core import (  # noqa: F401  (re-exported)
    NO_TORCH,
    STABLE,
    UNSTABLE,
    Options,
    Record,
    audit_file,
    parse_name,
)
from ._elf import is_elf
from ._inputs import InputError, expand

__all__ = ["STABLE", "UNSTABLE", "NO_TORCH", "Options", "Record", "audit_file",
           "audit_paths", "InputError"]


def audit_paths(paths: Iterable[str | Path], opts: Options | None = None) -> list[Record]:
    """Records for every shared object under paths. A path that cannot be read gives a
    failing record; a directory or package holding no shared object a skipped one."""
    opts = opts or Options()
    records: list[Record] = []
    for arg in paths:
        arg = str(arg)
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
