"""`bundle`: solve environments for the target nodes and carry exactly what they need.

A cluster's GPU nodes cannot reach a channel, and their `__cuda_arch` (CEP 46) is not this
machine's, so each environment is solved here with the target's virtual packages. The
result is one directory that installs with no network:

    OUT/channel/{linux-64,noarch}/  the union of the solved packages, indexed by rattler
    OUT/pixi.lock                   one pixi lock environment per NAME (+ "default", see below)
    OUT/pixi.toml                   the manifest that goes with the lock (`pixi install --frozen`)
    OUT/envs/NAME.txt               conda @EXPLICIT files, `URL#<sha256 hex>` lines (CEP 23)
    OUT/bundle.json                 manifest: tools, source channels, specs, virtual packages,
                                    sha256 and size of every file
    OUT/SHA256SUMS                  the same hashes for `sha256sum -c` (no tools needed there)

URLs point at `file://<OUT>/channel` (copy OUT to the same path on the other side) or at
`--base-url`, where OUT/channel will be served. The lock's "default" environment is the
environment named "default" if there is one, else a copy of the first one given.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import yaml
from rattler import (
    LockChannel,
    LockFile,
    LockPlatform,
    MatchSpec,
    PackageRecord,
    RepoDataRecord,
)

from ..channel import require_channel
from ..envs import RATTLER_ERRORS, node_packages, solve
from ..hashing import Digest, file_digest
from . import (
    FORMAT,
    SHA256SUMS,
    FORMAT_VERSION,
    AirgapError,
    index,
    read_json,
    tool_versions,
    url_to_path,
)

PLATFORM = "linux-64"
_NAME = re.compile(r"^[a-z0-9][a-z0-9-]*$")
_SPEC_SPLIT = re.compile(r",\s*(?=[A-Za-z_])")  # a comma that starts a new package name


@dataclass
class EnvRequest:
    name: str
    specs: list[str]
    cuda_arch: str | None = None


@dataclass
class SolvedEnv:
    request: EnvRequest
    virtual_packages: list[str]
    records: list = field(default_factory=list)
    solve_s: float = 0.0

    @property
    def size(self) -> int:
        return sum(r.size or 0 for r in self.records)


@dataclass
class BundleResult:
    out: Path
    channel_url: str
    envs: list[SolvedEnv]
    packages: int
    size: int
    seconds: float


# --- requests ------------------------------------------------------------------------------

def split_specs(text: str) -> list[str]:
    """`sm7x,python >=3.10,<3.12` -> ["sm7x", "python >=3.10,<3.12"]."""
    return [s.strip() for s in _SPEC_SPLIT.split(text) if s.strip()]


def _check_request(req: EnvRequest) -> EnvRequest:
    if not _NAME.match(req.name):
        raise AirgapError(f"environment name {req.name!r}: use lowercase letters, digits and dashes "
                          "(pixi's rule), e.g. --env t4-nodes=sm7x,python=3.11")
    if not req.specs:
        raise AirgapError(f"environment {req.name!r} has no specs, e.g. --env {req.name}=sm7x,python=3.11")
    for spec in req.specs:
        try:
            MatchSpec(spec)
        except RATTLER_ERRORS as exc:
            raise AirgapError(f"environment {req.name!r}: {spec!r} is not a valid match spec ({exc})") from None
    return req


def requests_from_args(env_args: list[str], arch_args: list[str], envs_file: Path | None) -> list[EnvRequest]:
    """From `--env NAME=SPEC,...`, `--cuda-arch NAME=7.5` and `--envs FILE.yaml`."""
    reqs: dict[str, EnvRequest] = {}
    if envs_file is not None:
        for req in _requests_from_yaml(Path(envs_file)):
            reqs[req.name] = req
    for item in env_args:
        name, sep, specs = item.partition("=")
        if not sep:
            raise AirgapError(f"--env {item!r}: write NAME=SPEC[,SPEC...], e.g. --env t4-nodes=sm7x,python=3.11")
        if name.strip() in reqs:
            raise AirgapError(f"environment {name.strip()!r} is given twice")
        reqs[name.strip()] = EnvRequest(name.strip(), split_specs(specs))
    for item in arch_args:
        name, sep, arch = item.partition("=")
        if not sep or name.strip() not in reqs:
            known = ", ".join(reqs) or "none given"
            raise AirgapError(f"--cuda-arch {item!r}: write NAME=X.Y for an environment given with --env "
                              f"(environments: {known})")
        reqs[name.strip()].cuda_arch = None if arch.strip().lower() in ("", "none") else arch.strip()
    if not reqs:
        raise AirgapError("no environments: give --env NAME=SPEC[,SPEC...] or --envs FILE.yaml")
    return [_check_request(r) for r in reqs.values()]


def _requests_from_yaml(path: Path) -> list[EnvRequest]:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise AirgapError(f"--envs {path}: not a text file (not UTF-8); it takes a YAML "
                          f"file") from None
    except (OSError, yaml.YAMLError) as exc:
        raise AirgapError(f"--envs {path}: cannot read it ({exc})") from None
    envs = (data or {}).get("environments") if isinstance(data, dict) else None
    if not isinstance(envs, dict) or not envs:
        raise AirgapError(f"--envs {path}: expected `environments: {{NAME: {{specs: [...], cuda_arch: \"7.5\"}}}}`")
    out = []
    form = "{NAME: {specs: [SPEC, ...], cuda_arch: \"7.5\"}}"
    for name, body in envs.items():
        body = body or {}
        if not isinstance(body, dict):
            raise AirgapError(f"--envs {path}: environment {name!r} is a "
                              f"{type(body).__name__}; write it as a mapping: {form}")
        specs = body.get("specs", [])
        if isinstance(specs, str):
            specs = split_specs(specs)
        elif isinstance(specs, list) and all(isinstance(s, (str, int, float)) for s in specs):
            specs = [str(s) for s in specs]
        else:
            raise AirgapError(f"--envs {path}: specs of {name!r} must be a list of package "
                              f"specs or a comma-separated string, got {specs!r}")
        arch = body.get("cuda_arch")
        out.append(EnvRequest(str(name), specs, None if arch in (None, "", "none") else str(arch)))
    return out


# --- solve ---------------------------------------------------------------------------------

def with_pip(req: EnvRequest) -> EnvRequest:
    """The request with pip added (unless it names pip): conda gives an environment with
    python pip of its own accord (add_pip_as_python_dependency), but an @EXPLICIT file or a
    lock installs only what it lists, and `pip list` / `pip check` are what users reach for."""
    if any(MatchSpec(s).name.normalized == "pip" for s in req.specs):
        return req
    return EnvRequest(req.name, [*req.specs, "pip"], req.cuda_arch)


def solve_env(req: EnvRequest, channels: list[Path], cuda: str, glibc: str | None) -> SolvedEnv:
    vpkgs = node_packages(req.cuda_arch, cuda=cuda, glibc=glibc)
    env = SolvedEnv(req, vpkgs)
    t0 = time.monotonic()
    try:
        env.records = solve(channels, req.specs, vpkgs)
    except RATTLER_ERRORS as exc:
        target = f"__cuda_arch {req.cuda_arch}" if req.cuda_arch else "no GPU (login node)"
        raise AirgapError(
            f"environment {req.name!r} ({', '.join(req.specs)}) cannot be solved for {target} from "
            f"{', '.join(str(c) for c in channels)}:\n  {str(exc).strip()}\n"
            "Check the specs; is the package built (./build.sh)? Add the channel that has it with --channel DIR."
        ) from None
    env.solve_s = time.monotonic() - t0
    return env


# --- writing -------------------------------------------------------------------------------

def _copy(src: Path, dst: Path, hardlink: bool) -> Digest:
    if hardlink:
        try:
            os.link(src, dst)
            return file_digest(dst)
        except OSError:
            pass  # another filesystem: copy
    shutil.copyfile(src, dst)
    os.chmod(dst, 0o644)  # rattler-build writes 0600; a mirror's web server must read them
    return file_digest(dst)


def _collect(envs: list[SolvedEnv]) -> dict[tuple[str, str], RepoDataRecord]:
    union: dict[tuple[str, str], RepoDataRecord] = {}
    for env in envs:
        for rec in env.records:
            key = (rec.subdir, rec.file_name)
            prev = union.get(key)
            if prev is not None and prev.sha256 != rec.sha256:
                raise AirgapError(f"{rec.subdir}/{rec.file_name} comes from two channels with different "
                                  f"content ({prev.channel} and {rec.channel}); drop one of them from --channel")
            union[key] = rec
    return union


def _copy_packages(union, channel_dir: Path, hardlink: bool) -> None:
    for (sub, fn), rec in sorted(union.items()):
        src = url_to_path(rec.url)
        (channel_dir / sub).mkdir(parents=True, exist_ok=True)
        got = _copy(src, channel_dir / sub / fn, hardlink)
        want = rec.sha256.hex() if rec.sha256 else None
        if want and got.sha256 != want:
            raise AirgapError(f"{src} has sha256 {got.sha256[:12]}… but its channel's repodata.json says "
                              f"{want[:12]}…: the source channel is damaged. Check it with "
                              f"./airgap.sh verify {src.parent.parent}, then rebuild it (./build.sh)")


def _rebase(rec, channel_url: str) -> RepoDataRecord:
    return RepoDataRecord(rec, rec.file_name, f"{channel_url}/{rec.subdir}/{rec.file_name}", channel_url)


def _write_lock(path: Path, envs: list[SolvedEnv], channel_url: str) -> None:
    lock = LockFile([LockPlatform(PLATFORM)])
    platform = LockPlatform(PLATFORM)
    names = [(e.request.name, e) for e in envs]
    if not any(n == "default" for n, _ in names):
        names.append(("default", envs[0]))
    for name, env in names:
        lock.set_channels(name, [LockChannel(channel_url)])
        for rec in env.records:
            lock.add_conda_package(name, platform, _rebase(rec, channel_url))
    lock.to_path(path)


def _write_explicit(path: Path, env: SolvedEnv, channel_url: str, created: str, tools: dict) -> None:
    req = env.request
    lines = [
        f"# sm7x air-gap bundle, environment {req.name}: a conda explicit file (no solve at install).",
        f"# specs: {', '.join(req.specs)}",
        f"# target virtual packages: {' '.join(env.virtual_packages)}",
        f"# made {created} by ./airgap.sh bundle (sm7x {tools['sm7x']}, py-rattler {tools['py-rattler']})",
        "# Each line is URL#<sha256, 64 hex> (CEP 23). conda (26.7.1 checked) compares it for http(s)",
        "# URLs but NOT for file:// URLs: verify a file:// bundle first (./airgap.sh verify BUNDLE, or",
        "# cd BUNDLE && sha256sum -c SHA256SUMS), or serve its channel/ over http (bundle --base-url).",
        "# conda older than 24.9 cannot parse the lines ('Could not parse explicit URL'): use pixi.lock.",
        f"# install: conda create -n {req.name} --file {req.name}.txt   (or micromamba create -n {req.name} -f ...)",
        f"# platform: {PLATFORM}",
        "@EXPLICIT",
    ]
    by_name = {r.name.normalized: r for r in env.records}
    for rec in PackageRecord.sort_topologically(env.records):
        rec = by_name[rec.name.normalized]
        lines.append(f"{channel_url}/{rec.subdir}/{rec.file_name}#{rec.sha256.hex()}")
    path.write_text("\n".join(lines) + "\n")


def _toml_deps(specs: list[str]) -> list[str]:
    out = []
    for spec in specs:
        ms = MatchSpec(spec)
        ver = str(ms.version) if ms.version is not None else "*"
        if ms.build is not None:
            out.append(f"{ms.name.normalized} = {{ version = {json.dumps(ver)}, build = {json.dumps(str(ms.build))} }}")
        else:
            out.append(f"{ms.name.normalized} = {json.dumps(ver)}")
    return out


def pixi_toml(envs: list[SolvedEnv], channel_url: str) -> str:
    """The manifest matching pixi.lock: one feature and environment per NAME, `default` as in
    the lock. A function of what bundle.json records (names, specs, virtual packages,
    channel URL), so verify can write it again and compare: pixi runs a manifest's
    activation scripts and tasks, which no other record of the bundle would show."""
    default = next((e for e in envs if e.request.name == "default"), envs[0])
    lines = [
        "# The pixi manifest that goes with pixi.lock (written by ./airgap.sh bundle).",
        "# Install without solving or network: pixi install --frozen -e NAME",
        "# pixi.lock is lock format v7 (py-rattler 0.28): pixi >= 0.71 reads it. That pixi parses",
        "# [system-requirements] as deprecated and maps it onto platforms.",
        "[workspace]",
        'name = "sm7x-airgap"',
        f"channels = [{json.dumps(channel_url)}]",
        f'platforms = ["{PLATFORM}"]',
        "",
        f"[dependencies]  # the default environment: {default.request.name}",
        *_toml_deps(default.request.specs),
    ]
    if default.request.cuda_arch:
        lines += ["", "[system-requirements]", f'cuda = "{_cuda_version(default)}"']
    named = [e for e in envs if e.request.name != "default"]
    for env in named:
        lines += ["", f"[feature.{env.request.name}.dependencies]", *_toml_deps(env.request.specs)]
        if env.request.cuda_arch:
            lines += ["", f"[feature.{env.request.name}.system-requirements]", f'cuda = "{_cuda_version(env)}"']
    if named:
        lines += ["", "[environments]"]
        lines += [f'{e.request.name} = {{ features = ["{e.request.name}"], no-default-feature = true }}' for e in named]
    return "\n".join(lines) + "\n"


def _cuda_version(env: SolvedEnv) -> str:
    return next(v.split("=")[1] for v in env.virtual_packages if v.startswith("__cuda="))


def _manifest(root: Path, envs, channels, channel_url, created, tools) -> dict:
    files = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        d = file_digest(path)
        files[str(path.relative_to(root))] = {"sha256": d.sha256, "size": d.size}
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "created": created,
        "tools": tools,
        "source_channels": [str(c) for c in channels],
        "channel_url": channel_url,
        "platform": PLATFORM,
        "environments": {
            e.request.name: {
                "specs": e.request.specs,
                "cuda_arch": e.request.cuda_arch,
                "virtual_packages": e.virtual_packages,
                "solve_seconds": round(e.solve_s, 3),
                "explicit_file": f"envs/{e.request.name}.txt",
                "packages": [{"file": f"channel/{r.subdir}/{r.file_name}", "sha256": r.sha256.hex(), "size": r.size}
                             for r in sorted(e.records, key=lambda r: r.file_name)],
            } for e in envs
        },
        "files": files,
    }


def _write_sha256sums(root: Path) -> None:
    """`sha256sum -c SHA256SUMS` checks the bundle on a node that has nothing but coreutils."""
    lines = [f"{file_digest(p).sha256}  {p.relative_to(root)}"
             for p in sorted(root.rglob("*")) if p.is_file() and p.name != SHA256SUMS]
    (root / SHA256SUMS).write_text("\n".join(lines) + "\n")


def is_bundle(path: Path) -> bool:
    try:
        return read_json(path / "bundle.json").get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def bundle(out: Path, requests: list[EnvRequest], channels: list[Path], base_url: str | None = None,
           cuda: str = "12.4", glibc: str | None = None, hardlink: bool = False) -> BundleResult:
    from . import staged

    start = time.monotonic()
    out = Path(out).resolve()
    channels = [require_channel(Path(c)) for c in channels]
    if base_url is not None and not re.match(r"^(https?|file)://", base_url):
        raise AirgapError(f"--base-url {base_url!r}: give the URL OUT/channel will be served at, "
                          "e.g. https://mirror.example/sm7x or file:///shared/sm7x/channel")
    channel_url = base_url.rstrip("/") if base_url else (out / "channel").as_uri()
    envs = [solve_env(with_pip(r), channels, cuda, glibc) for r in requests]
    union = _collect(envs)
    created = datetime.now(timezone.utc).isoformat(timespec="seconds")
    tools = tool_versions()
    with staged(out, is_bundle) as tmp:
        _copy_packages(union, tmp / "channel", hardlink)
        index(tmp / "channel")
        _write_lock(tmp / "pixi.lock", envs, channel_url)
        (tmp / "pixi.toml").write_text(pixi_toml(envs, channel_url))
        (tmp / "envs").mkdir()
        for env in envs:
            _write_explicit(tmp / "envs" / f"{env.request.name}.txt", env, channel_url, created, tools)
        manifest = _manifest(tmp, envs, channels, channel_url, created, tools)
        (tmp / "bundle.json").write_text(json.dumps(manifest, indent=1) + "\n")
        _write_sha256sums(tmp)
    size = sum(r.size or 0 for r in union.values())
    return BundleResult(out, channel_url, envs, len(union), size, time.monotonic() - start)


def print_summary(result: BundleResult) -> None:
    from rich.table import Table

    from ..ui import console

    table = Table(title=f"air-gap bundle: {result.out}")
    for col, just in (("environment", "left"), ("target", "left"), ("packages", "right"), ("size", "right"),
                      ("solve", "right")):
        table.add_column(col, justify=just)
    for env in result.envs:
        req = env.request
        table.add_row(req.name, f"__cuda_arch {req.cuda_arch}" if req.cuda_arch else "no GPU (fallback)",
                      str(len(env.records)), f"{env.size / 1e6:.1f} MB", f"{env.solve_s * 1000:.1f} ms")
    table.add_section()
    table.add_row("channel/", "union", str(result.packages), f"{result.size / 1e6:.1f} MB", "")
    console.print(table)
    out = result.out
    local = result.channel_url.startswith("file://")
    where = (f"copy {out} to the same path there (its URLs are file://{out}/channel)" if local
             else f"serve {out}/channel at {result.channel_url}")
    console.print(f"bundle written in {result.seconds:.1f} s. On the air-gapped side, {where}; then:", soft_wrap=True)
    for env in result.envs:
        n = env.request.name
        console.print(f"  [bold]{n}[/]\n"
                      f"    pixi:       mkdir {n} && cp {out}/pixi.toml {out}/pixi.lock {n}/ && "
                      f"cd {n} && pixi install --frozen -e {n}\n"
                      f"    conda:      conda create -n {n} --file {out}/envs/{n}.txt   (conda >= 24.9; "
                      f"{'it does not check the sha256 of file:// URLs: verify first' if local else 'it checks the sha256s over http(s)'})\n"
                      f"    micromamba: micromamba create -n {n} -f {out}/envs/{n}.txt", soft_wrap=True)
    console.print(f"  check it first, before any install: ./airgap.sh verify {out}; where only coreutils "
                  f"exist: cd {out} && sha256sum -c --quiet {SHA256SUMS}", soft_wrap=True)
