"""Greedy outputs of two engines compared token by token (no vLLM, no torch: unit-tested
on the CPU by test_token_match.py).

Two fp16 engines that differ only in their attention kernels round differently, so greedy
decoding may part where the model's two best tokens are nearly tied. The rule: the tokens
are equal; or, at the first difference, each run's chosen token is within ``tie_tol`` (in
logprob) of the other's in both runs (a near tie), and before it the logprob of every
chosen token agrees within ``lp_tol``. After a difference the sequences no longer share a
context and are not compared.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class Match:
    ok: bool
    equal: bool
    steps: int  # tokens compared
    first_difference: int | None  # index of the first differing token
    max_logprob_error: float  # over the shared steps
    tie_gap: float | None  # at the first difference: the larger of the two runs' gaps
    why: str

    def describe(self) -> str:
        if self.equal:
            return f"equal ({self.steps} tokens, logprob error <= {self.max_logprob_error:.2e})"
        return (f"first difference at token {self.first_difference} of {self.steps} (tie gap "
                f"{self.tie_gap if self.tie_gap is None else round(self.tie_gap, 4)}, logprob "
                f"error before it <= {self.max_logprob_error:.2e}){'' if self.ok else ': ' + self.why}")


def _lp(step: dict, token: int) -> float | None:
    v = step.get(str(token), step.get(token))
    return None if v is None else float(v)


def _not_finite(*steps: dict) -> bool:
    """A NaN or inf logprob (an engine whose activations overflowed) compares as nothing:
    max() over NaN errors would keep the old value and pass it."""
    return any(not math.isfinite(float(v)) for step in steps for v in step.values())


def compare(ours: dict, ref: dict, *, lp_tol: float, tie_tol: float) -> Match:
    """``ours``/``ref``: {"tokens": [int], "logprobs": [{token: logprob}] per step} (vLLM's
    top-k logprobs of each step, the chosen token always among them)."""
    a, b = ours["tokens"], ref["tokens"]
    if len(a) != len(b):
        return Match(False, False, min(len(a), len(b)), None, math.inf, None,
                     f"lengths differ: {len(a)} vs {len(b)} tokens")
    worst = 0.0
    for i, (x, y) in enumerate(zip(a, b)):
        lo, lr = ours["logprobs"][i], ref["logprobs"][i]
        if _not_finite(lo, lr):
            return Match(False, False, len(a), i, worst, None,
                         f"step {i}: a logprob is not finite (NaN or inf)")
        if x == y:
            ex, ey = _lp(lo, x), _lp(lr, y)
            if ex is None or ey is None:
                return Match(False, False, len(a), None, worst, None,
                             f"step {i}: the chosen token has no logprob")
            worst = max(worst, abs(ex - ey))
            continue
        # the first difference: a near tie in both runs?
        ours_x, ours_y, ref_x, ref_y = _lp(lo, x), _lp(lo, y), _lp(lr, x), _lp(lr, y)
        if None in (ours_x, ours_y, ref_x, ref_y):
            return Match(False, False, len(a), i, worst, None,
                         f"step {i}: token {x} (ours) / {y} (reference) is not among the other "
                         f"run's top logprobs: not a near tie")
        gap = max(ours_x - ours_y, ref_y - ref_x)
        ok = worst <= lp_tol and gap <= tie_tol
        why = "" if ok else (f"logprob error {worst:.3g} > {lp_tol}" if worst > lp_tol
                             else f"tie gap {gap:.3g} > {tie_tol}: not a near tie")
        return Match(ok, False, len(a), i, worst, gap, why)
    ok = worst <= lp_tol
    return Match(ok, True, len(a), None, worst, None,
                 "" if ok else f"logprob error {worst:.3g} > {lp_tol}")
