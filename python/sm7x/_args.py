"""Argument rules shared by sm7x.ops and sm7x.fa2 (no torch import: they read tensors'
shapes, strides and addresses): scalars of the right type, and the memory rules of ops
that write, which csrc/core/ops.cpp applies again for direct torch.ops calls.

Writes are refused into a tensor whose elements may share memory (an expanded tensor, or
strides that let rows run into each other), and where an output certainly overlaps an
input: both are laid out contiguously and their byte spans intersect, or they are the very
same view (the one overlap an op may allow, to run in place). As in torch's own in-place
and out= checks, strided views whose spans interleave (q and k as column slices of one
qkv buffer, K and V halves of vLLM's packed cache) are not refused: they need not share
an element.
"""

from __future__ import annotations

import numbers
import operator
import os

# what an on/off environment variable (SM7X_CHECK_INDICES, SM7X_VLLM_PLATFORM) reads as off
_OFF = ("0", "false", "no", "off")


def env_flag(name: str, default: bool) -> bool:
    """An on/off environment variable: unset or empty gives `default`; 0/false/no/off (any
    case, spaces around ignored) False; any other value True."""
    value = os.environ.get(name, "").strip().lower()
    return default if value == "" else value not in _OFF


def number(api: str, name: str, value) -> float:
    """A real number (not a bool, not a string): float(value)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{api}: {name} must be a number, got {type(value).__name__} "
                        f"{value!r}")
    return float(value)


def integer(api: str, name: str, value) -> int:
    """An int (or anything with __index__, such as a numpy integer; not a bool)."""
    if isinstance(value, bool):
        raise TypeError(f"{api}: {name} must be an int, got bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{api}: {name} must be an int, got {type(value).__name__} "
                        f"{value!r}") from None


def flag(api: str, name: str, value) -> bool:
    """A bool (or 0/1)."""
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    raise TypeError(f"{api}: {name} must be a bool, got {type(value).__name__} {value!r}")


def span(t) -> tuple[int, int]:
    """[first, last] byte address the tensor's elements occupy ((0, -1) when empty)."""
    if t.numel() == 0:
        return (0, -1)
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride())) * t.element_size()
    return (t.data_ptr(), t.data_ptr() + last + t.element_size() - 1)


def overlaps_itself(t) -> bool:
    """True unless each dim's stride clears everything the smaller-stride dims span (the
    sufficient rule for distinct elements that csrc/core/ops.cpp uses too). Expanded dims
    (stride 0, size > 1) always fail it."""
    dims = sorted((abs(st), n) for n, st in zip(t.shape, t.stride()) if n > 1)
    extent = 1  # elements spanned by the dims seen so far
    for st, n in dims:
        if st < extent:
            return True
        extent += (n - 1) * st
    return False


def certainly_overlap(a, b) -> bool:
    """Both contiguous with intersecting spans, or the very same view."""
    a0, a1 = span(a)
    b0, b1 = span(b)
    if not (a0 <= b1 and b0 <= a1):
        return False
    return same_view(a, b) or (a.is_contiguous() and b.is_contiguous())


def same_view(a, b) -> bool:
    return (a.data_ptr() == b.data_ptr() and tuple(a.shape) == tuple(b.shape)
            and tuple(a.stride()) == tuple(b.stride()))


def check_writes(api: str, outputs: dict, inputs: dict, in_place: tuple = ()) -> None:
    """outputs/inputs: name -> tensor (or None). Refuses an output whose elements may
    overlap, two outputs that overlap, and an output that overlaps an input, except the
    pairs named in in_place (output, input) when they are the same view.

    Skipped while torch.compile traces (fake tensors have no addresses): the C++ op checks
    the same rules on the real tensors when the graph runs."""
    import torch

    if torch.compiler.is_compiling():
        return
    outs = [(n, t) for n, t in outputs.items() if t is not None]
    for name, t in outs:
        if t.numel() > 1 and overlaps_itself(t):
            raise ValueError(f"{api}: {name} (shape {tuple(t.shape)}, strides {t.stride()}) is "
                             f"written, but its elements may share memory (an expanded or "
                             f"overlapping view); pass a tensor with its own storage (e.g. "
                             f"{name}.contiguous() or torch.empty_like)")
    for i, (name, t) in enumerate(outs):
        others = outs[i + 1:] + [(n, u) for n, u in inputs.items() if u is not None]
        for other, u in others:
            if (name, other) in in_place and same_view(t, u):
                continue
            if certainly_overlap(t, u):
                raise ValueError(f"{api}: {name} overlaps {other} in memory; {name} is "
                                 f"written while {other} is read or written: pass separate "
                                 f"tensors")
