"""CPU: the microbenchmark kernels (cuda_src/micro/micro.cu) compile for sm_80 and sm_90 without spills or
local memory, their SASS holds the instruction each benchmark claims to measure (when cuobjdump is
available), and the pure-Python helpers of bench/bench_micro.py are right on canned data."""
import struct

import numpy as np
import pytest

import bench.bench_micro as bm
from cuflash import _compile_check

ARCHS = (80, 90)


def _tasks(arch):
    """Every micro kernel (launched ones and the SASS count kernels), each compiled alone for sm_<arch>, as the
    run-time loader compiles it. sm_90-only instructions (red.global.add.v2/.v4.f32, red .bf16x2) have a scalar
    fallback below sm_90 in micro.cu, so they compile on sm_80 too; bench_micro skips them at run time there."""
    return [_compile_check.Task(bm.FILE, name, arch) for name in bm.all_kernel_names()]


# the compiles each test reads (tests/conftest.py: kernel_report)
KERNEL_TASKS = {"test_every_micro_kernel_compiles_without_spills": _tasks}


@pytest.mark.parametrize("arch", ARCHS)
def test_every_micro_kernel_compiles_without_spills(kernel_report, arch):
    kernels = kernel_report
    assert set(kernels) == set(bm.all_kernel_names())
    bounded = {s.name for s in bm.sweep_specs() if "micro_chain_kernel" in s.name or "ldsm_tput" in s.name}
    for name, info in kernels.items():
        assert "error" not in info, f"{name}: {info['error']}"
        assert "regs" in info, f"no ptxas report for {name}"
        assert info["stack"] == 0 and info["spill_st"] == 0 and info["spill_ld"] == 0, (name, info)
        # __launch_bounds__(128, 8): 32 warps per SM must fit, i.e. <= 64 registers
        assert info["regs"] <= (64 if name in bounded else 255), (name, info)


def test_specs_are_consistent():
    specs = bm.sweep_specs()
    assert len(specs) == len(set(specs))
    assert all(s.filename == bm.FILE for s in specs)
    exp = bm.expectations()
    assert {s.name for s in specs} == set(exp)  # every launched kernel has a SASS expectation
    for s in specs:
        assert s.threads in (32, 128, 256) and s.smem % 16 == 0
        if "micro_atomic_kernel" in s.name:
            assert s.threads == 256  # the kernel's NT
    assert all(bm.sm90_only(s) for s in specs if "RedV2F32" in s.name or "RedV4F32" in s.name)
    assert not any(bm.sm90_only(s) for s in specs if "micro_chain_kernel" in s.name)


def test_sass_has_the_measured_instruction_and_no_local_memory():
    if bm.find_cuobjdump() is None:
        pytest.skip("cuobjdump not found (CUDA toolkit or the nvidia-cuda-cuobjdump wheel)")
    res = bm.sass_analysis(90)
    if res["status"] != "ok":
        pytest.skip(f"SASS not available here: {res['status']}")
    kernels = res["kernels"]
    for name, expect in bm.expectations().items():
        chk = bm.sass_check(kernels[name]["opcodes"], expect)
        assert chk["ok"], (name, chk)
    # instructions per call of the softmax exponentials, and of the scale folding
    mix = {}
    for it in bm.CHAIN_ITEMS:
        if it.count:
            a = kernels[bm.count_name(it.lat_op, bm.COUNT_N)]["opcodes"]
            b = kernels[bm.count_name(it.lat_op, 2 * bm.COUNT_N)]["opcodes"]
            mix[it.variant] = bm.per_step_mix(a, b, bm.COUNT_N)
    assert mix["ex2.approx.ftz.f32"][0] == 1 and mix["ex2.approx.ftz.f32"][1] == {"MUFU.EX2": 1.0}
    assert mix["__expf"][1].get("MUFU.EX2") == 1.0 and mix["__expf"][0] == 2
    assert mix["expf"][0] > 2
    assert mix["s * scale - m*scale: FFMA"][0] == 1
    assert mix["(s - m) * scale: FADD + FMUL"][0] == 2


CANNED_SASS = """
	code for sm_90
		Function : _ZN7cuflash1kEv
	.headerflags	@"EF_CUDA_TEXMODE_UNIFIED EF_CUDA_64BIT_ADDRESS EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                           /* 0x00000a00ff017b82 */
                                                                                    /* 0x000fe40000000800 */
        /*0010*/              @!P0 BRA 0x1e60 ;                                     /* 0x0000000c00188947 */
        /*0020*/                   MUFU.EX2 R4, R4 ;                                /* 0x0000000400047308 */
        /*0030*/              @!UPT UIADD3 URZ, URZ, URZ, URZ ;                     /* 0x0000003f3f3ff290 */
        /*0040*/                   STL [R1], R4 ;                                   /* 0x0000000401007387 */
        /*0050*/                   EXIT ;                                           /* 0x000000000000794d */
		Function : _ZN7cuflash1jEv
        /*0000*/                   HMMA.16816.F32.BF16 R4, R8.reuse, R2.reuse, R4 ;  /* 0x000000020804723c */
        /*0010*/                   NOP;                                             /* 0x0000000000007918 */
"""


def test_parse_and_check_canned_sass():
    f = bm.parse_sass(CANNED_SASS)
    assert f["_ZN7cuflash1kEv"] == ["LDC", "BRA", "MUFU.EX2", "NOP", "STL", "EXIT"]
    assert f["_ZN7cuflash1jEv"] == ["HMMA.16816.F32.BF16", "NOP"]
    chk = bm.sass_check(f["_ZN7cuflash1kEv"], (r"MUFU\.EX2",))
    assert not chk["ok"] and chk["local_memory"] == ["STL"] and not chk["missing"]
    chk = bm.sass_check(f["_ZN7cuflash1jEv"], (r"HMMA\.16816\.F32",))  # full match: BF16 is another opcode
    assert not chk["ok"] and chk["missing"] == [r"HMMA\.16816\.F32"]
    assert bm.sass_check(f["_ZN7cuflash1jEv"], (r"HMMA\.16816\.F32\.BF16",))["ok"]
    assert bm.sass_check(None, ())["status"] == "unavailable"
    # per-step mix: 2n - n steps, NOPs ignored
    total, mix = bm.per_step_mix(["A", "B", "NOP"], ["A", "B", "B", "B", "C", "C", "NOP", "NOP"], 2)
    assert total == 2.0 and mix == {"B": 1.0, "C": 1.0}


def test_atomic_regexes_separate_scalar_and_vector():
    pats = {op: pat for _, op, _, _, _, pat in bm.ATOMIC_OPS}
    import re

    assert re.fullmatch(pats["MicroRedF32"], "REDG.E.ADD.F32.FTZ.RN.STRONG.GPU")
    assert not re.fullmatch(pats["MicroRedF32"], "REDG.E.ADD.F32x2.FTZ.RN.STRONG.GPU")
    assert re.fullmatch(pats["MicroRedV4F32"], "REDG.E.ADD.F32x4.FTZ.RN.STRONG.GPU")
    assert re.fullmatch(pats["MicroAtomAddF32"], "ATOMG.E.ADD.F32.FTZ.RN.STRONG.GPU")
    assert re.fullmatch(pats["MicroAtomAddF16x2"], "ATOM.E.ADD.F16x2.RN.STRONG.GPU")
    assert re.fullmatch(pats["MicroStoreV4"], "STG.E.128")


def test_fix_cubin_pads_the_cut_byte():
    hdr = bytearray(64)
    hdr[:5] = b"\x7fELF\x02"
    struct.pack_into("<QQ", hdr, 0x20, 100, 64)  # program headers at 100, sections at 64
    struct.pack_into("<HHHH", hdr, 0x36, 56, 1, 0, 0)  # one 56-byte program header: ends at 156
    cut = bytes(hdr) + bytes(155 - 64)
    assert len(bm.fix_cubin(cut)) == 156
    assert bm.fix_cubin(cut + b"\0") == cut + b"\0"
    assert bm.fix_cubin(b"not an elf") == b"not an elf"


def test_sm_rate_groups_blocks_by_sm():
    rows = [(100, 1100, 0, 10), (150, 1000, 0, 10),  # SM 0: span 1000, work 20 * 5
            (5000, 5500, 1, 10),  # SM 1: span 500, work 10 * 5
            (0, 0, 2, 0)]  # a block that recorded nothing
    rate, span, nsm = bm.sm_rate(rows, 5.0)
    assert nsm == 2 and span == 750
    assert rate == pytest.approx((100 / 1000 + 50 / 500) / 2)
    with pytest.raises(RuntimeError):
        bm.sm_rate([(0, 0, 0, 0)], 1.0)


def test_exp_errors_against_float64():
    x = np.array([-30.0, -1.0, 0.0], dtype=np.float32)
    ref = np.exp2(x.astype(np.float64))
    out = ref.astype(np.float32)
    rel, ulp, _ = bm.exp_errors(out, ref)
    assert rel == 0.0 and ulp == 0.0
    out[1] = np.nextafter(np.float32(0.5), np.float32(1.0))  # one ulp above 2^-1
    rel, ulp, i = bm.exp_errors(out, ref)
    assert i == 1 and ulp == pytest.approx(1.0) and rel == pytest.approx(2.0 ** -23)  # 2^-24 / 0.5


@pytest.mark.parametrize("trans", (False, True))
def test_ldmatrix_pointer_chase_is_a_fixed_point(trans):
    """micro_ldsm_latency_kernel stores matrix 0 so that r[0] of every lane is its own row address: emulate
    ldmatrix's fragment layout on the stored tile and check it (a wrong layout would fault on the GPU; the
    kernel also checks this before timing)."""
    base, row_bytes = 0x400, 136 * 2
    tile = bm.ldsm_chain_tile(trans, base, row_bytes)
    assert bm.ldmatrix_r0(tile, trans) == [base + lane * row_bytes for lane in range(32)]


def test_readme_numbers_match_committed_results():
    """The README's micro numbers table is what readme_numbers() makes of the committed results."""
    import json
    import pathlib

    root = pathlib.Path(bm.__file__).resolve().parents[1]
    text = (root / "README.md").read_text()
    records = [r for r in json.loads((root / "bench" / "results" / "results.json").read_text())["records"]
               if r.get("section") == "micro"]
    filled = bm.readme_numbers(records)
    assert filled and all(v != "n/a" for v in filled.values())
    for key, value in filled.items():
        assert str(value) in text, (key, value)
    assert all(v == "n/a" for v in bm.readme_numbers([]).values())
    rec = dict(name="exp", variant="ex2.approx.ftz.f32", metric="latency", value=17.84)
    assert bm.readme_numbers([rec])["{{ex2_latency}}"] == "17.8"
