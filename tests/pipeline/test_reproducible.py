"""Reproducible packages (sm7x_tools.repro): two builds of one commit, in two directories at
two times, give the same .conda bytes; what still differs is named.

The normalizer is tested on packages made here, as rattler-build lays them out; the real
thing (build sm7x-ext twice, compare, and compare with ./channel) runs `repro check` as CI
does.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile

import pytest
import zstandard
from sourcetree import run_tool

from sm7x_tools import REPO, bootstrap
from sm7x_tools.channel import read_stamp
from sm7x_tools.channel.digest import channel_stamp, source_digest
from sm7x_tools.hashing import file_digest
from sm7x_tools.repro import machine_paths, source_date_epoch
from sm7x_tools.repro.compare import differences
from sm7x_tools.repro.normalize import FIXED_PREFIX, PREFIX_LEN, normalize

EPOCH = 1796000000
SO = "lib/python3.12/site-packages/sm7x/_x.so"


def _tar_zst(members: dict[str, bytes], mtime: int) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode, info.uid, info.uname = len(data), mtime, 0o664, 1000, "builder"
            tar.addfile(info, io.BytesIO(data))
    return zstandard.ZstdCompressor(level=1).compress(raw.getvalue())


def _built(where, when: int, payload: bytes = b"code") -> tuple:
    """A package as rattler-build 0.73 writes it when built in `where` at time `when`."""
    out = where / "out"
    build_dir = f"{out}/bld/rattler-build_x_{when}"
    prefix = f"{build_dir}/host_env"
    prefix += ("_placehold" * 30)[:PREFIX_LEN - len(prefix)]
    so = payload + b"\0" + prefix.encode() + b"/lib\0"
    paths = {"paths": [{"_path": SO, "path_type": "hardlink", "file_mode": "binary", "prefix_placeholder": prefix,
                        "sha256": "x", "size_in_bytes": len(so)}], "paths_version": 1}
    info = {
        "info/index.json": json.dumps({"name": "x", "timestamp": when * 1000 + 123}, indent=2).encode(),
        "info/about.json": json.dumps({"channels": [f"file://{out}/", f"file://{where}/.sm7x/bootstrap/sm7x-bootstrap/"]},
                                      indent=2).encode(),
        "info/paths.json": json.dumps(paths, indent=2).encode(),
        "info/recipe/rendered_recipe.yaml": (
            f"build_configuration:\n  host_platform:\n    virtual_packages:\n    - __unix=0=0\n"
            f"    - __linux=6.{when % 7}.1=0\n    - __glibc=2.36=0\n    - __archspec=1=icelake\n"
            f"  directories:\n    host_prefix: {prefix}\n    work_dir: {build_dir}/work\n"
            f"  timestamp: 2026-12-01T19:39:{when % 60:02d}.115699017Z\n"
            f"staging_library_name_map:\n  library_to_package:\n"
            + "".join(f"    {n}.so: python\n" for n in (["b", "a", "c"] if when % 2 else ["c", "b", "a"]))).encode(),
    }
    pkg = out / "linux-64" / "x-1-h0_0.conda"
    pkg.parent.mkdir(parents=True)
    with zipfile.ZipFile(pkg, "w") as zf:
        zf.writestr("metadata.json", b'{"conda_pkg_format_version": 2}')
        zf.writestr("pkg-x-1-h0_0.tar.zst", _tar_zst({SO: so}, when))
        zf.writestr("info-x-1-h0_0.tar.zst", _tar_zst(info, when))
    return pkg, out, where


def _members(pkg) -> dict[str, bytes]:
    found = {}
    with zipfile.ZipFile(pkg) as zf:
        for name in zf.namelist():
            if name.endswith(".tar.zst"):
                raw = zstandard.ZstdDecompressor().stream_reader(zf.read(name)).read()
                with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
                    found |= {m.name: tar.extractfile(m).read() for m in tar}
    return found


def test_two_builds_in_two_places_at_two_times_give_the_same_bytes(tmp_path):
    a = _built(tmp_path / "a", 1796153958)
    b = _built(tmp_path / "second" / "tree-b", 1796160001)
    assert differences(a[0], b[0])  # as rattler-build writes them
    for pkg, out, tree in (a, b):
        normalize(pkg, epoch=EPOCH, paths=machine_paths(out, tree))
    assert differences(a[0], b[0]) == []
    assert file_digest(a[0]).sha256 == file_digest(b[0]).sha256
    files = _members(a[0])
    text = b"".join(files.values()).decode("utf-8", "replace")
    assert str(tmp_path) not in text and "rattler-build_x_" not in text and "__linux" not in text
    assert json.loads(files["info/index.json"])["timestamp"] == EPOCH * 1000
    # the host prefix is a fixed one of the same length, in the file and in paths.json,
    # whose sha256 is the file's
    [entry] = json.loads(files["info/paths.json"])["paths"]
    assert entry["prefix_placeholder"] == FIXED_PREFIX and len(FIXED_PREFIX) == PREFIX_LEN
    assert FIXED_PREFIX.encode() in files[SO] and entry["size_in_bytes"] == len(files[SO])
    assert entry["sha256"] == hashlib.sha256(files[SO]).hexdigest()
    with zipfile.ZipFile(a[0]) as zf:
        assert {i.date_time for i in zf.infolist()} == {time.gmtime(EPOCH - EPOCH % 2)[:6]}
    # normalizing again changes nothing
    before = file_digest(a[0]).sha256
    normalize(a[0], epoch=EPOCH, paths=machine_paths(*a[1:]))
    assert file_digest(a[0]).sha256 == before


def test_a_different_payload_stays_different_and_is_named(tmp_path):
    a = _built(tmp_path / "a", 1796153958)
    b = _built(tmp_path / "b", 1796153958, payload=b"other code")
    for pkg, out, tree in (a, b):
        normalize(pkg, epoch=EPOCH, paths=machine_paths(out, tree))
    diffs = differences(a[0], b[0])
    assert diffs and diffs[0].startswith(f"pkg-x-1-h0_0.tar.zst: {SO}: contents differ from byte 0"), diffs
    assert any("info/paths.json" in d and "sha256" in d for d in diffs), diffs


def test_source_date_epoch_is_the_last_commit_of_the_sources(monkeypatch):
    monkeypatch.delenv("SOURCE_DATE_EPOCH", raising=False)
    if subprocess.run(["git", "rev-parse"], cwd=REPO, capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    csrc = subprocess.run(["git", "log", "-1", "--format=%ct", "--", "csrc"], cwd=REPO, capture_output=True,
                          text=True, check=True).stdout.strip()
    if csrc:  # committed
        assert source_date_epoch([REPO / "csrc"]) == int(csrc)
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1234567890")
    assert source_date_epoch([REPO / "csrc"]) == 1234567890


def test_bootstrap_digest_names_no_checkout_path(tmp_path):
    """Two checkouts of one commit reuse each other's bootstrap channel (its stamp is this)."""
    shutil.copytree(REPO / "python" / "sm7x_tools", tmp_path / "python" / "sm7x_tools",
                    ignore=shutil.ignore_patterns("__pycache__"))
    code = "from sm7x_tools import bootstrap; print(bootstrap.digest())"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONPATH": str(tmp_path / "python")}).stdout.strip()
    assert other == bootstrap.digest()


@pytest.mark.slow
def test_sm7x_ext_rebuilds_byte_for_byte_and_equals_the_channel():
    """What CI runs: sm7x-ext (pybind11, gcc) built twice from two copies of the tree; and
    when ./channel was built from this tree, the rebuild is its package, byte for byte."""
    if not (bootstrap.CHANNEL / "noarch" / "repodata.json").exists():
        if os.environ.get("CI"):
            pytest.fail("the bootstrap channel was not built: run ./build.sh before ./test.sh")
        pytest.skip("no bootstrap channel (./build.sh builds it)")
    against = ["--against", REPO / "channel"] if _channel_is_of_this_tree() else []
    proc = run_tool("sm7x_tools.repro", "check", "--output", "sm7x-ext", "--variant", "python=3.12", *against,
                    timeout=900)
    print(proc.stdout[-3000:])
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    assert proc.stdout.count("1 of 1 package(s) the same bytes") == 1 + bool(against), proc.stdout[-3000:]


def _channel_is_of_this_tree() -> bool:
    """./channel holds what ./build.sh builds from this tree now (its stamp says so)."""
    channel = REPO / "channel"
    if not (channel / "noarch" / "repodata.json").exists():
        return False
    source = source_digest([read_stamp(bootstrap.CHANNEL) or ""])
    want = channel_stamp(source, [REPO / "variants" / "default.yaml"], [bootstrap.CHANNEL.as_uri()])
    return read_stamp(channel) == want


def test_run_exports_in_any_order_normalize_to_the_same_metadata():
    """rattler-build lists run exports (the sysroot's __glibc, g++'s libstdcxx / libgcc) in
    no fixed order: two builds differed only there, in index.json and the rendered recipe."""
    from sm7x_tools.repro import normalize as N

    items = [("__glibc >=2.28,<3.0.a0", "sysroot_linux-64"), ("libstdcxx >=12", "gxx_linux-64"),
             ("libgcc >=12", "gxx_linux-64")]

    def recipe(order):
        lines = "".join(f"    - spec: {items[i][0]}\n      from: build\n      run_export: {items[i][1]}\n"
                        for i in order)
        return ("  host:\n    specs:\n    - variant: python\n      spec: python 3.12.*\n"
                + lines + "    resolved: []\n").encode()

    def index(order):
        return json.dumps({"depends": ["python", *(items[i][0] for i in order)],
                           "timestamp": 1}, indent=2).encode()

    out = set()
    for order in ((0, 1, 2), (2, 0, 1), (1, 2, 0)):
        r = N._info(tarfile.TarInfo("info/recipe/rendered_recipe.yaml"), recipe(order), 7, {}, None, {})
        i = N._info(tarfile.TarInfo("info/index.json"), index(order), 7, {}, None, {})
        out.add((r, i))
    assert len(out) == 1
    (r, i), = out
    assert json.loads(i)["timestamp"] == 7000
    assert b"    - variant: python\n      spec: python 3.12.*\n    - spec: __glibc" in r  # others kept


def test_resolved_records_in_any_order_normalize_to_the_same_recipe():
    """The solver returns a resolved environment's records in an order that varied from
    build to build (finalized_cache_dependencies.host.resolved of a CUDA package, seen both
    ways over 3 builds): every `resolved:` list is sorted, its records kept whole."""
    import itertools
    import random

    import yaml

    from sm7x_tools.repro import normalize as N

    def record(name, deps):
        dep_lines = "".join(f"      - {d}\n" for d in deps) if deps else ""
        return (f"    - build: h0_0\n      depends:{'' if deps else ' []'}\n{dep_lines}"
                f"      name: {name}\n      run_exports:\n        strong:\n        - {name} >=1\n"
                f"      version: '1.0'\n")

    host = [record("libtorch", ["libgcc >=12"]), record("python", []),
            record("cuda-cudart", ["cuda-version 12.4.*", "libgcc"])]
    build = [record("ninja", []), record("cmake", ["libstdcxx"])]

    def recipe(h, b):
        return ("finalized_cache_dependencies:\n  build:\n    specs:\n    - source: cmake\n"
                "    - source: ninja\n    resolved:\n" + "".join(b) +
                "  host:\n    specs:\n    - source: python\n    resolved:\n" + "".join(h) +
                "finalized_cache_sources: []\n").encode()

    rng = random.Random(0)
    out = set()
    for h in itertools.permutations(host):
        b = build[:]
        rng.shuffle(b)
        out.add(N._info(tarfile.TarInfo("info/recipe/rendered_recipe.yaml"), recipe(h, b), 7, {},
                        None, {}))
    assert len(out) == 1
    (text,) = out
    doc = yaml.safe_load(text)  # still the same YAML, records whole
    original = yaml.safe_load(recipe(host, build))
    for env in ("build", "host"):
        got = doc["finalized_cache_dependencies"][env]
        want = original["finalized_cache_dependencies"][env]
        assert got["specs"] == want["specs"]  # the recipe's order is kept
        key = lambda r: r["name"]  # noqa: E731
        assert sorted(got["resolved"], key=key) == sorted(want["resolved"], key=key)
    assert doc["finalized_cache_sources"] == []
