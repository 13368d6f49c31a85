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
    assert kernels.kernel_key(name) == (64, 64, 64, False)
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
    assert kernels.kernel_key(name.format(0)) == (128, 128, 32, False)
    assert kernels.kernel_threads(name.format(0)) == 128
    wide = name.format(1).replace("ELi32EEE", "ELi16EEE")
    assert kernels.kernel_key(wide) == (128, 128, 32, True)
    assert kernels.kernel_threads(wide) == 256
    assert kernels.kernel_key("_ZN4sm7x3fa212run_combineEv") is None
    # a library built before warp_rows existed: no last argument, 16 rows per warp
    old = "_ZN4sm7x3fa24sm7510fwd_kernelINS1_9FwdConfigILi128ELi128ELi64ELNS0_10KvPrefetchE1ELb1EEELb0EEEvNS0_9FwdParamsE"
    assert kernels.kernel_key(old) == (128, 128, 64, False)
    assert kernels.kernel_threads(old) == 256


def test_occupancy_rules():
    # V100: 243 regs x 128 threads -> 7936 per warp (31 units), 8 warps by registers;
    # 96256 B of shared memory leaves one block
    assert kernels.occupancy("sm70", 128, 243, 96256) == (1, 4)
    assert kernels.occupancy("sm70", 64, 127, 15360) == (6, 12)  # shared memory bound
    # T4: at most 32 warps and 64 KB per SM
    assert kernels.occupancy("sm75", 32, 100, 3840) == (16, 16)
    assert kernels.occupancy("sm75", 256, 114, 20480) == (2, 16)
