"""`sm7x doctor`: gathering with injected devices, and the CLI in a subprocess."""

import json
import os
import subprocess
import sys

import pytest

from sm7x import _libfile, _select, doctor
from sm7x._select import Device


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ("SM7X_FA2_FORCE", "SM7X_LIBRARY_PATH", "CONDA_OVERRIDE_CUDA_ARCH",
                 "CONDA_OVERRIDE_CUDA", "CONDA_EXE", "MAMBA_EXE", "PIXI_ENVIRONMENT_NAME"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def fake_install(tmp_path, monkeypatch):
    """A conda prefix with sm7x packages and a package dir holding the sm70 library only."""
    meta = tmp_path / "prefix" / "conda-meta"
    meta.mkdir(parents=True)
    for name, build in (("sm7x", "h0_0"), ("sm7x-fa2", "sm70_h0_2"), ("sm7x-fa2-sm70", "h0_0")):
        rec = {"name": name, "version": "0.1.0", "build": build, "channel": "file:///ch"}
        (meta / f"{name}-0.1.0-{build}.json").write_text(json.dumps(rec))
    (meta / "python-3.11.7-h0_0.json").write_text(json.dumps({"name": "python"}))
    pkg = tmp_path / "site-packages" / "sm7x"
    (pkg / "fa2").mkdir(parents=True)
    (pkg / "fa2" / "_fa2_sm70.abi3.so").write_bytes(b"x" * 123)
    (pkg / "_core.abi3.so").write_bytes(b"y" * 7)
    monkeypatch.setattr(_select, "__file__", str(pkg / "_select.py"))
    # the stand-in files are no ELF libraries: the file check (tests/unit/test_libfile.py)
    # is not what these tests are about
    monkeypatch.setattr(_libfile, "problem", lambda path: None)
    return tmp_path / "prefix", pkg


DEVICES = [
    Device(0, "Tesla V100-SXM2-32GB", (7, 0)),
    Device(1, "Tesla T4", (7, 5)),
    Device(2, "NVIDIA GeForce GTX 1660", (7, 5)),
    Device(3, "NVIDIA H200", (9, 0)),
]


def test_collect_with_fake_devices(fake_install):
    prefix, pkg = fake_install
    info = doctor.collect(DEVICES, prefix=prefix, package_dir=pkg)
    json.dumps(info)  # plain data all the way down
    assert info["gpu_source"] == "caller"
    assert [p["name"] for p in info["packages"]["conda"]] == ["sm7x", "sm7x-fa2", "sm7x-fa2-sm70"]
    assert {"file": os.path.join("fa2", "_fa2_sm70.abi3.so"), "size": 123,
            "problem": None} in info["libraries"]
    assert {"file": "_core.abi3.so", "size": 7, "problem": None} in info["libraries"]

    v100, t4, gtx, h200 = info["gpus"]
    assert v100["capability"] == "7.0" and v100["fa2"]["arch"] == "sm70"
    assert v100["fa2"]["installed"] and v100["fa2"]["path"].endswith("_fa2_sm70.abi3.so")
    assert t4["fa2"]["arch"] == "sm75" and not t4["fa2"]["installed"]
    assert t4["fa2"]["fallback"] == "sm70"  # sm70 is installed and runs on 7.5
    assert "tensor cores" in gtx["fa2"]["error"]
    assert "FlashAttention" in h200["fa2"]["error"]
    assert info["node"] == {"required_packages": ["sm7x-fa2-sm70", "sm7x-fa2-sm75"],
                            "uncovered_gpus": [],  # the sm70 library runs on the V100 and the T4
                            "mixed": True}
    solver = info["solver"]  # the lowest capability of the node is the V100's 7.0
    assert solver["cuda_arch"] == "7.0" and "cuda:0" in solver["cuda_arch_source"]
    # a mixed node: the Volta build installs the Turing library too (this environment,
    # made otherwise, lacks it: the warning below)
    assert solver["variant"] == "sm70" and solver["packages"] == ["sm7x-fa2-sm70", "sm7x-fa2-sm75"]
    assert solver["installed_variant"] == "sm70"
    (warning,) = info["warnings"]
    assert "sm7x-fa2-sm75" in warning and "pixi add sm7x-fa2-sm75" in warning

    text = doctor.render(info)
    for needle in ("Tesla T4, compute capability 7.5", "NOT installed", "refused",
                   "pixi add sm7x-fa2-sm75", "_core.abi3.so (7 bytes)",
                   "__cuda_arch 7.0 (the lowest capability of the 4 GPUs, cuda:0",
                   "picks sm7x-fa2 build 'sm70' -> sm7x-fa2-sm70, sm7x-fa2-sm75",
                   "a mixed node: its lowest GPU sets __cuda_arch"):
        assert needle in text


def test_collect_missing_library_warns_with_hint(tmp_path, monkeypatch):
    monkeypatch.setattr(_select, "__file__", str(tmp_path / "sm7x" / "_select.py"))
    info = doctor.collect([Device(0, "Tesla V100", (7, 0))], prefix=tmp_path,
                          package_dir=tmp_path)
    assert info["gpus"][0]["fa2"]["installed"] is False
    assert "conda install -c <channel> sm7x-fa2-sm70" in info["warnings"][0]
    assert "is not covered by the installed FA2 libraries (installed: none)" in info["warnings"][0]
    assert info["node"]["uncovered_gpus"] == [0]


def test_t4_library_does_not_cover_a_v100(fake_install):
    """An env solved on a Turing node (sm75 only) and used on a Volta node: warned."""
    prefix, pkg = fake_install
    (pkg / "fa2" / "_fa2_sm70.abi3.so").rename(pkg / "fa2" / "_fa2_sm75.abi3.so")
    info = doctor.collect([Device(0, "Tesla T4", (7, 5)), Device(1, "Tesla V100", (7, 0))],
                          prefix=prefix, package_dir=pkg)
    assert info["node"]["uncovered_gpus"] == [1]
    (warning,) = info["warnings"]
    assert warning.startswith("cuda:1 (Tesla V100, 7.0) is not covered")
    assert "installed: sm7x-fa2-sm75" in warning and "sm7x-fa2-sm70" in warning


@pytest.mark.parametrize("override, cuda, gpus, arch, variant", [
    ("7.5", "12.4", True, "7.5", "sm75"),
    ("8.0", "12.4", True, "8.0", "sm75"),
    ("", None, True, None, "all"),
    ("7.0", None, True, "7.0", "sm70"),  # a driver gives __cuda, so the arch override holds
    ("7.5", "12.4", False, "7.5", "sm75"),  # a login node making a T4 environment
    ("7.5", None, False, None, "all"),  # no driver, no __cuda: clients drop __cuda_arch (warned)
])
def test_solver_pick_follows_override(fake_install, monkeypatch, override, cuda, gpus, arch, variant):
    prefix, pkg = fake_install
    monkeypatch.setenv("CONDA_OVERRIDE_CUDA_ARCH", override)
    monkeypatch.delenv("CONDA_OVERRIDE_CUDA", raising=False)
    if cuda:
        monkeypatch.setenv("CONDA_OVERRIDE_CUDA", cuda)
    devices = [Device(0, "Tesla V100", (7, 0))] if gpus else []
    info = doctor.collect(devices, prefix=prefix, package_dir=pkg)
    solver = info["solver"]
    assert (solver["cuda_arch"], solver["variant"]) == (arch, variant)
    assert "CONDA_OVERRIDE_CUDA_ARCH" in solver["cuda_arch_source"]
    needs_cuda = bool(override) and not cuda and not gpus
    assert any("CONDA_OVERRIDE_CUDA is not" in w for w in info["warnings"]) == needs_cuda
    text = doctor.render(info)
    assert ("this environment has sm7x-fa2 build 'sm70'" in text) == (variant != "sm70")


def test_env_solved_on_a_login_node_is_explained(fake_install):
    prefix, pkg = fake_install
    meta = prefix / "conda-meta"
    (meta / "sm7x-fa2-0.1.0-sm70_h0_2.json").unlink()
    rec = {"name": "sm7x-fa2", "version": "0.1.0", "build": "all_h0_1", "channel": "file:///ch"}
    (meta / "sm7x-fa2-0.1.0-all_h0_1.json").write_text(json.dumps(rec))
    info = doctor.collect([Device(0, "Tesla V100", (7, 0))], prefix=prefix, package_dir=pkg)
    assert info["solver"]["installed_variant"] == "all" and info["solver"]["variant"] == "sm70"
    assert "fallback build 'all'" in doctor.render(info)


def _made_by(prefix, cmd):
    (prefix / "conda-meta" / "history").write_text(
        f"==> 2026-12-01 10:00:00 <==\n# cmd: {cmd}\n# conda version: 26.7.1\n+file:///ch::sm7x-0.1.0-h0_0\n")


def _conda_base(tmp_path, plugin: bool):
    base = tmp_path / "miniforge"
    (base / "conda-meta").mkdir(parents=True)
    (base / "bin").mkdir()
    (base / "bin" / "conda").write_text("#!/bin/sh\n")
    if plugin:
        (base / "conda-meta" / "nvidia-virtual-packages-0.2.1-pyh0_0.json").write_text("{}")
    return base


@pytest.mark.parametrize("plugin", [False, True])
def test_plain_conda_without_the_plugin_gets_the_fallback(fake_install, tmp_path, monkeypatch, plugin):
    # conda sees __cuda_arch only through nvidia-virtual-packages: without it a T4 node gets
    # the fallback with both libraries, and the doctor says so instead of predicting sm75
    prefix, pkg = fake_install
    base = _conda_base(tmp_path, plugin)
    _made_by(prefix, f"{base}/bin/conda create -n t4 -c file:///ch sm7x python=3.11")
    monkeypatch.setenv("CONDA_OVERRIDE_CUDA_ARCH", "7.5")  # ignored by plain conda
    monkeypatch.setenv("CONDA_OVERRIDE_CUDA", "12.4")
    info = doctor.collect([Device(0, "Tesla T4", (7, 5))], prefix=prefix, package_dir=pkg)
    solver, text = info["solver"], doctor.render(info)
    assert solver["client"]["name"] == "conda" and solver["client"]["sees_cuda_arch"] is plugin
    if plugin:
        assert solver["variant"] == "sm75" and "has the nvidia-virtual-packages plugin" in text
    else:
        assert solver["variant"] == "all" and solver["cuda_arch"] is None
        assert solver["packages"] == ["sm7x-fa2-sm70", "sm7x-fa2-sm75"]
        assert "no nvidia-virtual-packages plugin" in text
        assert "conda install -n base nvidia-virtual-packages" in text
        assert "picks sm7x-fa2 build 'sm75'" not in text


def test_conda_found_through_conda_exe(fake_install, tmp_path, monkeypatch):
    prefix, pkg = fake_install
    base = _conda_base(tmp_path, plugin=False)
    monkeypatch.setenv("CONDA_EXE", str(base / "bin" / "conda"))
    info = doctor.collect([Device(0, "Tesla V100", (7, 0))], prefix=prefix, package_dir=pkg)
    assert info["solver"]["variant"] == "all" and info["solver"]["client"]["base"] == str(base)


@pytest.mark.parametrize("tool", ["micromamba", "mamba", "pixi"])
def test_clients_that_detect_cuda_arch_themselves(fake_install, tool):
    prefix, pkg = fake_install
    if tool == "pixi":
        (prefix / "conda-meta" / "pixi").write_text("{}")
    else:
        _made_by(prefix, f"/opt/{tool}/bin/{tool} create -n t4 sm7x")
    info = doctor.collect([Device(0, "Tesla T4", (7, 5))], prefix=prefix, package_dir=pkg)
    assert info["solver"]["client"] == {"name": tool, "sees_cuda_arch": True,
                                        "how": f"{tool} detects __cuda_arch itself"}
    assert info["solver"]["variant"] == "sm75"
    assert f"with {tool} picks sm7x-fa2 build 'sm75'" in doctor.render(info)


def test_unknown_client_notes_the_conda_plugin(fake_install):
    prefix, pkg = fake_install
    text = doctor.render(doctor.collect([Device(0, "Tesla T4", (7, 5))], prefix=prefix, package_dir=pkg))
    assert "client    unknown" in text and "conda install -n base nvidia-virtual-packages" in text


def test_solver_without_gpus_is_the_fallback(tmp_path):
    info = doctor.collect([], prefix=tmp_path, package_dir=tmp_path)
    assert info["solver"]["variant"] == "all" and info["solver"]["cuda_arch"] is None
    assert "__cuda_arch absent (no GPU found)" in doctor.render(info)


def test_bad_override_is_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("CONDA_OVERRIDE_CUDA_ARCH", "sm75")
    info = doctor.collect([], prefix=tmp_path, package_dir=tmp_path)
    assert "MAJOR.MINOR" in info["solver"]["error"] and "cannot tell" in doctor.render(info)


def test_collect_forced_shows_in_report(monkeypatch, fake_install):
    prefix, pkg = fake_install
    monkeypatch.setenv("SM7X_FA2_FORCE", "sm70")
    info = doctor.collect([Device(0, "NVIDIA H200", (9, 0))], prefix=prefix, package_dir=pkg)
    fa2 = info["gpus"][0]["fa2"]
    assert fa2["forced"] and fa2["installed"] and "forced" in fa2["reason"]
    assert info["environment"]["SM7X_FA2_FORCE"] == "sm70"


def test_collect_without_gpus(tmp_path):
    info = doctor.collect([], prefix=tmp_path, package_dir=tmp_path)
    assert info["gpus"] == [] and "none found" in doctor.render(info)


def _fake_smi(tmp_path, body):
    exe = tmp_path / "bin" / "nvidia-smi"
    exe.parent.mkdir()
    exe.write_text("#!/bin/sh\n" + body)
    exe.chmod(0o755)
    return str(exe.parent)


def test_nvidia_smi_parsing(tmp_path, monkeypatch):
    out = "0, Tesla V100-SXM2-16GB, 7.0\\n1, Quadro RTX 8000, 7.5\\n"
    monkeypatch.setenv("PATH", _fake_smi(tmp_path, f'printf "{out}"\n'))
    devices, error = doctor.query_nvidia_smi()
    assert error is None
    assert devices == [Device(0, "Tesla V100-SXM2-16GB", (7, 0)),
                       Device(1, "Quadro RTX 8000", (7, 5))]


def test_nvidia_smi_failure_is_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", _fake_smi(tmp_path, "echo 'No devices were found' >&2\nexit 6\n"))
    assert doctor.query_nvidia_smi() == (None, "nvidia-smi exited 6: No devices were found")


def test_nvidia_smi_absent(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert doctor.query_nvidia_smi() == (None, None)


def _run(*args, env=None):
    return subprocess.run([sys.executable, "-m", "sm7x", *args], capture_output=True,
                          text=True, timeout=120, env=env)


def test_cli_doctor_text():
    proc = _run("doctor")
    assert proc.returncode == 0, proc.stderr
    assert "python" in proc.stdout and "torch" in proc.stdout and "GPUs" in proc.stdout


def test_cli_doctor_json():
    proc = _run("doctor", "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["python"]["executable"] == sys.executable
    assert set(info) >= {"torch", "gpus", "packages", "libraries", "warnings"}


def test_cli_doctor_json_with_fake_nvidia_smi(tmp_path):
    env = dict(os.environ, SM7X_FA2_FORCE="",
               PATH=_fake_smi(tmp_path, 'printf "0, Tesla T4, 7.5\\n"\n'))
    info = json.loads(_run("doctor", "--json", env=env).stdout)
    if info["gpu_source"] != "nvidia-smi":
        pytest.skip(f"GPUs came from {info['gpu_source']} (a CUDA torch is installed)")
    assert info["gpus"][0]["name"] == "Tesla T4"
    assert info["gpus"][0]["fa2"]["package"] == "sm7x-fa2-sm75"


def test_cli_requires_a_command():
    assert _run().returncode == 2
    assert doctor.main(["doctor", "--json"]) == 0


@pytest.mark.parametrize("version, usable", [("5.17.0", True), ("4.57.1", False), (None, None)])
def test_doctor_names_the_transformers_integration(monkeypatch, version, usable):
    from importlib import metadata

    real = metadata.version

    def fake_version(name):
        if name != "transformers":
            return real(name)
        if version is None:
            raise metadata.PackageNotFoundError(name)
        return version

    monkeypatch.setattr(metadata, "version", fake_version)
    tf = doctor._integrations()["transformers"]
    assert tf["installed"] == (version is not None)
    if version is None:
        return
    assert tf["usable"] is usable
    assert ("attn_implementation='sm7x'" in tf["how"]) is usable


def _without_planner(monkeypatch):
    """As if sm7x._sched were not built for this Python (sys.modules None stops its import;
    the attribute an earlier import left on the package would bypass sys.modules)."""
    import sm7x

    monkeypatch.delattr(sm7x, "_sched", raising=False)
    monkeypatch.setitem(sys.modules, "sm7x._sched", None)


def test_missing_planner_warns_with_hint(tmp_path, monkeypatch):
    """Another Python's sm7x-ext, or a source tree on PYTHONPATH never built: the serving
    calls' planner is missing; doctor says which package brings it."""
    _without_planner(monkeypatch)
    info = doctor.collect([], prefix=tmp_path, package_dir=tmp_path)
    assert info["sched"]["path"] is None
    (warning,) = [w for w in info["warnings"] if "sm7x._sched" in w]
    assert "not importable for this Python" in warning and "sm7x-ext" in warning
    assert "planner   sm7x._sched NOT importable" in doctor.render(info)


def test_planner_present_is_reported(tmp_path):
    pytest.importorskip("sm7x._sched", reason="native module not built")
    info = doctor.collect([], prefix=tmp_path, package_dir=tmp_path)
    assert info["sched"]["problem"] is None and info["sched"]["path"].endswith(".so")
    assert not [w for w in info["warnings"] if "sm7x._sched" in w]


def test_serving_plan_without_planner_says_what_is_missing(monkeypatch):
    """A serving call's split plan (made on the host) names the missing module and package
    instead of the bare "cannot import name '_sched'"."""
    pytest.importorskip("torch")
    from sm7x.fa2 import _serving

    _without_planner(monkeypatch)
    with pytest.raises(ImportError, match=r"plan with sm7x._sched.*sm7x-ext"):
        _serving._split_plan.__wrapped__(2, 1, 1000, 8, 2, 64, 64, 132, 256)
