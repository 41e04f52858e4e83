"""CPU (offline NVRTC compile, SASS by cuobjdump): the column-split Hopper backward (head dim 256) adds its dQ into
the fp32 accumulator with fire-and-forget reductions from registers (REDG.E.ADD.F32x4: one per thread and
accumulator fragment, 16 per step), in every kernel of it the host can launch, "atomic", "seqpar" and "ordered" alike
(one copy of the code serves the three strategies).

ptxas picks the instruction from the code around it: while a sequentially consistent fence (`__threadfence()`,
MEMBAR.SC.GPU) followed the reductions for "ordered", it compiled all of them -- the default strategy's too -- as
ATOMG (an atomic that returns the old value), and no sequentially consistent fence is needed there: the semaphore's
release after the warp's barrier orders the warp's reductions (bench/NOTES.md, "Hopper backward")."""
from __future__ import annotations

import re

import pytest

from cuflash import _configs


def _split_specs(dtype: str) -> list:
    return [s for s in _configs.sm90_bwd_specs() if "split_kernel" in s.name and f"<{_configs.CTYPE[dtype]}," in s.name]


def _functions(sass: str) -> dict:
    """Function name -> its instructions (opcode and operands) in a cuobjdump -sass listing."""
    out, cur = {}, None
    for line in sass.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            cur = out.setdefault(m.group(1), [])
            continue
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s*(.*?)\s*;", line)
        if m and cur is not None:
            cur.append(m.group(1))
    return out


def _dq_reductions(ins: list) -> dict:
    """Counts of the instruction kinds this file checks."""
    return {"red_f32x4": sum(bool(re.match(r"(@!?P\d+\s+)?REDG\.E\.ADD\.F32x4", x)) for x in ins),
            "atom_f32": sum(bool(re.match(r"(@!?P\d+\s+)?ATOMG\.E\.ADD\.F32", x)) for x in ins),
            "membar_sc": sum("MEMBAR.SC" in x for x in ins)}


def test_parser_counts_the_kinds():
    """The parser on a hand-written listing: two functions, the reductions, an atomic, a fence."""
    sass = "\n".join([
        "        Function : f_one",
        "        /*0010*/                   REDG.E.ADD.F32x4.FTZ.RN.STRONG.GPU desc[UR30][R4.64], R24 ;  /* 0x0 */",
        "        /*0020*/               @P0 REDG.E.ADD.F32x4.FTZ.RN.STRONG.GPU desc[UR30][R4.64+0x200], R28 ; /* 0x0 */",
        "        Function : f_two",
        "        /*0010*/                   ATOMG.E.ADD.F32x4.FTZ.RN.STRONG.GPU PT, RZ, desc[UR30][R4.64], R24 ; /* 0x0 */",
        "        /*0020*/                   MEMBAR.SC.GPU ;  /* 0x0 */",
    ])
    f = _functions(sass)
    assert _dq_reductions(f["f_one"]) == {"red_f32x4": 2, "atom_f32": 0, "membar_sc": 0}
    assert _dq_reductions(f["f_two"]) == {"red_f32x4": 0, "atom_f32": 1, "membar_sc": 1}


@pytest.mark.parametrize("dtype", _configs.DTYPES)
def test_split_kernels_reduce_dq_with_red(dtype):
    from bench import bench_micro as bm
    from cuflash._loader import compile_offline

    if bm.find_cuobjdump() is None:
        pytest.skip("cuobjdump not found (CUDA toolkit or the nvidia-cuda-cuobjdump wheel)")
    specs = _split_specs(dtype)
    assert len(specs) >= 8, [s.name for s in specs]  # plain, causal, grouped, orders, modifiers, persistent forms
    r = compile_offline(specs[0].filename, [s.name for s in specs], "90a", verbose=True)
    sass, status = bm.cubin_sass(r["cubin"])
    assert sass is not None, status
    funcs = _functions(sass)
    lowered = {r["kernels"][s.name]["lowered"]: s.name for s in specs}
    assert set(lowered) <= set(funcs), sorted(set(lowered) - set(funcs))
    for low, name in lowered.items():
        kinds = _dq_reductions(funcs[low])
        assert kinds["atom_f32"] == 0 and kinds["membar_sc"] == 0, (name, kinds)
        assert kinds["red_f32x4"] >= 16, (name, kinds)  # HF = 16 fragments of a consumer's 128 columns
