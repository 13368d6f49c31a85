"""Repack a .conda so that its bytes depend on what was built, not on when or where.

A .conda is a stored zip of metadata.json, pkg-*.tar.zst (the files) and info-*.tar.zst
(the metadata). Both tars are rewritten member by member, in their order, with
- every member time SOURCE_DATE_EPOCH, owner root, mode 0644 or 0755 (from the exec bit),
- in info/: index.json's timestamp SOURCE_DATE_EPOCH (milliseconds), the rendered recipe's
  build time likewise, the build directory's id (rattler-build_<name>_<time>) dropped, the
  build machine's directories (machine_paths: output directory, source tree) replaced by
  fixed names, of the build machine's virtual packages the kernel, CPU and driver
  (__linux, __archspec, __cuda*) left out (they do not enter the build), and the map of
  staged libraries to packages, which rattler-build writes in hash order, sorted, and the
  run exports (index.json's depends / constrains, the rendered recipe's run_export items),
  which it lists in no fixed order, sorted, and the records of every resolved environment
  (the rendered recipe's `resolved:` lists), which come in the solver's varying order,
  sorted,
- the host prefix (rattler-build pads it to 255 bytes, and a file that holds it is listed
  in paths.json with it as prefix_placeholder, replaced at install time) replaced by a fixed
  one of the same length in those files and in paths.json, whose sha256s (of those files
  and of the symlinks that lead to them) are updated,
then compressed again with one pinned zstd (zstandard), one thread, a fixed level.
Normalizing a normalized package gives the same bytes.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import posixpath
import re
import shutil
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

import zstandard

from . import ZIP_EPOCH

LEVEL = 3  # zstd's default; on python 3.12's files 0.8 s and 44 MB, level 15 57 s and 39 MB
PREFIX_LEN = 255  # rattler-build's host prefix length, placeholder padding included
FIXED_PREFIX = ("/sm7x-build/host_env" + "_placehold" * 26)[:PREFIX_LEN]
_BUILD_ID = re.compile(r"(rattler-build_[^/\s'\"]+?)_\d{9,}(?=[/\s'\"]|$)", re.M)
_BUILD_TIME = re.compile(r"^(  timestamp: )\S+$", re.M)  # build_configuration.timestamp
_MACHINE_VPKG = re.compile(r"^\s*- (__linux|__archspec|__cuda|__cuda_arch)=.*\n", re.M)
_INDEX_TIME = re.compile(r'("timestamp":\s*)\d+')
# maps rattler-build writes in hash order: their "    key: value" lines, sorted
_HASH_ORDERED = re.compile(r"^(staging_library_name_map:\n(?:  \S.*:\n)?)((?:    .*\n)+)", re.M)
# run exports, which rattler-build lists in no fixed order: in the rendered recipe a run of
# "- spec / from / run_export" items (sorted as items), in index.json depends/constrains
_RUN_EXPORT_ITEM = r"- spec: .*\n(?P=ind)  from: .*\n(?P=ind)  run_export: .*\n"
_RUN_EXPORTS = re.compile(r"^(?P<ind> *)" + _RUN_EXPORT_ITEM + r"(?:(?P=ind)" + _RUN_EXPORT_ITEM + r")*", re.M)


# lists whose order is the solver's, not the recipe's: the records of each resolved
# environment (finalized_dependencies and finalized_cache_dependencies, build and host)
_SOLVER_ORDERED_KEYS = ("resolved",)


def _sort_solver_lists(text: str) -> str:
    """Sorts the items of every YAML block list under a key of _SOLVER_ORDERED_KEYS, each
    item (its "- " line and the lines indented under it) as one block of text. The solver
    returns the same records in an order that varies from build to build."""
    lines = text.splitlines(True)
    out, i = [], 0
    while i < len(lines):
        line = lines[i]
        out.append(line)
        i += 1
        key = line.strip()
        if not (key.endswith(":") and key[:-1] in _SOLVER_ORDERED_KEYS):
            continue
        ind = line[:len(line) - len(line.lstrip())]
        items: list[str] = []
        while i < len(lines) and lines[i].startswith(ind + "- "):
            j = i + 1
            while j < len(lines) and lines[j].startswith(ind + "  "):
                j += 1
            items.append("".join(lines[i:j]))
            i = j
        out.extend(sorted(items))
    return "".join(out)


def _sorted_run_exports(m: re.Match) -> str:
    lines = m.group(0).splitlines(True)
    return "".join(sorted("".join(lines[i:i + 3]) for i in range(0, len(lines), 3)))


def normalize(pkg: Path, *, epoch: int, paths: dict[str, str]) -> None:
    """Repack `pkg` in place (see the module doc); `paths`: machine directory -> fixed name."""
    pkg = Path(pkg)
    with zipfile.ZipFile(pkg) as zf, tempfile.TemporaryDirectory(prefix="sm7x-repack-", dir=pkg.parent) as tmp:
        names = zf.namelist()
        info_name = next((n for n in names if n.startswith("info-")), None)
        if info_name is None or not all(n == "metadata.json" or n.endswith(".tar.zst") for n in names):
            raise ValueError(f"{pkg}: not a .conda archive (members {names})")
        info = _read_tar(zf, info_name)
        prefix = _host_prefix(info)
        placeholders = _placeholder_files(info, prefix)
        files, new_sha, links = {name: Path(tmp) / name for name in names}, {}, {}
        for name in names:
            if name == "metadata.json":
                files[name].write_bytes(zf.read(name))
            elif name != info_name:  # the info tar goes last: it needs the files' new sha256s
                with zf.open(name) as src, open(files[name], "wb") as out:
                    new_sha.update(_repack(src, out, epoch, prefix, placeholders, links))
        # paths.json gives a symlink the sha256 of the file it leads to
        new_sha.update({link: new_sha[target] for link in links
                        if (target := _resolve(link, links)) in new_sha})
        with open(files[info_name], "wb") as out:
            _write_tar(out, ((m, _info(m, data, epoch, paths, prefix, new_sha)) for m, data in info), epoch)
        new = Path(tmp) / "repacked.conda"
        date = time.gmtime(max(epoch, ZIP_EPOCH))[:6]
        with zipfile.ZipFile(new, "w", zipfile.ZIP_STORED) as out_zip:
            for name in names:
                zinfo = zipfile.ZipInfo(name, date)
                zinfo.external_attr = 0o644 << 16
                zinfo.create_system = 3
                zinfo.file_size = files[name].stat().st_size
                with open(files[name], "rb") as src, out_zip.open(zinfo, "w", force_zip64=zinfo.file_size > 2**31) as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
        os.replace(new, pkg)


def normalize_channel(directory: Path, *, epoch: int, paths: dict[str, str]) -> None:
    """normalize() every package of a channel directory that a build is still writing to,
    and drop its repodata.json, which rattler-build indexes anew before its next build."""
    for pkg in sorted(Path(directory).glob("*/*.conda")):
        normalize(pkg, epoch=epoch, paths=paths)
    for index in Path(directory).glob("*/repodata.json"):
        index.unlink()


def _read_tar(zf: zipfile.ZipFile, name: str) -> list[tuple[tarfile.TarInfo, bytes | None]]:
    with zf.open(name) as raw, _decompress(raw) as stream, tarfile.open(fileobj=stream, mode="r|") as tar:
        return [(m, tar.extractfile(m).read() if m.isfile() else None) for m in tar]


def _decompress(raw):
    return zstandard.ZstdDecompressor(max_window_size=2**31).stream_reader(raw, read_across_frames=True)


def _host_prefix(info) -> str | None:
    """The build's host prefix: from the rendered recipe, else from paths.json."""
    files = {m.name: d for m, d in info}
    found = set()
    recipe = files.get("info/recipe/rendered_recipe.yaml")
    if recipe is not None:
        found |= set(re.findall(r"^\s*host_prefix: (\S+)$", recipe.decode("utf-8", "replace"), re.M))
    if "info/paths.json" in files:
        found |= {e.get("prefix_placeholder") for e in json.loads(files["info/paths.json"]).get("paths", [])}
    found = {p for p in found if p and len(p) == PREFIX_LEN}
    if len(found) > 1:
        raise ValueError(f"more than one host prefix in the package's metadata: {sorted(found)}")
    return found.pop() if found else None


def _placeholder_files(info, prefix) -> set[str]:
    if prefix is None:
        return set()
    data = dict((m.name, d) for m, d in info)["info/paths.json"]
    return {e["_path"] for e in json.loads(data)["paths"] if e.get("prefix_placeholder") == prefix}


def _info(member, data, epoch, paths, prefix, new_sha):
    if data is None:
        return data
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return data
    if prefix:
        text = text.replace(prefix, FIXED_PREFIX)
    for path, name in sorted(paths.items(), key=lambda kv: -len(kv[0])):
        text = text.replace(path, name)
    text = _BUILD_ID.sub(r"\1", text)
    if member.name == "info/index.json":
        text = _INDEX_TIME.sub(rf"\g<1>{epoch * 1000}", text)
        doc = json.loads(text)
        for key in ("depends", "constrains"):
            if isinstance(doc.get(key), list):
                doc[key] = sorted(doc[key])
        text = json.dumps(doc, indent=2)
    elif member.name == "info/recipe/rendered_recipe.yaml":
        iso = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))
        text = _BUILD_TIME.sub(rf"\g<1>{iso}", text)
        text = _MACHINE_VPKG.sub("", text)
        text = _HASH_ORDERED.sub(lambda m: m.group(1) + "".join(sorted(m.group(2).splitlines(True))), text)
        text = _RUN_EXPORTS.sub(_sorted_run_exports, text)
        text = _sort_solver_lists(text)
    elif member.name == "info/paths.json" and new_sha:
        doc = json.loads(text)
        for entry in doc.get("paths", []):
            entry["sha256"] = new_sha.get(entry["_path"], entry.get("sha256"))
        text = json.dumps(doc, indent=2)
    return text.encode("utf-8")


def _resolve(path: str, links: dict[str, str]) -> str:
    """Where a symlink of the package leads, through other symlinks of it."""
    for _ in range(40):
        if path not in links:
            return path
        path = posixpath.normpath(posixpath.join(posixpath.dirname(path), links[path]))
    return path


def _repack(src, out, epoch: int, prefix: str | None, placeholders: set[str], links: dict) -> dict[str, str]:
    """Rewrite one payload tar.zst into `out`, streaming every file but those that hold the
    host prefix; returns their new sha256s, and adds the symlinks to `links`."""
    changed = {}

    def members():
        with _decompress(src) as stream, tarfile.open(fileobj=stream, mode="r|") as tar:
            for m in tar:
                if m.issym():
                    links[m.name] = m.linkname
                if m.isfile() and m.name in placeholders:
                    data = tar.extractfile(m).read().replace(prefix.encode(), FIXED_PREFIX.encode())
                    changed[m.name] = hashlib.sha256(data).hexdigest()
                    yield m, data
                else:
                    yield m, tar.extractfile(m) if m.isfile() else None

    _write_tar(out, members(), epoch)
    return changed


def _write_tar(f, members, epoch: int) -> None:
    """members: (TarInfo, bytes, a file object or None)."""
    cctx = zstandard.ZstdCompressor(level=LEVEL, threads=0, write_checksum=True)
    with cctx.stream_writer(f, closefd=False) as zst, \
            tarfile.open(fileobj=zst, mode="w|", format=tarfile.PAX_FORMAT, encoding="utf-8") as tar:
        for m, data in members:
            size = len(data) if isinstance(data, bytes) else m.size if data is not None else 0
            tar.addfile(_header(m, epoch, size), io.BytesIO(data) if isinstance(data, bytes) else data)


def _header(m: tarfile.TarInfo, epoch: int, size: int) -> tarfile.TarInfo:
    n = tarfile.TarInfo(m.name)
    n.type, n.linkname, n.size = m.type, m.linkname, size if m.isfile() else 0
    n.mtime, n.uid, n.gid, n.uname, n.gname = epoch, 0, 0, "", ""
    n.mode = 0o777 if m.issym() else (0o755 if m.isdir() or m.mode & 0o111 else 0o644)
    n.pax_headers = {}
    return n
