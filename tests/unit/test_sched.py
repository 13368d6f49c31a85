"""Invariants of the sm7x._sched planners (varlen tile lists and split-KV plans).

Runs on CPU with the standard library only (array.array, memoryview): the module needs
neither torch nor numpy. Costs and plans are checked against brute-force Python
references written from the definitions, not from the C++ code.
"""

import array
import struct
import sys
import threading

import pytest

sched = pytest.importorskip(
    "sm7x._sched", reason="native module not built: run ./test.sh or pip install -e . --no-build-isolation"
)

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
INT32_MAX = 2**31 - 1


# --------------------------------------------------------------------------------------
# helpers and references


def i32(values):
    return array.array("i", values)


def i64(values):
    return array.array("q", values)


def cumsum(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def ceil_div(a, b):
    return -(-a // b)


def rows(buf):
    """Rows of a 2-D result through the buffer protocol only."""
    mv = memoryview(buf)
    assert mv.ndim == 2
    return [tuple(r) for r in mv.tolist()]


def ref_tile_cost(len_q, len_k, m, block_m, block_n, causal):
    """KV blocks a tile visits: blocks holding at least one key visible to one of its rows.

    Visibility is monotone in the key index, so a block holds a visible key for row i iff
    its first key b*block_n is visible; rows are enumerated one by one.
    """
    nblocks = ceil_div(len_k, block_n)
    visited = set()
    for i in range(m * block_m, min((m + 1) * block_m, len_q)):
        for b in range(nblocks):
            if not causal or b * block_n <= i + len_k - len_q:
                visited.add(b)
    return len(visited)


def ref_tile_cost_exhaustive(len_q, len_k, m, block_m, block_n, causal):
    """Same by enumerating every (row, key) pair: the definition itself (small sizes only)."""
    visited = set()
    for i in range(m * block_m, min((m + 1) * block_m, len_q)):
        for j in range(len_k):
            if not causal or j <= i + len_k - len_q:
                visited.add(j // block_n)
    return len(visited)


def ref_tiles(lens_q, lens_k, num_heads, block_m, block_n, causal):
    tiles = []
    for s, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        for m in range(ceil_div(lq, block_m)):
            cost = ref_tile_cost(lq, lk, m, block_m, block_n, causal)
            for h in range(num_heads):
                tiles.append((s, h, m, cost))
    tiles.sort(key=lambda t: (-t[3], t[0], t[1], t[2]))
    return tiles


def ref_split_counts(lens, num_heads, num_sms, block_n, max_splits):
    """The split-KV model, by trying every chunk size C from 1 to max nblocks."""
    nblocks = [ceil_div(n, block_n) for n in lens]
    if not lens or 5 * len(lens) * num_heads >= 4 * num_sms:
        return [1] * len(lens)
    best = None
    for c in range(1, max(max(nblocks), 1) + 1):
        splits = [min(max_splits, max(1, ceil_div(nb, c))) for nb in nblocks]
        chunk = max(ceil_div(nb, s) for nb, s in zip(nblocks, splits))
        makespan = ceil_div(num_heads * sum(splits), num_sms) * chunk
        key = (makespan, sum(splits))
        if best is None or key < best[0]:
            best = (key, splits)
    return best[1]


def check_split_plan(plan, lens, num_heads, num_sms, block_n, max_splits):
    """Structural invariants of a SplitPlan; returns its num_splits as a list."""
    batch = len(lens)
    num_splits = memoryview(plan.num_splits).tolist()
    offsets = memoryview(plan.split_offsets).tolist()
    parts = rows(plan.partitions)
    for buf, shape in (
        (plan.num_splits, (batch,)),
        (plan.split_offsets, (batch + 1,)),
        (plan.partitions, (plan.total_splits, 3)),
    ):
        mv = memoryview(buf)
        assert (mv.format, mv.itemsize, mv.shape, mv.readonly, mv.c_contiguous) == ("i", 4, shape, True, True)
    assert len(plan) == batch
    assert all(1 <= s <= max_splits for s in num_splits)
    assert offsets == cumsum(num_splits)
    assert plan.total_splits == offsets[-1] == len(parts)
    assert plan.waves == ceil_div(num_heads * plan.total_splits, num_sms)
    chunks_max = 0
    for i, n in enumerate(lens):
        mine = parts[offsets[i] : offsets[i + 1]]
        assert [p[0] for p in mine] == [i] * num_splits[i], "partitions not grouped by sequence"
        assert mine[0][1] == 0 and mine[-1][2] == n, "chunks must cover [0, len)"
        for (_, a0, a1), (_, b0, _) in zip(mine, mine[1:]):
            assert a1 == b0, "gap or overlap between chunks"
        nblocks = ceil_div(n, block_n)
        sizes = []
        for _, start, end in mine:
            assert start % block_n == 0, "chunk does not start on a block boundary"
            assert start < end or n == 0, "empty chunk"
            sizes.append(ceil_div(end - start, block_n))
        assert sum(sizes) == nblocks
        if n:
            assert max(sizes) - min(sizes) <= 1, "blocks not spread evenly"
            assert num_splits[i] <= nblocks
        else:
            assert mine == [(i, 0, 0)]
        chunks_max = max(chunks_max, max(sizes))
    assert plan.max_chunk_blocks == chunks_max
    return num_splits


# --------------------------------------------------------------------------------------
# module surface and buffer protocol


def test_module_surface():
    assert "varlen_tiles" in sched.__doc__ and "split_kv_plan" in sched.__doc__
    assert set(sched.__all__) == {"varlen_tiles", "split_kv_plan", "TileList", "SplitPlan", "Int32Buffer"}
    for name in sched.__all__:
        assert getattr(sched, name).__doc__
    with pytest.raises(TypeError):
        sched.TileList()  # results come from the planners only


def test_no_torch_or_numpy_imported(tmp_path):
    import subprocess

    code = (
        "import sys, array, sm7x._sched as s\n"
        "t = s.varlen_tiles(array.array('i', [0, 5]), array.array('i', [0, 5]), 1)\n"
        "assert memoryview(t).shape == (1, 4)\n"
        "assert 'torch' not in sys.modules and 'numpy' not in sys.modules, sorted(sys.modules)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path)


def test_tilelist_buffer_protocol():
    t = sched.varlen_tiles(i32([0, 130, 131]), i32([0, 200, 300]), 2, causal=True)
    mv = memoryview(t)
    assert (mv.format, mv.itemsize, mv.ndim, mv.shape) == ("i", 4, 2, (6, 4))
    assert mv.readonly and mv.c_contiguous and mv.strides == (16, 4)
    assert len(t) == 6 and t.shape == (6, 4)
    assert t.columns == ("seq", "head", "m_block", "cost")
    assert (t.num_heads, t.block_m, t.block_n, t.causal) == (2, 128, 64, True)
    # Hand-computed: seq 0 (130 q, 200 k): last rows 127 and 129 see 198 and 200 keys -> 4
    # blocks each; seq 1 (1 q, 100 k) sees all 100 keys -> 2 blocks.
    expected = [(0, 0, 0, 4), (0, 0, 1, 4), (0, 1, 0, 4), (0, 1, 1, 4), (1, 0, 0, 2), (1, 1, 0, 2)]
    assert rows(t) == expected
    assert t.tolist() == [list(r) for r in expected]
    assert t.total_cost == 20
    assert "TileList(num_tiles=6" in repr(t) and "total_cost=20" in repr(t)
    with pytest.raises(TypeError):
        mv[0, 0] = 1  # read-only
    assert isinstance(t, sched.Int32Buffer)
    # the view keeps the data alive
    del t
    assert mv.tolist()[0] == [0, 0, 0, 4]


def test_struct_unpack_matches_rows():
    t = sched.varlen_tiles(i32([0, 3, 10]), i32([0, 7, 7]), 3, block_m=2, block_n=4)
    raw = bytes(memoryview(t))
    flat = struct.unpack(f"={len(t) * 4}i", raw)
    assert [tuple(flat[k : k + 4]) for k in range(0, len(flat), 4)] == rows(t)


# --------------------------------------------------------------------------------------
# varlen_tiles


@st.composite
def varlen_batches(draw):
    batch = draw(st.integers(0, 5))
    lens_q = draw(st.lists(st.integers(0, 300), min_size=batch, max_size=batch))
    # key lengths both shorter and longer than the queries (cross attention, KV cache)
    lens_k = draw(st.lists(st.integers(0, 400), min_size=batch, max_size=batch))
    return lens_q, lens_k


@SETTINGS
@given(
    varlen_batches(),
    st.integers(1, 3),
    st.sampled_from([16, 64, 128, 48]),
    st.sampled_from([16, 32, 64, 40]),
    st.booleans(),
    st.booleans(),
)
def test_varlen_tiles_match_reference(batch, num_heads, block_m, block_n, causal, use_int64):
    lens_q, lens_k = batch
    make = i64 if use_int64 else i32
    t = sched.varlen_tiles(make(cumsum(lens_q)), make(cumsum(lens_k)), num_heads, block_m, block_n, causal)
    got = rows(t)
    expected = ref_tiles(lens_q, lens_k, num_heads, block_m, block_n, causal)
    # every (seq, head, m_block) exactly once
    keys = [r[:3] for r in got]
    assert len(keys) == len(set(keys))
    assert set(keys) == {r[:3] for r in expected}
    # ordering: longest first, ties by (seq, head, m_block)
    assert got == sorted(got, key=lambda r: (-r[3], r[0], r[1], r[2]))
    # costs against the brute-force reference, and within bounds
    assert got == expected
    for s, _, m, cost in got:
        assert 0 <= cost <= ceil_div(lens_k[s], block_n)
        assert m * block_m < lens_q[s]
        if not causal:
            assert cost == ceil_div(lens_k[s], block_n)
    assert t.total_cost == sum(r[3] for r in got)
    assert len(t) == num_heads * sum(ceil_div(n, block_m) for n in lens_q)


def test_causal_cost_exhaustive_small():
    """Every tile of single-sequence batches with tiny sizes, against the (row, key) definition."""
    for block_m in (1, 2, 3, 4):
        for block_n in (1, 2, 3, 5):
            for len_q in range(0, 10):
                for len_k in range(0, 10):
                    for causal in (False, True):
                        t = sched.varlen_tiles(i32([0, len_q]), i32([0, len_k]), 1, block_m, block_n, causal)
                        got = {r[2]: r[3] for r in rows(t)}
                        want = {
                            m: ref_tile_cost_exhaustive(len_q, len_k, m, block_m, block_n, causal)
                            for m in range(ceil_div(len_q, block_m))
                        }
                        assert got == want, (block_m, block_n, len_q, len_k, causal)


def test_causal_formula_bottom_right():
    # 256 queries, 1024 keys (prefix cached): last row of block m sees m*128+127+768+1 keys
    t = sched.varlen_tiles(i32([0, 256]), i32([0, 1024]), 1, causal=True)
    assert rows(t) == [(0, 0, 1, 16), (0, 0, 0, 14)]
    # square causal: block m sees (m+1)*128 keys
    t = sched.varlen_tiles(i32([0, 512]), i32([0, 512]), 1, causal=True)
    assert rows(t) == [(0, 0, 3, 8), (0, 0, 2, 6), (0, 0, 1, 4), (0, 0, 0, 2)]


def test_causal_tiles_without_keys_are_listed():
    # 300 queries but only 10 keys: rows 0..289 see nothing (bottom-right alignment)
    t = sched.varlen_tiles(i32([0, 300]), i32([0, 10]), 2, block_m=64, block_n=64, causal=True)
    got = rows(t)
    assert len(got) == 2 * 5
    assert [r for r in got if r[3] > 0] == [(0, 0, 4, 1), (0, 1, 4, 1)]
    assert sorted(r[2] for r in got if r[3] == 0) == [0, 0, 1, 1, 2, 2, 3, 3]
    # no keys at all: every tile costs 0, in both modes
    for causal in (False, True):
        t = sched.varlen_tiles(i32([0, 100]), i32([0, 0]), 1, block_m=32, causal=causal)
        assert rows(t) == [(0, 0, m, 0) for m in range(4)]
        assert t.total_cost == 0


@pytest.mark.parametrize(
    "cu_q, cu_k",
    [
        ([0], [0]),  # batch of 0
        ([0, 0, 0], [0, 0, 0]),  # only empty sequences
        ([0, 0, 0], [0, 5, 70]),  # keys but no queries
    ],
)
def test_empty_tile_lists(cu_q, cu_k):
    for make in (i32, i64):
        t = sched.varlen_tiles(make(cu_q), make(cu_k), 4, causal=True)
        mv = memoryview(t)
        assert (len(t), mv.shape, mv.format, mv.tolist(), t.total_cost) == (0, (0, 4), "i", [], 0)
        assert t.tolist() == []


def test_degenerate_sequences():
    # len_q 0 sequences vanish, seqlen 1, lengths that are not block multiples
    lens_q = [0, 1, 129, 0, 64, 65]
    lens_k = [3, 1, 129, 0, 1, 200]
    t = sched.varlen_tiles(i32(cumsum(lens_q)), i32(cumsum(lens_k)), 2, block_m=64, block_n=64, causal=True)
    got = rows(t)
    assert {r[0] for r in got} == {1, 2, 4, 5}
    assert got == ref_tiles(lens_q, lens_k, 2, 64, 64, True)


def test_int64_and_mixed_inputs():
    lens_q, lens_k = [5, 200, 0, 77], [9, 300, 12, 77]
    ref = rows(sched.varlen_tiles(i32(cumsum(lens_q)), i32(cumsum(lens_k)), 3, 32, 16, True))
    assert rows(sched.varlen_tiles(i64(cumsum(lens_q)), i64(cumsum(lens_k)), 3, 32, 16, True)) == ref
    assert rows(sched.varlen_tiles(i32(cumsum(lens_q)), i64(cumsum(lens_k)), 3, 32, 16, True)) == ref
    if array.array("l").itemsize == 8:
        ll = array.array("l", cumsum(lens_q))
        assert rows(sched.varlen_tiles(ll, i64(cumsum(lens_k)), 3, 32, 16, True)) == ref
    # raw bytes cast to int64, including a misaligned view
    raw = b"\0" + struct.pack(f"={len(lens_q) + 1}q", *cumsum(lens_q))
    view = memoryview(raw)[1:].cast("q")
    assert rows(sched.varlen_tiles(view, memoryview(i32(cumsum(lens_k))), 3, 32, 16, True)) == ref


def test_numpy_input_if_available():
    np = pytest.importorskip("numpy")
    cu = np.array([0, 100, 300], dtype=np.int64)
    t = sched.varlen_tiles(cu, cu.astype(np.int32), 2, causal=True)
    arr = np.asarray(t)
    assert arr.dtype == np.int32 and arr.shape == (len(t), 4)
    assert arr.tolist() == [list(r) for r in rows(t)]
    with pytest.raises(ValueError, match="byte order|format"):
        sched.varlen_tiles(cu.astype(">i4"), cu, 2)
    with pytest.raises(ValueError, match="contiguous"):
        sched.varlen_tiles(np.arange(10, dtype=np.int32)[::3], np.arange(4, dtype=np.int32), 1)


def test_default_parameters():
    t = sched.varlen_tiles(i32([0, 1000]), i32([0, 1000]), 1)
    assert (t.block_m, t.block_n, t.causal) == (128, 64, False)
    assert len(t) == 8 and {r[3] for r in rows(t)} == {16}


# --------------------------------------------------------------------------------------
# bad input -> ValueError (TypeError for non-buffers), never a crash


def _bad_varlen_cases():
    good = i32([0, 4, 9])
    two_d = memoryview(struct.pack("=4i", 0, 1, 2, 3)).cast("i", (2, 2))
    strided = memoryview(i32([0, 9, 4, 9, 9, 9]))[::2]
    return [
        ("float", (array.array("d", [0, 4, 9]), good, 1), {}, "format"),
        ("int16", (array.array("h", [0, 4, 9]), good, 1), {}, "int32 or int64"),
        ("unsigned", (array.array("I", [0, 4, 9]), good, 1), {}, "format"),
        ("bytes", (b"\0\0\0\0", good, 1), {}, "format"),
        ("2-D", (two_d, good, 1), {}, "1-D"),
        ("strided", (good, strided, 1), {}, "contiguous"),
        ("empty", (i32([]), i32([]), 1), {}, "empty"),
        ("start", (i32([1, 4, 9]), good, 1), {}, "start at 0"),
        ("decreasing", (good, i32([0, 9, 4]), 1), {}, "non-decreasing"),
        ("length mismatch", (good, i32([0, 4]), 1), {}, "batch \\+ 1"),
        ("int64 overflow", (i64([0, 2**31]), i64([0, 1]), 1), {}, "int32"),
        ("int64 negative", (i64([0, -(2**40)]), i64([0, 1]), 1), {}, "non-decreasing"),
        ("heads 0", (good, good, 0), {}, "num_heads"),
        ("heads negative", (good, good, -2), {}, "num_heads"),
        ("heads too big", (good, good, 2**31), {}, "num_heads"),
        ("block_m 0", (good, good, 1), {"block_m": 0}, "block_m"),
        ("block_n negative", (good, good, 1), {"block_n": -64}, "block_n"),
        ("tile overflow", (i32([0, INT32_MAX]), i32([0, 1]), 2), {"block_m": 1}, "tiles"),
    ]


@pytest.mark.parametrize("name, args, kwargs, match", _bad_varlen_cases(), ids=lambda v: v if isinstance(v, str) else "")
def test_varlen_bad_input_raises_value_error(name, args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        sched.varlen_tiles(*args, **kwargs)


def test_error_messages_say_how_to_fix():
    with pytest.raises(ValueError) as e:
        sched.varlen_tiles(array.array("d", [0.0, 1.0]), i32([0, 1]), 1)
    msg = str(e.value)
    assert "cu_seqlens_q" in msg and "'d'" in msg and "'i'" in msg and "array.array" in msg
    with pytest.raises(ValueError) as e:
        sched.varlen_tiles(i32([0, 5, 3]), i32([0, 5, 9]), 1)
    assert "cu_seqlens_q[2]=3" in str(e.value)


def test_non_buffer_raises_type_error():
    with pytest.raises(TypeError, match="buffer protocol"):
        sched.varlen_tiles([0, 4], i32([0, 4]), 1)
    with pytest.raises(TypeError, match="buffer protocol"):
        sched.split_kv_plan([4, 4], 1, 80)


# --------------------------------------------------------------------------------------
# split_kv_plan


@SETTINGS
@given(
    st.lists(st.integers(0, 5000), min_size=0, max_size=6),
    st.integers(1, 8),
    st.sampled_from([1, 8, 40, 80, 108]),
    st.sampled_from([16, 64, 100]),
    st.sampled_from([1, 2, 7, 128]),
    st.booleans(),
)
def test_split_plan_invariants(lens, num_heads, num_sms, block_n, max_splits, use_int64):
    make = i64 if use_int64 else i32
    plan = sched.split_kv_plan(make(lens), num_heads, num_sms, block_n, max_splits)
    num_splits = check_split_plan(plan, lens, num_heads, num_sms, block_n, max_splits)
    # the documented model, brute-forced over every chunk size
    assert num_splits == ref_split_counts(lens, num_heads, num_sms, block_n, max_splits)
    # longer sequences never get fewer splits
    for a, sa in zip(lens, num_splits):
        for b, sb in zip(lens, num_splits):
            if a >= b:
                assert sa >= sb
    if 5 * len(lens) * num_heads >= 4 * num_sms:
        assert num_splits == [1] * len(lens)


def test_no_split_when_device_is_full():
    lens = [8192, 8192]
    # 2 * 32 = 64 >= 0.8 * 80: one split each
    plan = sched.split_kv_plan(i32(lens), 32, 80)
    assert memoryview(plan.num_splits).tolist() == [1, 1]
    assert rows(plan.partitions) == [(0, 0, 8192), (1, 0, 8192)]
    assert plan.waves == 1
    # 2 * 31 = 62 < 64: the same batch is split
    plan = sched.split_kv_plan(i32(lens), 31, 80)
    assert min(memoryview(plan.num_splits).tolist()) > 1
    check_split_plan(plan, lens, 31, 80, 64, 128)


def test_longer_sequences_get_more_splits():
    lens = [128, 2048, 65536]
    plan = sched.split_kv_plan(i32(lens), 1, 80)
    s = memoryview(plan.num_splits).tolist()
    assert s[0] < s[1] < s[2]
    check_split_plan(plan, lens, 1, 80, 64, 128)


def test_split_fills_waves():
    # one long sequence, 4 heads, 80 SMs: splitting must shrink the estimated makespan
    lens = [32768]
    plan = sched.split_kv_plan(i32(lens), 4, 80)
    nblocks = 32768 // 64
    assert plan.waves * plan.max_chunk_blocks < nblocks
    assert plan.total_splits * 4 <= 80 * plan.waves
    assert plan.total_splits == ref_split_counts(lens, 4, 80, 64, 128)[0]


def test_max_splits_respected():
    lens = [100_000, 50_000, 10]
    plan = sched.split_kv_plan(i32(lens), 1, 80, block_n=64, max_splits=3)
    s = check_split_plan(plan, lens, 1, 80, 64, 3)
    assert max(s) <= 3 and s[0] == 3


def test_empty_and_zero_length_split_plans():
    plan = sched.split_kv_plan(i32([]), 8, 80)
    assert (plan.total_splits, plan.waves, len(plan)) == (0, 0, 0)
    assert memoryview(plan.split_offsets).tolist() == [0]
    assert memoryview(plan.partitions).shape == (0, 3)
    assert memoryview(plan.num_splits).shape == (0,)
    plan = sched.split_kv_plan(i64([0, 0, 1000, 0]), 1, 80)
    parts = rows(plan.partitions)
    assert [p for p in parts if p[0] != 2] == [(0, 0, 0), (1, 0, 0), (3, 0, 0)]
    check_split_plan(plan, [0, 0, 1000, 0], 1, 80, 64, 128)


def test_split_plan_objects():
    plan = sched.split_kv_plan(i32([300, 70]), 2, 80, block_n=64, max_splits=4)
    assert plan.num_splits is plan.num_splits  # the same object, not a fresh copy
    assert isinstance(plan.partitions, sched.Int32Buffer)
    assert plan.partitions.shape == (plan.total_splits, 3)
    assert "SplitPlan(batch=2" in repr(plan) and "total_splits=" in repr(plan)
    assert "num_splits" in repr(plan.num_splits)
    assert (plan.num_heads, plan.num_sms, plan.block_n, plan.max_splits) == (2, 80, 64, 4)
    with pytest.raises(TypeError):
        memoryview(plan.num_splits)[0] = 7


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((i32([5, -1]), 1, 80), {}, "negative"),
        ((i64([5, 2**33]), 1, 80), {}, "int32"),
        ((i32([5]), 0, 80), {}, "num_heads"),
        ((i32([5]), 1, 0), {}, "num_sms"),
        ((i32([5]), 1, -3), {}, "num_sms"),
        ((i32([5]), 1, 80), {"block_n": 0}, "block_n"),
        ((i32([5]), 1, 80), {"max_splits": 0}, "max_splits"),
        ((array.array("f", [5.0]), 1, 80), {}, "format"),
        ((memoryview(struct.pack("=4i", 1, 2, 3, 4)).cast("i", (2, 2)), 1, 80), {}, "1-D"),
        ((memoryview(i32([1, 2, 3, 4]))[::2], 1, 80), {}, "contiguous"),
    ],
)
def test_split_bad_input_raises_value_error(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        sched.split_kv_plan(*args, **kwargs)


# --------------------------------------------------------------------------------------
# threads (the planners run without the GIL) and a large batch


def test_concurrent_planning_is_deterministic():
    lens_q = [(i * 37) % 900 + 1 for i in range(200)]
    lens_k = [n + (i * 11) % 300 for i, n in enumerate(lens_q)]
    cu_q, cu_k = i32(cumsum(lens_q)), i32(cumsum(lens_k))
    expected = bytes(memoryview(sched.varlen_tiles(cu_q, cu_k, 16, causal=True)))
    results = []

    def work():
        for _ in range(5):
            results.append(bytes(memoryview(sched.varlen_tiles(cu_q, cu_k, 16, causal=True))))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(results) == 20 and all(r == expected for r in results)


def test_large_batch():
    lens = [(i * 7919) % 16384 + 1 for i in range(2000)]
    t = sched.varlen_tiles(i32(cumsum(lens)), i32(cumsum(lens)), 32, causal=True)
    assert len(t) == 32 * sum(ceil_div(n, 128) for n in lens)
    costs = memoryview(t).cast("B").cast("i").tolist()[3::4]
    assert costs == sorted(costs, reverse=True)
    plan = sched.split_kv_plan(i32([1 << 30, 5, 1 << 20]), 1, 132, block_n=16, max_splits=1 << 20)
    check = memoryview(plan.num_splits).tolist()
    assert check[0] >= check[2] >= check[1] >= 1


# --------------------------------------------------------------------------------------
# split_kv_plan as decode uses it (sm7x.fa2.plan_decode): one upper bound of the key count
# for every sequence, the serving kernels' key tiles (16, 32, 64), long caches


@pytest.mark.parametrize("block_n", [16, 32, 64])
@pytest.mark.parametrize("length", [1, 15, 16, 17, 1000, 4097, 32768, 100_000])
def test_decode_plan_for_one_bound(block_n, length):
    """A plan for an upper bound (every sequence at max_seqlen_k) gives every sequence the
    same chunks: starts on block_n multiples, the last one ending at the bound."""
    for batch, heads, sms, max_splits in ((1, 1, 132, 128), (2, 8, 264, 7), (4, 2, 80, 128)):
        lens = [length] * batch
        plan = sched.split_kv_plan(i32(lens), heads, sms, block_n, max_splits)
        num_splits = check_split_plan(plan, lens, heads, sms, block_n, max_splits)
        assert num_splits == ref_split_counts(lens, heads, sms, block_n, max_splits)
        assert len(set(num_splits)) == 1
        chunks = [[p[1:] for p in rows(plan.partitions) if p[0] == i] for i in range(batch)]
        assert all(c == chunks[0] for c in chunks), "sequences of one bound got different chunks"
        assert chunks[0][-1][1] == length
        assert all(start % block_n == 0 for start, _ in chunks[0])


def test_decode_plan_max_splits_one_never_splits():
    # one long sequence on a large device would be split; max_splits=1 keeps one chunk each
    lens = [100_000, 32_768, 1]
    assert sched.split_kv_plan(i32(lens[:1]), 1, 132, 16, 128).total_splits > 1
    plan = sched.split_kv_plan(i32(lens), 1, 132, block_n=16, max_splits=1)
    assert memoryview(plan.num_splits).tolist() == [1, 1, 1]
    assert rows(plan.partitions) == [(0, 0, 100_000), (1, 0, 32_768), (2, 0, 1)]
    assert plan.total_splits == 3 and plan.max_chunk_blocks == ceil_div(100_000, 16)
