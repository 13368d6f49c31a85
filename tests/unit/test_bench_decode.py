"""sm7x.bench.decode without a GPU: argument parsing, the byte / budget / FLOP arithmetic,
the goal lines, the paged-cache layout, the context table, and decode and prefill rows
(fp16 and 8-bit caches) run on CPU against a torch stand-in of the paged API (timings
meaningless; the real run is on CUDA)."""

from __future__ import annotations

import array
import json
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="sm7x.bench.decode needs torch")

import sm7x.fa2 as fa2  # noqa: E402
from sm7x.bench import core, decode as D  # noqa: E402

GiB = 1 << 30


# ---------------------------------------------------------------------------------------
# CLI


def test_parse_sizes():
    assert D.parse_sizes("1k,32K, 4096,") == [1024, 32768, 4096]
    assert D.parse_sizes("1m") == [1 << 20]
    for bad in ("", "x", "0", "-1k", "1.5k"):
        with pytest.raises(ValueError):
            D.parse_sizes(bad)


def test_parse_args_defaults_quick_and_overrides():
    a = D.parse_args([])
    assert a.batches == [1, 8, 16, 64]
    assert a.lens == [1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]
    assert a.prefill_batches == [1, 4]
    assert (a.iters, a.repeats, a.budget, a.page_size, a.num_splits) == (20, 10, 0.4, 16, 0)
    assert a.out is None and a.plot is None
    assert a.shape == D.Shape(32, 8, 128) == D.DEFAULT_SHAPE and str(a.shape) == "32/8/128"
    assert D.parse_args(["--shape", "16/8/256"]).shape == D.Shape(16, 8, 256)

    q = D.parse_args(["--quick"])
    assert q.batches == [1, 16] and q.lens == [1024, 32768] and q.prefill_batches == [1]
    assert (q.iters, q.repeats) == (5, 5)
    # the goal row (32k x batch 16) is in the quick subset
    assert D.GOAL_BATCH in q.batches and D.GOAL_LEN in q.lens

    o = D.parse_args(["--quick", "--batches", "2,3", "--lens", "2k", "--prefill-batches", "0",
                      "--iters", "7", "--out", "d.json", "--plot", "d.png"])
    assert (o.batches, o.lens, o.prefill_batches, o.iters, o.repeats) == ([2, 3], [2048], [], 7, 5)
    assert (o.out, o.plot) == ("d.json", "d.png")


@pytest.mark.parametrize("argv", [["--lens", "abc"], ["--page-size", "12"], ["--budget", "0"],
                                  ["--budget", "1.5"], ["--iters", "0"], ["--batches", ""],
                                  ["--shape", "32/8"], ["--shape", "32/5/128"],
                                  ["--shape", "8/8/260"], ["--shape", "a/b/c"]])
def test_parse_args_rejects(argv, capsys):
    with pytest.raises(SystemExit) as e:
        D.parse_args(argv)
    assert e.value.code == 2


@pytest.mark.parametrize("text, why", [("32/8", "HEADS/KV_HEADS/HEAD_DIM"),
                                       ("32/5/128", "must divide"), ("8/8/100", "multiple of 8"),
                                       ("8/8/520", "8..512"), ("0/0/64", "must divide")])
def test_parse_shape_says_what_is_wrong(text, why):
    with pytest.raises(ValueError, match=why):
        D.parse_shape(text)


def test_cli_help_and_registry():
    env_cmd = [sys.executable, "-m", "sm7x.bench"]
    help_ = subprocess.run(env_cmd + ["decode", "--help"], capture_output=True, text=True,
                           timeout=120)
    assert help_.returncode == 0, help_.stderr
    assert "--quick" in help_.stdout and "--batches" in help_.stdout
    listing = subprocess.run(env_cmd, capture_output=True, text=True, timeout=60)
    assert listing.returncode == 2 and "decode" in listing.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit")
def test_main_without_cuda(capsys):
    assert D.main(["--quick"]) == 1
    assert "needs a CUDA device" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------
# Arithmetic


def test_bytes_and_bandwidth():
    # 16 sequences x 32k keys x 8 kv heads x 128 x (K and V) x 2 bytes = 2 GiB
    assert D.kv_bytes(16, 32768) == 2 * GiB
    assert D.qo_bytes(16) == 2 * 16 * 32 * 128 * 2
    assert D.useful_bytes(16, 32768) == 2 * GiB + D.qo_bytes(16)
    assert D.useful_bytes(2, 100, q_per_seq=5) == D.kv_bytes(2, 100) + D.qo_bytes(10)
    # int8: one byte per element plus each K and V row's float32 scale
    assert D.useful_bytes(2, 100, kv_dtype="int8_per_token_head") == (
        D.kv_bytes(2, 100, elem=1) + 2 * 100 * D.KV_HEADS * 2 * 4 + D.qo_bytes(2))
    assert D.gbps(2_000_000_000, 1e-3) == pytest.approx(2000.0)
    assert D.gbps(10, None) is None and D.gbps(10, 0.0) is None
    assert D.ratio(2.0, 1.0) == 2.0 and D.ratio(None, 1.0) is None and D.ratio(1.0, None) is None


def test_cache_bytes_and_budget():
    c = D.cache_bytes(3, 20)  # 20 keys: 2 whole pages of 16
    assert c["paged"] == 3 * 2 * 16 * 8 * 128 * 4
    assert c["contiguous"] == D.kv_bytes(3, 20) and c["expanded"] == 0
    assert c["total"] == c["paged"] + c["contiguous"]
    e = D.cache_bytes(3, 20, expanded=True)
    assert e["expanded"] == 4 * D.kv_bytes(3, 20) and e["total"] == c["total"] + e["expanded"]
    g = D.cache_bytes(3, 20, expanded=True, shape=D.Shape(16, 8, 256))  # --shape 16/8/256
    assert g["paged"] == 3 * 2 * 16 * 8 * 256 * 4 and g["contiguous"] == D.kv_bytes(3, 20, 8, 256)
    assert g["expanded"] == D.kv_bytes(3, 20, 16, 256) == 2 * g["contiguous"]
    assert D.num_pages(16) == 1 and D.num_pages(17) == 2 and D.num_pages(1) == 1

    assert D.fits_budget(40, 100, 0.4) and not D.fits_budget(41, 100, 0.4)
    free = 139 * GiB  # an H200
    assert not D.fits_budget(D.cache_bytes(64, 131072)["total"], free, 0.4)
    assert D.fits_budget(D.cache_bytes(64, 65536)["total"], free, 0.4)
    assert not D.fits_budget(D.cache_bytes(64, 65536, expanded=True)["total"], free, 0.4)
    assert D.fits_budget(D.cache_bytes(16, 32768, expanded=True)["total"], free, 0.4)


def test_prefill_flops_counts_bottom_right_causal():
    new, prefix, b, h, d = 3, 5, 2, 4, 8
    seen = sum(prefix + i + 1 for i in range(new))  # 6 + 7 + 8
    assert D.prefill_flops(b, new, prefix, h, d) == 4 * b * h * d * seen
    mask = D._bottom_right_mask(new, prefix + new, "cpu")
    assert int(mask.sum()) == seen and bool(mask[-1].all()) and not bool(mask[0, -1])
    assert D.prefill_flops(1) == 4 * 32 * 128 * (512 * 16384 + 512 * 513 // 2)


class _Obj:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def test_plan_splits_finds_the_count():
    assert D.plan_splits(None) == (None, None)
    assert D.plan_splits(_Obj(num_splits=4)) == (4, "num_splits")
    assert D.plan_splits(_Obj(num_splits=torch.tensor([3, 5, 5]))) == (5, "num_splits")
    assert D.plan_splits(_Obj(splits=array.array("i", [2, 2]))) == (2, "splits")
    assert D.plan_splits(_Obj(num_splits=(2, 9, 2))) == (9, "num_splits")  # DecodePlan's tuple
    assert D.plan_splits(_Obj(num_splits=[[1, 6], [2]])) == (6, "num_splits")
    # 0 is the num_splits=0 ("decide") argument, not a count: look further
    assert D.plan_splits(_Obj(num_splits=0, split_plan=_Obj(num_splits=array.array("i", [7]))))\
        == (7, "split_plan.num_splits")
    assert D.plan_splits(_Obj(num_splits=lambda: 3, max_splits=128)) == (None, None)
    assert D.plan_splits(_Obj(num_splits=torch.tensor([], dtype=torch.int32))) == (None, None)


def _result(**row):
    base = {"batch": D.GOAL_BATCH, "kv_len": D.GOAL_LEN, "kv_mbytes": 2147.5}
    return {"results": [dict(base, **row)], "prefill": [], "notes": [],
            "copy": {"gbps": 4000.0, "bytes": 4, "samples_gbps": [4000.0]},
            "baselines": {"decode": {"sdpa_flash": {"gqa": None, "note": "needs sm80"}}}}


def test_dense_goal_lines():
    rows = [dict(batch=16, kv_len=32768, sm7x_dense_eager_gbps=3000.0,
                 sm7x_kvcache_eager_gbps=3200.0, sm7x_dense_prefill_eager_gbps=480.0),
            dict(batch=1, kv_len=131072, sm7x_dense_eager_gbps=1000.0,
                 sm7x_kvcache_eager_gbps=2000.0),
            dict(batch=1, kv_len=4096, skipped="too big")]
    met, missed = D.dense_goal_lines({"results": rows})
    assert met.startswith("flash_attn_func decode, 32k x batch 16: 3000 GB/s, 0.94 of")
    assert "[met]" in met and "the prefill kernel: 480 GB/s" in met
    assert "0.50 of flash_attn_with_kvcache's 2000" in missed and "[missed]" in missed
    assert "prefill kernel" not in missed


def test_goal_lines():
    r = _result(sm7x_over_sdpa_flash=0.8, frac_of_copy=0.55)
    (line,) = D.goal_lines(r)
    assert line.startswith("32k x batch 16: sm7x/sdpa_flash = 0.80 (goal >= 0.75)")
    assert "fraction of copy bandwidth = 0.55 (goal >= 0.60)" in line
    assert "[met]" in line and "[missed]" in line
    (na,) = D.goal_lines(_result(sm7x_over_sdpa_flash=None, frac_of_copy=0.7))
    assert "sm7x/sdpa_flash = n/a (sdpa_flash: needs sm80)" in na and "= 0.70" in na
    (sk,) = D.goal_lines(_result(skipped="too big"))
    assert "skipped (too big)" in sk
    (nm,) = D.goal_lines({"results": []})
    assert "not measured" in nm


def test_finish_fraction_warnings_and_tables(capsys):
    r = _result(sm7x_gbps=3000.0, sm7x_us=700.0, max_abs_diff=0.5, num_splits=4,
                sm7x_over_sdpa_flash=None)
    r["results"].append({"batch": 64, "kv_len": 131072, "skipped": "caches need 69 GB"})
    r["prefill"].append({"batch": 1, "q_len": 512, "prefix": 16384, "sm7x_us": None,
                         "max_abs_diff": None})
    D.finish(r)
    assert r["results"][0]["frac_of_copy"] == pytest.approx(0.75)
    assert any("max abs diff" in w for w in r["warnings"])
    assert any("prefill batch 1: sm7x did not run" in w for w in r["warnings"])
    assert any("64x131072" in n for n in r["notes"])
    assert r["goal"] == D.goal_lines(r)
    D.finish(r)  # idempotent
    assert len(r["warnings"]) == 2 and len(r["notes"]) == 1
    r.update(device="X", capability="9.0", torch="t", forced="sm75")
    D.print_table(r)
    out = capsys.readouterr().out
    assert "DIFF!" in out and "skipped: caches need 69 GB" in out
    assert "SM7X_FA2_FORCE=sm75" in out and "32k x batch 16" in out


def test_draw(tmp_path):
    pytest.importorskip("matplotlib")
    from sm7x.bench import _output

    rows = [{"batch": b, "kv_len": n, "sm7x_gbps": 1000.0 + n / 100, "sm7x_eager_gbps": 900.0,
             "sdpa_flash_gbps": 800.0, "sdpa_efficient_gbps": 300.0,
             "sdpa_efficient_gqa": "expanded"} for b in (1, 16) for n in (1024, 32768)]
    rows.append({"batch": 64, "kv_len": 131072, "skipped": "big"})
    pre = [{"batch": 1, "sm7x_tflops": 100.0, "sdpa_efficient_tflops": 50.0,
            "sdpa_efficient_lr_tflops": None, "sdpa_flash_lr_tflops": 120.0}]
    result = {"device": "X", "forced": None, "results": rows,
              "config": {"page_size": 16, "heads": 16, "kv_heads": 8, "head_dim": 256},
              "prefill": pre, "copy": {"gbps": 4000.0}}
    png = tmp_path / "d.png"
    _output.write(result, str(tmp_path / "d.json"), str(png), D.draw)
    assert png.stat().st_size > 0


# ---------------------------------------------------------------------------------------
# Layout and references (CPU tensors)


def test_paged_inputs_hold_the_contiguous_keys():
    gen = torch.Generator().manual_seed(1)
    batch, kv_len, page = 3, 40, 16  # not a multiple of the page size
    shape = D.Shape(4, 2, 64)
    k_c, v_c, k_p, v_p, bt, seqused = D._paged_inputs(batch, kv_len, page, gen, "cpu", shape)
    assert k_c.shape == (batch, 2, kv_len, 64)
    assert k_p.shape == (batch * 3, page, 2, 64) and bt.shape == (batch, 3)
    assert bt.dtype == torch.int32 and seqused.tolist() == [kv_len] * batch
    assert sorted(bt.flatten().tolist()) == list(range(batch * 3))
    assert bt.flatten().tolist() != list(range(batch * 3))  # permuted (seeded)
    for b in range(batch):
        for j in (0, 15, 16, 39):
            p = int(bt[b, j // page])
            assert torch.equal(k_p[p, j % page], k_c[b, :, j])
            assert torch.equal(v_p[p, j % page], v_c[b, :, j])
        assert not k_p[int(bt[b, 2]), kv_len % page:].any()  # tail of the last page zeroed


def test_references_agree_with_sdpa():
    gen = torch.Generator().manual_seed(2)
    b, sq, sk = 2, 5, 24
    q = torch.randn(b, D.HEADS, sq, D.HEAD_DIM, generator=gen)
    k, v = (torch.randn(b, D.KV_HEADS, sk, D.HEAD_DIM, generator=gen) for _ in range(2))
    ke, ve = D._expand(k, D.DEFAULT_SHAPE), D._expand(v, D.DEFAULT_SHAPE)
    mask = D._bottom_right_mask(sq, sk, "cpu")
    sdpa = torch.nn.functional.scaled_dot_product_attention
    torch.testing.assert_close(D._reference(q, k, v, causal=True),
                               sdpa(q, ke, ve, attn_mask=mask), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(D._reference(q, k, v, causal=False), sdpa(q, ke, ve),
                               atol=1e-5, rtol=1e-5)
    q1 = q[:, :, :1].half()
    dec = D._decode_reference(q1.squeeze(2), k.half(), v.half())
    torch.testing.assert_close(dec.float(), sdpa(q1.float(), ke, ve).squeeze(2), atol=2e-3,
                               rtol=0)


# ---------------------------------------------------------------------------------------
# Rows on CPU against a torch stand-in of the paged API


class _Plan:
    def __init__(self, batch, kv_cache_dtype=None):
        self.num_splits = torch.full((batch,), 3, dtype=torch.int32)
        self.kv_cache_dtype = kv_cache_dtype


def _fake_paged(q, kc, vc, cu_q, bt, seqused):
    outs = []
    page = kc.shape[1]
    for b in range(bt.shape[0]):
        n, s0, s1 = int(seqused[b]), int(cu_q[b]), int(cu_q[b + 1])
        tok = torch.arange(n)
        slots = bt[b].long()[tok // page] * page + tok % page
        k = kc.flatten(0, 1)[slots].transpose(0, 1)[None]
        v = vc.flatten(0, 1)[slots].transpose(0, 1)[None]
        o = D._reference(q[s0:s1].transpose(0, 1)[None], k, v, causal=True)[0]
        outs.append(o.transpose(0, 1).to(q.dtype))
    return torch.cat(outs)


@pytest.fixture
def fake_api(monkeypatch):
    calls = []

    def plan_decode(batch_size, max_seqlen_q, max_seqlen_k, num_heads, num_kv_heads, head_dim,
                    *, device=None, num_splits=0, kv_cache_dtype=None):
        calls.append(("plan", batch_size, max_seqlen_q, max_seqlen_k, num_heads, num_kv_heads,
                      head_dim) + ((kv_cache_dtype,) if kv_cache_dtype else ()))
        return _Plan(batch_size, kv_cache_dtype)

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=False, block_table=None,
               seqused_k=None, out=None, scheduler_metadata=None, k_descale=None,
               v_descale=None, kv_cache_dtype=None):
        assert cu_k is None and causal and isinstance(scheduler_metadata, _Plan)
        assert scheduler_metadata.kv_cache_dtype == kv_cache_dtype  # a plan per cache format
        if kv_cache_dtype is not None:  # an 8-bit cache: codes * descale, as the kernels read
            calls.append(("kv8", kv_cache_dtype, k.dtype))
            assert k.dtype == D.KV8_TORCH_DTYPES[kv_cache_dtype] == v.dtype
            for d in (k_descale, v_descale):
                assert d.dtype == torch.float32 and d.shape == (1,)
            k, v = (k.float() * k_descale).half(), (v.float() * v_descale).half()
        else:
            assert k_descale is None and v_descale is None and k.dtype == torch.float16
        out.copy_(_fake_paged(q, k, v, cu_q, block_table, seqused_k))
        return out

    def kvcache(q, kc, vc, cache_seqlens=None, block_table=None, causal=False, num_splits=0):
        b, sq = q.shape[:2]
        cu = torch.arange(b + 1, dtype=torch.int32) * sq
        return _fake_paged(q.flatten(0, 1), kc, vc, cu, block_table, cache_seqlens).view(q.shape)

    def dense(q, k, v, causal=False):  # one query row: causal changes nothing
        assert q.shape[1] == 1 and causal
        qh, kh, vh = (t.transpose(1, 2).float() for t in (q, k, v))  # [B, H, S, D]
        g = qh.shape[1] // kh.shape[1]
        kh, vh = kh.repeat_interleave(g, 1), vh.repeat_interleave(g, 1)
        p = (qh @ kh.transpose(-1, -2) * qh.shape[-1] ** -0.5).softmax(-1)
        return (p @ vh).transpose(1, 2).half()

    monkeypatch.setattr(fa2, "plan_decode", plan_decode, raising=False)
    monkeypatch.setattr(fa2, "flash_attn_func", dense)
    monkeypatch.setattr(fa2, "flash_attn_varlen_func", varlen)
    monkeypatch.setattr(fa2, "flash_attn_with_kvcache", kvcache, raising=False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(D.runs, "_time", lambda fn, iters, repeats, graph: core._time(
        fn, iters, repeats, graph, dev="cpu"))
    return calls


def _args(**kw):
    import argparse

    return argparse.Namespace(**dict(dict(iters=1, repeats=1, budget=0.4, page_size=16,
                                          num_splits=0, shape=D.DEFAULT_SHAPE), **kw))


def test_decode_row_on_cpu(fake_api):
    flash = D.probe_sdpa("sdpa_flash", "decode", "cpu")  # torch's CPU flash kernel
    if flash["gqa"] is None:
        pytest.skip(f"no CPU SDPA flash kernel here: {flash['note']}")
    baselines = {"sdpa_flash": flash, "sdpa_efficient": {"gqa": None, "note": "n/a"}}
    gen = torch.Generator().manual_seed(3)
    row = D._decode_row(2, 40, _args(), baselines, 10 * GiB, gen, "cpu", 0)
    assert fake_api == [("plan", 2, 1, 40, 32, 8, 128)]
    assert row["num_splits"] == 3 and row["num_splits_attr"] == "num_splits"
    assert row["sm7x_timing"] == "graph"  # on CPU core._time ignores graph
    for key in ("sm7x_gbps", "sm7x_eager_gbps", "sm7x_kvcache_eager_gbps", "sdpa_flash_gbps",
                "sm7x_dense_eager_gbps", "sm7x_dense_prefill_eager_gbps",
                "sm7x_over_sdpa_flash"):
        assert row[key] > 0, key
    assert row["sdpa_efficient_gbps"] is None and row["sm7x_over_sdpa_efficient"] is None
    assert row["max_abs_diff"] < 1e-2 and set(row["max_abs_diff_vs"]) == {
        "torch_matmul", "sm7x_kvcache", "sm7x_dense", "sm7x_dense_prefill", "sdpa_flash"}
    assert row["useful_bytes"] == D.useful_bytes(2, 40) and not row["notes"]

    big = D._decode_row(64, 131072, _args(), baselines, 10 * GiB, gen, "cpu", 0)
    assert "budget" in big["skipped"] and "sm7x_gbps" not in big


def test_decode_row_at_another_shape(fake_api):
    """--shape reaches every tensor, the plan and the byte count (Gemma-2 9B: 16/8/256)."""
    flash = D.probe_sdpa("sdpa_flash", "decode", "cpu", D.Shape(16, 8, 256))
    if flash["gqa"] is None:
        pytest.skip(f"no CPU SDPA flash kernel here: {flash['note']}")
    shape = D.Shape(16, 8, 256)
    gen = torch.Generator().manual_seed(6)
    row = D._decode_row(2, 40, _args(shape=shape), {"sdpa_flash": flash}, 10 * GiB, gen, "cpu", 0)
    assert fake_api == [("plan", 2, 1, 40, 16, 8, 256)]
    assert row["useful_bytes"] == D.useful_bytes(2, 40, shape=shape) != D.useful_bytes(2, 40)
    assert row["useful_bytes"] == 2 * 40 * 8 * 256 * 2 * 2 + 2 * 2 * 16 * 256 * 2
    assert row["max_abs_diff"] < 1e-2 and row["sm7x_gbps"] > 0 and not row["notes"]


def test_decode_row_records_a_failing_sm7x(fake_api, monkeypatch):
    def broken(*a, **kw):
        raise RuntimeError("kernel not built\nmore")

    monkeypatch.setattr(fa2, "flash_attn_varlen_func", broken)
    gen = torch.Generator().manual_seed(4)
    row = D._decode_row(1, 16, _args(), {"sdpa_flash": {"gqa": None}}, 10 * GiB, gen, "cpu", 0)
    assert row["sm7x_us"] is None and row["sm7x_timing"] is None
    assert any("sm7x failed: RuntimeError: kernel not built" in n for n in row["notes"])
    result = {"results": [row], "prefill": []}
    D.finish(result)
    assert any("sm7x did not run" in w for w in result["warnings"])


@pytest.mark.parametrize("shape", [D.DEFAULT_SHAPE, D.Shape(16, 8, 256)])
def test_prefill_row_on_cpu(fake_api, monkeypatch, shape):
    lr = D.probe_sdpa("sdpa_flash", "lr", "cpu", shape)
    if lr["gqa"] is None:
        pytest.skip(f"no CPU SDPA flash kernel with causal_lower_right here: {lr['note']}")
    # No memory-efficient kernel on CPU: run the explicit-mask baseline on the math one.
    from torch.nn.attention import SDPBackend

    monkeypatch.setattr(D.runs, "_backend", lambda name: SDPBackend.MATH
                        if name == "sdpa_efficient" else SDPBackend.FLASH_ATTENTION)
    monkeypatch.setattr(D.runs, "PREFILL_NEW", 32)
    monkeypatch.setattr(D.runs, "PREFILL_PREFIX", 96)
    baselines = {"sdpa_efficient": {"gqa": "expanded"}, "sdpa_efficient_lr": {"gqa": None},
                 "sdpa_flash_lr": lr}
    gen = torch.Generator().manual_seed(5)
    row = D._prefill_row(2, _args(shape=shape), baselines, 10 * GiB, gen, "cpu")
    assert fake_api == [("plan", 2, 32, 128, shape.heads, shape.kv_heads, shape.head_dim)]
    assert row["flops"] == D.prefill_flops(2, 32, 96, shape.heads, shape.head_dim)
    assert row["sm7x_tflops"] > 0 and row["sdpa_efficient_tflops"] > 0
    assert row["sdpa_flash_lr_tflops"] > 0 and row["sdpa_efficient_lr_tflops"] is None
    assert row["max_abs_diff"] < 1e-2, row["max_abs_diff_vs"]
    assert row["max_abs_diff_vs"]["sdpa_flash_lr_vs_sdpa_efficient"] < 1e-2
    assert not row["notes"]


# ---------------------------------------------------------------------------------------
# 8-bit KV caches (--kv-dtype)


def test_parse_kv_dtypes():
    assert D.parse_args([]).kv_dtypes == ["fp16"]  # default: today's run
    assert D.parse_kv_dtypes("fp16") == ["fp16"]
    # fp16 always runs (the ratios are against it), in KV_DTYPES order, no duplicates
    assert D.parse_kv_dtypes("fp8_e4m3") == ["fp16", "fp8_e4m3"]
    assert D.parse_kv_dtypes(" FP8_E5M2, fp16,fp8_e5m2") == ["fp16", "fp8_e5m2"]
    assert D.parse_kv_dtypes("fp8") == ["fp16", "fp8_e4m3"]  # vLLM's name for E4M3
    assert D.parse_kv_dtypes("int8") == ["fp16", "int8_per_token_head"]
    assert D.parse_kv_dtypes("all") == ["fp16", "fp8_e4m3", "fp8_e5m2",
                                        "int8_per_token_head"] == list(D.KV_DTYPES)
    assert D.parse_args(["--kv-dtype", "all"]).kv_dtypes == list(D.KV_DTYPES)
    for bad, what in (("int4", "'int4'"), ("fp16,bf16", "'bf16'"), ("fp8_e4m3fn", "'fp8_e4m3fn'")):
        with pytest.raises(ValueError, match=what) as e:
            D.parse_kv_dtypes(bad)
        assert "choose from fp16, fp8_e4m3, fp8_e5m2, int8_per_token_head" in str(e.value)
    with pytest.raises(ValueError, match="empty"):
        D.parse_kv_dtypes(" , ")


@pytest.mark.parametrize("argv, why", [(["--kv-dtype", "e4m3"], "unknown cache format 'e4m3'"),
                                       (["--kv-dtype", ""], "empty"),
                                       (["--weights-gb", "0"], "--weights-gb must be > 0")])
def test_parse_args_rejects_kv_dtype(argv, why, capsys):
    with pytest.raises(SystemExit) as e:
        D.parse_args(argv)
    assert e.value.code == 2 and why in capsys.readouterr().err


def test_bytes_per_format():
    # an 8-bit cache reads 1 byte per K/V element: 16 x 32k x 8 x 128 x 2 = 1 GiB; q and out
    # stay fp16
    for fmt in ("fp8_e4m3", "fp8_e5m2"):
        assert D.KV_ELEM[fmt] == 1
        assert D.useful_bytes(16, 32768, kv_dtype=fmt) == GiB + D.qo_bytes(16)
    assert D.useful_bytes(16, 32768, kv_dtype="fp16") == D.useful_bytes(16, 32768)
    assert D.kv_bytes(1, 131072, elem=1) == 131072 * 8 * 128 * 2 == D.kv_bytes(1, 131072) // 2
    shape = D.Shape(16, 8, 256)
    assert D.useful_bytes(2, 40, shape=shape, kv_dtype="fp8_e5m2") == \
        2 * 40 * 8 * 256 * 2 * 1 + 2 * 2 * 16 * 256 * 2
    # GB/s of the bytes that format reads: the same time gives about half fp16's GB/s
    t = 1e-3
    assert D.gbps(D.useful_bytes(16, 32768, kv_dtype="fp8_e4m3"), t) == pytest.approx(
        (GiB + D.qo_bytes(16)) / t / 1e9)
    assert D.time_ratio(0.5, 1.0) == 0.5 and D.time_ratio(None, 1.0) is None
    assert D.time_ratio(1.0, 0.0) is None
    assert D.kv8_descale(448.0, "fp8_e4m3") == pytest.approx(1.0)
    assert D.kv8_descale(57344.0, "fp8_e5m2") == pytest.approx(1.0)
    assert D.kv8_descale(0.0, "fp8_e4m3") > 0  # no division by zero downstream


def test_budget_counts_8bit_caches():
    c = D.cache_bytes(3, 20)
    assert c["paged_8bit"] == 0 and c["total"] == c["paged"] + c["contiguous"]
    one = D.cache_bytes(3, 20, kv8=1)
    two = D.cache_bytes(3, 20, kv8=2, expanded=True)
    assert one["paged_8bit"] == c["paged"] // 2 == 3 * 2 * 16 * 8 * 128 * 2  # whole pages
    assert one["total"] == c["total"] + c["paged"] // 2
    assert two["paged_8bit"] == c["paged"]
    assert two["total"] == c["total"] + two["expanded"] + c["paged"]
    free = 139 * GiB  # an H200, 40% budget = 55.6 GiB
    # 64 x 64k: fp16 paged + contiguous = 32 GiB fits; with two 8-bit copies (+16 GiB) too;
    # 64 x 64k with the expanded baseline (+64 GiB) never did
    assert D.fits_budget(D.cache_bytes(64, 65536, kv8=2)["total"], free, 0.4)
    free = 80 * GiB  # an H100: 32 GiB budget: 16 x 64k fp16 = 8 GiB, + 2 x 2 GiB
    assert D.cache_bytes(16, 65536, kv8=2)["total"] == 12 * GiB


def _decode_row_kv8(fake_api, kv8, free=10 * GiB, batch=2, kv_len=40, seed=7):
    gen = torch.Generator().manual_seed(seed)
    baselines = {"sdpa_flash": {"gqa": None, "note": "n/a"}}
    return D._decode_row(batch, kv_len, _args(kv8=kv8), baselines, free, gen, "cpu", 0)


def test_decode_row_8bit_on_cpu(fake_api):
    row = _decode_row_kv8(fake_api, ("fp8_e4m3", "fp8_e5m2"))
    assert ("kv8", "fp8_e4m3", torch.float8_e4m3fn) in fake_api
    assert ("kv8", "fp8_e5m2", torch.float8_e5m2) in fake_api
    # one plan per cache format: fp16's, then each 8-bit format's
    assert [c[7:] for c in fake_api if c[0] == "plan"] == [(), ("fp8_e4m3",), ("fp8_e5m2",)]
    assert row["sm7x_us"] > 0 and not row["notes"], row["notes"]
    for fmt in ("fp8_e4m3", "fp8_e5m2"):
        p = f"sm7x_{fmt}"
        assert row[f"{p}_useful_bytes"] == D.useful_bytes(2, 40, kv_dtype=fmt)
        assert row[f"{p}_us"] > 0 and row[f"{p}_timing"] == "graph"
        assert row[f"{p}_gbps"] == pytest.approx(row[f"{p}_useful_bytes"] / row[f"{p}_us"] / 1e3)
        assert row[f"{p}_time_ratio"] == pytest.approx(row[f"{p}_us"] / row["sm7x_us"])
        # against the dequantized reference: exact up to fp16 rounding; quantization itself
        # moves the output (more for e5m2's 2 mantissa bits than e4m3's 3)
        assert row[f"{p}_max_abs_diff"] < 1e-2
        assert row[f"{p}_diff_vs_fp16"] > row[f"{p}_max_abs_diff"]
    assert row["sm7x_fp8_e5m2_diff_vs_fp16"] > row["sm7x_fp8_e4m3_diff_vs_fp16"]
    lines = D.format_kv8_lines(row, ("fp8_e4m3", "fp8_e5m2"))
    assert len(lines) == 2 and "e4m3" in lines[0] and "e5m2" in lines[1]
    assert f"x{row['sm7x_fp8_e4m3_time_ratio']:.2f} fp16 time" in lines[0]


def test_decode_row_8bit_over_budget(fake_api):
    fp16 = D.cache_bytes(2, 40)["total"]
    with8 = D.cache_bytes(2, 40, kv8=2)["total"]
    free = int((fp16 + with8) / 2 / 0.4)  # fp16 caches fit the 40% budget, + 8-bit ones not
    row = _decode_row_kv8(fake_api, ("fp8_e4m3", "fp8_e5m2"), free=free)
    assert not row.get("skipped") and row["sm7x_us"] > 0
    assert "2 8-bit copies" in row["kv8_skipped"]
    assert any("the 8-bit rows are skipped" in n for n in row["notes"])
    assert row["sm7x_fp8_e4m3_us"] is None and not any(c[0] == "kv8" for c in fake_api)
    assert D.format_kv8_lines(row, ["fp8_e4m3"])[0].split()[:2] == ["e4m3", "skipped:"]
    result = {"results": [row], "prefill": [], "config": {"kv_dtypes": ["fp16", "fp8_e4m3"]}}
    D.finish(result)
    assert not result["warnings"]  # skipped on purpose, not a failure


def test_8bit_timing_matches_fp16(fake_api, monkeypatch):
    """A graph capture that fails for the 8-bit call: eager against fp16 eager, noted."""
    seen = []

    def fake_time(fn, iters, repeats, graph):
        seen.append(graph)
        if graph and len(seen) > 1:
            raise RuntimeError("capture failed")
        return 2e-3 if graph else 4e-3

    monkeypatch.setattr(D.runs, "_time", fake_time)
    notes: list[str] = []
    fp16 = {"graph": 1e-3}
    t, how, ref = D._time_like_fp16("sm7x fp8_e4m3", lambda: None, _args(), notes, "graph",
                                    {"graph": 1e-3}, lambda: None)
    assert (t, how, ref) == (2e-3, "graph", 1e-3)  # the first (graph) call succeeds
    t, how, ref = D._time_like_fp16("sm7x fp8_e4m3", lambda: None, _args(), notes, "graph",
                                    fp16, lambda: None)
    assert (t, how, ref) == (4e-3, "eager", 4e-3) and fp16["eager"] == 4e-3  # fp16 eager timed
    assert any("eager against fp16 eager" in n for n in notes)
    assert D._time_like_fp16("x", lambda: None, _args(), notes, None, {}, None) == (None,) * 3


def test_encode_cache_in_slices(monkeypatch):
    gen = torch.Generator().manual_seed(8)
    t = (torch.randn(5, 16, 2, 64, generator=gen) * 3).half()
    monkeypatch.setattr(D.runs, "_CHUNK_BYTES", 16 * 2 * 64 * 4 * 2)  # 2 pages a slice
    assert len(D.runs._slices(t)) == 3
    from sm7x.fa2._serving import KV_CACHE_DTYPES, encode_codes

    for fmt, big in (("fp8_e4m3", 448.0), ("fp8_e5m2", 57344.0)):
        codes, d = D._encode_cache(t, fmt)
        assert codes.dtype == D.KV8_TORCH_DTYPES[fmt] and d.shape == (1,)
        assert d.item() == pytest.approx(t.abs().max().item() / big, rel=1e-6)
        whole = encode_codes(t, KV_CACHE_DTYPES[fmt], d)  # in one piece
        assert torch.equal(codes.view(torch.uint8), whole.view(torch.uint8))
        assert codes.float().abs().max().item() == big  # amax lands on the top code


def test_prefill_row_8bit_on_cpu(fake_api, monkeypatch):
    monkeypatch.setattr(D.runs, "PREFILL_NEW", 32)
    monkeypatch.setattr(D.runs, "PREFILL_PREFIX", 96)
    baselines = {"sdpa_efficient": {"gqa": None}, "sdpa_efficient_lr": {"gqa": None},
                 "sdpa_flash_lr": {"gqa": None}}
    gen = torch.Generator().manual_seed(9)
    row = D._prefill_row(2, _args(kv8=("fp8_e4m3",)), baselines, 10 * GiB, gen, "cpu")
    kv8_calls = {c for c in fake_api if c[0] == "kv8"}
    assert kv8_calls == {("kv8", "fp8_e4m3", torch.float8_e4m3fn)}
    assert [c[7:] for c in fake_api if c[0] == "plan"] == [(), ("fp8_e4m3",)]  # one per format
    assert row["sm7x_timing"] == "graph" and row["sm7x_fp8_e4m3_timing"] == "graph"
    assert row["sm7x_fp8_e4m3_tflops"] > 0
    assert row["sm7x_fp8_e4m3_time_ratio"] == pytest.approx(
        row["sm7x_fp8_e4m3_us"] / row["sm7x_us"])
    # the bottom-right causal reference over the dequantized prefix, chunk by chunk
    assert row["sm7x_fp8_e4m3_max_abs_diff"] < 1e-2
    assert row["sm7x_fp8_e4m3_diff_vs_fp16"] > row["sm7x_fp8_e4m3_max_abs_diff"]
    assert not row["notes"], row["notes"]
    (line,) = D.format_kv8_lines(row, ["fp8_e4m3"], prefill=True)
    assert "e4m3" in line and "fp16 time" in line


def _kv8_result(decode_ratios: dict, prefill_ratios: dict, kinds=("fp16", "fp8_e4m3")):
    rows = [{"batch": b, "kv_len": n, "kv_mbytes": 1.0, "sm7x_us": 100.0,
             "sm7x_fp8_e4m3_us": None if x is None else 100.0 * x,
             "sm7x_fp8_e4m3_time_ratio": x, "sm7x_fp8_e4m3_timing": "graph"}
            for (b, n), x in decode_ratios.items()]
    pre = [{"batch": b, "q_len": 512, "prefix": 16384, "sm7x_us": 1000.0,
            "sm7x_fp8_e4m3_us": 1000.0 * x, "sm7x_fp8_e4m3_time_ratio": x}
           for b, x in prefill_ratios.items()]
    return {"results": rows, "prefill": pre, "notes": [], "config": {"kv_dtypes": list(kinds)},
            "copy": {"gbps": 1000.0, "bytes": 4, "samples_gbps": [1000.0]}}


def test_kv8_goal_lines_met_and_missed():
    assert D.GOAL_KV8_POINTS == ((16, 32768), (1, 131072))
    assert (D.GOAL_KV8_STEP, D.GOAL_KV8_PREFILL) == (0.60, 1.10)
    r = _kv8_result({(16, 32768): 0.55, (1, 131072): 0.71}, {1: 1.04, 4: 1.2})
    lines = D.kv8_goal_lines(r)
    assert lines == [
        "fp8_e4m3 cache, 32k x batch 16: step time / fp16 = 0.55 (goal <= 0.60) [met]",
        "fp8_e4m3 cache, 128k x batch 1: step time / fp16 = 0.71 (goal <= 0.60) [missed]",
        "fp8_e4m3 cache, chunked prefill batch 1 (512 q / 16k prefix): time / fp16 = 1.04 "
        "(goal <= 1.10) [met]",
        "fp8_e4m3 cache, chunked prefill batch 4 (512 q / 16k prefix): time / fp16 = 1.20 "
        "(goal <= 1.10) [missed]"]
    # exactly at the goal counts as met
    (at,) = [x for x in D.kv8_goal_lines(_kv8_result({(16, 32768): 0.6}, {})) if "32k" in x]
    assert at.endswith("[met]")
    D.finish(r)
    assert r["goal"] == D.goal_lines(r) + lines and len(r["goal"]) == 5


def test_kv8_goal_lines_not_measured_skipped_failed():
    r = _kv8_result({(16, 32768): None}, {}, kinds=("fp16", "fp8_e4m3"))
    lines = D.kv8_goal_lines(r)
    assert "32k x batch 16: step time / fp16 = n/a (sm7x fp8_e4m3 did not run" in lines[0]
    assert lines[1] == ("fp8_e4m3 cache, 128k x batch 1: not measured "
                        "(add --batches 1 --lens 128k)")
    assert lines[2] == "fp8_e4m3 cache, chunked prefill: not measured (no --prefill-batches)"
    r["results"][0]["kv8_skipped"] = "caches with 1 8-bit copies need 9 GB > budget 8 GB"
    assert "skipped (caches with 1 8-bit" in D.kv8_goal_lines(r)[0]
    both = _kv8_result({(16, 32768): 0.5}, {}, kinds=("fp16", "fp8_e4m3", "fp8_e5m2"))
    assert sum("fp8_e5m2 cache" in x for x in D.kv8_goal_lines(both)) == 3


def test_finish_and_tables_with_8bit(capsys):
    r = _kv8_result({(16, 32768): 0.55}, {1: 1.04})
    row = r["results"][0]
    row.update(sm7x_gbps=800.0, sm7x_fp8_e4m3_gbps=700.0, sm7x_fp8_e4m3_max_abs_diff=0.5,
               sm7x_fp8_e4m3_diff_vs_fp16=0.6, num_splits=2)
    r["results"].append({"batch": 1, "kv_len": 131072, "kv_mbytes": 1.0, "sm7x_us": 10.0,
                         "sm7x_fp8_e4m3_us": None, "sm7x_fp8_e4m3_time_ratio": None})
    D.finish(r)
    assert row["sm7x_fp8_e4m3_frac_of_copy"] == pytest.approx(0.7)
    assert row["frac_of_copy"] == pytest.approx(0.8)
    assert any("fp8_e4m3 cache vs the dequantized reference = 5.000e-01" in w
               for w in r["warnings"])
    assert any("kv_len 131072: sm7x over the fp8_e4m3 cache did not run" in w
               for w in r["warnings"])
    r.update(device="X", capability="7.5", torch="t", forced=None)
    D.print_table(r)
    out = capsys.readouterr().out
    assert "x0.55 fp16 time, 70% copy, max diff 5.0e-01 (vs fp16 6.0e-01)  DIFF!" in out
    assert "[met]" in out and "128k x batch 1: step time / fp16 = n/a" in out


def test_default_run_unchanged(fake_api):
    """Without --kv-dtype: no 8-bit field, line, goal or config entry."""
    gen = torch.Generator().manual_seed(3)
    row = D._decode_row(2, 40, _args(), {"sdpa_flash": {"gqa": None}}, 10 * GiB, gen, "cpu", 0)
    assert not [k for k in row if "fp8" in k or "kv8" in k]
    assert not any(c[0] == "kv8" for c in fake_api)
    assert D.format_kv8_lines(row, D.kv8_formats({"results": [row]})) == []
    r = _result(sm7x_over_sdpa_flash=0.8, frac_of_copy=0.7)
    D.finish(r)
    assert D.kv8_formats(r) == [] and D.kv8_goal_lines(r) == [] and r["goal"] == D.goal_lines(r)
    assert len(r["goal"]) == 1


def test_main_writes_kv_dtypes_and_context_table(monkeypatch, tmp_path, capsys):
    """main's wiring with the GPU run replaced: --kv-dtype reaches run(), the JSON carries
    the context table, and a default run passes fp16 alone."""
    seen = {}

    def fake_run(*args, result, shape, kv_dtypes):
        seen["kv_dtypes"] = kv_dtypes
        result.update({"results": [], "prefill": [], "notes": [], "warnings": [],
                       "device": "X", "capability": "7.5", "torch": "t", "forced": None,
                       "config": {"heads": 32}})
        if len(kv_dtypes) > 1:
            result["config"]["kv_dtypes"] = kv_dtypes
        D.finish(result)
        return result

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(fa2, "plan_decode", lambda *a, **k: None, raising=False)
    monkeypatch.setattr(D.cli, "run", fake_run)
    out = tmp_path / "d.json"
    assert D.main(["--out", str(out)]) == 0
    assert seen["kv_dtypes"] == ["fp16"]
    data = json.loads(out.read_text())
    assert "kv_dtypes" not in data["config"] and len(data["goal"]) == 1
    assert data["context_table"]["kind"].startswith("arithmetic")
    assert "Largest KV context" not in capsys.readouterr().out  # in the JSON, not printed
    assert D.main(["--out", str(out), "--kv-dtype", "fp8_e5m2"]) == 0
    assert seen["kv_dtypes"] == ["fp16", "fp8_e5m2"]
    assert any("fp8_e5m2 cache" in g for g in json.loads(out.read_text())["goal"])


def test_draw_with_8bit(tmp_path):
    pytest.importorskip("matplotlib")
    from sm7x.bench import _output

    rows = [{"batch": 16, "kv_len": n, "sm7x_gbps": 1000.0, "sm7x_fp8_e4m3_gbps": 900.0,
             "sm7x_fp8_e5m2_gbps": 850.0} for n in (1024, 32768)]
    pre = [{"batch": 1, "sm7x_tflops": 100.0, "sm7x_fp8_e4m3_tflops": 95.0}]
    result = {"device": "X", "forced": None, "results": rows, "prefill": pre,
              "config": {"page_size": 16, "heads": 32, "kv_heads": 8, "head_dim": 128,
                         "kv_dtypes": ["fp16", "fp8_e4m3", "fp8_e5m2"]},
              "copy": {"gbps": 4000.0}}
    png = tmp_path / "d.png"
    _output.write(result, None, str(png), D.draw)
    assert png.stat().st_size > 0


# ---------------------------------------------------------------------------------------
# The context table (arithmetic from model configs)


def test_context_table_by_hand():
    assert D.kv_bytes_per_token(32, 8, 128, 2) == 131072  # 2 x 32 x 8 x 128 x 2 = 128 KiB
    assert D.kv_bytes_per_token(32, 8, 128, 1) == 65536
    assert D.kv_bytes_per_token(32, 8, 128, 1, 4) == 67584  # int8: + a 4-byte scale per row
    t = D.context_table()
    assert t["kind"] == "arithmetic from model config numbers, not measured"
    assert (t["utilization"], t["reserve_bytes"], t["page_size"]) == (0.9, GiB, 16)
    rows = {(r["card"], r["model"], r["weights"]): r for r in t["rows"]}

    # V100 32 GB (31.74 GiB as torch reports it), Llama-3.1-8B fp16, by hand:
    #   31.74 x 2**30 = 34,080,565,494 bytes; x 0.9 = 30,672,508,945
    #   - 16.06e9 weights - 1 GiB (1,073,741,824) = 13,538,767,121 bytes for KV
    #   fp16: / (131,072 B/token x 16) = 6455.8 pages -> 6455 x 16 = 103,280 tokens
    #   8-bit: / (65,536 x 16) = 12911.6 pages -> 12911 x 16 = 206,576 tokens, one sequence
    #   capped at Llama-3.1's 131,072; int8 (132 bytes a row): / (67,584 x 16) = 12520.3
    #   pages -> 200,320 tokens
    v = rows[("V100 32 GB", "Llama-3.1-8B", "fp16")]
    assert v["card_bytes"] == 34_080_565_494
    assert v["kv_memory_bytes"] == pytest.approx(13_538_767_121, abs=1)
    assert v["tokens"] == {"fp16": 103_280, "8-bit": 206_576, "int8": 200_320}
    assert v["one_sequence"] == {"fp16": 103_280, "8-bit": 131_072, "int8": 131_072}
    assert v["fits"] and ("V100 32 GB", "Llama-3.1-8B", "8-bit (fp16 bytes / 2)") not in rows

    # T4 (14.75 GiB): 0.9 x 15,837,691,904 = 14,253,922,714 < 16.06e9 of fp16 weights
    t4 = rows[("T4 16 GB", "Llama-3.1-8B", "fp16")]
    assert not t4["fits"] and t4["tokens"] == {"fp16": 0, "8-bit": 0, "int8": 0}
    # ... so the 8-bit-weight variant: 14,253,922,714 - 8.03e9 - 1 GiB = 5,150,180,890
    #   -> fp16 2455.8 pages: 2455 x 16 = 39,280 tokens; 8-bit 4911.6: 4911 x 16 = 78,576;
    #   int8 4762.8: 4762 x 16 = 76,192
    t48 = rows[("T4 16 GB", "Llama-3.1-8B", "8-bit (fp16 bytes / 2)")]
    assert t48["weights_bytes"] == 8.03e9 and t48["fits"]
    assert t48["tokens"] == {"fp16": 39_280, "8-bit": 78_576, "int8": 76_192}
    # Mistral-7B's 14.48e9 fp16 bytes do not fit a T4 either; on a V100 its 32k context caps
    assert not rows[("T4 16 GB", "Mistral-7B-v0.3", "fp16")]["fits"]
    assert rows[("V100 32 GB", "Mistral-7B-v0.3", "fp16")]["one_sequence"]["8-bit"] == 32768
    # 8-bit KV holds twice the tokens (up to one page of rounding)
    for r in t["rows"]:
        assert 0 <= r["tokens"]["8-bit"] - 2 * r["tokens"]["fp16"] < 32

    # a weight size the user passes (--weights-gb) adds a row per model and card
    g = D.context_table(weights_bytes=5e9)
    given = [r for r in g["rows"] if r["weights"] == "given (--weights-gb)"]
    assert len(given) == 4 and all(r["weights_bytes"] == 5e9 for r in given)
    assert D.tokens_that_fit(-1.0, 131072) == 0 and D.tokens_that_fit(131072 * 17, 131072) == 16


def test_context_table_markdown_and_cli():
    md = D.context_table_markdown(D.context_table())
    assert "not measured" in md and "| card | model | weights |" in md
    assert "| V100 32 GB (31.74 GiB) | Llama-3.1-8B | fp16 | 16.06 | 13.54 | 103,280 | 206,576 " \
        "| 200,320 | 103,280 / 131,072 / 131,072 (model max) |" in md
    assert "| T4 16 GB (14.75 GiB) | Llama-3.1-8B | fp16 | 16.06 | -2.88 |" in md
    assert "do not fit" in md and "8-bit (fp16 bytes / 2)" in md
    # printable without a GPU, from the command line
    p = subprocess.run([sys.executable, "-m", "sm7x.bench", "decode", "--context-table",
                        "--weights-gb", "5"], capture_output=True, text=True, timeout=120,
                       env={**__import__("os").environ, "CUDA_VISIBLE_DEVICES": ""})
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("given (--weights-gb)") == 4 and "103,280" in p.stdout
