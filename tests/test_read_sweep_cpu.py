"""CPU: the read-bandwidth sweep's kernels (cuda_src/micro/read_sweep.cu) compile without spills or local memory
under the installed NVRTC and, where CUFLASH_NVRTC_ALT names a second one, under that one too; the sweep's grid
(bench/diag/hbm_read_sweep.py) and the harness' read-probe candidates are well-formed; the decode mimic is the
decode kernel's pattern on the decode case (threads, bytes in flight per block, blocks per SM, grid)."""
import os
import re
from pathlib import Path

import pytest

import bench.bench_read as br
import bench.diag.hbm_read_sweep as sweep
from cuflash import _compile_check

ALT_NVRTC = os.environ.get("CUFLASH_NVRTC_ALT")


def _specs():
    return list({s.name: s for s in sweep.specs() + [p.spec() for p in br.PROBE_POINTS]}.values())


def _tasks(arch, nvrtc=None):
    return [_compile_check.Task(br.FILE, s.name, arch, nvrtc) for s in _specs() if s.min_arch <= arch]


# the compiles each test reads (tests/conftest.py: kernel_report)
KERNEL_TASKS = {
    "test_read_kernels_compile_without_spills": lambda arch: _tasks(arch),
    "test_read_kernels_compile_without_spills_alt_nvrtc": lambda arch: _tasks(arch, ALT_NVRTC) if ALT_NVRTC else [],
}


def _check(kernels, arch):
    names = {s.name for s in _specs() if s.min_arch <= arch}
    assert names and set(kernels) == names
    for name, info in kernels.items():
        assert "error" not in info, f"{name}: {info['error']}"
        assert "regs" in info, f"no ptxas report for {name}"
        assert info["stack"] == 0 and info["spill_st"] == 0 and info["spill_ld"] == 0, (name, info)
        if "read_ldg_kernel" in name:  # __launch_bounds__(512, 1)
            assert info["regs"] <= 128, (name, info)


@pytest.mark.parametrize("arch", (80, 90))
def test_read_kernels_compile_without_spills(kernel_report, arch):
    _check(kernel_report, arch)


@pytest.mark.parametrize("arch", (80, 90))
def test_read_kernels_compile_without_spills_alt_nvrtc(alt_nvrtc, kernel_report, arch):
    versions = {info.get("nvrtc") for info in kernel_report.values()}
    assert len(versions) == 1 and _compile_check.nvrtc_version() not in versions, versions
    _check(kernel_report, arch)


def test_grid_is_well_formed():
    points = sweep.POINTS + br.PROBE_POINTS
    names = [p.name for p in points]
    assert len(names) == len(set(names))
    assert 24 <= len(sweep.POINTS) <= 60  # a few dozen
    for p in points:
        assert not p.problems(), (p.name, p.problems())
        smem = br.launch_smem(p)
        assert p.ring_bytes <= smem <= br.SMEM_MAX_BLOCK
        # the padding holds blocks_per_sm blocks (their static 128 bytes and the reserved KB counted), and no more
        per_block = smem + br.SMEM_RESERVED + 128
        assert p.blocks_per_sm * per_block <= br.SMEM_PER_SM, p.name
        if smem < br.SMEM_MAX_BLOCK:
            assert (p.blocks_per_sm + 1) * per_block > br.SMEM_PER_SM, p.name
        if p.is_heads:  # every split holds whole tiles of K and of V
            assert p.heads.rows % p.splits == 0 and (p.heads.rows // p.splits * br.ROW_BYTES) % p.tile_bytes == 0
    # the axes: every load kind, hint, layout and cache order, several depths and launch shapes
    assert {p.kind for p in sweep.POINTS} == set(br.KINDS)
    assert {p.layout for p in sweep.POINTS} == set(br.LAYOUTS)
    assert {p.hint for p in sweep.POINTS} == set(br.HINTS)
    assert {p.heads.cache for p in sweep.POINTS if p.is_heads} == {"bshd", "bhsd"}
    assert len({p.block_in_flight * p.blocks_per_sm for p in sweep.POINTS}) >= 4
    assert {p.threads for p in sweep.POINTS} >= {128, 256, 512}
    assert {p.order for p in sweep.POINTS} == {"head", "split"}
    # the heads layouts read exactly the decode case's K and V, which fill the sweep's buffer
    d = sweep.DECODE
    assert 2 * sweep.BSHD.region_bytes == 2 * d["batch"] * d["kv_heads"] * d["seqlen"] * d["headdim"] * 2
    assert 2 * sweep.BSHD.region_bytes <= sweep.BUFFER_BYTES
    assert sweep.BSHD.strides() == (d["seqlen"] * d["kv_heads"] * 256, 256, d["kv_heads"] * 256)
    assert sweep.BHSD.strides() == (d["kv_heads"] * d["seqlen"] * 256, d["seqlen"] * 256, 256)


def test_mimic_is_the_decode_kernels_pattern():
    """The mimic: the decode kernel's threads, bytes in flight per block (NWARPS x (STAGES - 1) x the K and V warp
    tiles) and K / V interleaving, one block per SM as the kernel's shared memory allows, one block per (b, head)."""
    from cuflash import _configs
    from cuflash.decode import decode_num_splits

    d = sweep.DECODE
    t = _configs.decode_tile(d["headdim"])
    m = sweep.MIMIC
    assert m.threads == t.nwarps * 32
    assert m.block_in_flight == t.nwarps * (t.stages - 1) * 2 * t.block_n * d["headdim"] * 2
    assert m.layout == "heads_interleaved" and m.heads.cache == "bshd" and m.splits == 1 and m.hint == "plain"
    smem = _configs.decode_smem_bytes(d["headdim"], t, 1)
    assert 2 * (smem + br.SMEM_RESERVED) > br.SMEM_PER_SM and m.blocks_per_sm == 1
    blocks = d["batch"] * d["kv_heads"]  # h == hk: one row per (b, head), one m-block
    assert decode_num_splits(blocks, 132, d["seqlen"], d["headdim"]) == 1
    assert m.heads.batch * m.heads.kv_heads * m.splits == blocks
    for p in sweep.POINTS:  # the "mimic + ..." points change the mimic and nothing else than they say
        if p.name.startswith("mimic +"):
            assert p.kind == m.kind and p.threads == m.threads, p.name


def test_params_struct_matches_the_host_format():
    src = (Path(br.__file__).resolve().parents[1] / "cuda_src" / br.FILE).read_text()
    body = re.search(r"struct ReadSweepParams \{(.*?)\n\};", src, re.S).group(1)
    fields = re.findall(r"^\s+(const unsigned char\*|uint32_t\*|int64_t)\s+(\w+);", body, re.M)
    assert len(fields) == len(br.PARAM_FORMAT) - 1  # one 8-byte slot each
    assert [f[1] for f in fields][:3] == ["k", "v", "out"]
    assert re.search(r"READ_BULK_MAX_STAGES = %d;" % br.BULK_MAX_STAGES, src)
    for name, value in br.LAYOUTS.items():
        assert re.search(r"READ_%s = %d;" % (name.upper(), value), src), name
