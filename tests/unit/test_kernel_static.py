"""sm7x_tools.kernels' SASS parsing and occupancy rules on small inputs (the shipped
libraries are analysed in tests/package/test_fa2_packages.py)."""

from sm7x_tools import kernels

SASS = """
        Function : _ZN4sm7x3fa24sm7010fwd_kernelINS1_9FwdConfigILi64ELi64ELi64ELNS0_10KvPrefetchE1ELb0ELi16EEELb0EEEvNS0_9FwdParamsE
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDS.U.128 R4, [R2] ;
        /*0020*/                   HMMA.884.F32.F32.STEP0 R8, R4.ROW, R6.COL, R8 ;
        /*0030*/                   STS.64 [R3], R4 ;
        /*0040*/                   LDSM.16.M88.4 R12, [R2] ;
        /*0050*/               @P0 BRA 0x10 ;
        /*0060*/                   HMMA.884.F32.F32.STEP1 R8, R4.ROW, R6.COL, R8 ;
        /*0070*/                   EXIT ;
"""


def test_tile_loop_is_the_backward_branch_span():
    (name, insns), = kernels.sass_functions(SASS).items()
    assert kernels.kernel_key(name) == (64, 64, 64, False, False)
    assert kernels.kernel_threads(name) == 128
    body = kernels.tile_loop(insns)
    assert [op for _, op, _ in body] == ["LDS.U.128", "HMMA.884.F32.F32.STEP0", "STS.64",
                                         "LDSM.16.M88.4", "BRA"]
    assert kernels.tensor_flop_per_warp(body) == (1, 512)
    # 16 B x 32 lanes + 8 B x 32 lanes + four 8x8 fp16 matrices
    assert kernels.smem_bytes_per_warp(body) == 512 + 256 + 512


def test_kernel_threads_follow_the_warp_rows_of_the_name():
    # sm75 d=128 128x32 tile, 32 rows per warp: 4 warps; its wide serving kernel: 16 rows, 8 warps
    name = "_ZN4sm7x3fa24sm7510fwd_kernelINS1_9FwdConfigILi128ELi128ELi32ELNS0_10KvPrefetchE2ELb0ELi32EEELb{}EEEvNS0_9FwdParamsE"
    assert kernels.kernel_key(name.format(0)) == (128, 128, 32, False, False)
    assert kernels.kernel_threads(name.format(0)) == 128
    wide = name.format(1).replace("ELi32EEE", "ELi16EEE")
    assert kernels.kernel_key(wide) == (128, 128, 32, True, False)
    assert kernels.kernel_threads(wide) == 256
    assert kernels.kernel_key("_ZN4sm7x3fa212run_combineEv") is None
    # the kernels' KV8 argument (8-bit caches), mangled after SERVING
    kv8 = wide.replace("ELb1EEEv", "ELb1ELb1EEEv")
    assert kernels.kernel_key(kv8) == (128, 128, 32, True, True)
    assert kernels.kernel_key(wide.replace("ELb1EEEv", "ELb1ELb0EEEv")) == (128, 128, 32, True, False)
    assert kernels.kernel_threads(kv8) == 256
    # since int8 caches: an int (fa2.h KvRead), 0 fp16, 1 fp8, 2 int8 with row scales
    for read in (0, 1, 2):
        named = wide.replace("ELb1EEEv", f"ELb1ELi{read}EEEv")
        assert kernels.kernel_key(named) == (128, 128, 32, True, read)
    # a library built before warp_rows existed: no last argument, 16 rows per warp
    old = "_ZN4sm7x3fa24sm7510fwd_kernelINS1_9FwdConfigILi128ELi128ELi64ELNS0_10KvPrefetchE1ELb1EEELb0EEEvNS0_9FwdParamsE"
    assert kernels.kernel_key(old) == (128, 128, 64, False, False)
    assert kernels.kernel_threads(old) == 256


def test_decode_kernel_names():
    # sm75/decode_kernel.cuh: decode_kernel<DecodeConfig<head_dim, block_n>, KvRead>, one warp
    name = "_ZN4sm7x3fa24sm7513decode_kernelINS1_12DecodeConfigILi128ELi16EEELi{}EEEvNS0_9FwdParamsE"
    for read in (0, 1, 2):
        assert kernels.kernel_key(name.format(read)) == (128, kernels.DECODE_ROWS, 16, True, read)
        assert kernels.is_decode(name.format(read)) and kernels.kernel_threads(name.format(read)) == 32
    fwd = "_ZN4sm7x3fa24sm7510fwd_kernelINS1_9FwdConfigILi128ELi16ELi16ELNS0_10KvPrefetchE1ELb1ELi16ELi1EEELb1ELi1EEEvNS0_9FwdParamsE"
    assert kernels.kernel_key(fwd) == (128, 16, 16, True, 1) and not kernels.is_decode(fwd)


def test_kernel_threads_count_the_dim_split_of_the_name():
    # sm75 d=256 64x32, 16 rows per warp, two warps per row slice (dim_split 2): 8 warps
    name = "_ZN4sm7x3fa24sm7510fwd_kernelINS1_9FwdConfigILi256ELi64ELi32ELNS0_10KvPrefetchE2ELb1ELi16ELi{}EEELb0EEEvNS0_9FwdParamsE"
    assert kernels.kernel_key(name.format(2)) == (256, 64, 32, False, False)
    assert kernels.kernel_threads(name.format(2)) == 256
    assert kernels.kernel_threads(name.format(1)) == 128


def test_occupancy_rules():
    # V100: 243 regs x 128 threads -> 7936 per warp (31 units), 8 warps by registers;
    # 96256 B of shared memory leaves one block
    assert kernels.occupancy("sm70", 128, 243, 96256) == (1, 4)
    assert kernels.occupancy("sm70", 64, 127, 15360) == (6, 12)  # shared memory bound
    # T4: at most 32 warps and 64 KB per SM
    assert kernels.occupancy("sm75", 32, 100, 3840) == (16, 16)
    assert kernels.occupancy("sm75", 256, 114, 20480) == (2, 16)


def test_backward_kernel_names_tiles_and_flop():
    main = ("_ZN4sm7x3fa24sm7010bwd_kernelINS1_9BwdConfigILi128ELi64ELi32ELi64ELi32ELb0EEELi0EEEv"
            "NS0_9BwdParamsE")
    dv = ("_ZN4sm7x3fa24sm7510bwd_kernelINS1_9BwdConfigILi256ELi16ELi16ELi32ELi16ELb1EEELi1EEEv"
          "NS0_9BwdParamsE")
    dq = ("_ZN4sm7x3fa24sm7513bwd_dq_kernelINS1_9BwdConfigILi256ELi16ELi16ELi32ELi16ELb1EEEEEv"
          "NS0_9BwdParamsE")
    # main: block_n keys (16 per warp) x block_m queries; dQ kernel: dq_block_m queries (16 per warp)
    assert kernels.bwd_key(main) == ("bwd", 128, 64, 32, 128, False)
    assert kernels.bwd_key(dv) == ("bwd dV", 256, 16, 16, 32, True)
    assert kernels.bwd_key(dq) == ("bwd dQ", 256, 32, 16, 64, True)
    # today's names: prefetch, min_blocks and v_in_regs follow split
    vregs = ("_ZN4sm7x3fa24sm7510bwd_kernelINS1_9BwdConfigILi128ELi64ELi16ELi64ELi32ELb1ELb1ELi2ELb1"
             "EEELi2EEEvNS0_9BwdParamsE")
    assert kernels.bwd_key(vregs) == ("bwd dKdQ", 128, 64, 16, 128, True)
    assert kernels.bwd_key(vregs.replace("ELi2ELb1EEE", "ELi2EEE")) == ("bwd dKdQ", 128, 64, 16,
                                                                        128, True)
    # dim_split after v_in_regs: two warps per 16 keys
    split2 = vregs.replace("ELb1EEELi2EEE", "ELb1ELi2EEELi2EEE")
    assert kernels.bwd_key(split2) == ("bwd dKdQ", 128, 64, 16, 256, True)
    assert kernels.bwd_key(vregs.replace("ELb1EEELi2EEE", "ELb1ELi1EEELi2EEE"))[4] == 128
    # dq_pass after dim_split: the main kernel computes no dQ (the dQ kernel does)
    dkdv = vregs.replace("ELb1EEELi2EEE", "ELb1ELi1ELb1EEELi0EEE")
    assert kernels.bwd_key(dkdv) == ("bwd dKdV", 128, 64, 16, 128, True)
    assert kernels.bwd_key(dkdv.replace("ELi0EEE", "ELi2EEE"))[0] == "bwd dK"
    assert kernels.bwd_key(vregs.replace("ELb1EEELi2EEE", "ELb1ELi1ELb0EEELi2EEE"))[0] == "bwd dKdQ"
    assert kernels.bwd_key(main.replace("bwd_kernel", "fwd_kernel")) is None
    assert kernels.kernel_key(main) is None
    # 2 * rows * cols * d per GEMM: 5 in the main kernel, 2 + 4 in the split passes, 3 in dQ
    assert kernels.bwd_flop("bwd", 128, 64, 32, False) == 5 * 2 * 64 * 32 * 128
    assert kernels.bwd_flop("bwd dV", 256, 16, 16, True) + kernels.bwd_flop(
        "bwd dKdQ", 256, 16, 16, True) == 6 * 2 * 16 * 16 * 256
    assert kernels.bwd_flop("bwd dQ", 128, 64, 32, False) == 3 * 2 * 64 * 32 * 128
    assert kernels.bwd_flop("bwd dKdV", 128, 64, 32, False) == 4 * 2 * 64 * 32 * 128
    assert kernels.bwd_flop("bwd dQ", 256, 32, 16, True) == int(2.5 * 2 * 32 * 16 * 256)


def test_render_shows_what_a_kernel_spills():
    res = {"arch": "sm75", "reg": 255, "stack": 8, "shared": 0, "local": 4}
    s = kernels.KernelStats("sm75", 64, 128, 64, False, 256, 255, 55808, 1, 8, None, None, 1,
                            None, None, "T4", "bwd", kernels.local_bytes(res))
    head, row = (line.split() for line in kernels.render([s]).splitlines()[:2])
    assert row[head.index("lmem")] == "12"
