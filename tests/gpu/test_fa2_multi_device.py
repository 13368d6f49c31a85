"""FA2 on two devices of one process (needs 2 CUDA devices; skipped otherwise): calls whose
tensors live on cuda:1 while the current device is cuda:0, and two threads calling FA2 at
once, one per device, each on its own stream. The library is chosen per call from the
tensor's device (or the forced arch), so every result must equal, bit for bit, the same
call made alone on one device. Both archs in turn where both libraries are there; on GPUs
newer than Turing they are forced (their PTX runs there)."""

from __future__ import annotations

import os
import threading

import pytest

from sm7x._targets import torch_min

torch = pytest.importorskip("torch", reason=f"sm7x FA2 needs torch >= {torch_min()}")
if not torch.cuda.is_available():
    pytest.skip("torch.cuda.is_available() is False: no CUDA device", allow_module_level=True)
if torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA devices", allow_module_level=True)

from sm7x import _select  # noqa: E402

ARCHS = [a for a in _select.ARCHS if _select.library_path(a) is not None]
if not ARCHS:
    pytest.skip("no FA2 library found (SM7X_LIBRARY_PATH)", allow_module_level=True)
if min(torch.cuda.get_device_capability(i) for i in range(2)) < (7, 0):
    pytest.skip("both devices must be Volta or newer", allow_module_level=True)

from fa2_reference import _qkv, paged_cache  # noqa: E402

from sm7x.fa2 import flash_attn_func, flash_attn_with_kvcache  # noqa: E402

pytestmark = pytest.mark.gpu

CALLS = 8  # per thread: enough that the two devices' launches overlap


# An arch forced from outside (tests/gpu/sanitize.sh) is the one run; else on GPUs newer
# than Turing each library is forced in turn, and on V100 / T4 nodes every device runs the
# library it selects itself (forcing sm75 on a V100 cannot run).
FORCED = os.environ.get(_select.FORCE_ENV, "").strip() or None
NEWER = min(torch.cuda.get_device_capability(i) for i in range(2)) >= (8, 0)


@pytest.fixture(params=[FORCED] if FORCED else ARCHS if NEWER else [None])
def arch(request, monkeypatch):
    if request.param is None:
        monkeypatch.delenv(_select.FORCE_ENV, raising=False)
    else:
        monkeypatch.setenv(_select.FORCE_ENV, request.param)
    return request.param


def _on(device, tensors):
    return [t.to(device) for t in tensors]


def test_prefill_on_the_second_device_while_the_first_is_current(arch):
    q, k, v = _qkv(2, 333, 517, 8, 2, 128, seed=3)
    with torch.cuda.device(0):
        alone = flash_attn_func(q, k, v, causal=True).cpu()
        other = flash_attn_func(*_on("cuda:1", (q, k, v)), causal=True)
        assert other.device == torch.device("cuda:1")
    assert torch.equal(other.cpu(), alone)


def test_decode_on_the_second_device_while_the_first_is_current(arch):
    lens = [1, 700, 4097]
    k_cache, v_cache, bt = paged_cache(lens, 16, 2, 128, seed=5)
    q = _qkv(len(lens), 1, 1, 8, 2, 128, seed=6)[0]
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    kw = dict(causal=True, return_softmax_lse=True)
    with torch.cuda.device(0):
        out0, lse0 = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                             block_table=bt, **kw)
        q1, k1, v1, bt1, s1 = _on("cuda:1", (q, k_cache, v_cache, bt, seqlens))
        out1, lse1 = flash_attn_with_kvcache(q1, k1, v1, cache_seqlens=s1, block_table=bt1, **kw)
        assert out1.device == torch.device("cuda:1")
    assert torch.equal(out1.cpu(), out0.cpu()) and torch.equal(lse1.cpu(), lse0.cpu())


def test_two_threads_two_devices_bit_identical(arch):
    """Each thread makes cuda:i current, calls FA2 CALLS times on its own stream; both start
    together. Each result equals the call made alone, and both devices agree."""
    inputs = [_on(f"cuda:{i}", _qkv(4, 1024, 1024, 16, 4, 64, seed=11)) for i in range(2)]
    alone = []
    for i in range(2):
        with torch.cuda.device(i):
            alone.append(flash_attn_func(*inputs[i], causal=True).cpu())
    assert torch.equal(alone[0], alone[1])  # one library, same inputs: same bits on both
    results, errors = [None, None], []
    # a thread that fails before the barrier aborts it, so the other one does not wait forever
    start = threading.Barrier(2, timeout=120)

    def work(i):
        try:
            torch.cuda.set_device(i)
            stream = torch.cuda.Stream(device=i)
            stream.wait_stream(torch.cuda.default_stream(i))
            start.wait()
            with torch.cuda.stream(stream):
                outs = [flash_attn_func(*inputs[i], causal=True) for _ in range(CALLS)]
            stream.synchronize()
            results[i] = [o.cpu() for o in outs]
        except BaseException as e:  # re-raised below, in the test's thread
            start.abort()
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a thread did not finish in 300 s"
    if errors:  # the first failure (a BrokenBarrierError is only the other thread's echo)
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
    for i in range(2):
        for n, out in enumerate(results[i]):
            assert torch.equal(out, alone[i]), f"cuda:{i}, call {n}: differs from the call made alone"
