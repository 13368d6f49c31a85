"""`sm7x doctor`: gathering with injected devices, and the CLI in a subprocess."""

import json
import os
import subprocess
import sys

import pytest

from sm7x import _select, doctor
from sm7x._select import Device


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv("SM7X_FA2_FORCE", raising=False)
    monkeypatch.delenv("SM7X_LIBRARY_PATH", raising=False)


@pytest.fixture
def fake_install(tmp_path, monkeypatch):
    """A conda prefix with sm7x packages and a package dir holding the sm70 library only."""
    meta = tmp_path / "prefix" / "conda-meta"
    meta.mkdir(parents=True)
    for name in ("sm7x", "sm7x-fa2-sm70"):
        rec = {"name": name, "version": "0.1.0", "build": "h0_0", "channel": "file:///ch"}
        (meta / f"{name}-0.1.0-h0_0.json").write_text(json.dumps(rec))
    (meta / "python-3.11.7-h0_0.json").write_text(json.dumps({"name": "python"}))
    pkg = tmp_path / "site-packages" / "sm7x"
    (pkg / "fa2").mkdir(parents=True)
    (pkg / "fa2" / "_fa2_sm70.abi3.so").write_bytes(b"x" * 123)
    (pkg / "_core.abi3.so").write_bytes(b"y" * 7)
    monkeypatch.setattr(_select, "__file__", str(pkg / "_select.py"))
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
    assert [p["name"] for p in info["packages"]["conda"]] == ["sm7x", "sm7x-fa2-sm70"]
    assert {"file": os.path.join("fa2", "_fa2_sm70.abi3.so"), "size": 123} in info["libraries"]
    assert {"file": "_core.abi3.so", "size": 7} in info["libraries"]

    v100, t4, gtx, h200 = info["gpus"]
    assert v100["capability"] == "7.0" and v100["fa2"]["arch"] == "sm70"
    assert v100["fa2"]["installed"] and v100["fa2"]["path"].endswith("_fa2_sm70.abi3.so")
    assert t4["fa2"]["arch"] == "sm75" and not t4["fa2"]["installed"]
    assert t4["fa2"]["fallback"] == "sm70"  # sm70 is installed and runs on 7.5
    assert "tensor cores" in gtx["fa2"]["error"]
    assert "FlashAttention" in h200["fa2"]["error"]
    assert info["node"] == {"required_packages": ["sm7x-fa2-sm70", "sm7x-fa2-sm75"],
                            "min_capability_package": "sm7x-fa2-sm70"}
    (warning,) = info["warnings"]
    assert "sm7x-fa2-sm75" in warning and "pixi add sm7x-fa2-sm75" in warning

    text = doctor.render(info)
    for needle in ("Tesla T4, compute capability 7.5", "NOT installed", "refused",
                   "pixi add sm7x-fa2-sm75", "_core.abi3.so (7 bytes)"):
        assert needle in text


def test_collect_missing_library_warns_with_hint(tmp_path, monkeypatch):
    monkeypatch.setattr(_select, "__file__", str(tmp_path / "sm7x" / "_select.py"))
    info = doctor.collect([Device(0, "Tesla V100", (7, 0))], prefix=tmp_path,
                          package_dir=tmp_path)
    assert info["gpus"][0]["fa2"]["installed"] is False
    assert "conda install -c <channel> sm7x-fa2-sm70" in info["warnings"][0]


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
