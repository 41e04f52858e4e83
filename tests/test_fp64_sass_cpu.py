"""CPU (offline NVRTC compile, SASS by cuobjdump): the kernels execute no FP64 instruction. The parameter blocks'
float scalars are float32 in 8-byte slots (f32_slot, cuda_src/common/ptx.cuh), read as floats. When they were doubles,
each conversion in device code was F2F.F32.F64 plus an FP64 compare (DSETP, the -ftz denormal test), and ptxas put
some inside main loops: in the Hopper backward's score-modifier kernel the DSETP came right after the S^T / dP^T wgmma
issue and held 10% of the kernel's warp-stall samples, on the math pipe (bench/NOTES.md, "Score modifiers"). The
scan is bench.diag.sass_fp64's (its parser: tests/test_sass_diag_cpu.py). The sample: the first, middle and last
configuration of every kernel source, the Hopper backward's and forward's score-modifier kernels at head dims 64 and
128, one of the Hopper forward's persistent modifier form, and the configurations that hold scale_log2 in a register
(runtime_copy; one per kernel source)."""
from __future__ import annotations

import pytest

from cuflash import _configs

# one configuration per kernel source whose scale_log2 is held in a register (runtime_copy / read_once)
_HELD = ("cuflash::flash_decode_kernel<__half, 128, 2, 32, 4, false, 2, 139776, 1, false, true>",
         "cuflash::flash_v1_fwd_kernel<__half, 64, 64, 128, 4, 1, true, 55296>",
         "cuflash::flash_fwd_kernel<__half, 128, 128, 32, 4, false, false, 69632, 0, 0, 1, 3, 0, true>",
         "cuflash::flash_bwd_kernel<__nv_bfloat16, 128, 64, 128, 8, 1, false, 207872, 2, 0, true, true, 1, true>")


def _sample():
    by_file, by_name = {}, {}
    for s in _configs.all_specs():
        by_file.setdefault(s.filename, []).append(s)
        by_name[s.name] = s
    picked = []
    for specs in by_file.values():
        picked += [specs[0], specs[len(specs) // 2], specs[-1]]
    picked += [_configs.sm90_bwd_spec("float16", d, False, mod=_configs.MOD_SCORE) for d in (64, 128)]
    picked += [_configs.sm90_fwd_spec("float16", d, False, mod=_configs.MOD_SCORE) for d in (64, 128)]
    picked += _configs.sm90_fwd_mod_persist_specs()[:1] + [by_name[n] for n in _HELD]
    seen, out = set(), []
    for s in picked:
        if s.name not in seen:
            seen.add(s.name)
            out.append(s)
    return out


SAMPLE = _sample()


def test_sample_covers_the_modifier_kernels():
    names = [s.name for s in SAMPLE]
    assert "cuflash::flash_bwd_sm90_kernel<__half, 64, 128, 2, false, 240, 24, 199736, 1>" in names
    assert any(n.startswith("cuflash::flash_fwd_sm90_kernel<") for n in names)
    assert set(_HELD) <= set(names)
    assert {s.filename for s in SAMPLE} == {s.filename for s in _configs.all_specs()}


@pytest.mark.parametrize("spec", SAMPLE, ids=lambda s: s.name)
def test_no_fp64_instruction(spec):
    from bench import bench_micro as bm
    from bench.diag import sass_fp64

    if bm.find_cuobjdump() is None:
        pytest.skip("cuobjdump not found (CUDA toolkit or the nvidia-cuda-cuobjdump wheel)")
    name, res = sass_fp64._one(spec)
    assert not isinstance(res, str), res
    every, looped = res
    assert every == [] and looped == [], (name, every[:4])
