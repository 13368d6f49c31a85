"""`python -m sm7x_tools.audit` (a build tool in python/sm7x_tools, not in any sm7x
package): torch ABI, lowest torch, abi3 and name verdicts on libraries built at test time
from tests/audit_fixtures/ (deliberately good and bad), on the real pybind11 module when
one is built, and on a real stable-ABI op library when torch's headers are installed."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("elftools", reason="sm7x_tools.audit needs pyelftools (tests/requirements.txt)")

from sm7x_tools import audit  # noqa: E402
from sm7x_tools.audit import _core, shims  # noqa: E402
from sm7x_tools.audit._core import NO_TORCH, STABLE, UNSTABLE, Options  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "audit_fixtures"
# the tool runs from the source tree, as recipe/scripts/audit_libs.sh runs it
TOOL_ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(
    p for p in (os.environ.get("PYTHONPATH"), str(REPO / "python")) if p))
SUFFIX = sysconfig.get_config_var("EXT_SUFFIX")  # .cpython-311-x86_64-linux-gnu.so
PY_INCLUDE = sysconfig.get_paths()["include"]
HAVE_ABI3AUDIT = importlib.util.find_spec("abi3audit") is not None
needs_abi3audit = pytest.mark.skipif(not HAVE_ABI3AUDIT, reason="abi3audit not installed")
BOTH_CHECKERS = pytest.mark.parametrize("use_abi3audit", [
    pytest.param(True, marks=needs_abi3audit, id="abi3audit"),
    pytest.param(False, id="no-abi3audit"),
])


def _cc(compiler: str, src: str, out: Path, *flags: str, libs: tuple[str, ...] = ()) -> Path:
    if shutil.which(compiler) is None:
        pytest.skip(f"{compiler} not available")
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [compiler, "-shared", "-fPIC", "-O1", *flags, str(FIXTURES / src), *libs,
           "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stderr}"
    return out


def _pymod(out: Path, modname: str, *flags: str) -> Path:
    if not (Path(PY_INCLUDE) / "Python.h").is_file():
        pytest.skip("Python.h not installed")
    return _cc("gcc", "pymod.c", out, f"-I{PY_INCLUDE}", f"-DMODNAME={modname}", *flags)


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    """Every fixture library, each in its own directory (so file names can repeat)."""
    d = tmp_path_factory.mktemp("audit")
    b = {
        "unstable": _cc("g++", "unstable_c10.cpp", d / "a" / "libunstable.so"),
        "stable": _cc("g++", "stable_shims.cpp", d / "b" / "libstable.so"),
        "stable212": _cc("g++", "stable_shims.cpp", d / "b2" / "libstable212.so",
                         "-DSHIMS_2_12"),
        "notorch": _cc("gcc", "no_torch.c", d / "c" / "libplain.so", libs=("-lm",)),
        "abi3_nonlimited": _pymod(d / "d" / "foo.abi3.so", "foo", "-DNON_LIMITED"),
        "abi3_limited": _pymod(d / "e" / "foo.abi3.so", "foo", "-DPy_LIMITED_API=0x030A0000"),
        "abi3_misnamed": _pymod(d / "f" / "foo.abi3.so", "bar", "-DPy_LIMITED_API=0x030A0000"),
        "pybind_soabi": _pymod(d / "g" / f"foo{SUFFIX}", "foo", "-DNON_LIMITED",
                               "-DPYBIND11_MARKER"),
        "limited_soabi": _pymod(d / "h" / f"foo{SUFFIX}", "foo", "-DPy_LIMITED_API=0x030A0000"),
    }
    b["pybind_abi3"] = d / "g3" / "foo.abi3.so"
    b["pybind_abi3"].parent.mkdir()
    shutil.copy(b["pybind_soabi"], b["pybind_abi3"])
    return b


def run(*args: str, cwd: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sm7x_tools.audit", *map(str, args)],
                          capture_output=True, text=True, timeout=300, cwd=cwd, env=TOOL_ENV)


# --- torch verdicts ----------------------------------------------------------------------

def test_c10_calls_are_unstable(fx):
    rec = audit.audit_file(fx["unstable"])
    t = rec.torch
    assert t.verdict == UNSTABLE
    assert "_ZN3c1013some_functionEv" in t.unstable
    assert "_ZNK2at6Tensor5numelEv" in t.unstable
    assert t.stable_shims == ["aoti_torch_dtype_float16"]  # one shim does not save it
    assert t.min_torch is None  # C++ ABI: the build's own torch only
    if shutil.which("c++filt"):
        assert "c10::some_function()" in t.unstable_demangled
    assert rec.ok  # reported, not failed, without --require stable
    assert not audit.audit_file(fx["unstable"], opts=Options(require="stable")).ok


def test_c_shims_only_are_stable_with_lowest_version(fx):
    t = audit.audit_file(fx["stable"]).torch
    assert t.verdict == STABLE
    assert t.unstable == []
    assert set(t.stable_shims) == {"aoti_torch_dtype_float16", "aoti_torch_get_numel",
                                   "torch_library_impl", "torch_from_blob"}
    assert t.min_torch == "2.11"
    assert t.by_version == {"<=2.9": ["aoti_torch_dtype_float16", "aoti_torch_get_numel",
                                      "aoti_torch_get_current_cuda_stream"],
                            "2.10": ["torch_library_impl"], "2.11": ["torch_from_blob"]}
    # looked up with dlsym, as sm7x's loader does for CUDA-only shims: counted, not imported
    assert t.dlsym_shims == ["aoti_torch_get_current_cuda_stream"]
    assert t.device_shims == {}
    assert audit.audit_file(fx["stable212"]).torch.min_torch == "2.12"
    assert audit.audit_file(fx["stable"], opts=Options(require="stable")).ok


def test_cuda_only_shim_imported_directly_is_flagged(tmp_path):
    so = _cc("g++", "stable_shims.cpp", tmp_path / "libcuda_direct.so", "-DCUDA_DIRECT")
    t = audit.audit_file(so).torch
    assert t.verdict == STABLE and t.dlsym_shims == []
    assert t.device_shims == {"cuda": ["aoti_torch_get_current_cuda_stream"]}
    assert any("will not load in a torch without libtorch_cuda.so" in n for n in t.notes)


def test_torch_target_fails_newer_shims(fx):
    opts = Options(require="stable", torch_target="2.11")
    assert audit.audit_file(fx["stable"], opts=opts).ok
    rec = audit.audit_file(fx["stable212"], opts=opts)
    assert not rec.ok
    assert "torch_tag_core" in rec.failures[0] and "2.12" in rec.failures[0]


def test_no_torch(fx):
    rec = audit.audit_file(fx["notorch"], opts=Options(require="no-torch"))
    assert rec.torch.verdict == NO_TORCH and rec.torch.min_torch is None
    assert rec.ok and rec.abi3.status == "n/a" and rec.name["ok"]
    assert not audit.audit_file(fx["stable"], opts=Options(require="no-torch")).ok


def test_c_import_from_a_needed_torch_library_is_unstable(tmp_path):
    fake = _cc("gcc", "fake_libtorch.c", tmp_path / "lib" / "libtorch_python.so")
    so = _cc("gcc", "torch_c_user.c", tmp_path / "libuser.so",
             libs=(f"-L{fake.parent}", "-ltorch_python"))
    rec = audit.audit_file(so)
    assert rec.needed[:1] == ["libtorch_python.so"] and rec.torch.verdict == UNSTABLE
    assert rec.torch.unstable == ["initModule"]
    assert rec.torch.needed_torch == ["libtorch_python.so"]


def test_mangled_torch_patterns():
    torch = ["_ZN3c1013some_functionEv", "_ZNK2at6Tensor5numelEv", "_ZTVN3c1011StorageImplE",
             "_ZTIN5torch8autograd4NodeE", "_ZN6caffe28TypeMeta5_typeEv",
             "_ZThn16_N3c1011StorageImplD1Ev", "_ZGVN2at4impl1xE"]
    other = ["_ZNSt6vectorIN3c106IValueESaIS1_EED1Ev",  # std::vector<c10::IValue>: std
             "_ZN3foo3c10Ev", "_ZN4attr1xEv", "_ZN7torchvx1fEv", "_Z3c10v", "_ZdlPvm"]
    assert [n for n in torch if not _core.MANGLED_TORCH.match(n)] == []
    assert [n for n in other if _core.MANGLED_TORCH.match(n)] == []


# --- abi3 and names ----------------------------------------------------------------------

@needs_abi3audit
def test_non_limited_module_named_abi3_fails(fx):
    rec = audit.audit_file(fx["abi3_nonlimited"])
    assert rec.abi3.status == "violations"
    assert {"PyInstanceMethod_New", "_PyObject_GetDictPtr"} <= set(rec.abi3.non_abi3)
    assert rec.abi3.checker.startswith("abi3audit")
    assert not rec.ok
    assert any("abi3 violation" in f for f in rec.failures)
    assert any("must be SOABI-named" in f for f in rec.failures)


@needs_abi3audit
def test_limited_module_named_abi3_is_ok(fx):
    rec = audit.audit_file(fx["abi3_limited"])
    assert rec.abi3.status == "ok", rec.abi3
    assert rec.python.init == ["foo"] and rec.python.non_limited == []
    assert rec.name["ok"] and rec.ok, rec.failures


def test_without_abi3audit_an_abi3_file_must_not_use_python(fx):
    """The recipe's offline check: abi3 names are fine for files that use no Python C API
    (sm7x's torch libraries); any that does is unchecked and fails."""
    opts = Options(use_abi3audit=False)
    for lib in ("abi3_limited", "abi3_nonlimited"):
        rec = audit.audit_file(fx[lib], opts=opts)
        assert rec.abi3.status == "error" and not rec.ok, lib
        assert "needs abi3audit" in rec.abi3.message
    plain = fx["notorch"].parent.parent / "abi3plain" / "_lib.abi3.so"
    plain.parent.mkdir(exist_ok=True)
    shutil.copy(fx["notorch"], plain)
    rec = audit.audit_file(plain, opts=opts)
    assert (rec.abi3.status, rec.abi3.checker) == ("ok", "no Python API") and rec.ok


@needs_abi3audit
@pytest.mark.skipif(sys.version_info < (3, 11), reason="needs Python >= 3.11 headers")
def test_abi3_symbol_newer_than_python_min(tmp_path):
    so = _pymod(tmp_path / "foo.abi3.so", "foo", "-DPy_LIMITED_API=0x030B0000", "-DUSE_311")
    rec = audit.audit_file(so)
    assert rec.abi3.status == "violations" and rec.abi3.non_abi3 == []
    assert rec.abi3.newer_than_min == {"PyType_GetName": "3.11"}
    assert not rec.ok and "newer than 3.10: PyType_GetName (3.11)" in rec.failures[0]
    rec = audit.audit_file(so, opts=Options(python_min="3.11"))
    assert rec.ok, rec.failures


@needs_abi3audit
def test_pyinit_name_must_match_file_name(fx):
    rec = audit.audit_file(fx["abi3_misnamed"])
    assert rec.python.init == ["bar"]
    assert rec.abi3.status == "ok"  # limited API: the name is what is wrong
    assert not rec.name["ok"] and not rec.ok
    assert "PyInit_bar" in rec.name["problems"][0] and "'foo'" in rec.name["problems"][0]


@BOTH_CHECKERS
def test_pybind11_like_module_soabi_ok_abi3_fails(fx, use_abi3audit):
    opts = Options(use_abi3audit=use_abi3audit)
    good = audit.audit_file(fx["pybind_soabi"], opts=opts)
    assert good.python.pybind11  # the marker alone: SOABI, whatever abi3audit says
    assert bool(good.python.non_limited) == use_abi3audit
    assert good.name["kind"] == "soabi" and good.abi3.status == "n/a"
    assert good.ok, good.failures
    bad = audit.audit_file(fx["pybind_abi3"], opts=opts)
    assert not bad.ok
    assert bad.abi3.status == ("violations" if use_abi3audit else "error")
    assert any(p.startswith("a pybind11 module: must be SOABI-named") for p in
               bad.name["problems"])


@needs_abi3audit
def test_limited_module_soabi_named_is_reported_ok(fx):
    rec = audit.audit_file(fx["limited_soabi"])
    assert rec.ok
    assert rec.name["notes"] == ["uses only the limited API: could ship as .abi3.so"]


def test_parse_name():
    p = _core.parse_name("_sched.cpython-312-x86_64-linux-gnu.so")
    assert (p.kind, p.stem, p.python, p.platform) == ("soabi", "_sched", "3.12", "x86_64")
    assert _core.parse_name("_sched.cpython-313t-aarch64-linux-gnu.so").python == "3.13"
    assert (_core.parse_name("_core.abi3.so").kind, _core.parse_name("x.so").kind) == \
        ("abi3", "plain")
    assert _core.parse_name("libc10.so.2").kind == "library"


@pytest.mark.skipif(importlib.util.find_spec("pybind11") is None, reason="pybind11 missing")
def test_real_pybind11_module(tmp_path):
    import pybind11

    flags = ("-std=c++17", "-O0", "-fvisibility=hidden", f"-I{pybind11.get_include()}",
             f"-I{PY_INCLUDE}", "-DMODNAME=pbmod")
    soabi = _cc("g++", "pybind_mod.cpp", tmp_path / f"pbmod{SUFFIX}", *flags)
    rec = audit.audit_file(soabi)
    assert rec.python.pybind11 and rec.ok, rec.failures
    abi3 = tmp_path / "x" / "pbmod.abi3.so"
    abi3.parent.mkdir()
    shutil.copy(soabi, abi3)
    bad = audit.audit_file(abi3)
    assert not bad.ok and bad.abi3.status == "violations" and not bad.name["ok"]


def test_real_sched_module():
    """The project's own pybind11 module, when it is built (./test.sh: editable install)."""
    spec = importlib.util.find_spec("sm7x._sched")
    if spec is None or not spec.origin or not spec.origin.endswith(".so"):
        pytest.skip("sm7x._sched is not built here")
    rec = audit.audit_file(spec.origin, opts=Options(require="no-torch"))
    assert rec.torch.verdict == NO_TORCH
    assert rec.python.init == ["_sched"] and rec.python.pybind11
    assert rec.name["kind"] == "soabi" and ".abi3." not in spec.origin
    assert rec.ok, rec.failures


# --- a real stable-ABI op library, against the installed torch's headers ----------------

def _torch():
    """(include root, X.Y) of the installed torch, found without importing it."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("torch (its headers) is not installed")
    root = Path(list(spec.submodule_search_locations)[0])
    if not (root / "include/torch/csrc/stable/library.h").is_file():
        pytest.skip("torch's stable-ABI headers are not installed")
    m = re.search(r"__version__\s*=\s*'(\d+)\.(\d+)", (root / "version.py").read_text())
    return root / "include", f"{m[1]}.{m[2]}"


def test_real_stable_op_library(tmp_path):
    inc, torch_xy = _torch()
    flags = ("-std=c++17", "-O1", "-fvisibility=hidden", f"-I{inc}")
    lib210 = _cc("g++", "stable_op.cpp", tmp_path / "a" / "_ops.abi3.so", *flags,
                 "-DTORCH_TARGET_VERSION=0x020A000000000000")
    libnow = _cc("g++", "stable_op.cpp", tmp_path / "b" / "_ops.abi3.so", *flags)
    opts = Options(require="stable", torch_target="2.10")
    rec = audit.audit_file(lib210, opts=opts)
    assert rec.torch.verdict == STABLE and rec.torch.min_torch == "2.10"
    assert "torch_library_impl" in rec.torch.stable_shims
    assert rec.abi3.checker == "no Python API"
    assert rec.ok, rec.failures
    rec = audit.audit_file(libnow, opts=opts)
    assert rec.torch.verdict == STABLE
    assert rec.torch.min_torch == torch_xy  # the headers' own torch (2.13: torch_exception_*)
    assert not rec.ok  # needs shims newer than 2.10


# --- the version table --------------------------------------------------------------------

def test_shim_table():
    t = shims.shim_table()
    assert t.baseline == (2, 9)
    assert t.since("aoti_torch_dtype_float16") == (2, 9)
    assert t.since("torch_library_impl") == (2, 10)
    assert t.since("torch_from_blob") == (2, 11)
    assert t.since("torch_tag_core") == (2, 12)
    assert t.since("torch_exception_get_what") == (2, 13)
    assert t.since("aoti_torch_dtype_float8_e8m0fnu") == (2, 12)
    assert t.since("no_such_shim") is None and t.label(t.baseline) == "<=2.9"
    assert shims.device_of("aoti_torch_get_current_cuda_stream") == "cuda"
    assert shims.device_of("torch_get_current_cuda_blas_handle") == "cuda"
    assert shims.device_of("aoti_torch_get_current_sycl_queue") == "xpu"
    assert shims.device_of("aoti_torch_device_type_cuda") is None
    assert shims.device_of("aoti_torch_get_numel") is None


@pytest.mark.skipif(importlib.util.find_spec("torch_abi_audit") is None,
                    reason="torch-abi-audit not installed")
def test_shim_table_is_torch_abi_audits():
    """torch_shims.json is a snapshot of torch-abi-audit's data, nothing of our own:
    python -m sm7x_tools.audit --update-shims write refreshes it."""
    assert shims.TABLE.read_text() == shims.dump(shims.from_torch_abi_audit())
    assert run("--update-shims", "check").returncode == 0


# --- inputs: directories, wheels, conda packages ----------------------------------------

def test_directory_scan_skips_symlinks_and_non_elf(fx, tmp_path):
    d = tmp_path / "pkg" / "sm7x"
    d.mkdir(parents=True)
    shutil.copy(fx["pybind_soabi"], d / f"foo{SUFFIX}")
    shutil.copy(fx["notorch"], d / "libplain.so.1")
    (d / "libplain.so").symlink_to("libplain.so.1")
    (d / "libc.so").write_text("/* GNU ld script */\nGROUP ( libc.so.6 )\n")
    recs = audit.audit_paths([tmp_path / "pkg"])
    by_name = {Path(r.file).name: r for r in recs}
    assert set(by_name) == {f"foo{SUFFIX}", "libplain.so.1", "libc.so"}
    assert by_name["libc.so"].skipped and by_name["libc.so"].ok
    assert all(r.ok for r in recs)
    # named explicitly, a non-ELF file fails
    assert not audit.audit_paths([d / "libc.so"])[0].ok


def test_wheel(fx, tmp_path):
    whl = tmp_path / "demo-1.0-cp310-abi3-linux_x86_64.whl"
    with zipfile.ZipFile(whl, "w") as zf:
        zf.write(fx["pybind_soabi"], f"demo/foo{SUFFIX}")
        zf.write(fx["abi3_misnamed"], "demo/sub/foo.abi3.so")
        zf.writestr("demo/__init__.py", "")
    recs = audit.audit_paths([whl], Options(use_abi3audit=False))
    assert [(r.file, r.ok) for r in recs] == [(f"{whl.name}!demo/foo{SUFFIX}", True),
                                              (f"{whl.name}!demo/sub/foo.abi3.so", False)]


def _zstd_compress(data: bytes) -> bytes | None:
    try:
        from compression import zstd  # Python >= 3.14

        return zstd.compress(data)
    except ImportError:
        pass
    try:
        import zstandard
    except ImportError:
        return None
    return zstandard.ZstdCompressor().compress(data)


def test_conda_package(fx, tmp_path):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        tf.add(fx["pybind_soabi"], f"lib/python3.11/site-packages/demo/foo{SUFFIX}")
        tf.add(fx["stable"], "lib/libstable.so")
    pkg = tmp_path / "demo-1.0-py311_0.conda"
    compressed = _zstd_compress(buf.getvalue())
    with zipfile.ZipFile(pkg, "w") as zf:
        zf.writestr("metadata.json", '{"conda_pkg_format_version": 2}')
        zf.writestr("pkg-demo-1.0-py311_0.tar.zst", compressed or b"\x28\xb5\x2f\xfd")
        zf.writestr("info-demo-1.0-py311_0.tar.zst", b"")
    recs = audit.audit_paths([pkg], Options(require="stable"))
    if compressed is None:
        (rec,) = recs
        assert not rec.ok and "zstandard" in rec.error and "compression.zstd" in rec.error
        return
    assert sorted((r.file, r.torch.verdict) for r in recs) == [
        (f"{pkg.name}!lib/libstable.so", STABLE),
        (f"{pkg.name}!lib/python3.11/site-packages/demo/foo{SUFFIX}", NO_TORCH)]
    assert all(r.ok for r in recs)


# --- the CLI ------------------------------------------------------------------------------

def test_cli_exit_codes(fx):
    good = [fx["stable"], fx["notorch"], fx["pybind_soabi"]]
    if HAVE_ABI3AUDIT:
        good.append(fx["abi3_limited"])
    assert run(*good, "--require", "stable").returncode == 0
    assert run(fx["unstable"]).returncode == 0  # reported only
    assert run(fx["unstable"], "--require", "stable").returncode == 1
    assert run(fx["stable"], "--require", "no-torch").returncode == 1
    assert run(fx["notorch"], "--require", "no-torch").returncode == 0
    assert run(fx["stable212"], "--torch-target", "2.11").returncode == 1
    assert run(fx["stable212"], "--torch-target", "2.12").returncode == 0
    # misnamed files and abi3 violations fail whatever --require says
    for bad in ("abi3_misnamed", "pybind_abi3", "abi3_nonlimited"):
        assert run(fx[bad], "--require", "any").returncode == 1, bad
    assert run("/nonexistent/x.so").returncode == 1
    assert run(fx["stable"], "--require", "sometimes").returncode == 2
    assert run().returncode == 2
    assert run(fx["stable"], "--torch-target", "latest").returncode == 2


def test_cli_empty_directory_fails(tmp_path):
    proc = run(tmp_path)
    assert proc.returncode == 1 and "no shared object was audited" in proc.stderr
    assert run("--json").returncode == 2  # no PATH


def test_cli_json(fx):
    proc = run(fx["stable"], fx["unstable"], fx["abi3_misnamed"], "--json",
               "--require", "stable")
    assert proc.returncode == 1
    data = json.loads(proc.stdout)
    assert data["require"] == "stable" and data["ok"] is False
    assert data["shim_table"].startswith("torch_shims.json (torch-abi-audit ")
    stable, unstable, misnamed = data["files"]
    assert (stable["ok"], stable["torch"]["verdict"], stable["torch"]["min_torch"]) == \
        (True, "STABLE", "2.11")
    assert unstable["torch"]["verdict"] == "UNSTABLE" and not unstable["ok"]
    assert "_ZN3c1013some_functionEv" in unstable["torch"]["unstable"]
    assert misnamed["name"]["ok"] is False and misnamed["python"]["init"] == ["bar"]
    assert misnamed["abi3"]["status"] == ("ok" if HAVE_ABI3AUDIT else "error")


def test_cli_text(fx):
    proc = run(fx["stable"], fx["abi3_misnamed"], "--plain")  # --plain: the only format
    assert proc.returncode == 1
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["TORCH", "MIN", "ABI3", "NAME", "FILE"]
    assert any(line.split()[:4] == ["STABLE", "2.11", "n/a", "ok"] for line in lines)
    abi3 = "ok" if HAVE_ABI3AUDIT else "ERROR"
    assert any(line.split()[:4] == ["NO-TORCH", "-", abi3, "MISNAMED"] for line in lines)
    assert "2 file(s) audited, 1 failing" in proc.stdout


def test_works_without_abi3audit_and_torch(fx):
    """Only stdlib + pyelftools, as in the recipe: abi3audit blocked, torch never imported."""
    code = f"""
import sys
for mod in ("rich", "abi3audit", "abi3info", "torch", "torch_abi_audit"):
    sys.modules[mod] = None
from sm7x_tools.audit.__main__ import main
rc = main([{str(fx["abi3_nonlimited"])!r}, {str(fx["stable"])!r}])
print("rc", rc)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=TOOL_ENV)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.splitlines()[0].split()[:4] == ["TORCH", "MIN", "ABI3", "NAME"]
    assert "abi3audit is not installed" in out and "needs abi3audit" in out
    assert "STABLE    2.11" in out and out.rstrip().endswith("rc 1")


def test_runtime_package_does_not_carry_the_audit():
    """The auditor is a build tool: sm7x (the runtime package) has no sm7x.audit."""
    assert importlib.util.find_spec("sm7x") is not None
    assert importlib.util.find_spec("sm7x.audit") is None


RECIPE_AUDIT = REPO / "recipe" / "scripts" / "audit_libs.sh"


@pytest.mark.parametrize("require, lib, ok", [
    ("stable", "unstable", False),       # c10 C++ symbols: never packaged
    ("stable", "stable212", False),      # shims newer than torch 2.10
    ("no-torch", "pybind_abi3", False),  # a pybind11 module named .abi3.so
    ("no-torch", "unstable", False),
    ("no-torch", "pybind_soabi", True),
])
def test_recipe_audit_step_fails_the_package_build(fx, require, lib, ok):
    """recipe/scripts/audit_libs.sh, as the recipe runs it on every shipped library."""
    env = dict(os.environ, PYTHON=sys.executable, SRC_DIR=str(REPO))
    proc = subprocess.run(["bash", str(RECIPE_AUDIT), require, str(fx[lib])], env=env,
                          capture_output=True, text=True, timeout=120)
    assert (proc.returncode == 0) == ok, proc.stdout + proc.stderr
