"""Invariants of the sm7x._sched planner (split-KV plans for decode).

Runs on CPU with the standard library only (array.array, memoryview): the module needs
neither torch nor numpy. Plans are checked against brute-force Python
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
# module surface, buffer protocol and inputs


def test_module_surface():
    assert "split_kv_plan" in sched.__doc__
    assert set(sched.__all__) == {"split_kv_plan", "SplitPlan", "Int32Buffer"}
    for name in sched.__all__:
        assert getattr(sched, name).__doc__
    with pytest.raises(TypeError):
        sched.Int32Buffer()  # results come from the planner only


def test_no_torch_or_numpy_imported(tmp_path):
    import subprocess

    code = (
        "import sys, array, sm7x._sched as s\n"
        "p = s.split_kv_plan(array.array('i', [5]), 1, 80)\n"
        "assert memoryview(p.partitions).shape == (1, 3)\n"
        "assert 'torch' not in sys.modules and 'numpy' not in sys.modules, sorted(sys.modules)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path)


def test_partitions_buffer_protocol():
    plan = sched.split_kv_plan(i32([200, 64]), 1, 80, block_n=64, max_splits=2)
    t = plan.partitions
    mv = memoryview(t)
    assert (mv.format, mv.itemsize, mv.ndim, mv.shape) == ("i", 4, 2, (3, 3))
    assert mv.readonly and mv.c_contiguous and mv.strides == (12, 4)
    assert len(t) == 3 and t.shape == (3, 3) and t.name == "partitions"
    # hand-computed: 4 and 1 blocks of 64 keys, at most 2 splits: 2 chunks of 2 blocks, 1
    assert memoryview(plan.num_splits).tolist() == [2, 1]
    assert rows(t) == [(0, 0, 128), (0, 128, 200), (1, 0, 64)]
    assert t.tolist() == [list(r) for r in rows(t)]
    with pytest.raises(TypeError):
        mv[0, 0] = 1  # read-only
    raw = bytes(mv)
    flat = struct.unpack(f"={len(t) * 3}i", raw)
    assert [tuple(flat[k : k + 3]) for k in range(0, len(flat), 3)] == rows(t)
    # the view keeps the data alive
    first = rows(t)[0]
    del t, plan
    assert tuple(mv.tolist()[0]) == first


def test_int64_and_mixed_inputs():
    lens = [5, 200, 0, 77, 9000]
    ref = rows(sched.split_kv_plan(i32(lens), 2, 80, 16).partitions)
    assert rows(sched.split_kv_plan(i64(lens), 2, 80, 16).partitions) == ref
    if array.array("l").itemsize == 8:
        assert rows(sched.split_kv_plan(array.array("l", lens), 2, 80, 16).partitions) == ref
    # raw bytes cast to int64, including a misaligned view
    raw = b"\0" + struct.pack(f"={len(lens)}q", *lens)
    view = memoryview(raw)[1:].cast("q")
    assert rows(sched.split_kv_plan(view, 2, 80, 16).partitions) == ref


def test_numpy_input_if_available():
    np = pytest.importorskip("numpy")
    lens = np.array([100, 3000], dtype=np.int64)
    plan = sched.split_kv_plan(lens, 2, 80)
    arr = np.asarray(plan.partitions)
    assert arr.dtype == np.int32 and arr.shape == (plan.total_splits, 3)
    assert arr.tolist() == [list(r) for r in rows(plan.partitions)]
    assert rows(sched.split_kv_plan(lens.astype(np.int32), 2, 80).partitions) == rows(plan.partitions)
    with pytest.raises(ValueError, match="byte order|format"):
        sched.split_kv_plan(lens.astype(">i4"), 2, 80)
    with pytest.raises(ValueError, match="contiguous"):
        sched.split_kv_plan(np.arange(10, dtype=np.int32)[::3], 1, 80)


def test_default_parameters():
    plan = sched.split_kv_plan(i32([1000]), 1, 80)
    assert (plan.block_n, plan.max_splits) == (64, 128)


def _bad_buffers():
    two_d = memoryview(struct.pack("=4i", 0, 1, 2, 3)).cast("i", (2, 2))
    strided = memoryview(i32([0, 9, 4, 9, 9, 9]))[::2]
    return [
        ("float", array.array("d", [0, 4, 9]), "format"),
        ("int16", array.array("h", [0, 4, 9]), "int32 or int64"),
        ("unsigned", array.array("I", [0, 4, 9]), "format"),
        ("bytes", b"\0\0\0\0", "format"),
        ("2-D", two_d, "1-D"),
        ("strided", strided, "contiguous"),
    ]


@pytest.mark.parametrize("name, buf, match", _bad_buffers(), ids=lambda v: v if isinstance(v, str) else "")
def test_bad_buffers_raise_value_error(name, buf, match):
    with pytest.raises(ValueError, match=match):
        sched.split_kv_plan(buf, 1, 80)


def test_error_messages_say_how_to_fix():
    with pytest.raises(ValueError) as e:
        sched.split_kv_plan(array.array("d", [0.0, 1.0]), 1, 80)
    msg = str(e.value)
    assert "seqlens_k" in msg and "'d'" in msg and "'i'" in msg and "array.array" in msg
    with pytest.raises(ValueError) as e:
        sched.split_kv_plan(i32([5, 3, -1]), 1, 80)
    assert "seqlens_k[2]=-1" in str(e.value)


def test_non_buffer_raises_type_error():
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
# threads (the planner runs without the GIL) and a large batch


def test_concurrent_planning_is_deterministic():
    lens = [(i * 37) % 9000 + 1 for i in range(200)]
    expected = bytes(memoryview(sched.split_kv_plan(i32(lens), 1, 132, 16).partitions))
    results = []

    def work():
        for _ in range(5):
            results.append(bytes(memoryview(sched.split_kv_plan(i32(lens), 1, 132, 16).partitions)))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(results) == 20 and all(r == expected for r in results)


def test_large_batch():
    lens = [(i * 7919) % 16384 + 1 for i in range(2000)]
    plan = sched.split_kv_plan(i32(lens), 1, 132, block_n=16)
    check_split_plan(plan, lens, 1, 132, 16, 128)
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
