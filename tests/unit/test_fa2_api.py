"""sm7x.fa2's Python API without a GPU: argument validation (all before any library is
loaded) and the per-call dispatch to a library through sm7x._select's rules."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading

import pytest

from sm7x._targets import torch_min

torch = pytest.importorskip("torch", reason=f"sm7x.fa2 needs torch >= {torch_min()}")

import sm7x.fa2 as fa2  # noqa: E402
from sm7x import _libfile, _select  # noqa: E402
from sm7x.fa2 import _loader, flash_attn_func, flash_attn_varlen_func  # noqa: E402


def qkv(b=2, sq=16, sk=16, h=4, hk=4, d=64, dtype=torch.float16):
    return (torch.zeros(b, sq, h, d, dtype=dtype), torch.zeros(b, sk, hk, d, dtype=dtype),
            torch.zeros(b, sk, hk, d, dtype=dtype))


def varlen(total=20, h=4, hk=4, d=64):
    q = torch.zeros(total, h, d, dtype=torch.float16)
    k = torch.zeros(total, hk, d, dtype=torch.float16)
    cu = torch.tensor([0, 5, total], dtype=torch.int32)
    return q, k, k.clone(), cu, cu.clone()


@pytest.fixture(autouse=True)
def no_load(monkeypatch):
    """Any attempt to load a library fails the test: validation must come first."""
    def boom(*a, **kw):
        raise AssertionError("a library was loaded before validation finished")
    monkeypatch.setattr(_loader, "load", boom)


def test_import_sm7x_does_not_import_fa2_or_torch():
    code = "import sys, sm7x; assert 'torch' not in sys.modules; assert 'sm7x.fa2' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_dropout_and_alibi_refused():
    with pytest.raises(NotImplementedError, match="dropout_p=0.0"):
        flash_attn_func(*qkv(), dropout_p=0.1)
    with pytest.raises(NotImplementedError, match="alibi_slopes=None"):
        flash_attn_func(*qkv(), alibi_slopes=torch.ones(4))
    # a block_table selects the paged path, which checks its own arguments
    with pytest.raises(ValueError, match="k_cache must be 4-D"):
        flash_attn_varlen_func(*varlen(), 15, 15, block_table=torch.zeros(1, 1))


def test_shapes():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="4-D"):
        flash_attn_func(q[0], k, v)
    with pytest.raises(TypeError, match="torch.Tensor"):
        flash_attn_func(q.tolist(), k, v)


# One owner per check: what the op sees (dtypes, head dims, GQA, shapes that must agree,
# option values) the op checks, with its own message (tests/package/test_fa2_packages.py:
# the op on CPU tensors, both libraries; tests/gpu: through this API). Python passes such a
# call through to its last check, the one only it makes: no library for CPU tensors.
@pytest.mark.parametrize("call", [
    lambda: flash_attn_func(*qkv(dtype=torch.bfloat16)),
    lambda: flash_attn_func(*qkv(d=12)),
    lambda: flash_attn_func(*qkv(d=100)),
    lambda: flash_attn_func(*qkv(h=4, hk=3)),
    lambda: flash_attn_func(qkv()[0], qkv()[1][..., :32], qkv()[2]),
    lambda: flash_attn_func(qkv()[0], qkv()[1][:1], qkv()[2][:1]),
    lambda: flash_attn_func(*qkv(), softmax_scale=-1.0),
    lambda: flash_attn_func(*qkv(), window_size=(-2, 0)),
    lambda: flash_attn_func(*qkv(), softcap=-1.0),
    lambda: flash_attn_varlen_func(*varlen(d=12), 15, 15),
], ids=["bf16", "d12", "d100", "gqa-4-3", "head-dim-mismatch", "batch-mismatch", "scale",
        "window", "softcap", "varlen-d12"])
def test_the_ops_checks_are_not_repeated_in_python(call):
    with pytest.raises(ValueError, match="CUDA tensors only"):
        call()


def test_options():
    with pytest.raises(TypeError, match="window_size"):
        flash_attn_func(*qkv(), window_size=5)


@pytest.mark.parametrize("kw, name", [
    (dict(softmax_scale="x"), "softmax_scale must be a number, got str"),
    (dict(softcap="1"), "softcap must be a number"),
    (dict(window_size=(1, "a")), r"window_size\[1\] must be an int"),
    (dict(window_size=(1.5, 0)), r"window_size\[0\] must be an int"),
    (dict(causal="yes"), "causal must be a bool"),
])
def test_options_of_the_wrong_type_name_the_argument(kw, name):
    with pytest.raises(TypeError, match=name):
        flash_attn_func(*qkv(), **kw)


def test_varlen_max_seqlen_of_the_wrong_type():
    with pytest.raises(TypeError, match="max_seqlen_q must be an int, got str"):
        flash_attn_varlen_func(*varlen(), "15", 15)


def test_cpu_tensors_refused_before_loading():
    with pytest.raises(ValueError, match="CUDA tensors only"):
        flash_attn_func(*qkv())
    with pytest.raises(ValueError, match="CUDA tensors only"):
        flash_attn_varlen_func(*varlen(), 15, 15)


def test_varlen_validation():
    q, k, v, cq, ck = varlen()
    with pytest.raises(TypeError, match="int32"):
        flash_attn_varlen_func(q, k, v, cq.long(), ck, 15, 15)
    with pytest.raises(ValueError, match=r"\[batch \+ 1\]"):
        flash_attn_varlen_func(q, k, v, cq, ck[:2], 15, 15)
    with pytest.raises(ValueError, match="3-D"):
        flash_attn_varlen_func(q[None], k, v, cq, ck, 15, 15)
    with pytest.raises(ValueError, match="max_seqlen"):
        flash_attn_varlen_func(q, k, v, cq, ck, -1, 15)


@pytest.mark.parametrize("bad, message", [
    ([1, 5, 20], "must start at 0"),
    ([0, 9, 5], "never decrease"),
    ([0, 5, 19], "ends at 19 but q holds 20 tokens"),
    ([0, 5, 21], "ends at 21 but q holds 20 tokens"),
])
def test_cu_seqlens_inconsistent_with_the_tensors(bad, message):
    """A cu_seqlens the kernel would read out of bounds with is refused before launch."""
    q, k, v, cq, ck = varlen()
    with pytest.raises(ValueError, match=message):
        flash_attn_varlen_func(q, k, v, torch.tensor(bad, dtype=torch.int32), ck, 15, 15)


def test_max_seqlen_shorter_than_a_sequence_is_refused():
    q, k, v, cq, ck = varlen()
    longest = int((cq[1:] - cq[:-1]).max())
    with pytest.raises(ValueError, match=f"has {longest} tokens but max_seqlen_q is {longest - 1}"):
        flash_attn_varlen_func(q, k, v, cq, ck, longest - 1, 15)


# ---------------------------------------------------------------------------------------
# Dispatch: the library is chosen per call from the input tensor's device.

T4 = _select.Device(1, "Tesla T4", (7, 5))
V100 = _select.Device(0, "Tesla V100-SXM2-32GB", (7, 0))
H200 = _select.Device(2, "NVIDIA H200", (9, 0))


def test_ops_for_selects_per_device(monkeypatch):
    seen = []
    devices = {0: V100, 1: T4, 2: H200}
    monkeypatch.setattr(fa2, "_device_info", lambda dev: devices[dev.index])
    monkeypatch.setattr(_loader, "load",
                        lambda sel, dev: seen.append((sel.arch, dev.index)) or "sm7x_fa2_x")
    monkeypatch.setattr(torch, "ops", type("Ops", (), {"sm7x_fa2_x": "NS"})())
    monkeypatch.delenv(_select.FORCE_ENV, raising=False)

    class FakeT:
        def __init__(self, i):
            self.device = torch.device("cuda", i)

    assert fa2._ops_for(FakeT(1)) == "NS"
    assert fa2._ops_for(FakeT(0)) == "NS"
    assert seen == [("sm75", 1), ("sm70", 0)]
    with pytest.raises(_select.UnsupportedDeviceError, match="SM7X_FA2_FORCE=sm75"):
        fa2._ops_for(FakeT(2))
    monkeypatch.setenv(_select.FORCE_ENV, "sm75")
    fa2._ops_for(FakeT(2))
    assert seen[-1] == ("sm75", 2)


def test_loader_missing_library_names_package(monkeypatch, tmp_path):
    monkeypatch.undo()  # the real loader
    monkeypatch.delenv(_select.FORCE_ENV, raising=False)  # the rules, not a forced arch
    monkeypatch.setattr(_select, "library_path", lambda arch: None)
    monkeypatch.setattr(_loader, "_loaded", {})
    # as in a process where no FA2 library was loaded before (GPU tests may have run first)
    monkeypatch.setattr(_loader, "_registered", lambda torch, ns: False)
    sel = _select.select_fa2_library(T4)
    with pytest.raises(_select.MissingLibraryError, match="sm7x-fa2-sm75"):
        _loader.load(sel, T4)


def test_loader_loads_once_thread_safe(monkeypatch, tmp_path, caplog):
    monkeypatch.undo()
    monkeypatch.setattr(_libfile, "problem", lambda path: None)  # an empty stand-in file
    lib = tmp_path / "_fa2_sm75.abi3.so"
    lib.write_bytes(b"")
    monkeypatch.setenv(_select.LIBRARY_PATH_ENV, str(tmp_path))
    monkeypatch.setattr(_loader, "_loaded", {})
    monkeypatch.setattr(_loader, "_registered", lambda torch, ns: False)
    monkeypatch.setattr(_loader, "_register_fakes", lambda torch, ns: None)
    calls = []
    monkeypatch.setattr(torch.ops, "load_library", lambda p: calls.append(p))
    sel = _select.select_fa2_library(T4)
    caplog.set_level(logging.INFO, logger="sm7x")
    threads = [threading.Thread(target=_loader.load, args=(sel, T4)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == [str(lib)]
    assert _loader.load(sel, T4) == "sm7x_fa2_sm75"
    msg = caplog.text
    assert str(lib) in msg and "cuda:1 (Tesla T4" in msg and "7.5" in msg


def test_loader_falls_back_to_sm70_on_turing(monkeypatch, tmp_path):
    monkeypatch.undo()
    monkeypatch.setattr(_libfile, "problem", lambda path: None)  # an empty stand-in file
    monkeypatch.delenv(_select.FORCE_ENV, raising=False)  # the rules, not a forced arch
    lib = tmp_path / "_fa2_sm70.abi3.so"
    lib.write_bytes(b"")
    monkeypatch.setenv(_select.LIBRARY_PATH_ENV, str(tmp_path))
    monkeypatch.setattr(_select, "library_path",
                        lambda arch: lib if arch == "sm70" else None)
    monkeypatch.setattr(_loader, "_loaded", {})
    monkeypatch.setattr(_loader, "_registered", lambda torch, ns: False)
    monkeypatch.setattr(_loader, "_register_fakes", lambda torch, ns: None)
    monkeypatch.setattr(torch.ops, "load_library", lambda p: None)
    assert _loader.load(_select.select_fa2_library(T4), T4) == "sm7x_fa2_sm70"


# ---------------------------------------------------------------------------------------
# The built library (skipped when none is found): loads in a CPU-only torch, defines the
# schemas, refuses CPU tensors with its own message, has fake kernels, links no CUDA torch.

def _built_library():
    path = _select.library_path("sm75")
    if path is None:
        pytest.skip("_fa2_sm75.abi3.so not found (set SM7X_LIBRARY_PATH to a build)")
    return path


def test_built_library_in_cpu_torch():
    path = _built_library()
    code = f"""
import torch
torch.ops.load_library({str(path)!r})
ns = torch.ops.sm7x_fa2_sm75
s = str(ns.fwd.default._schema)
assert "Tensor(a!) out" in s and "float softcap" in s, s
assert "cu_seqlens_q" in str(ns.fwd_varlen.default._schema)
q = torch.zeros(1, 4, 2, 64, dtype=torch.half)
try:
    ns.fwd(q, q, q, q.clone(), torch.zeros(1, 2, 4), 0.1, False, -1, -1, 0.0)
except RuntimeError as e:
    assert "must be a CUDA tensor" in str(e), e
else:
    raise AssertionError("CPU tensors were accepted")
from sm7x.fa2 import _loader
_loader._register_fakes(torch, "sm7x_fa2_sm75")
m = q.to("meta")
ns.fwd(m, m, m, m.clone(), torch.empty(1, 2, 4, device="meta"), 0.1, True, -1, -1, 0.0)
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def test_built_library_needs_no_cuda_torch_or_cudart():
    path = _built_library()
    elftools = pytest.importorskip("elftools.elf.elffile")
    with open(path, "rb") as f:
        dyn = elftools.ELFFile(f).get_section_by_name(".dynamic")
        needed = [t.needed for t in dyn.iter_tags() if t.entry.d_tag == "DT_NEEDED"]
    assert "libtorch_cpu.so" in needed
    assert not [n for n in needed if "cuda" in n or "c10" in n], needed


@pytest.mark.parametrize("sq, sk, name", [(0, 15, "max_seqlen_q"), (15, 0, "max_seqlen_k")])
def test_max_seqlen_zero_with_tokens_is_refused(sq, sk, name):
    """0 reads as "nothing to do" in the kernels: the output would be left unwritten."""
    q, k, v, cq, ck = varlen()
    with pytest.raises(ValueError, match=f"{name} is 0 but . holds 20 tokens"):
        flash_attn_varlen_func(q, k, v, cq, ck, sq, sk)


def test_input_checks_switch(monkeypatch):
    """sm7x.fa2.set_input_checks: a bool, remembered for libraries loaded later, applied to
    every loaded library's set_input_checks op (a library without the op is left alone)."""
    from types import SimpleNamespace

    calls = []
    lib = SimpleNamespace(set_input_checks=calls.append)
    fake_torch = SimpleNamespace(ops=SimpleNamespace(sm7x_fa2_sm75=lib, sm7x_fa2_sm70=object()))
    monkeypatch.setattr(_loader, "_input_checks", [True])
    with pytest.raises(TypeError, match="enabled must be a bool"):
        fa2.set_input_checks("no")
    fa2.set_input_checks(False)
    assert fa2.input_checks() is False
    _loader._apply_input_checks(fake_torch, "sm7x_fa2_sm75")
    _loader._apply_input_checks(fake_torch, "sm7x_fa2_sm70")  # no op: nothing to call
    fa2.set_input_checks(True)
    _loader._apply_input_checks(fake_torch, "sm7x_fa2_sm75")
    assert calls == [False, True]


def test_input_checks_default_from_the_environment():
    code = "import sm7x.fa2 as f; print(f.input_checks())"
    for value, want in (("", "True"), ("0", "False"), ("off", "False"), ("1", "True")):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**os.environ, "SM7X_FA2_CHECK_INPUTS": value}, check=True)
        assert out.stdout.strip() == want, (value, out.stdout, out.stderr)
