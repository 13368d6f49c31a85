"""The FA2 library selection rules (README, "The loader") and the install hints."""

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sm7x import _install_hints, _select
from sm7x._select import (
    ARCHS,
    Device,
    MissingLibraryError,
    UnsupportedDeviceError,
    dtype_error,
    head_dim_error,
    library_path,
    missing_library_error,
    node_cuda_arch,
    selector_pick,
    covering_archs,
    required_packages,
    select_fa2_library,
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    # The user's shell must not change what the rules decide.
    monkeypatch.delenv("SM7X_FA2_FORCE", raising=False)
    monkeypatch.delenv("SM7X_LIBRARY_PATH", raising=False)


def dev(major, minor, name="GPU", index=0):
    return Device(index, name, (major, minor))


@pytest.mark.parametrize(
    "cap, name, arch",
    [
        ((7, 0), "Tesla V100-SXM2-16GB", "sm70"),
        ((7, 0), "TITAN V", "sm70"),
        ((7, 2), "Xavier", "sm70"),
        ((7, 5), "Tesla T4", "sm75"),
        ((7, 5), "Quadro RTX 8000", "sm75"),
        ((7, 5), "NVIDIA GeForce RTX 2080 Ti", "sm75"),
    ],
)
def test_known_volta_turing(cap, name, arch):
    sel = select_fa2_library(Device(1, name, cap))
    assert sel.arch == arch and not sel.forced
    assert sel.package == f"sm7x-fa2-{arch}"
    assert sel.library == f"_fa2_{arch}.abi3.so"
    assert sel.namespace == f"sm7x_fa2_{arch}"
    assert name in sel.reason and "%d.%d" % cap in sel.reason


def test_sm75_falls_back_to_sm70_only():
    assert select_fa2_library(dev(7, 5)).fallback == "sm70"
    assert select_fa2_library(dev(7, 0)).fallback is None


@pytest.mark.parametrize("minor", [1, 3, 6, 9])
def test_other_7x_uses_sm70_and_says_why(minor):
    sel = select_fa2_library(dev(7, minor))
    assert sel.arch == "sm70"
    assert "binary compatible" in sel.reason and f"7.{minor}" in sel.reason


@pytest.mark.parametrize("cap, name", [((8, 0), "A100"), ((8, 6), "RTX 3090"),
                                       ((9, 0), "NVIDIA H200")])
def test_ampere_and_newer_refused_with_pointer_upstream(cap, name):
    with pytest.raises(UnsupportedDeviceError) as err:
        select_fa2_library(Device(2, name, cap))
    msg = str(err.value)
    assert f"cuda:2 ({name}, compute capability {cap[0]}.{cap[1]})" in msg
    assert "FlashAttention" in msg and "scaled_dot_product_attention" in msg
    assert "40x" in msg and "SM7X_FA2_FORCE" in msg
    assert err.value.device == Device(2, name, cap)


@pytest.mark.parametrize("cap", [(6, 1), (6, 0), (5, 2), (3, 7)])
def test_pre_volta_refused(cap):
    with pytest.raises(UnsupportedDeviceError, match="scaled_dot_product_attention") as err:
        select_fa2_library(dev(*cap, name="GeForce GTX 1080"))
    assert "GeForce GTX 1080" in str(err.value) and "%d.%d" % cap in str(err.value)


@pytest.mark.parametrize("name", ["NVIDIA GeForce GTX 1660", "GeForce GTX 1660 SUPER",
                                  "NVIDIA GeForce GTX 1650 Ti", "NVIDIA GeForce MX450",
                                  "NVIDIA T1000", "Quadro T2000"])
def test_turing_without_tensor_cores_refused(name):
    with pytest.raises(UnsupportedDeviceError, match="tensor cores") as err:
        select_fa2_library(dev(7, 5, name=name))
    assert name in str(err.value) and "7.5" in str(err.value)


@pytest.mark.parametrize("arch", ARCHS)
def test_force_by_argument_on_h200(arch):
    sel = select_fa2_library(dev(9, 0, "NVIDIA H200"), force=arch)
    assert sel.arch == arch and sel.forced
    assert "forced" in sel.reason and "H200" in sel.reason


@pytest.mark.parametrize("arch", ARCHS)
def test_force_by_env(monkeypatch, arch):
    monkeypatch.setenv("SM7X_FA2_FORCE", arch)
    sel = select_fa2_library(dev(9, 0, "NVIDIA H200"))
    assert sel.arch == arch and sel.forced and "SM7X_FA2_FORCE" in sel.reason
    # Forcing also overrides the normal choice on a Volta/Turing card.
    assert select_fa2_library(dev(7, 5)).arch == arch


def test_force_argument_wins_over_env(monkeypatch):
    monkeypatch.setenv("SM7X_FA2_FORCE", "sm70")
    assert select_fa2_library(dev(7, 5), force="sm75").arch == "sm75"


def test_force_on_card_without_tensor_cores_is_allowed():
    assert select_fa2_library(dev(7, 5, "NVIDIA GeForce GTX 1660"), force="sm75").forced


def test_force_newer_arch_than_device_refused():
    # compute_75 code cannot run on 7.0 nor compute_70 on 6.1: fail here, not at launch.
    with pytest.raises(UnsupportedDeviceError, match="7.5 or newer"):
        select_fa2_library(dev(7, 0), force="sm75")
    with pytest.raises(UnsupportedDeviceError, match="7.0 or newer"):
        select_fa2_library(dev(6, 1), force="sm70")


@pytest.mark.parametrize("value", ["sm80", "70", "fa2", " "])
def test_invalid_force_argument(value):
    with pytest.raises(ValueError, match="sm70, sm75"):
        select_fa2_library(dev(7, 0), force=value)


def test_invalid_force_env(monkeypatch):
    monkeypatch.setenv("SM7X_FA2_FORCE", "sm90")
    with pytest.raises(ValueError, match="SM7X_FA2_FORCE=sm90.*sm70, sm75"):
        select_fa2_library(dev(7, 0))


def test_empty_force_env_means_unset(monkeypatch):
    monkeypatch.setenv("SM7X_FA2_FORCE", "")
    assert not select_fa2_library(dev(7, 5)).forced


@given(major=st.integers(0, 12), minor=st.integers(0, 9), name=st.text(max_size=30))
def test_every_device_selects_or_refuses_with_its_description(major, minor, name):
    device = Device(0, name, (major, minor))
    try:
        sel = select_fa2_library(device, force=None)
    except UnsupportedDeviceError as exc:
        assert device.describe() in str(exc)
    else:
        assert major == 7 and sel.arch in ARCHS and device.describe() in sel.reason


# --- install hints and error helpers -------------------------------------------------


def test_hint_unpatched_mentions_source_build_conda_and_pixi(monkeypatch):
    monkeypatch.setattr(_install_hints, "PACKAGED_BY", None)
    hint = _install_hints.install_hint("sm7x-fa2-sm75")
    assert "pip install ." in hint
    assert "conda install -c" in hint and "pixi add sm7x-fa2-sm75" in hint


def test_hint_conda_packaged_never_says_pip(monkeypatch):
    monkeypatch.setattr(_install_hints, "PACKAGED_BY", "conda")
    hint = _install_hints.install_hint("sm7x-fa2-sm70")
    assert "conda install -c" in hint and "sm7x-fa2-sm70" in hint
    assert "pixi add sm7x-fa2-sm70" in hint and "pip" not in hint


def test_packaged_by_line_is_patchable():
    # The conda recipe's patch rewrites exactly this line.
    with open(_install_hints.__file__) as f:
        assert "PACKAGED_BY = None\n" in f.read().splitlines(keepends=True)


@pytest.mark.parametrize("packaged_by", [None, "conda"])
@pytest.mark.parametrize("cap, arch", [((7, 0), "sm70"), ((7, 5), "sm75")])
def test_missing_library_message(monkeypatch, packaged_by, cap, arch):
    monkeypatch.setattr(_install_hints, "PACKAGED_BY", packaged_by)
    device = dev(*cap, name="Tesla X", index=3)
    err = missing_library_error(select_fa2_library(device), device)
    msg = str(err)
    assert isinstance(err, MissingLibraryError)
    assert f"cuda:3 (Tesla X, compute capability {cap[0]}.{cap[1]})" in msg
    assert f"conda install -c <channel> sm7x-fa2-{arch}" in msg
    assert f"pixi add sm7x-fa2-{arch}" in msg and f"_fa2_{arch}.abi3.so" in msg


def test_dtype_error():
    err = dtype_error("sm7x.fa2.flash_attn_func: q", "torch.bfloat16")
    assert isinstance(err, TypeError)
    assert str(err).startswith("sm7x.fa2.flash_attn_func: q is torch.bfloat16: ")
    assert ".half()" in str(err) and "bf16" in str(err)


def test_head_dim_error():
    err = head_dim_error(96, [128, 64])
    assert isinstance(err, ValueError)
    assert "head_dim=96" in str(err) and "64, 128" in str(err) and "pad" in str(err)
    assert "pad" not in str(head_dim_error(256, [64, 128]))


# --- where libraries are loaded from --------------------------------------------------


def _fake_lib(directory, arch="sm70"):
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"_fa2_{arch}.abi3.so"
    path.write_bytes(b"not really ELF")
    return path


def test_library_path_absent_and_never_cwd(tmp_path, monkeypatch):
    # Stray libraries in the working directory (flat or in a fa2/ or sm7x/fa2/ tree).
    _fake_lib(tmp_path)
    _fake_lib(tmp_path / "fa2")
    _fake_lib(tmp_path / "sm7x" / "fa2")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(_select, "__file__", str(tmp_path / "pkg" / "sm7x" / "_select.py"))
    assert library_path("sm70") is None
    # Empty entries mean cwd in PATH-like variables; here they must not.
    monkeypatch.setenv("SM7X_LIBRARY_PATH", os.pathsep * 2)
    assert library_path("sm70") is None


def test_library_path_in_package_dir(tmp_path, monkeypatch):
    pkg = tmp_path / "site-packages" / "sm7x"
    lib = _fake_lib(pkg / "fa2", "sm75")
    monkeypatch.setattr(_select, "__file__", str(pkg / "_select.py"))
    assert library_path("sm75") == lib
    assert library_path("sm70") is None


def test_library_path_env_is_searched_first(tmp_path, monkeypatch):
    pkg = tmp_path / "site-packages" / "sm7x"
    _fake_lib(pkg / "fa2")
    mine = _fake_lib(tmp_path / "mybuild")
    monkeypatch.setattr(_select, "__file__", str(pkg / "_select.py"))
    monkeypatch.setenv("SM7X_LIBRARY_PATH", os.pathsep.join([str(tmp_path / "nope"),
                                                             str(tmp_path / "mybuild")]))
    assert library_path("sm70") == mine


def test_library_path_rejects_unknown_arch():
    with pytest.raises(ValueError, match="sm70, sm75"):
        library_path("sm80")


# --- what a node needs ----------------------------------------------------------------


V100, T4 = dev(7, 0, "Tesla V100"), dev(7, 5, "Tesla T4", 1)
GTX1660, A100 = dev(7, 5, "NVIDIA GeForce GTX 1660", 2), dev(8, 0, "A100", 3)


@pytest.mark.parametrize(
    "devices, needed",
    [
        ([V100, T4], {"sm7x-fa2-sm70", "sm7x-fa2-sm75"}),
        ([T4, T4], {"sm7x-fa2-sm75"}),
        ([V100, A100], {"sm7x-fa2-sm70"}),
        ([GTX1660, T4], {"sm7x-fa2-sm75"}),
        ([GTX1660, A100], set()),
        ([], set()),
    ],
)
def test_required_packages(devices, needed):
    assert required_packages(devices) == needed


def test_required_packages_forced():
    assert required_packages([V100, T4, A100], force="sm70") == {"sm7x-fa2-sm70"}


@pytest.mark.parametrize(
    "devices, arch, variant, packages",
    [
        # the lowest GPU decides __cuda_arch: a 7.0 node may hold Turing GPUs too, and gets
        # their native library as well (targets.json selector_installs)
        ([V100, T4], "7.0", "sm70", ("sm7x-fa2-sm70", "sm7x-fa2-sm75")),
        ([V100], "7.0", "sm70", ("sm7x-fa2-sm70", "sm7x-fa2-sm75")),
        ([T4], "7.5", "sm75", ("sm7x-fa2-sm75",)),
        ([T4, A100], "7.5", "sm75", ("sm7x-fa2-sm75",)),
        ([A100], "8.0", "sm75", ("sm7x-fa2-sm75",)),  # the documented choice for >= 8.0
        ([dev(6, 1), T4], "6.1", None, ()),  # the solve fails: nothing runs on Pascal
        ([], None, "all", ("sm7x-fa2-sm70", "sm7x-fa2-sm75")),
    ],
)
def test_selector_pick_for_node(devices, arch, variant, packages):
    """What a conda/pixi solve of sm7x-fa2 installs, from the node's minimum capability."""
    assert node_cuda_arch(devices, environ={})[0] == arch
    pick = selector_pick(arch)
    assert (pick.variant, pick.packages) == (variant, packages)


@pytest.mark.parametrize(
    "built, arch, variant",
    [
        (["sm75"], "7.0", None),  # a Turing-only channel cannot serve a Volta node
        (["sm75"], None, "all"),
        (["sm70"], "7.5", "all"),  # a Volta-only channel's fallback also runs on Turing
        (["sm70"], "7.0", "sm70"),
    ],
)
def test_selector_pick_for_single_arch_channels(built, arch, variant):
    assert selector_pick(arch, built).variant == variant


def test_volta_build_of_a_volta_only_channel_installs_what_it_has():
    assert selector_pick("7.0", ["sm70"]).packages == ("sm7x-fa2-sm70",)


@pytest.mark.parametrize("built", [[], ["sm80"]])
def test_selector_pick_without_a_known_arch_says_so(built):
    with pytest.raises(ValueError, match="names no FA2 arch; valid values: sm70, sm75"):
        selector_pick("7.5", built)


def test_node_cuda_arch_override():
    assert node_cuda_arch([V100], environ={"CONDA_OVERRIDE_CUDA_ARCH": "7.5"})[0] == "7.5"
    assert node_cuda_arch([V100], environ={"CONDA_OVERRIDE_CUDA_ARCH": " "})[0] is None
    # no GPU (no driver): the arch override needs CONDA_OVERRIDE_CUDA, as in the clients
    assert node_cuda_arch([], environ={"CONDA_OVERRIDE_CUDA_ARCH": "7.5"})[0] is None
    both = {"CONDA_OVERRIDE_CUDA_ARCH": "7.5", "CONDA_OVERRIDE_CUDA": "12.4"}
    assert node_cuda_arch([], environ=both)[0] == "7.5"
    with pytest.raises(ValueError, match="MAJOR.MINOR"):
        node_cuda_arch([], environ={"CONDA_OVERRIDE_CUDA_ARCH": "sm_75"})


def test_covering_archs():
    assert covering_archs(V100) == ("sm70",)
    assert covering_archs(T4) == ("sm70", "sm75")
    assert covering_archs(A100) == () and covering_archs(dev(6, 1)) == ()
