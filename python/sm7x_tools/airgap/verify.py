"""`verify`: check a bundle or any channel directory before it crosses the air gap.

A copy to removable media or a mirror can lose, truncate or alter files, and nobody on the
other side can fetch them again. Every problem is reported, not just the first:

- each subdir's repodata.json parses; every listed file exists with the recorded size,
  sha256 and md5; every package file on disk is listed; each package's own info/index.json
  (read by rattler) agrees with its record;
- every file is accounted for: a package or repodata.json of an indexed subdir whose name
  is a conda platform, the channel's .sm7x-stamp, and for a bundle the files bundle.json
  lists. A stray file, a package under a subdir no client reads (osx-64/ without a
  repodata.json), an @EXPLICIT file of no environment of the bundle: each is a problem, as
  verify cannot say what it is or vouch for it;
- every dependency is satisfiable by some package of the channel, or of `--with` channels
  (virtual packages, `__*`, excepted; ./airgap.sh adds the bootstrap channel for a channel);
- with `--against SOURCE`, every package of the source channel (or bundle) must be here
  with the source's sha256, and every package here must be one of the source's: a mirror
  altered and re-indexed agrees with itself, not with it;
- for a bundle, the hashes are also checked against the records that do not live in the
  channel: pixi.lock, envs/*.txt and bundle.json. Someone who alters a package and
  re-indexes passes a repodata-only check; these independent records still catch it. Every
  URL of pixi.lock and of every envs/*.txt must be a package file of the bundle's channel
  (its base URL + `/<subdir>/<file>`, nothing else). Each environment's package list
  must be the same in pixi.lock and envs/NAME.txt (and, with `--against` a bundle, in the
  source bundle's): a line added or removed with bundle.json and SHA256SUMS sealed again
  agrees with its own hashes, not with the other records. A symbolic link is refused:
  what it points to is not in what verify checked. pixi.toml must say what bundle.json's
  environments give (compared as TOML): pixi runs a manifest's activation scripts and
  tasks, and `pixi install --frozen` installs the lock whatever else it says. Each
  environment is then solved again, offline, from the bundle's channel with its recorded
  virtual packages, and must give the packages of the lock.
"""

from __future__ import annotations

import json
import re
import time
import tomllib
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote

from rattler import Channel, IndexJson, LockFile, MatchSpec, RepoData, Subdir
from rattler.explicit_environment import ExplicitEnvironmentSpec

from ..channel import STAMP, is_channel, require_channel
from ..envs import RATTLER_ERRORS, solve
from ..hashing import Digest, file_digest
from . import (
    PACKAGE_SUFFIXES,
    SHA256SUMS,
    READ_ERRORS,
    AirgapError,
    is_package,
    read_json,
    short,
    subdirs,
    url_to_path,
)

FIX_CHANNEL = "copy it again from the source channel, then verify again"
FIX_BUNDLE = "copy the bundle again from where it was made, or re-make it (./airgap.sh bundle)"
FIX_INDEX = "re-index the channel (./airgap.sh merge NEW DIR writes an indexed copy) or copy it again"
FIX_STRAY = ("remove it: verify vouches only for what a record lists (repodata.json, bundle.json); if it "
             "belongs there, re-index the channel or re-make the bundle")
PLATFORMS = {str(p) for p in Subdir.all()}  # the subdir names a conda client reads
# what a bundle URL may name below its channel: <subdir>/<package file>, nothing that leaves it
_URL_TAIL = re.compile(r"[a-z0-9-]+/[^/]+\.(conda|tar\.bz2)")


@dataclass
class Problem:
    file: str
    problem: str
    fix: str


@dataclass
class Report:
    root: Path
    kind: str  # "bundle" or "channel"
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    packages: int = 0
    bytes: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems


class _Verifier:
    def __init__(self, root: Path, with_channels: list[Path], resolve: bool):
        self.root = root
        self.with_channels = [require_channel(Path(c), "--with channel") for c in with_channels]
        self.resolve = resolve
        self.bundle = (root / "bundle.json").exists()
        self.channel = root / "channel" if self.bundle else root
        self.report = Report(root, "bundle" if self.bundle else "channel")
        self.fix = FIX_BUNDLE if self.bundle else FIX_CHANNEL
        self._digests: dict[Path, Digest | None] = {}
        # relative path -> [(source file, detail, sha256, size)]
        self.expect: dict[str, list[tuple[str, str, str, int | None]]] = defaultdict(list)
        self.pool = []  # RepoDataRecords of the verified channel
        self.manifest: dict | None = None
        self.lock_envs: dict[str, list] = {}
        self.accounted = {self.rel(self.channel / STAMP)}  # files a record lists; ./build.sh's stamp
        self.reported: set[str] = set()  # files already named by a problem of their own
        self.against: set[str] | None = None  # with --against: the package files of the sources
        # per environment: the package files its pixi.lock entry and its envs/NAME.txt name
        self.lock_files: dict[str, set[str]] = {}
        self.explicit_files: dict[str, set[str]] = {}
        # with --against a bundle: the same, from the source bundle ("--against DIR")
        self.ref_envs: dict[str, dict[str, set[str]]] = {}

    def rel(self, path: Path) -> str:
        return str(path.relative_to(self.root))

    def problem(self, path: Path | str, text: str, fix: str | None = None) -> None:
        where = self.rel(path) if isinstance(path, Path) else path
        self.report.problems.append(Problem(where, text, fix or self.fix))

    def digest(self, path: Path) -> Digest | None:
        if path not in self._digests:
            self._digests[path] = file_digest(path) if path.is_file() else None
        return self._digests[path]

    # --- the channel ---------------------------------------------------------------------

    def check_channel(self) -> None:
        if not is_channel(self.channel):
            self.problem(self.channel, "no linux-64/ or noarch/ repodata.json: not an indexed channel", FIX_INDEX)
            return
        for sub in subdirs(self.channel):
            self.check_subdir(sub)

    def check_subdir(self, sub: Path) -> None:
        repodata = sub / "repodata.json"
        self.accounted.add(self.rel(repodata))
        if sub.name not in PLATFORMS:
            self.problem(sub, f"{sub.name}/ is not a conda platform subdir: no client reads it, and what it "
                              "holds was not installed by anyone", FIX_STRAY)
        if not repodata.is_file():
            self.problem(sub, "no repodata.json: clients cannot see this subdir (every subdir needs one, "
                              "noarch included)", FIX_INDEX)
            listed = {}
        else:
            try:
                data = json.loads(repodata.read_text())
                listed = {**data.get("packages", {}), **data.get("packages.conda", {})}
                self.pool += RepoData.from_path(repodata).into_repo_data(Channel(self.channel.as_uri()))
            except READ_ERRORS as exc:
                self.problem(repodata, f"does not parse: {exc}", FIX_INDEX)
                listed = {}
        for fn, rec in sorted(listed.items()):
            path = sub / fn
            self.expect[self.rel(path)].append((self.rel(repodata), "", rec.get("sha256"), rec.get("size")))
            self.accounted.add(self.rel(path))
            if rec.get("subdir") not in (None, sub.name):
                self.problem(path, f"{self.rel(repodata)} records it for subdir {rec['subdir']!r}, but it lies in "
                                   f"{sub.name}/", FIX_INDEX)
            got = self.digest(path)
            if got is None:
                continue  # reported with the expectations
            self.report.packages += 1
            self.report.bytes += got.size
            if rec.get("md5") and rec["md5"] != got.md5 and rec.get("sha256") == got.sha256:
                self.problem(path, f"md5 {got.md5} differs from {rec['md5']} in {self.rel(repodata)}", FIX_INDEX)
            self.check_index_json(path, rec, self.rel(repodata))
        for path in sorted(p for p in sub.iterdir() if is_package(p) and p.name not in listed):
            self.reported.add(self.rel(path))
            self.problem(path, f"package file not listed in {self.rel(repodata)}: no client will ever install it",
                         "remove it, or re-index the channel if it belongs there")

    def read(self, path: Path, what: str, reader):
        """reader(path), or None and a problem when the file does not parse as `what`."""
        try:
            return reader(path)
        except READ_ERRORS as exc:
            self.problem(path, f"cannot be read as {what} ({str(exc).strip()})")
            return None

    def check_index_json(self, path: Path, rec: dict, source: str) -> None:
        ij = self.read(path, "a conda package", IndexJson.from_package_archive)
        if ij is None:
            return
        got = {"name": ij.name.normalized, "version": str(ij.version), "build": str(ij.build),
               "build_number": ij.build_number, "subdir": ij.subdir,
               "depends": sorted(ij.depends), "constrains": sorted(ij.constrains)}
        want = {"name": rec.get("name"), "version": rec.get("version"), "build": rec.get("build"),
                "build_number": rec.get("build_number", 0), "subdir": rec.get("subdir"),
                "depends": sorted(rec.get("depends", [])), "constrains": sorted(rec.get("constrains", []))}
        for key, value in got.items():
            if value != want[key]:
                self.problem(path, f"info/index.json has {key} {value!r}, {source} says {want[key]!r}"
                                   + (" (a channel with repodata patches differs here on purpose)"
                                      if key in ("depends", "constrains") else ""))

    # --- independent records of a bundle -------------------------------------------------

    def read_bundle(self) -> None:
        try:
            self.manifest = read_json(self.root / "bundle.json")
            base = self.manifest["channel_url"].rstrip("/")
            envs = self.manifest["environments"]
            files = self.manifest["files"]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            self.problem(self.root / "bundle.json", f"does not parse as a bundle manifest ({exc})")
            self.manifest = None
            return
        self.accounted |= {"bundle.json", SHA256SUMS}
        for rel, rec in files.items():
            self.expect[rel].append(("bundle.json", "", rec.get("sha256"), rec.get("size")))
            self.accounted.add(rel)
        if base.startswith("file://") and url_to_path(base) != self.channel:
            self.report.notes.append(f"this bundle's URLs point at {base}, but it lies at {self.root}: "
                                     f"on the target, put it at {url_to_path(base).parent} (or re-make it with "
                                     "--base-url for where it will be served)")
        self.read_sha256sums(self.root / SHA256SUMS)
        self.read_lock(base, set(envs))
        for name in envs:
            self.read_explicit(self.root / "envs" / f"{name}.txt", base)
        # an @EXPLICIT file of no environment: `conda create --file` would install what it says
        for path in sorted((self.root / "envs").glob("*.txt")):
            if path.stem not in envs:
                self.reported.add(self.rel(path))
                self.problem(path, "an @EXPLICIT file of no environment in bundle.json: this bundle did not make "
                                   "it, and conda would install whatever it names", FIX_STRAY)
                self.read_explicit(path, base)

    def url_rel(self, url: str, base: str) -> str | None:
        """channel/<subdir>/<file> for a URL of a package of the bundle's channel, else None
        (another host or path, or a `..` that leaves the channel)."""
        url, base = unquote(url), unquote(base)
        tail = url[len(base) + 1:] if url.startswith(base + "/") else ""
        return "channel/" + tail if _URL_TAIL.fullmatch(tail) and ".." not in tail.split("/") else None

    def read_lock(self, base: str, env_names: set[str]) -> None:
        path = self.root / "pixi.lock"
        lock = self.read(path, "a pixi lock file", LockFile.from_path)
        self.lock_envs = {name: [r for recs in env.conda_repodata_records().values() for r in recs]
                          for name, env in lock.environments()} if lock else {}
        for name in sorted(env_names - set(self.lock_envs)):
            self.problem(path, f"has no environment {name!r}, which bundle.json lists")
        for name, records in self.lock_envs.items():
            for rec in records:
                rel = self.url_rel(rec.url, base)
                if rel is None:
                    self.problem(path, f"environment {name!r}: {rec.url} is outside the bundle's channel {base}")
                    continue
                self.expect[rel].append(("pixi.lock", name, rec.sha256.hex() if rec.sha256 else None, rec.size))
                self.lock_files.setdefault(name, set()).add(rel)

    def read_sha256sums(self, path: Path) -> None:
        if not path.is_file():
            self.problem(path, "missing: the air-gapped side checks the bundle with sha256sum -c against it")
            return
        for line in path.read_text().splitlines():
            sha, sep, rel = line.partition("  ")
            if not sep or len(sha) != 64:
                self.problem(path, f"line {line!r} is not '<sha256>  <file>'")
                continue
            if rel.startswith("/") or ".." in rel.split("/"):
                self.problem(path, f"line {line!r} names a file outside the bundle")
                continue
            self.expect[rel].append((SHA256SUMS, "", sha, None))

    def read_explicit(self, path: Path, base: str) -> None:
        if not path.is_file():
            return  # a missing file is reported through bundle.json
        spec = self.read(path, "an @EXPLICIT file", ExplicitEnvironmentSpec.from_path)
        if spec is None:
            return
        for entry in spec.packages:
            url, _, frag = entry.url.partition("#")
            rel = self.url_rel(url, base)
            if rel is None:
                self.problem(path, f"{url} is outside the bundle's channel {base}")
                continue
            self.explicit_files.setdefault(path.stem, set()).add(rel)
            sha = frag.removeprefix("sha256:")  # CEP 23 allows the prefix; we write none
            if len(sha) != 64:
                self.problem(path, f"{url}: no #<sha256> after the URL", FIX_BUNDLE)
                sha = None
            self.expect[rel].append((self.rel(path), "", sha, None))

    def compare(self) -> None:
        """Every recorded hash against the file as it is now, grouped by what each record expects."""
        for rel, records in sorted(self.expect.items()):
            got = self.digest(self.root / rel)
            if got is None:
                self.problem(rel, f"missing; listed in {_sources(records)}")
                continue
            by_sha = defaultdict(list)
            for rec in records:
                if rec[2] is not None:
                    by_sha[rec[2]].append(rec)
            for sha, recs in by_sha.items():
                if sha == got.sha256:
                    continue
                sizes = {r[3] for r in recs if r[3] is not None}
                size = f" (size {got.size}, recorded {sizes.pop()})" if sizes and got.size not in sizes else ""
                self.problem(rel, f"sha256 is {short(got.sha256)} but {short(sha)} is expected by "
                                  f"{_sources(recs)}{size}: the file changed after it was recorded")

    def compare_environments(self) -> None:
        """Each environment's package list in pixi.lock and in envs/NAME.txt must be the
        same, and (with --against a bundle) the source bundle's: a line added to or removed
        from one record, with bundle.json and SHA256SUMS sealed again, agrees with its own
        hashes but not with the other records."""
        for name in sorted(self.manifest["environments"] if self.manifest else []):
            lock, explicit = self.lock_files.get(name, set()), self.explicit_files.get(name, set())
            records = {"pixi.lock": lock, f"envs/{name}.txt": explicit}
            for ref, envs in self.ref_envs.items():
                for what, files in envs.get(name, {}).items():
                    records[f"{ref} {what}"] = files
            for ref, envs in self.ref_envs.items():
                if name not in envs:
                    self.problem(f"envs/{name}.txt", f"environment {name!r} is not in {ref}")
            first = f"envs/{name}.txt"
            for what, files in records.items():
                if what == first or files == explicit:
                    continue
                diff = [f"+{Path(f).name}" for f in sorted(explicit - files)] + \
                       [f"-{Path(f).name}" for f in sorted(files - explicit)]
                self.problem(first, f"environment {name!r} lists other packages than {what}: "
                                    f"{' '.join(diff)}")

    def check_pixi_toml(self) -> None:
        """pixi.toml must say what bundle.json's environments give (bundle.pixi_toml), compared
        as TOML (comments and layout aside). pixi runs a manifest's activation scripts and
        tasks, and `pixi install --frozen` installs the lock whatever else the manifest says,
        so an edit there, sealed again, would show in no other record."""
        from .bundle import EnvRequest, SolvedEnv, pixi_toml

        path = self.root / "pixi.toml"
        self.accounted.add(self.rel(path))
        try:
            envs = [SolvedEnv(EnvRequest(name, list(e["specs"]), e.get("cuda_arch")), list(e["virtual_packages"]))
                    for name, e in self.manifest["environments"].items()]
            want = tomllib.loads(pixi_toml(envs, self.manifest["channel_url"]))
        except (KeyError, TypeError, AttributeError, ValueError, StopIteration, *RATTLER_ERRORS) as exc:
            self.problem(self.root / "bundle.json", f"its environments do not make a pixi manifest ({exc})")
            return
        try:
            got = tomllib.loads(path.read_text())
        except FileNotFoundError:
            self.problem(path, "is missing (bundle.json lists it)")
            return
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            self.problem(path, f"does not parse as TOML ({exc})")
            return
        diff = _toml_differences(got, want)
        if diff:
            self.problem(path, "is not the manifest of the environments bundle.json records: "
                               + "; ".join(diff[:6]) + (f" (+{len(diff) - 6} more)" if len(diff) > 6 else ""))

    # --- dependencies and the offline solve ----------------------------------------------

    def check_dependencies(self) -> None:
        pool = list(self.pool)
        for ch in self.with_channels:
            for sub in subdirs(ch):
                if (sub / "repodata.json").is_file():
                    pool += RepoData.from_path(sub / "repodata.json").into_repo_data(Channel(ch.as_uri()))
        by_name = defaultdict(list)
        for rec in pool:
            by_name[rec.name.normalized].append(rec)
        where = "this channel" + (" or the --with channels" if self.with_channels else "")
        for rec in self.pool:
            for dep in rec.depends:
                try:
                    spec = MatchSpec(dep)
                except RATTLER_ERRORS as exc:
                    self.problem(self._pkg_rel(rec), f"dependency {dep!r} does not parse ({exc})", FIX_INDEX)
                    continue
                name = spec.name.normalized
                if name.startswith("__"):
                    continue
                found = any(spec.matches(c) for c in by_name.get(name, [])
                            if rec.subdir == "noarch" or c.subdir in (rec.subdir, "noarch"))
                if not found:
                    self.problem(self._pkg_rel(rec), f"depends on {dep!r}, which no package in {where} provides",
                                 "copy the package that provides it into this channel, or name the channel "
                                 "that has it with --with DIR")

    def _pkg_rel(self, rec) -> str:
        return self.rel(self.channel / rec.subdir / rec.file_name)

    def resolve_envs(self) -> None:
        if not self.manifest or not self.lock_envs:
            return
        for name, env in self.manifest["environments"].items():
            locked = {r.file_name for r in self.lock_envs.get(name, [])}
            try:
                records = solve([self.channel], env["specs"], env["virtual_packages"])
            except RATTLER_ERRORS as exc:
                self.problem("pixi.lock", f"environment {name!r} no longer solves offline from the bundle's "
                                          f"channel: {str(exc).strip()}")
                continue
            solved = {r.file_name for r in records}
            if solved != locked:
                diff = [f"+{f}" for f in sorted(solved - locked)] + [f"-{f}" for f in sorted(locked - solved)]
                self.problem("pixi.lock", f"environment {name!r}: an offline solve from the bundle's channel "
                                          f"differs from the lock: {' '.join(diff)}")

    def read_reference(self, ref: Path) -> None:
        """--against: the source channel's (or bundle's) records, kept apart from this copy.

        A mirror whose package was altered and then re-indexed agrees with itself; it
        cannot agree with the repodata.json of the channel it was copied from.
        """
        ref_channel = ref / "channel" if (ref / "bundle.json").exists() else ref
        prefix = "channel/" if self.bundle else ""
        if self.bundle and (ref / "bundle.json").exists():
            self.ref_envs[f"--against {ref}"] = _bundle_environments(ref)
        self.against = self.against or set()
        for sub in subdirs(ref_channel):
            repodata = sub / "repodata.json"
            try:
                data = json.loads(repodata.read_text())
            except (OSError, ValueError) as exc:
                raise AirgapError(f"--against {ref}: cannot read {repodata} ({exc})") from None
            for fn, rec in {**data.get("packages", {}), **data.get("packages.conda", {})}.items():
                self.expect[f"{prefix}{sub.name}/{fn}"].append(
                    (f"--against {repodata}", "", rec.get("sha256"), rec.get("size")))
                self.against.add(f"{prefix}{sub.name}/{fn}")

    def check_unaccounted(self) -> None:
        """Every file (and link) under the directory must be one a record accounts for."""
        for path in sorted(self.root.rglob("*")):
            rel = self.rel(path)
            if path.is_symlink():  # what it points to lies outside what verify vouches for
                self.reported.add(rel)
                self.problem(path, f"a symbolic link (to {path.readlink()}): verify checks only files that lie "
                                   "in the directory", "replace the link by the file itself (cp -L), then verify again")
                continue
            if path.is_dir():
                continue
            if is_package(path) and self.against is not None and rel in self.accounted and rel not in self.against:
                self.problem(path, "a package that no --against source has: it was added to this copy",
                             "remove it, or give the source it came from with --against")
            if rel in self.accounted or rel in self.reported:
                continue
            if path.name.endswith(PACKAGE_SUFFIXES):
                indexed = (path.parent / "repodata.json").is_file() and path.parent.parent == self.channel
                folder = "the top level" if path.parent == self.root else f"{self.rel(path.parent)}/"
                where = (f"{folder} is not an indexed subdir of the channel" if not indexed
                         else f"{folder}repodata.json does not list it")
                self.problem(path, f"a package file no client installs from here ({where}); it was not checked",
                             "remove it; packages belong in an indexed subdir (linux-64/, noarch/)")
            else:
                records = "bundle.json" if self.bundle else "repodata.json"
                self.problem(path, f"not accounted for: no {records} lists it and it is no file these tools write",
                             FIX_STRAY)

    def run(self, against: list[Path] = ()) -> Report:
        start = time.monotonic()
        self.check_channel()
        if self.bundle:
            self.read_bundle()
        for ref in against:
            self.read_reference(ref)
        if self.bundle:
            self.compare_environments()
            if self.manifest is not None:
                self.check_pixi_toml()
        self.compare()
        self.check_unaccounted()
        self.check_dependencies()
        if self.bundle and self.resolve:
            self.resolve_envs()
        self.report.seconds = time.monotonic() - start
        return self.report


def _bundle_environments(bundle: Path) -> dict[str, dict[str, set[str]]]:
    """A bundle's environments: name -> {"pixi.lock": files, "envs/NAME.txt": files}, the
    package files as channel/<subdir>/<file> (what --against compares)."""
    out: dict[str, dict[str, set[str]]] = defaultdict(dict)
    try:
        lock = LockFile.from_path(bundle / "pixi.lock")
        for name, env in lock.environments():
            out[name]["pixi.lock"] = {_channel_rel(r.url) for recs in env.conda_repodata_records().values()
                                      for r in recs}
        for path in sorted((bundle / "envs").glob("*.txt")):
            spec = ExplicitEnvironmentSpec.from_path(path)
            out[path.stem][f"envs/{path.stem}.txt"] = {_channel_rel(e.url.partition("#")[0])
                                                       for e in spec.packages}
    except READ_ERRORS as exc:
        raise AirgapError(f"--against {bundle}: cannot read its environments ({exc})") from None
    return out


def _toml_differences(got, want, where: str = "") -> list[str]:
    """What a parsed TOML document has that the expected one lacks, and the reverse, as
    dotted keys: ["activation.scripts added", "dependencies.sm7x is '*', not '0.1.0'"]."""
    if isinstance(got, dict) and isinstance(want, dict):
        out = []
        for key in sorted(set(got) | set(want)):
            at = f"{where}.{key}" if where else key
            if key not in want:
                out.append(f"{at} added")
            elif key not in got:
                out.append(f"{at} missing")
            else:
                out += _toml_differences(got[key], want[key], at)
        return out
    return [] if got == want else [f"{where or 'the document'} is {got!r}, not {want!r}"]


def _channel_rel(url: str) -> str:
    """channel/<subdir>/<file> of a package URL (the last two path parts)."""
    parts = unquote(url).rstrip("/").split("/")
    return "channel/" + "/".join(parts[-2:])


def _sources(records) -> str:
    """[("pixi.lock", "a"), ("pixi.lock", "b"), ("bundle.json", "")] -> "pixi.lock (envs a, b), bundle.json"."""
    details: dict[str, list[str]] = {}
    for source, detail, *_ in records:
        details.setdefault(source, [])
        if detail and detail not in details[source]:
            details[source].append(detail)
    parts = []
    for source, ds in details.items():
        parts.append(f"{source} ({'env' if len(ds) == 1 else 'envs'} {', '.join(sorted(ds))})" if ds else source)
    return ", ".join(parts)


def verify(directory: Path, with_channels: list[Path] = (), resolve: bool = True,
           against: list[Path] = ()) -> Report:
    root = Path(directory).resolve()
    if not root.is_dir():
        raise AirgapError(f"{root} is not a directory")
    if not (root / "bundle.json").exists() and not is_channel(root):
        raise AirgapError(f"{root} is neither a bundle (no bundle.json) nor a channel (no linux-64/ or noarch/ "
                          "with a repodata.json)")
    refs = []
    for ref in against:
        ref = Path(ref).resolve()
        if not (ref / "bundle.json").exists() and not is_channel(ref):
            raise AirgapError(f"--against {ref} is neither a bundle nor an indexed channel: give the channel "
                              "this directory was copied from")
        refs.append(ref)
    return _Verifier(root, list(with_channels), resolve).run(refs)


def print_report(report: Report) -> None:
    from rich.markup import escape
    from rich.table import Table

    from ..ui import console

    for note in report.notes:
        console.print(f"[yellow]note:[/] {escape(note)}")
    what = f"{report.kind} {report.root}: {report.packages} packages, {report.bytes / 1e6:.1f} MB, " \
           f"checked in {report.seconds:.1f} s"
    if report.ok:
        console.print(f"[green]verified[/] {what}; no problems")
        return
    table = Table(title=f"{len(report.problems)} problem(s) in {report.kind} {report.root}", show_lines=True)
    table.add_column("file", overflow="fold")
    table.add_column("problem", overflow="fold")
    table.add_column("what to do", overflow="fold")
    for p in report.problems:
        table.add_row(escape(p.file), escape(p.problem), escape(p.fix))
    console.print(table)
    console.print(f"[bold red]verify failed:[/] {what}")
