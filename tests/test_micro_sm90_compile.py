"""CPU: the Hopper microbenchmark kernels (cuda_src/micro/micro_sm90.cu) compile for sm_90a without spills or local
memory, their SASS holds the instruction each benchmark claims to measure (HGMMA of the right shape, dtype and A
operand form, UTMALDG, SYNCS.*, UBLKRED) with no ptxas note that wgmma was serialized (when cuobjdump is
available), and the pure-Python helpers of bench/bench_micro_sm90.py are right on canned data."""
import re

import numpy as np
import pytest

import bench.bench_micro as bm
import bench.bench_micro_sm90 as b9
from cuflash import _compile_check


def _nvrtc_available() -> bool:
    try:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
        return True
    except Exception:  # noqa: BLE001 - no CuPy / no libnvrtc
        return False


needs_nvrtc = pytest.mark.skipif(not _nvrtc_available(), reason="NVRTC not available (CuPy / libnvrtc)")


def _tasks():
    """Every micro90 kernel, each compiled alone for sm_90a, as the run-time loader compiles it."""
    return [_compile_check.Task(b9.FILE, name, 90, None, suffix="a") for name in b9.all_kernel_names()]


# the compiles each test reads (tests/conftest.py: kernel_report)
KERNEL_TASKS = {"test_every_micro90_kernel_compiles_without_spills": _tasks}


def _reg_cap(name: str) -> int:
    """Registers per thread the kernel's __launch_bounds__ allows (65536 / its most threads, at most 255)."""
    m = re.match(r"cuflash::micro90_wgmma_tput_kernel<[^,]+, (\d+), (true|false), \d, (\d+)>", name)
    if m:
        threads = b9.tput_max_threads(int(m.group(1)), m.group(2) == "true", int(m.group(3)))
        return min(255, 65536 // threads // 8 * 8)
    return 255


@needs_nvrtc
def test_every_micro90_kernel_compiles_without_spills(kernel_report):
    kernels = kernel_report
    assert set(kernels) == set(b9.all_kernel_names())
    for name, info in kernels.items():
        assert "error" not in info, f"{name}: {info['error']}"
        assert "regs" in info, f"no ptxas report for {name}"
        assert info["stack"] == 0 and info["spill_st"] == 0 and info["spill_ld"] == 0, (name, info)
        assert info["regs"] <= _reg_cap(name), (name, info)


@needs_nvrtc
def test_sass_has_the_measured_instruction_and_no_local_memory():
    if bm.find_cuobjdump() is None:
        pytest.skip("cuobjdump not found (CUDA toolkit or the nvidia-cuda-cuobjdump wheel)")
    res = b9.sass_analysis(jobs=2)
    if res["status"] != "ok":
        pytest.skip(f"SASS not available here: {res['status']}")
    kernels = res["kernels"]
    exp = b9.expectations()
    assert set(kernels) == set(exp)
    for name, expect in exp.items():
        info = kernels[name]
        chk = b9.sass_check90(info, expect)
        assert chk["ok"], (name, chk)
        assert not info["perf_notes"], (name, info["perf_notes"])  # e.g. C7512: wgmma serialized
    # the loop bodies: 4 k16 steps x chains (throughput), 4 steps x G (latency), two boxes per TMA stage
    for name, info in kernels.items():
        n_hgmma = len(info["hgmma"])
        m = re.match(r"cuflash::micro90_wgmma_tput_kernel<.*, (\d+)>", name)
        if m:
            assert n_hgmma >= 4 * int(m.group(1)), (name, n_hgmma)
        m = re.match(r"cuflash::micro90_wgmma_latency_kernel<.*, (\d+)>", name)
        if m:
            assert n_hgmma >= 4 * int(m.group(1)), (name, n_hgmma)
        if "tma_load" in name:
            assert info["opcodes"].count("UTMALDG.4D") >= 2, name
        if "wgmma" not in name:
            assert n_hgmma == 0, name
        if "bulk_reduce" in name:  # the dQ writer's instruction, once per loop trip (UBLKRED.G.S.ADD.F32.RN)
            assert [o for o in info["opcodes"] if o.startswith("UBLKRED")] == ["UBLKRED.G.S.ADD.F32.RN"], name
    # fp16 and bf16 are different HGMMA opcodes; the rs form with B MN-major reads B transposed (.tnspB)
    h = kernels[b9.tput_name("__half", 128, b9.FORM_RS, 1)]["hgmma"]
    assert all(op == "HGMMA.64x128x16.F32" and b.endswith(".tnspB") for op, _, b in h), h
    h = kernels[b9.tput_name("__nv_bfloat16", 256, b9.FORM_SS, 1)]["hgmma"]
    assert all(op == "HGMMA.64x256x16.F32.BF16" and a.startswith("gdesc") for op, a, _ in h), h


def test_specs_are_consistent():
    specs = b9.sweep_specs()
    assert len(specs) == len(set(specs))
    assert all(s.filename == b9.FILE and s.min_arch == 90 and s.arch_suffix == "a" for s in specs)
    exp = b9.expectations()
    assert {s.name for s in specs} == set(exp)  # every launched kernel has a SASS expectation
    for s in specs:
        assert s.smem <= 227 * 1024 and s.smem % 16 == 0, s
        if "wgmma_tput" in s.name:
            m = re.match(r"cuflash::micro90_wgmma_tput_kernel<[^,]+, (\d+), (true|false), \d, (\d+)>", s.name)
            assert s.threads % 128 == 0
            assert s.threads <= b9.tput_max_threads(int(m.group(1)), m.group(2) == "true", int(m.group(3)))
        if "wgmma_latency" in s.name or "tma_load" in s.name:
            assert s.threads == 128
    # the grid the suite promises: N = 64..256, fp16 and bf16, ss and rs, throughput and latency
    names = set(exp)
    for form in b9.FORMS:
        for _, t in b9.DTYPES:
            for n in (64, 128, 192, 256):
                assert b9.tput_name(t, n, form, 1) in names
                assert b9.latency_name(t, n, form, 1) in names and b9.latency_name(t, n, form, 4) in names
    assert b9.FORM_SS.trans_b == 0 and b9.FORM_RS.trans_b == 1 and b9.FORM_RS.rs and not b9.FORM_SS.rs
    for p in b9.MBAR_SIDES:
        assert b9.pingpong_name(p) in names
    # bulk reductions: 16 and 32 KB tiles waiting for the read, 32 KB (the dQ tile at d64 / d128) for the adds too
    for t in (16384, 32768):
        assert b9.bulk_name(t, False) in names
    assert b9.bulk_name(32768, True) in names
    for s in specs:
        if "bulk_reduce" in s.name:
            assert s.threads == 128 and s.smem <= 48 * 1024
    assert [b9.bulk_dests(d, 528) for d in b9.BULK_DESTS] == [1, 8, 528]


def test_suite_is_registered():
    from bench.suites import SUITES

    s = SUITES["micro90"]
    assert (s.module, s.func) == ("bench_micro_sm90", "micro90")
    assert s.resolve() is b9.micro90


CANNED_SASS = """
		Function : _ZN7cuflash2rsEv
        /*10f0*/                   HGMMA.64x128x16.F32.BF16 R24, R156, gdesc[UR12].tnspB, R24, gsb0 ;
        /*1100*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
		Function : _ZN7cuflash2ssEv
        /*0df0*/                   HGMMA.64x256x16.F32 R24, gdesc[UR12], R24 ;
        /*0fd0*/              @P0  HGMMA.64x256x16.F32 R24, gdesc[UR12], R24, gsb0 ;
        /*0fe0*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R3+URZ], R4 ;
"""


def test_parse_hgmma_and_form():
    f = b9.parse_hgmma(CANNED_SASS)
    assert f["_ZN7cuflash2rsEv"] == [("HGMMA.64x128x16.F32.BF16", "R156", "gdesc[UR12].tnspB")]
    assert [x[:2] for x in f["_ZN7cuflash2ssEv"]] == [("HGMMA.64x256x16.F32", "gdesc[UR12]")] * 2
    assert b9.hgmma_form(f["_ZN7cuflash2rsEv"]) == "rs"
    assert b9.hgmma_form(f["_ZN7cuflash2ssEv"]) == "ss"
    assert b9.hgmma_form(f["_ZN7cuflash2rsEv"] + f["_ZN7cuflash2ssEv"]) == "mixed"
    assert b9.hgmma_form([]) is None
    ops = bm.parse_sass(CANNED_SASS)["_ZN7cuflash2ssEv"]
    assert re.fullmatch(b9.hgmma_opcode(256, "f16"), ops[0])
    assert not re.fullmatch(b9.hgmma_opcode(256, "bf16"), ops[0])
    assert any(re.fullmatch(b9.MBAR_EXPECT[1], o) for o in ops)
    info = dict(opcodes=ops, hgmma=f["_ZN7cuflash2ssEv"], perf_notes=[])
    assert b9.sass_check90(info, ((b9.hgmma_opcode(256, "f16"),), "ss"))["ok"]
    assert not b9.sass_check90(info, ((b9.hgmma_opcode(256, "f16"),), "rs"))["ok"]
    info["perf_notes"] = ["wgmma.mma_async instructions are serialized"]
    assert not b9.sass_check90(info, ((b9.hgmma_opcode(256, "f16"),), "ss"))["ok"]


def test_perf_notes_by_function():
    log = ("ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
           "insufficient register resources for the function '_ZN7cuflash1kEv'\nptxas info    : Used 168 registers")
    assert b9.perf_notes(log) == {"_ZN7cuflash1kEv": [
        "wgmma.mma_async instructions are serialized due to insufficient register resources"]}
    assert b9.perf_notes("ptxas info    : Used 16 registers") == {}


def test_sw128_is_a_permutation_of_each_chunk():
    offs = [b9.sw128_offset(r, c) for r in range(64) for c in range(64)]
    assert sorted(offs) == list(range(0, 64 * 128, 2))
    assert b9.sw128_offset(0, 8) == 16 and b9.sw128_offset(1, 0) == 128 + 16 and b9.sw128_offset(7, 63) == 7 * 128 + \
        ((7 ^ 7) << 4) + 14


def test_operands_are_random_and_rounded():
    ab, bb, a64, b64 = b9.random_operands(128, "bf16", seed=3)
    assert ab.shape == (3, 64, 64) and bb.shape == (128, 64) and ab.dtype == np.uint16
    assert len(np.unique(ab)) > 1000 and np.all(np.isfinite(a64)) and 0.8 < np.std(a64) < 1.2
    assert np.array_equal(b9.bf16_bits(b9.bits_to_float(bb, "bf16")), bb)  # exact round trip
    assert b9.bf16_bits(np.float32(1.0 + 2 ** -8)) == 0x3F80  # a tie rounds to even
    assert b9.bf16_bits(np.float32(1.0 + 3 * 2 ** -9)) == 0x3F81
    ah, _, a64h, _ = b9.random_operands(64, "f16", seed=3)
    assert np.array_equal(a64h, ah.view(np.float16).astype(np.float64))
    ref = b9.wgmma_reference(a64, b64, 4, 3)
    assert ref.shape == (64, 128) and np.allclose(ref, 3 * a64[1] @ b64.T)


def test_tma_word_offsets_follow_the_swizzle():
    stages, rows, grid, total = 2, 64, 2, 3
    offs = b9.tma_word_offsets("bhsd", stages, rows, grid, total)
    assert offs.shape == (grid, 128, total)
    nbytes = int(np.prod(b9.TMA_SHAPE)) * 2
    assert offs.min() >= 0 and offs.max() + 4 <= nbytes and np.all(offs % 4 == 0)
    # [b, h, s, d], tile 0: rows 0..63 of (head 0, batch 0); thread t reads stage byte 128 t: box 0, row t,
    # smem piece 0 = global piece t % 8
    for t in (0, 1, 9, 63):
        assert offs[0, t, 0] == t * 256 + (t % 8) * 16
    assert offs[0, 64, 0] == 128  # box 1 (columns 64..127), row 0
    # block 1 starts at tile 1 = rows 64..127; block 0's second tile is tile 0 + grid = 2
    assert offs[1, 0, 0] == 64 * 256 and offs[0, 0, 1] == 2 * 64 * 256
    # [b, s, h, d]: the same tile's rows are heads * 256 bytes apart
    o2 = b9.tma_word_offsets("bshd", stages, rows, 1, 1)
    h = b9.TMA_SHAPE[2]
    assert o2[0, 3, 0] == 3 * h * 256 + 3 * 16
    dims, strides, box = b9.tma_map_args("bshd", 128)
    assert dims == (128, 16384, 32, 8) and strides == (8192, 256, 16384 * 8192) and box == (64, 128, 1, 1)
    assert b9.tma_n_tiles(128) == 8 * 32 * 128
