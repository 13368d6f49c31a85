"""Which FlashAttention-2 library a GPU uses: the loader's rules (README,
"The loader") as pure logic.

No torch and no native code here, so the rules can be tested on any machine and the
doctor can explain them on a login node without GPUs.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from . import _install_hints, _libfile, _targets

ARCHS = _targets.archs()  # ("sm70", "sm75"), from targets.json
FORCE_ENV = "SM7X_FA2_FORCE"
LIBRARY_PATH_ENV = "SM7X_LIBRARY_PATH"

# Turing parts that report 7.5 but have no tensor cores; capability alone cannot tell.
_NO_TENSOR_CORES = re.compile(
    r"GTX\s*16"  # GeForce GTX 1630/1650/1660 (TU116/TU117)
    r"|\bMX\s*[45]\d\d\b"  # GeForce MX450/MX550 (TU117)
    r"|\bT(?:400|500|550|600|1000|1200|2000)\b",  # NVIDIA/Quadro T-series on TU117
    re.IGNORECASE,
)


@dataclass(frozen=True)
class Device:
    """A CUDA device as the rules see it: index, marketing name, (major, minor)."""

    index: int
    name: str
    capability: tuple[int, int]

    def describe(self) -> str:
        major, minor = self.capability
        return f"cuda:{self.index} ({self.name}, compute capability {major}.{minor})"


@dataclass(frozen=True)
class Selection:
    """The FA2 library chosen for one device, and why."""

    arch: str  # "sm70" or "sm75"
    reason: str
    forced: bool = False
    # An arch whose library also runs here if the preferred one is not installed
    # (sm_70 code runs on 7.5: what a conda solve with __cuda_arch = min installs).
    fallback: str | None = None
    # Derived from arch; fields rather than properties so dataclasses.asdict shows them.
    package: str = field(init=False)  # "sm7x-fa2-sm70"
    library: str = field(init=False)  # "_fa2_sm70.abi3.so"
    namespace: str = field(init=False)  # torch op namespace "sm7x_fa2_sm70"

    def __post_init__(self):
        object.__setattr__(self, "package", package_name(self.arch))
        object.__setattr__(self, "library", library_name(self.arch))
        object.__setattr__(self, "namespace", f"sm7x_fa2_{self.arch}")


class UnsupportedDeviceError(RuntimeError):
    """The device cannot (or should not) run sm7x FA2; the message says what to do."""

    def __init__(self, message: str, device: Device | None = None):
        super().__init__(message)
        self.device = device


class MissingLibraryError(ImportError):
    """The selected FA2 library is not installed; the message says which package to add."""


def package_name(arch: str) -> str:
    return f"sm7x-fa2-{_check_arch(arch)}"


def library_name(arch: str) -> str:
    return f"_fa2_{_check_arch(arch)}.abi3.so"


def _check_arch(arch: str) -> str:
    if arch not in ARCHS:
        raise ValueError(f"unknown sm7x FA2 arch {arch!r}; valid values: {', '.join(ARCHS)}")
    return arch


def _resolve_force(force: str | None) -> tuple[str | None, str]:
    """(arch or None, where it came from): the argument wins over the environment."""
    if force is None:
        force = os.environ.get(FORCE_ENV, "").strip() or None
        if force is None:
            return None, ""
        source = f"{FORCE_ENV}={force}"
    else:
        source = f"force={force!r}"
    arch = force.strip().lower()
    if arch not in ARCHS:
        raise ValueError(
            f"invalid sm7x FA2 force value ({source}); valid values: {', '.join(ARCHS)}"
        )
    return arch, source


def select_fa2_library(device: Device, *, force: str | None = None) -> Selection:
    """Pick the FA2 library for ``device`` or raise UnsupportedDeviceError.

    ``force`` (or $SM7X_FA2_FORCE) names an arch to use regardless of the device; that is
    how the kernels are tested on sm_90, where the library's PTX is JIT-compiled.
    """
    arch, source = _resolve_force(force)
    desc = device.describe()
    major, minor = device.capability
    if arch is not None:
        # PTX can only be JIT-compiled for the same or a newer GPU.
        need = _targets.capability(arch)
        if device.capability < need:
            raise UnsupportedDeviceError(
                f"{desc}: {arch} was forced ({source}), but its code needs compute "
                f"capability {need[0]}.{need[1]} or newer and cannot run here; force an arch this "
                f"device can run, or do not force",
                device,
            )
        how = "native" if device.capability == need else "PTX JIT-compiled"
        return Selection(arch, f"{arch} forced by {source} on {desc} ({how})", forced=True)

    if major == 7 and _NO_TENSOR_CORES.search(device.name):
        raise UnsupportedDeviceError(
            f"{desc}: this Turing GPU has no tensor cores (capability {major}.{minor} "
            f"does not show that), and sm7x FA2 is built on them; use "
            f"torch.nn.functional.scaled_dot_product_attention instead",
            device,
        )
    if (major, minor) == (7, 0):
        return Selection("sm70", f"{desc} is Volta: sm70 library (native sm_70 code)")
    if (major, minor) == (7, 2):
        return Selection("sm70", f"{desc} is Volta (Xavier): sm70 library (runs on 7.2)")
    if (major, minor) == (7, 5):
        return Selection(
            "sm75", f"{desc} is Turing: sm75 library (native sm_75 code)", fallback="sm70"
        )
    if major == 7:
        return Selection(
            "sm70",
            f"{desc} is an unknown 7.x GPU: sm70 library (same major version, so sm_70 "
            f"code is binary compatible)",
        )
    if major >= 8:
        raise UnsupportedDeviceError(
            f"{desc} is Ampere or newer: sm7x FA2 targets Volta/Turing and would run its "
            f"PTX JIT-compiled here (the sm70 kernels about 40x slower than native). Use "
            f"upstream FlashAttention (package flash-attn) or "
            f"torch.nn.functional.scaled_dot_product_attention instead; to test sm7x "
            f"anyway set {FORCE_ENV}=sm75 (or sm70) or pass force='sm75'",
            device,
        )
    raise UnsupportedDeviceError(
        f"{desc} is older than Volta: sm7x FA2 needs tensor cores (compute capability "
        f"7.0 or 7.5); use torch.nn.functional.scaled_dot_product_attention instead",
        device,
    )


def missing_library_error(selection: Selection, device: Device,
                          skipped: Iterable[str] = ()) -> MissingLibraryError:
    """The error to raise when the selected library is not installed (``skipped``: the
    directories that could not be searched, from :func:`library_search`)."""
    skipped = list(skipped)
    unread = (f" (could not search {'; '.join(skipped)}: fix the permissions or remove it "
              f"from {LIBRARY_PATH_ENV})" if skipped else "")
    return MissingLibraryError(
        f"{device.describe()} needs {selection.library} from package {selection.package}, "
        f"which is not installed{unread}: {_install_hints.install_hint(selection.package)}"
    )


def broken_library_error(path: Path, why: str, package: str) -> MissingLibraryError:
    """The error for a library file that is there but cannot be loaded (``why``: from
    sm7x._libfile), naming the file, the cause and the fix."""
    return MissingLibraryError(
        f"cannot load {path}: {why}. Copy the file again, or reinstall {package} "
        f"({_install_hints.install_hint(package)})")


def dtype_error(what: str, dtype_name: str) -> TypeError:
    """The error for an unsupported dtype of ``what`` (e.g. "sm7x.fa2.flash_attn_func: q"),
    to raise: these GPUs have fp16 tensor cores only."""
    return TypeError(
        f"{what} is {dtype_name}: sm7x FA2 supports float16 only (Volta and Turing have no "
        f"bf16 tensor cores). Cast the inputs with .half() (e.g. q.half(), k.half(), v.half())"
    )


def head_dim_error(head_dim: int, supported: Iterable[int]) -> ValueError:
    """The error for a head dim without a kernel (to raise), listing those that exist."""
    dims = sorted(supported)
    larger = [d for d in dims if d > head_dim]
    pad = (
        f"; or zero-pad q, k, v to {larger[0]}, pass softmax_scale={head_dim}**-0.5 "
        f"and slice the output back to {head_dim}"
        if larger
        else ""
    )
    return ValueError(
        f"sm7x FA2 has no kernel for head_dim={head_dim}; supported head dims: "
        f"{', '.join(map(str, dims))}{pad}"
    )


def library_path(arch: str) -> Path | None:
    """Where the FA2 library for ``arch`` lies, or None.

    Only the installed package (sm7x/fa2/) or directories the user names in
    $SM7X_LIBRARY_PATH (searched first): never the working directory, so a stray file
    in cwd cannot be loaded into the process.
    """
    return library_search(arch)[0]


def library_search(arch: str) -> tuple[Path | None, list[str]]:
    """:func:`library_path`, and the directories that could not be searched ("DIR: why";
    they are skipped, as a shell skips an unreadable PATH entry)."""
    dirs = [Path(d).absolute() for d in os.environ.get(LIBRARY_PATH_ENV, "").split(os.pathsep) if d]
    # An empty entry would mean cwd in PATH-like variables: skipped above on purpose.
    dirs.append(Path(__file__).resolve().parent / "fa2")
    return _libfile.search(dirs, library_name(arch))


def required_packages(devices: Iterable[Device], *, force: str | None = None) -> set[str]:
    """The FA2 packages a node with ``devices`` needs for native kernels on every GPU.

    Devices sm7x refuses need nothing and are skipped.
    """
    needed = set()
    for device in devices:
        try:
            needed.add(select_fa2_library(device, force=force).package)
        except UnsupportedDeviceError:
            pass
    return needed


# --- What a conda/pixi solve installs for `sm7x-fa2` (the selector package, CEP 46) ---
# Mirrors the sm7x-fa2 output of recipe/recipe.yaml; tests/package/test_fa2_selector.py
# checks this table against real py-rattler solves of the built channel.

CUDA_ARCH_OVERRIDE_ENV = "CONDA_OVERRIDE_CUDA_ARCH"
CUDA_OVERRIDE_ENV = "CONDA_OVERRIDE_CUDA"


@dataclass(frozen=True)
class SelectorPick:
    """The sm7x-fa2 build a solver takes for a given __cuda_arch, and why."""

    variant: str | None  # "sm75", "sm70", "all"; None: no build can be installed
    build_number: int | None
    packages: tuple[str, ...]  # the FA2 library packages it pulls in
    cuda_arch: str | None  # the __cuda_arch the solver sees (None: absent)
    reason: str


def _parse_cuda_arch(value: str) -> tuple[int, int]:
    try:
        major, minor = (int(p) for p in value.strip().split("."))
    except ValueError:
        raise ValueError(f"invalid __cuda_arch {value!r}: expected MAJOR.MINOR such as 7.5") from None
    return major, minor


def arch_override_dropped(devices: Iterable[Device], environ=None) -> bool:
    """Whether a non-empty CONDA_OVERRIDE_CUDA_ARCH is ignored by the clients: on a node
    without a GPU (no driver) __cuda_arch needs __cuda, so CONDA_OVERRIDE_CUDA too."""
    environ = os.environ if environ is None else environ
    return (bool(environ.get(CUDA_ARCH_OVERRIDE_ENV, "").strip()) and not list(devices)
            and CUDA_OVERRIDE_ENV not in environ)


def node_cuda_arch(devices: Iterable[Device], environ=None) -> tuple[str | None, str]:
    """(__cuda_arch as a solver would see it, where it came from).

    CEP 46: the lowest compute capability among the node's GPUs, unless
    CONDA_OVERRIDE_CUDA_ARCH is set (an empty value removes the virtual package).
    """
    environ = os.environ if environ is None else environ
    devices = list(devices)
    if CUDA_ARCH_OVERRIDE_ENV in environ:
        value = environ[CUDA_ARCH_OVERRIDE_ENV].strip()
        if not value:
            return None, f"{CUDA_ARCH_OVERRIDE_ENV} is set and empty"
        _parse_cuda_arch(value)
        if arch_override_dropped(devices, environ):
            # run with conda 26.7.1 + nvidia-virtual-packages 0.2.0, which warns so
            return None, (f"{CUDA_ARCH_OVERRIDE_ENV}={value} without {CUDA_OVERRIDE_ENV} on a "
                          f"node without a GPU driver: clients then report no __cuda_arch")
        return value, f"{CUDA_ARCH_OVERRIDE_ENV}={value}"
    if not devices:
        return None, "no GPU found"
    low = min(devices, key=lambda d: d.capability)
    arch = "%d.%d" % low.capability
    if len(devices) == 1:
        return arch, f"the capability of {low.describe()}"
    return arch, f"the lowest capability of the {len(devices)} GPUs, {low.describe()}"


def _satisfies(cap: tuple[int, int], spec: str) -> bool:
    """Whether a capability meets a version range such as ">=7.0,<7.5" (targets.json)."""
    for part in spec.split(","):
        op = ">=" if part.startswith(">=") else "<"
        bound = _parse_cuda_arch(part[len(op):])
        if (cap >= bound) != (op == ">="):
            return False
    return True


# Why a single-arch selector build suits a node (prose; the ranges and build numbers are
# in targets.json).
_SELECTOR_WHY = {
    "sm75": lambda cap: ("Turing: native sm_75 kernels" if cap < (8, 0) else
                         "Ampere or newer: sm7x FA2 is refused at run time there unless forced "
                         f"({FORCE_ENV}); the sm75 library is the one whose PTX runs fast when "
                         "forced, and it also serves Turing nodes sharing the environment"),
    "sm70": lambda cap: ("Volta; __cuda_arch is the lowest GPU of the node, so this build also "
                         "installs the libraries of newer archs the channel has (a node mixing "
                         "V100 and RTX 8000 runs native code on each)"),
}


def selector_pick(cuda_arch: str | None, built_archs: Iterable[str] = ARCHS) -> SelectorPick:
    """The sm7x-fa2 build a solver takes for ``cuda_arch`` (None: no __cuda_arch).

    built_archs: the FA2 libraries the channel's variant builds (default: all). A solver
    takes the highest build number whose dependencies hold.
    """
    wanted = set(built_archs)
    built = tuple(a for a in ARCHS if a in wanted)
    if not built:
        raise ValueError(f"built_archs {sorted(wanted)!r} names no FA2 arch; valid values: "
                         f"{', '.join(ARCHS)}")
    oldest = "%d.%d" % _targets.capability(built[0])
    fallback_build = _targets.fallback_build(every_arch=built == ARCHS)
    everything = tuple(package_name(a) for a in built)
    if cuda_arch is None:
        return SelectorPick("all", fallback_build, everything, None,
                            "no __cuda_arch (no GPU, or the override is empty): the fallback "
                            "build installs every FA2 library, so the environment works on "
                            "any Volta or Turing node")
    cap = _parse_cuda_arch(cuda_arch)
    for arch in sorted(built, key=_targets.selector_build, reverse=True):
        spec, build = _targets.selector_cuda_arch(arch), _targets.selector_build(arch)
        if _satisfies(cap, spec):
            packages = tuple(package_name(a) for a in _targets.selector_installs(arch) if a in built)
            return SelectorPick(arch, build, packages, cuda_arch,
                                f"__cuda_arch {cuda_arch} satisfies {spec} (build {build}): "
                                f"{_SELECTOR_WHY[arch](cap)}")
    if cap >= _parse_cuda_arch(oldest):
        # e.g. a Turing node on a channel built for sm_70 only: the fallback still fits
        return SelectorPick("all", fallback_build, everything, cuda_arch,
                            f"__cuda_arch {cuda_arch}: no build for it in this channel, the "
                            f"fallback (build {fallback_build}) fits (it needs __cuda_arch >={oldest})")
    return SelectorPick(None, None, (), cuda_arch,
                        f"__cuda_arch {cuda_arch} is below {oldest}, the oldest GPU this "
                        "channel has kernels for: the solve fails (sm7x needs Volta or newer)")


def covering_archs(device: Device) -> tuple[str, ...]:
    """The FA2 libraries whose code runs on ``device`` natively or as same-major SASS."""
    if device.capability[0] != 7:
        return ()
    return tuple(a for a in ARCHS if device.capability >= _targets.capability(a))
