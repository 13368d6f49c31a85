"""``python -m sm7x doctor``: what is installed and which FA2 library each GPU would use.

Gathering (``collect``, a plain dict) is kept apart from printing so that tests can
inject fake devices and ``--json`` can hand the same facts to scripts and bug reports.
torch is imported only here, and any failure to import it is reported, not raised.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterable

from . import __version__, _core_loader, _install_hints, _libfile
from ._planner import sched_module
from ._select import (
    FORCE_ENV,
    LIBRARY_PATH_ENV,
    Device,
    UnsupportedDeviceError,
    library_path,
    library_search,
    ARCHS,
    CUDA_ARCH_OVERRIDE_ENV,
    CUDA_OVERRIDE_ENV,
    arch_override_dropped,
    covering_archs,
    node_cuda_arch,
    package_name,
    required_packages,
    select_fa2_library,
    selector_pick,
)

PACKAGE_DIR = Path(__file__).resolve().parent


def _torch_info() -> tuple[dict, list[Device] | None]:
    """torch's version and, if it has CUDA, its devices (None: ask nvidia-smi)."""
    try:
        import torch
    except Exception as exc:  # a broken torch must not break the doctor
        missing = isinstance(exc, ModuleNotFoundError) and exc.name == "torch"
        error = None if missing else f"{type(exc).__name__}: {exc}"
        return {"installed": False, "error": error}, None
    info = {"installed": True, "version": getattr(torch, "__version__", "?"),
            "cuda": getattr(torch.version, "cuda", None), "error": None}
    try:
        if not torch.cuda.is_available():
            return info, None
        cuda = torch.cuda
        devices = [Device(i, cuda.get_device_name(i), tuple(cuda.get_device_capability(i)))
                   for i in range(cuda.device_count())]
    except Exception as exc:
        info["error"] = f"torch.cuda: {type(exc).__name__}: {exc}"
        return info, None
    return info, devices


def query_nvidia_smi() -> tuple[list[Device] | None, str | None]:
    """(devices, error) from nvidia-smi; (None, None) when the binary is absent."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None, None
    cmd = [exe, "--query-gpu=index,name,compute_cap", "--format=csv,noheader"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"nvidia-smi: {exc}"
    if out.returncode != 0:  # e.g. no driver loaded, or a driver too old for compute_cap
        return None, f"nvidia-smi exited {out.returncode}: {(out.stderr or out.stdout).strip()}"
    devices = []
    for line in out.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 3:
            continue
        try:  # the name could contain a comma: index first, capability last
            major, minor = parts[-1].split(".")
            devices.append(Device(int(parts[0]), ", ".join(parts[1:-1]), (int(major), int(minor))))
        except ValueError:
            return None, f"nvidia-smi: cannot parse {line!r}"
    return devices, None


def _installed_packages(prefix: Path) -> dict:
    """sm7x packages known to conda (conda-meta) and to pip (dist-info)."""
    conda = []
    for meta in sorted((prefix / "conda-meta").glob("sm7x*.json")):
        try:
            rec = json.loads(meta.read_text())
        except (OSError, ValueError):
            continue
        if str(rec.get("name", "")).startswith("sm7x"):
            conda.append({k: rec.get(k) for k in ("name", "version", "build", "channel")})
    pip = []
    try:
        dist = importlib.metadata.distribution("sm7x")
        pip.append({"name": "sm7x", "version": dist.version,
                    "installer": (dist.read_text("INSTALLER") or "").strip() or None})
    except importlib.metadata.PackageNotFoundError:
        pass
    return {"conda": conda, "pip": pip}


def _native_libraries(package_dir: Path) -> list[dict]:
    return [{"file": str(p.relative_to(package_dir)), "size": p.stat().st_size,
             "problem": _libfile.problem(p)}
            for p in sorted(package_dir.rglob("*.so")) if p.is_file()]


def _core_report(warnings: list[str]) -> dict:
    """Where the core library would load from, and whether that file can load."""
    path, skipped = _core_loader.core_library_search()
    bad = _libfile.problem(path) if path is not None else None
    for d in skipped:
        warnings.append(f"cannot search {d} (from {LIBRARY_PATH_ENV}): skipped")
    if bad is not None:
        warnings.append(f"{path} cannot be loaded: {bad}; copy it again or reinstall "
                        f"{_core_loader.PACKAGE}")
    return {"path": str(path) if path else None, "problem": bad}


def _sched_report(warnings: list[str]) -> dict:
    """Whether sm7x._sched (the serving calls' split-KV planner, package sm7x-ext) imports."""
    try:
        return {"path": sched_module().__file__, "problem": None}
    except ImportError as e:
        warnings.append(str(e))
        return {"path": None, "problem": str(e.__cause__ or e)}


def _gpu_report(device: Device, warnings: list[str]) -> dict:
    entry = {"index": device.index, "name": device.name,
             "capability": "%d.%d" % device.capability}
    try:
        sel = select_fa2_library(device)
    except (UnsupportedDeviceError, ValueError) as exc:
        entry["fa2"] = {"error": str(exc)}  # shown with the GPU, not repeated as a warning
        return entry
    path, skipped = library_search(sel.arch)
    bad = _libfile.problem(path) if path is not None else None
    fa2 = {"arch": sel.arch, "package": sel.package, "library": sel.library,
           "namespace": sel.namespace, "reason": sel.reason, "forced": sel.forced,
           "installed": path is not None and bad is None, "path": str(path) if path else None,
           "problem": bad}
    for d in skipped:
        warnings.append(f"cuda:{device.index}: cannot search {d} (from {LIBRARY_PATH_ENV}) "
                        f"for {sel.library}: skipped")
    if bad is not None:
        warnings.append(f"cuda:{device.index}: {path} cannot be loaded: {bad}; copy it again "
                        f"or reinstall {sel.package}")
    elif path is None:
        hint = _install_hints.install_hint(sel.package)
        if sel.fallback and library_path(sel.fallback):
            # sm_70 code runs on 7.5, so the GPU works, just not with native kernels.
            fa2["fallback"] = sel.fallback
            warnings.append(f"cuda:{device.index}: {sel.package} is not installed; the "
                            f"{sel.fallback} library that is installed also runs here, but "
                            f"for native kernels {hint}")
        else:
            installed = [a for a in ARCHS if library_path(a)]
            have = ", ".join(package_name(a) for a in installed) or "none"
            warnings.append(f"cuda:{device.index} ({device.name}, {entry['capability']}) is not "
                            f"covered by the installed FA2 libraries (installed: {have}): {hint}")
    entry["fa2"] = fa2
    return entry


def collect(devices: Iterable[Device] | None = None, *, prefix: str | Path | None = None,
            package_dir: str | Path | None = None) -> dict:
    """All doctor facts as a JSON-able dict; ``devices`` replaces GPU detection."""
    warnings: list[str] = []
    torch_info, torch_devices = _torch_info()
    smi_error = None
    if devices is not None:
        devices, source = list(devices), "caller"
    elif torch_devices is not None:
        devices, source = torch_devices, "torch"
    else:
        devices, smi_error = query_nvidia_smi()
        source = "nvidia-smi" if devices is not None else None
        devices = devices or []
    package_dir = Path(package_dir) if package_dir else PACKAGE_DIR
    packages = _installed_packages(Path(prefix) if prefix else Path(sys.prefix))
    return {
        "sm7x": {"version": __version__, "location": str(package_dir),
                 "packaged_by": _install_hints.PACKAGED_BY},
        "python": {"version": platform.python_version(), "executable": sys.executable},
        "torch": torch_info,
        "environment": {k: os.environ.get(k) for k in (FORCE_ENV, LIBRARY_PATH_ENV,
                                                       "CUDA_VISIBLE_DEVICES")},
        "packages": packages,
        "libraries": _native_libraries(package_dir),
        "core": _core_report(warnings),
        "sched": _sched_report(warnings),
        "gpu_source": source,
        "gpu_error": smi_error,
        "gpus": [_gpu_report(d, warnings) for d in devices],
        "node": {"required_packages": sorted(required_packages(devices)),
                 "uncovered_gpus": [d.index for d in devices if _uncovered(d)],
                 "mixed": len(required_packages(devices)) > 1},
        "solver": _solver_report(devices, packages, warnings,
                                 detect_client(Path(prefix) if prefix else Path(sys.prefix))),
        "integrations": _integrations(),
        "warnings": warnings,
    }


def _integrations() -> dict:
    """Which frameworks sm7x plugs into here, from their installed metadata (none imported)."""
    from importlib import metadata

    try:
        version = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return {"transformers": {"installed": False}}
    major = version.split(".")[0]
    usable = major.isdigit() and int(major) >= 5
    how = ("import sm7x.integrations.transformers, then attn_implementation='sm7x' (fp16; "
           "continuous batching: 'paged|sm7x')" if usable
           else "too old: sm7x's integration needs transformers >= 5.0")
    return {"transformers": {"installed": True, "version": version, "usable": usable,
                             "how": how}}


# conda reads __cuda_arch only through this plugin (CEP 46); mamba, micromamba and pixi
# detect it themselves
CUDA_ARCH_PLUGIN = "nvidia-virtual-packages"
PLUGIN_INSTALL = f"conda install -n base {CUDA_ARCH_PLUGIN}"


def _history_command(prefix: Path) -> tuple[str | None, str | None]:
    """(tool, its executable) of the last ``# cmd:`` in the environment's conda-meta/history
    (conda and micromamba write one per transaction), e.g. ("conda", "/opt/conda/bin/conda")."""
    try:
        lines = (prefix / "conda-meta" / "history").read_text(errors="replace").splitlines()
    except OSError:
        return None, None
    cmds = [l[len("# cmd:"):].split() for l in lines if l.startswith("# cmd:")]
    cmds = [c for c in cmds if c]
    if not cmds:
        return None, None
    exe = cmds[-1][0]
    name = Path(exe).name
    # conda's history names the script that ran: bin/conda, or conda/__main__.py under python -m
    if name in ("__main__.py", "conda-script.py") and "conda" in exe:
        name = "conda"
    return name, exe


def _conda_base(exe: str | None, environ) -> Path | None:
    """conda's installation (base env) from $CONDA_EXE or the history's executable."""
    for cand in (environ.get("CONDA_EXE"), exe):
        if cand and Path(cand).name in ("conda", "__main__.py", "conda-script.py"):
            path = Path(cand).resolve()
            for up in path.parents:
                if (up / "conda-meta").is_dir():
                    return up
    return None


def detect_client(prefix: Path, environ=None) -> dict:
    """Which client made this environment, and whether it sees __cuda_arch (CEP 46).

    From the environment itself: pixi's marker (conda-meta/pixi), else the last command in
    conda-meta/history, else $CONDA_EXE / $MAMBA_EXE. conda sees __cuda_arch only with the
    nvidia-virtual-packages plugin in its base environment (looked up in base's conda-meta);
    without it conda installs the fallback sm7x-fa2 build ('all'), whatever the GPUs.
    """
    environ = os.environ if environ is None else environ
    tool, exe = _history_command(prefix)
    if (prefix / "conda-meta" / "pixi").exists() or "PIXI_ENVIRONMENT_NAME" in environ:
        return {"name": "pixi", "sees_cuda_arch": True, "how": "pixi detects __cuda_arch itself"}
    if tool in ("mamba", "micromamba"):
        return {"name": tool, "sees_cuda_arch": True, "how": f"{tool} detects __cuda_arch itself"}
    if tool is None and environ.get("MAMBA_EXE") and not environ.get("CONDA_EXE"):
        name = Path(environ["MAMBA_EXE"]).name
        return {"name": name, "sees_cuda_arch": True, "how": f"{name} detects __cuda_arch itself"}
    if tool == "conda" or (tool is None and environ.get("CONDA_EXE")):
        base = _conda_base(exe, environ)
        if base is None:
            return {"name": "conda", "sees_cuda_arch": None, "base": None,
                    "how": f"conda's installation was not found here, so whether it has the "
                           f"{CUDA_ARCH_PLUGIN} plugin is unknown"}
        plugin = sorted(base.glob(f"conda-meta/{CUDA_ARCH_PLUGIN}-[0-9]*.json"))
        if plugin:
            return {"name": "conda", "sees_cuda_arch": True, "base": str(base),
                    "how": f"conda at {base} has the {CUDA_ARCH_PLUGIN} plugin ({plugin[-1].stem})"}
        return {"name": "conda", "sees_cuda_arch": False, "base": str(base),
                "how": f"conda at {base} has no {CUDA_ARCH_PLUGIN} plugin: it sees no "
                       f"__cuda_arch and ignores CONDA_OVERRIDE_CUDA_ARCH"}
    return {"name": tool, "sees_cuda_arch": None,
            "how": "the client that made this environment is not known"}


def _uncovered(device: Device) -> bool:
    """A Volta/Turing GPU that none of the installed FA2 libraries can run on."""
    archs = covering_archs(device)
    return bool(archs) and not any(library_path(a) for a in archs)


def _solver_report(devices: list[Device], packages: dict, warnings: list[str],
                   client: dict | None = None) -> dict:
    """Which sm7x-fa2 build a solve on this node takes, and why (CEP 46): the client that
    made the environment (detect_client) decides whether __cuda_arch exists at all."""
    try:
        arch, source = node_cuda_arch(devices)
    except ValueError as exc:
        warnings.append(f"{CUDA_ARCH_OVERRIDE_ENV}: {exc}")
        return {"error": str(exc)}
    if arch_override_dropped(devices):
        warnings.append(f"{CUDA_ARCH_OVERRIDE_ENV} is set but {CUDA_OVERRIDE_ENV} is not: on a "
                        f"node without a GPU driver pixi, rattler-based tools and conda's "
                        f"{CUDA_ARCH_PLUGIN} plugin then see no __cuda_arch at all and install "
                        f"the fallback; set {CUDA_OVERRIDE_ENV}=12.4 (say) as well")
    installed = next((p for p in packages["conda"] if p["name"] == "sm7x-fa2"), None)
    installed_variant = str(installed["build"]).split("_")[0] if installed else None
    if client and client.get("sees_cuda_arch") is False:
        # plain conda: no __cuda_arch whatever the GPUs, so the fallback
        pick = selector_pick(None)
        return {"cuda_arch": None, "cuda_arch_source": f"conda without the {CUDA_ARCH_PLUGIN} plugin",
                "node_cuda_arch": arch, "client": client, "variant": pick.variant,
                "build_number": pick.build_number, "packages": list(pick.packages),
                "reason": f"{client['how']}; so it installs the fallback build, every FA2 "
                          f"library (this works: each GPU loads its own). For the build of "
                          f"this node's GPUs ({selector_pick(arch).variant if arch else 'none'}): "
                          f"{PLUGIN_INSTALL}, or use mamba/micromamba or pixi",
                "installed_variant": installed_variant}
    pick = selector_pick(arch)
    return {"cuda_arch": arch, "cuda_arch_source": source, "node_cuda_arch": arch,
            "client": client, "variant": pick.variant,
            "build_number": pick.build_number, "packages": list(pick.packages),
            "reason": pick.reason, "installed_variant": installed_variant}


def render(info: dict) -> str:
    """The human report for a ``collect`` dict."""
    t = info["torch"]
    torch_line = (f"{t['version']} (CUDA {t['cuda'] or 'none'})" if t["installed"]
                  else "not installed" + (f" ({t['error']})" if t.get("error") else ""))
    pk = info["packages"]
    pkgs = [f"{p['name']} {p['version']} ({p['build']})" for p in pk["conda"]]
    pkgs += [f"{p['name']} {p['version']} (pip, installer {p['installer']})" for p in pk["pip"]]
    lines = [
        f"sm7x      {info['sm7x']['version']} at {info['sm7x']['location']}",
        f"python    {info['python']['version']} ({info['python']['executable']})",
        f"torch     {torch_line}",
        f"packages  {', '.join(pkgs) or 'none found'}",
        "libraries " + (", ".join(f"{l['file']} ({l['size']} bytes"
                                  + (f", BROKEN: {l['problem']})" if l.get("problem") else ")")
                                  for l in info["libraries"])
                        or "none in the sm7x package directory"),
    ]
    core = info["core"]
    lines.append("core      " + (f"{core['path']}" + (f": BROKEN: {core['problem']}"
                                                      if core["problem"] else "")
                                 if core["path"] else "_core.abi3.so not found"))
    sched = info["sched"]
    lines.append("planner   " + (sched["path"] if sched["path"]
                                 else f"sm7x._sched NOT importable: {sched['problem']}"))
    lines += [f"env       {k}={v}" for k, v in info["environment"].items() if v is not None]
    if not info["gpus"]:
        why = f": {info['gpu_error']}" if info["gpu_error"] else " (no CUDA torch, no nvidia-smi)"
        lines.append(f"GPUs      none found{why}")
    else:
        lines.append(f"GPUs      (from {info['gpu_source']})")
    for g in info["gpus"]:
        lines.append(f"  cuda:{g['index']} {g['name']}, compute capability {g['capability']}")
        fa2 = g["fa2"]
        if "error" in fa2:
            lines.append(f"    FA2: refused: {fa2['error']}")
            continue
        state = (f"installed at {fa2['path']}" if fa2["installed"]
                 else f"BROKEN at {fa2['path']}: {fa2['problem']}" if fa2.get("problem")
                 else f"NOT installed (fallback {fa2['fallback']} installed)" if fa2.get("fallback")
                 else "NOT installed")
        lines += [f"    FA2: {fa2['library']} from {fa2['package']}: {state}",
                  f"    why: {fa2['reason']}"]
    if info["gpus"]:
        needs = ", ".join(info["node"]["required_packages"]) or "nothing"
        lines.append(f"node      native FA2 kernels on every GPU need: {needs}"
                     + (" (a mixed node: its lowest GPU sets __cuda_arch)" if info["node"].get("mixed") else ""))
    lines += _render_solver(info["solver"])
    tf = info["integrations"]["transformers"]
    lines.append(f"transformers {tf['version']}: {tf['how']}" if tf["installed"]
                 else "transformers not installed (sm7x.integrations.transformers needs >= 5.0)")
    lines += [f"warning:  {w}" for w in info["warnings"]]
    return "\n".join(lines)


def _render_solver(solver: dict) -> list[str]:
    if "error" in solver:
        return [f"solver    cannot tell: {solver['error']}"]
    arch = solver["cuda_arch"] or "absent"
    picks = (f"sm7x-fa2 build '{solver['variant']}' -> {', '.join(solver['packages'])}"
             if solver["variant"] else "nothing: the solve fails")
    client = solver.get("client") or {}
    who = client.get("name") or "a client with __cuda_arch (mamba, micromamba, pixi, conda + plugin)"
    lines = [f"client    {client['name'] or 'unknown'}: {client['how']}"] if client else []
    lines += [f"solver    __cuda_arch {arch} ({solver['cuda_arch_source']}): installing sm7x "
              f"with {who} picks {picks}", f"    why: {solver['reason']}"]
    inst = solver["installed_variant"]
    if client.get("sees_cuda_arch") is None and client:
        lines.append(f"    note: if conda made it, conda needs the {CUDA_ARCH_PLUGIN} plugin for "
                     f"__cuda_arch ({PLUGIN_INSTALL}); without it, it installs the fallback 'all'")
    if inst == "all" and solver["variant"] != "all":
        lines.append("    note: this environment has the fallback build 'all' (solved without "
                     "__cuda_arch, e.g. on a login node): every FA2 library, this node included")
    elif inst and inst != solver["variant"]:
        lines.append(f"    note: this environment has sm7x-fa2 build '{inst}': it was solved "
                     f"for other GPUs (another node, or {CUDA_ARCH_OVERRIDE_ENV})")
    return lines


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m sm7x`` and the ``sm7x`` console script."""
    import argparse

    parser = argparse.ArgumentParser(prog="sm7x", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"sm7x {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    doc = sub.add_parser("doctor", help="report installed packages, GPUs and FA2 library choice")
    doc.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    info = collect()
    print(json.dumps(info, indent=2) if args.json else render(info))
    return 0  # a diagnostic: findings are reported, not turned into failures
