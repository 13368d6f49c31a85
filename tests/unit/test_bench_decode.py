"""sm7x.bench.decode without a GPU: argument parsing, the byte / budget / FLOP arithmetic,
the goal line, the paged-cache layout, and one decode and one prefill row run on CPU
against a torch stand-in of the paged API (timings meaningless; the real run is on CUDA)."""

from __future__ import annotations

import array
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
                                       ("8/8/264", "8..256"), ("0/0/64", "must divide")])
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
    def __init__(self, batch):
        self.num_splits = torch.full((batch,), 3, dtype=torch.int32)


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
                    *, device=None, num_splits=0):
        calls.append(("plan", batch_size, max_seqlen_q, max_seqlen_k, num_heads, num_kv_heads,
                      head_dim))
        return _Plan(batch_size)

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=False, block_table=None,
               seqused_k=None, out=None, scheduler_metadata=None):
        assert cu_k is None and causal and isinstance(scheduler_metadata, _Plan)
        out.copy_(_fake_paged(q, k, v, cu_q, block_table, seqused_k))
        return out

    def kvcache(q, kc, vc, cache_seqlens=None, block_table=None, causal=False, num_splits=0):
        b, sq = q.shape[:2]
        cu = torch.arange(b + 1, dtype=torch.int32) * sq
        return _fake_paged(q.flatten(0, 1), kc, vc, cu, block_table, cache_seqlens).view(q.shape)

    monkeypatch.setattr(fa2, "plan_decode", plan_decode, raising=False)
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
                "sm7x_over_sdpa_flash"):
        assert row[key] > 0, key
    assert row["sdpa_efficient_gbps"] is None and row["sm7x_over_sdpa_efficient"] is None
    assert row["max_abs_diff"] < 1e-2 and set(row["max_abs_diff_vs"]) == {
        "torch_matmul", "sm7x_kvcache", "sdpa_flash"}
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
