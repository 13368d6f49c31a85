"""`python -m sm7x_tools.audit.floor`, the glibc / GCC-runtime floor check every native
package's test runs: it must fail on a library linked against this machine's glibc (which
binds dlopen and pthread_* at GLIBC_2.34), on a package that does not declare its floor,
and on an unversioned import; it passes what a 2.28 link gives."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("elftools", reason="sm7x_tools.audit needs pyelftools (tests/requirements.txt)")

from sm7x_tools.audit import floor  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TOOL_ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(
    p for p in (os.environ.get("PYTHONPATH"), str(REPO / "python")) if p))

# uses what glibc 2.34 moved into libc (dlopen, pthread_*, sem_*, shm_*), as static cudart does
MOVED = r'''
#include <dlfcn.h>
#include <pthread.h>
#include <semaphore.h>
#include <sys/mman.h>
#include <fcntl.h>
#include <string>
static void* run(void*) { return nullptr; }
extern "C" int f(const char* p) {
  pthread_t t; pthread_create(&t, nullptr, run, nullptr); pthread_join(t, nullptr);
  sem_t s; sem_init(&s, 0, 1);
  std::string name(p);
  return (dlopen(name.c_str(), RTLD_NOLOAD) != nullptr) + shm_open("/x", O_RDONLY, 0);
}
'''
# the same calls bound at the versions a glibc 2.28 link gives (x86_64's first: 2.2.5)
PINNED = "\n".join(f'__asm__(".symver {s},{s}@GLIBC_2.2.5");'
                   for s in ("dlopen", "pthread_create", "pthread_join", "sem_init", "shm_open")) + MOVED


def _lib(tmp_path: Path, name: str, source: str, *flags: str) -> Path:
    if shutil.which("g++") is None:
        pytest.skip("g++ not available")
    src = tmp_path / f"{name}.cpp"
    src.write_text(source)
    out = tmp_path / f"{name}.so"
    proc = subprocess.run(["g++", "-shared", "-fPIC", "-O1", str(src), "-o", str(out), *flags,
                           "-ldl", "-lpthread", "-lrt"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return out


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sm7x_tools.audit.floor", *args],
                          capture_output=True, text=True, env=TOOL_ENV)


def _glibc_of_this_machine() -> tuple[int, ...]:
    return tuple(int(x) for x in os.confstr("CS_GNU_LIBC_VERSION").split()[1].split("."))


def test_a_library_linked_against_this_glibc_breaks_the_floor(tmp_path):
    if _glibc_of_this_machine() < (2, 34):
        pytest.skip("this machine's glibc predates 2.34: its links do not break a 2.28 floor")
    lib = _lib(tmp_path, "moved", MOVED)
    proc = _run("--glibc", "2.28", "--gcc", "12", str(lib))
    assert proc.returncode == 1, proc.stderr
    assert "needs GLIBC_2.34, newer than GLIBC_2.28" in proc.stderr
    # and the same file passes a floor at this machine's glibc
    here = ".".join(map(str, _glibc_of_this_machine()[:2]))
    assert _run("--glibc", here, "--gcc", "12", str(lib)).returncode == 0


def test_a_library_bound_at_old_versions_passes(tmp_path):
    lib = _lib(tmp_path, "pinned", PINNED)
    proc = _run("--glibc", "2.28", "--gcc", "12", str(lib))
    assert proc.returncode == 0, proc.stderr
    record, = json.loads(_run("--glibc", "2.28", "--gcc", "12", "--json", str(lib)).stdout)
    assert tuple(map(int, record["needs"]["GLIBC"].split("."))) <= (2, 28)


def test_an_unversioned_import_fails(tmp_path):
    lib = _lib(tmp_path, "loose", 'extern "C" int made_up(); extern "C" int f() { return made_up(); }')
    proc = _run("--glibc", "2.28", "--gcc", "12", str(lib))
    assert proc.returncode == 1 and "without a symbol version" in proc.stderr and "made_up" in proc.stderr
    # torch's shims and the Python C API are provided unversioned by the process
    ok = _lib(tmp_path, "shims", 'extern "C" int aoti_torch_x(); extern "C" int PyLong_Y();'
                                 'extern "C" int f() { return aoti_torch_x() + PyLong_Y(); }')
    assert _run("--glibc", "2.28", "--gcc", "12", str(ok)).returncode == 0


def test_gcc_runtime_limits(monkeypatch):
    monkeypatch.setattr(floor, "unversioned_imports", lambda path: [])
    for gcc, needs, ok in [(12, {"libstdc++.so.6": {"GLIBCXX_3.4.30"}}, True),
                           (11, {"libstdc++.so.6": {"GLIBCXX_3.4.30"}}, False),
                           (12, {"libstdc++.so.6": {"CXXABI_1.3.14"}}, False),
                           (12, {"libgcc_s.so.1": {"GCC_12.0.0"}}, True),
                           (12, {"libgcc_s.so.1": {"GCC_13.0.0"}}, False)]:
        monkeypatch.setattr(floor, "version_needs", lambda path, n=needs: n)
        _, problems = floor.check_file("x.so", (2, 28), gcc)
        assert (not problems) == ok, (gcc, needs, problems)


def _package(tmp_path: Path, lib: Path, depends: list[str]) -> Path:
    prefix = tmp_path / "env"
    (prefix / "lib").mkdir(parents=True)
    (prefix / "conda-meta").mkdir()
    shutil.copy(lib, prefix / "lib" / "libx.so")
    rec = {"name": "sm7x-x", "version": "0.1.0", "build": "h0_0", "depends": depends,
           "files": ["lib/libx.so", "info/whatever.json"]}
    (prefix / "conda-meta" / "sm7x-x-0.1.0-h0_0.json").write_text(json.dumps(rec))
    return prefix


@pytest.mark.parametrize("depends, ok, says", [
    (["__glibc >=2.28,<3.0.a0", "libstdcxx >=12", "libgcc >=12"], True, ""),
    (["libstdcxx >=12", "libgcc >=12"], False, "declares no __glibc"),
    (["__glibc >=2.28,<3.0.a0", "libgcc >=12"], False, "no libstdcxx run dependency"),
    (["__glibc >=2.28,<3.0.a0", "libstdcxx >=9", "libgcc >=12"], False, "older than GCC 12"),
    (["__glibc >=2.34", "libstdcxx >=12", "libgcc >=12"], False, "newer than the floor 2.28"),
])
def test_package_declares_its_floor(tmp_path, depends, ok, says):
    lib = _lib(tmp_path, "pinned", PINNED)
    prefix = _package(tmp_path, lib, depends)
    proc = _run("--glibc", "2.28", "--gcc", "12", "--package", "sm7x-x", "--prefix", str(prefix))
    assert (proc.returncode == 0) == ok, proc.stderr
    assert says in proc.stderr


def test_bad_input_is_refused(tmp_path):
    assert _run("--glibc", "2", "--gcc", "12", "x.so").returncode == 2
    assert _run("--glibc", "2.28", "--gcc", "7", "x.so").returncode == 2
    proc = _run("--glibc", "2.28", "--gcc", "12", str(tmp_path / "missing.so"))
    assert proc.returncode == 2 and "no such file" in proc.stderr
    proc = _run("--glibc", "2.28", "--gcc", "12", "--package", "sm7x-core", "--prefix", str(tmp_path))
    assert proc.returncode != 0 and "installed records of sm7x-core" in proc.stderr
