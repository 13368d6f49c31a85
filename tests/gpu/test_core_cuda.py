"""sm7x core ops on CUDA: every check of tests/unit/test_core_ops.py with device="cuda",
plus what only a GPU shows (current stream, CUDA graphs, CPU/CUDA agreement, big rows).

Marked `gpu`; skipped where torch has no CUDA device or the library is not built.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from sm7x._targets import torch_min

torch = pytest.importorskip("torch", reason=f"the core ops need torch >= {torch_min()}")
if not torch.cuda.is_available():
    pytest.skip("torch.cuda.is_available() is False: no CUDA device", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
import test_core_ops as base  # noqa: E402  (skips this module too if the library is missing)
from test_core_ops import *  # noqa: E402,F401,F403  (the CPU tests, collected again here)

# Device-independent tests of the unit module are not repeated here.
for _name in ("test_first_use_inside_compiled_function", "test_loader_uses_env_path_first_and_never_cwd",
              "test_loader_loaded_once", "test_missing_library_message",
              "test_library_uses_only_stable_c_shims", "test_cpu_fp16_paths_agree",
              "test_loader_and_bench_packages_do_not_import_torch", "test_bench_cli_smoke",
              "test_torch_ops_namespace_is_filled_by_load_library"):
    globals().pop(_name, None)

pytestmark = pytest.mark.gpu

ops = base.ops
ref = base.ref


@pytest.fixture(scope="module")
def device():
    return "cuda"


def test_library_has_cuda_kernels():
    x = torch.randn(2, 8, device="cuda")
    out = ops.rms_norm(x, torch.ones(8, device="cuda"))
    assert out.is_cuda
    base.close(out, ref.rms_norm(x, torch.ones(8, device="cuda"), 1e-6))


@pytest.mark.parametrize("dtype", base.DTYPES)
def test_cuda_matches_cpu(dtype):
    torch.manual_seed(1)
    x = torch.randn(33, 4096).to(dtype)
    res = torch.randn(33, 4096).to(dtype)
    w = torch.randn(4096).to(dtype)
    base.close(ops.rms_norm(x.cuda(), w.cuda()).cpu(), ops.rms_norm(x, w).float(), dtype)
    xc, rc, xg, rg = x.clone(), res.clone(), x.cuda(), res.cuda()
    ops.fused_add_rms_norm(xc, rc, w)
    ops.fused_add_rms_norm(xg, rg, w.cuda())
    assert torch.equal(rg.cpu(), rc)
    base.close(xg.cpu(), xc.float(), dtype)


def test_runs_on_current_stream():
    side = torch.cuda.Stream()
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
    w = torch.randn(4096, device="cuda", dtype=torch.float16)
    expected = ref.rms_norm(x.float(), w.float(), 1e-6)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y = x * 1  # queued on the side stream; the op must run after it, on that stream
        out = torch.empty_like(y)
        ops.rms_norm(y, w, out=out)
        x2 = out.float() + 0
    torch.cuda.current_stream().wait_stream(side)
    base.close(x2, expected, torch.float16)


def test_cuda_graph_capture():
    x = torch.randn(64, 256, device="cuda", dtype=torch.float16)
    w = torch.randn(256, device="cuda", dtype=torch.float16)
    out = torch.empty_like(x)
    ops.rms_norm(x, w, out=out)  # warm up (and load) outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ops.rms_norm(x, w, out=out)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    base.close(out, ref.rms_norm(x.float(), w.float(), 1e-6), torch.float16)


@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_large(is_neox):
    base.check_rotary("cuda", torch.float16, 3000, 32, 8, 128, 128, is_neox, fused_qkv=True)


def test_reshape_and_cache_large():
    base.check_cache("cuda", torch.bfloat16, 3000, 8, 128, 16, num_blocks=400, padding=100)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_second_device():
    x = torch.randn(8, 64, device="cuda:1")
    w = torch.randn(64, device="cuda:1")
    base.close(ops.rms_norm(x, w), ref.rms_norm(x, w, 1e-6))
    with pytest.raises(ValueError, match="move all tensors to one device"):
        ops.rms_norm(x, w.to("cuda:0"))
