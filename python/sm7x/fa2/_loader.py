"""Finds and loads sm7x's FlashAttention-2 libraries (``_fa2_sm70.abi3.so``,
``_fa2_sm75.abi3.so``), one per arch, each at most once per process (thread-safe).

Which library a device uses is decided by :func:`sm7x._select.select_fa2_library` (per
call, on the input tensor's device); where it lies by :func:`sm7x._select.library_path`
(``$SM7X_LIBRARY_PATH`` first, then the installed ``sm7x/fa2/``; never the working
directory). Each library registers its own op namespace (``torch.ops.sm7x_fa2_sm75``...),
so both can live in one process. The log line names the file, the device and its
capability.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from .. import _args, _libfile, _select

log = logging.getLogger("sm7x")

_lock = threading.Lock()
_loaded: dict[str, Path] = {}  # arch -> path
# the serving op's device-side input check, for every library loaded now or later
_input_checks = [_args.env_flag("SM7X_FA2_CHECK_INPUTS", True)]
_PROBE_OP = "fwd"


def loaded() -> dict[str, Path]:
    """The FA2 libraries this process loaded so far: arch -> path."""
    return dict(_loaded)


def _registered(torch, namespace: str) -> bool:
    try:
        getattr(getattr(torch.ops, namespace), _PROBE_OP)
        return True
    except (AttributeError, RuntimeError):
        return False


def _register_fakes(torch, namespace: str) -> None:
    # The ops write their (a!)/(b!) outputs and return nothing: the fakes only must exist
    # (torch.compile / meta tensors).
    def fake_fwd(q, k, v, out, lse, softmax_scale, causal, window_left, window_right, softcap,
                 sinks=None):
        return None

    def fake_fwd_varlen(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                        max_seqlen_k, softmax_scale, causal, window_left, window_right,
                        softcap, sinks=None):
        return None

    def fake_fwd_serving(*args):
        return None

    # The backward ops write dq, dk, dv, dq_accum and dsum in place.
    def fake_bwd(dout, q, k, v, out, lse, dq, dk, dv, dq_accum, dsum, softmax_scale, causal,
                 window_left, window_right, softcap, deterministic):
        return None

    def fake_bwd_varlen(dout, q, k, v, out, lse, dq, dk, dv, dq_accum, dsum, cu_seqlens_q,
                        cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                        window_left, window_right, softcap, deterministic):
        return None

    for name, fn in (("fwd", fake_fwd), ("fwd_varlen", fake_fwd_varlen),
                     ("fwd_serving", fake_fwd_serving), ("bwd", fake_bwd),
                     ("bwd_varlen", fake_bwd_varlen)):
        try:
            torch.library.register_fake(f"{namespace}::{name}")(fn)
        except RuntimeError as exc:  # registered before, or an op this build lacks
            if "already" not in str(exc) and "does not exist" not in str(exc):
                raise


def set_input_checks(enabled: bool) -> None:
    """Turns the serving calls' device-side input check on or off, in every FA2 library,
    loaded or not (on unless ``SM7X_FA2_CHECK_INPUTS=0``). The check (block_table entries
    inside the cache, key counts within the cache and the plan, cu_seqlens_q,
    cache_batch_idx / cache_leftpad, the plan itself) runs a small kernel and waits for it:
    one stream sync per eager call of flash_attn_varlen_func over a cache or
    flash_attn_with_kvcache (none under CUDA-graph capture). Off, a bad value gives a
    wrong answer but never an out-of-bounds access (the kernels clamp every index): for
    engines that build those tensors themselves."""
    if not isinstance(enabled, bool):
        raise TypeError(f"sm7x.fa2.set_input_checks: enabled must be a bool, got "
                        f"{type(enabled).__name__}")
    with _lock:
        _input_checks[0] = enabled
        if _loaded:
            import torch

            for arch in _loaded:
                _apply_input_checks(torch, f"sm7x_fa2_{arch}")


def input_checks() -> bool:
    """Whether the serving calls check their device-side inputs (set_input_checks)."""
    return _input_checks[0]


def _apply_input_checks(torch, namespace: str) -> None:
    op = getattr(getattr(torch.ops, namespace), "set_input_checks", None)
    if op is not None:  # a library older than the switch always checks
        op(_input_checks[0])


def load(selection: _select.Selection, device: _select.Device) -> str:
    """Loads the library of ``selection`` (or its fallback arch) once; returns the
    torch op namespace to call. Raises sm7x._select.MissingLibraryError when neither is
    installed."""
    for arch in (selection.arch, selection.fallback):
        if arch is not None and arch in _loaded:
            return f"sm7x_fa2_{arch}"
    with _lock:
        for arch in (selection.arch, selection.fallback):
            if arch is not None and arch in _loaded:
                return f"sm7x_fa2_{arch}"
        import torch

        skipped: list[str] = []
        for arch in (selection.arch, selection.fallback):
            if arch is None:
                continue
            namespace = f"sm7x_fa2_{arch}"
            path, unread = _select.library_search(arch)
            skipped += [u for u in unread if u not in skipped]
            if path is None:
                if _registered(torch, namespace):  # loaded by hand (torch.ops.load_library)
                    _register_fakes(torch, namespace)
                    _apply_input_checks(torch, namespace)
                    _loaded[arch] = Path(f"<{namespace} ops registered outside sm7x>")
                    return namespace
                continue
            if _registered(torch, namespace):
                log.info("sm7x: torch.ops.%s already registered; not loading %s", namespace, path)
            else:
                package = _select.package_name(arch)
                bad = _libfile.problem(path)  # before dlopen: a truncated file is SIGBUS
                if bad is not None:
                    raise _select.broken_library_error(path, bad, package)
                try:
                    torch.ops.load_library(str(path))
                except OSError as exc:
                    raise _select.broken_library_error(
                        path, _libfile.load_failure(exc, torch.__version__), package) from exc
                major, minor = device.capability
                log.info("sm7x: loaded %s for %s (compute capability %d.%d): %s", path,
                         device.describe(), major, minor, selection.reason)
            _register_fakes(torch, namespace)
            _apply_input_checks(torch, namespace)
            _loaded[arch] = path
            return namespace
        raise _select.missing_library_error(selection, device, skipped)
