"""The comparison rule of the engine tests (token_match.compare), on hand-made outputs."""

from __future__ import annotations

from token_match import compare

TOL = dict(lp_tol=0.05, tie_tol=0.1)


def _run(tokens, steps):
    return {"tokens": tokens, "logprobs": steps}


def test_equal_tokens_close_logprobs():
    ref = _run([5, 6], [{"5": -0.1, "7": -2.0}, {"6": -0.3, "8": -1.5}])
    ours = _run([5, 6], [{"5": -0.11, "7": -2.0}, {"6": -0.29, "8": -1.5}])
    m = compare(ours, ref, **TOL)
    assert m.ok and m.equal and abs(m.max_logprob_error - 0.01) < 1e-9


def test_equal_tokens_far_logprobs_fail():
    ref = _run([5], [{"5": -0.1}])
    ours = _run([5], [{"5": -0.5}])
    m = compare(ours, ref, **TOL)
    assert not m.ok and "logprob error" in m.why


def test_difference_at_near_tie_passes():
    ref = _run([5, 6, 1], [{"5": -0.1}, {"6": -0.70, "9": -0.72}, {"1": -1.0}])
    ours = _run([5, 9, 2], [{"5": -0.1}, {"9": -0.70, "6": -0.71}, {"2": -1.0}])
    m = compare(ours, ref, **TOL)
    assert m.ok and not m.equal and m.first_difference == 1 and m.tie_gap < 0.05


def test_difference_without_tie_fails():
    ref = _run([6], [{"6": -0.1, "9": -2.5}])
    ours = _run([9], [{"9": -0.1, "6": -2.5}])
    m = compare(ours, ref, **TOL)
    assert not m.ok and "not a near tie" in m.why


def test_difference_outside_topk_fails():
    ref = _run([6], [{"6": -0.1, "7": -0.2}])
    ours = _run([9], [{"9": -0.1, "8": -0.2}])
    m = compare(ours, ref, **TOL)
    assert not m.ok and "not among" in m.why


def test_length_mismatch_fails():
    assert not compare(_run([1], [{"1": 0.0}]), _run([1, 2], [{"1": 0.0}, {"2": 0.0}]), **TOL).ok


def test_non_finite_logprobs_fail():
    """NaN logprobs (overflowed activations) fail, equal tokens or not; -inf too."""
    ref = _run([5, 6], [{"5": -0.1}, {"6": -0.2}])
    for bad in (float("nan"), float("-inf")):
        m = compare(_run([5, 6], [{"5": -0.1}, {"6": bad}]), ref, **TOL)
        assert not m.ok and "not finite" in m.why
        m = compare(ref, _run([5, 6], [{"5": bad, "7": -3.0}, {"6": -0.2}]), **TOL)
        assert not m.ok and "not finite" in m.why
