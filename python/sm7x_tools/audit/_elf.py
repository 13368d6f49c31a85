"""What the dynamic linker sees in an ELF shared object: imports, exports, DT_NEEDED.

Only pyelftools and the standard library; demangling uses ``c++filt`` when it is on PATH.
"""

from __future__ import annotations

import mmap
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

ELF_MAGIC = b"\x7fELF"

# e_machine values as pyelftools names them, and the platform part of an EXT_SUFFIX.
MACHINE_PLATFORM = {
    "EM_X86_64": "x86_64",
    "EM_386": "i386",
    "EM_AARCH64": "aarch64",
    "EM_PPC64": "powerpc64le",
    "EM_S390": "s390x",
    "EM_ARM": "arm",
    "EM_RISCV": "riscv64",
}


class ElfError(Exception):
    """The file is not a readable ELF shared object."""


@dataclass(frozen=True)
class Import:
    """An undefined dynamic symbol, with the GNU version (and the file that version
    names) when the linker recorded one."""

    name: str
    weak: bool = False
    version: str | None = None
    version_file: str | None = None


@dataclass
class ElfInfo:
    path: Path
    machine: str
    soname: str | None
    needed: list[str]
    runpath: list[str]
    imports: list[Import]
    exports: set[str]
    versioned_needed: set[str] = field(default_factory=set)  # files named by .gnu.version_r
    rodata_strings: set[str] = field(default_factory=set)
    has_pybind11_marker: bool = False

    @property
    def platform(self) -> str | None:
        return MACHINE_PLATFORM.get(self.machine)


def is_elf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == ELF_MAGIC
    except OSError:
        return False


# NUL-terminated C identifiers that could name a torch C shim, for dlsym'd lookups.
_SHIM_STRING = re.compile(rb"(?<![A-Za-z0-9_])((?:aoti_torch|torch)_[A-Za-z0-9_]{2,120})\x00")


def read_elf(path: Path) -> ElfInfo:
    try:
        from elftools.common.exceptions import ELFError
        from elftools.elf.dynamic import DynamicSection
        from elftools.elf.elffile import ELFFile
        from elftools.elf.gnuversions import GNUVerNeedSection, GNUVerSymSection
        from elftools.elf.sections import SymbolTableSection
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ElfError(
            "sm7x_tools.audit needs pyelftools to read ELF files: pip install pyelftools "
            "(conda: pyelftools)"
        ) from exc

    path = Path(path)
    if not is_elf(path):
        raise ElfError(f"{path}: not an ELF file")
    try:
        with open(path, "rb") as f:
            elf = ELFFile(f)
            machine = elf["e_machine"]
            soname, needed, runpath = None, [], []
            dynsym = versym = verneed = None
            for sec in elf.iter_sections():
                if isinstance(sec, DynamicSection):
                    for tag in sec.iter_tags():
                        if tag.entry.d_tag == "DT_NEEDED":
                            needed.append(tag.needed)
                        elif tag.entry.d_tag == "DT_SONAME":
                            soname = tag.soname
                        elif tag.entry.d_tag == "DT_RUNPATH":
                            runpath.extend(tag.runpath.split(":"))
                        elif tag.entry.d_tag == "DT_RPATH":
                            runpath.extend(tag.rpath.split(":"))
                elif isinstance(sec, SymbolTableSection) and sec.name == ".dynsym":
                    dynsym = sec
                elif isinstance(sec, GNUVerSymSection):
                    versym = sec
                elif isinstance(sec, GNUVerNeedSection):
                    verneed = sec

            # version index -> (version name, file that provides it)
            vermap: dict[int, tuple[str, str]] = {}
            versioned_needed: set[str] = set()
            if verneed is not None:
                for vn, auxes in verneed.iter_versions():
                    versioned_needed.add(vn.name)
                    for aux in auxes:
                        vermap[aux["vna_other"]] = (aux.name, vn.name)

            imports: list[Import] = []
            exports: set[str] = set()
            if dynsym is not None:
                for i, sym in enumerate(dynsym.iter_symbols()):
                    if i == 0 or not sym.name:
                        continue
                    bind = sym.entry.st_info.bind
                    if sym.entry.st_shndx == "SHN_UNDEF":
                        ver = vermap.get(versym.get_symbol(i).entry["ndx"]) if versym else None
                        imports.append(Import(sym.name, weak=bind == "STB_WEAK",
                                              version=ver[0] if ver else None,
                                              version_file=ver[1] if ver else None))
                    elif bind in ("STB_GLOBAL", "STB_WEAK", "STB_LOOS") and \
                            sym.entry.st_other.visibility in ("STV_DEFAULT", "STV_PROTECTED"):
                        exports.add(sym.name)

            rodata: set[str] = set()
            for name in (".rodata", ".data.rel.ro"):
                sec = elf.get_section_by_name(name)
                if sec is not None and sec["sh_type"] != "SHT_NOBITS":
                    rodata.update(m.decode() for m in _SHIM_STRING.findall(sec.data()))
    except (ELFError, ValueError, KeyError, OSError) as exc:
        raise ElfError(f"{path}: cannot read ELF: {exc}") from exc

    return ElfInfo(path=path, machine=machine, soname=soname, needed=needed, runpath=runpath,
                   imports=imports, exports=exports, versioned_needed=versioned_needed,
                   rodata_strings=rodata,
                   has_pybind11_marker=_file_contains(path, b"pybind11"))


def _file_contains(path: Path, needle: bytes) -> bool:
    with open(path, "rb") as f:
        try:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                return mm.find(needle) != -1
        except ValueError:  # empty file
            return False


def demangle(names: list[str]) -> dict[str, str]:
    """Mangled name -> demangled, through one ``c++filt`` call; {} without c++filt."""
    mangled = [n for n in names if n.startswith("_Z")]
    exe = shutil.which("c++filt")
    if not mangled or exe is None:
        return {}
    try:
        proc = subprocess.run([exe], input="\n".join(mangled) + "\n", capture_output=True,
                              text=True, timeout=60, check=True)
    except (OSError, subprocess.SubprocessError):
        return {}
    out = proc.stdout.splitlines()
    if len(out) != len(mangled):
        return {}
    return {m: d for m, d in zip(mangled, out) if d != m}
