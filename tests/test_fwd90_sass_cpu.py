"""CPU (offline NVRTC compile, SASS by cuobjdump): in the Hopper forward's main loop the wait for O += P V
(WARPGROUP.DEPBAR.LE gsb0, 0x0) comes after every exponential of the softmax (MUFU.EX2), so that the softmax of the
new S runs while the warpgroup's own product is in flight. ptxas places a wgmma wait as early as its basic block
allows: written after the exponentials but in their block, it came first in the SASS (cuda_src/flash_fwd_sm90.cu keeps
it in the arms of the re-scaling branch; bench/NOTES.md, "Hopper forward"). The loop is the code from the wait for S
(WARPGROUP.DEPBAR.LE gsb0, 0x1) to the next turn's named barrier.

And the branch in front of those waits is not on a warp's vote: wgmma.wait_group is .aligned (all threads of the
warpgroup execute the same one), so the branch that separates the waits from the exponentials must go the same way in
the warpgroup's four warps; a branch on a warp vote (`__any_sync` of the rows' "max moved") put them on different
waits, which compute-sanitizer's synccheck reports as a warpgroup MMA sequence error (the kernel's branch is on
`scale_log2 > 0`: wait_pv_rescale)."""
from __future__ import annotations

import re

import pytest

from cuflash import _configs

# (dtype, head dim, causal, key count for the configured tile (None: the default tile), score modifier)
CASES = [
    ("bfloat16", 128, False, 2048, _configs.MOD_NONE),  # persistent form, 160-key stages
    ("float16", 64, True, 2048, _configs.MOD_NONE),  # persistent form, three consumer warpgroups
    ("float16", 64, True, 8192, _configs.MOD_NONE),  # one-tile kernel
    ("bfloat16", 128, True, 6000, _configs.MOD_NONE),  # one-tile kernel
    ("float16", 256, False, None, _configs.MOD_NONE),  # one-tile kernel, 80-key stages
    ("bfloat16", 128, False, None, _configs.MOD_SCORE),  # window / soft-cap / ALiBi
    ("float16", 64, False, None, _configs.MOD_SCORE_DROPOUT),  # dropout at head dim 64
]


def _instructions(sass: str) -> list:
    out = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s*(.*?)\s*;", line)
        if m:
            out.append(m.group(1))
    return out


def _loops(ins: list) -> list:
    """Each stretch from a wait for S (gsb0, 0x1) to the next BAR.SYNC that holds exponentials."""
    loops = []
    for i, s in enumerate(ins):
        if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in s:
            j = next((k for k in range(i + 1, len(ins)) if "BAR.SYNC" in ins[k]), len(ins))
            if any("MUFU.EX2" in x for x in ins[i:j]):
                loops.append(ins[i:j])
    return loops


def _pv_wait_follows_exponentials(loop: list) -> bool:
    """Every wait for P V (gsb0, 0x0) of the loop after its last MUFU.EX2, and at least one such wait."""
    last_ex2 = max(k for k, x in enumerate(loop) if "MUFU.EX2" in x)
    waits = [k for k, x in enumerate(loop) if "DEPBAR.LE gsb0, 0x0" in x]
    return bool(waits) and min(waits) > last_ex2


def test_loop_parser_finds_the_order():
    """The parser on a hand-written stretch: the wait after the last exponential passes, one before it is seen."""
    good = ["WARPGROUP.DEPBAR.LE gsb0, 0x1", "FMNMX R1, R2, R3, !PT", "MUFU.EX2 R4, R4", "FADD R5, R4, R5",
            "WARPGROUP.DEPBAR.LE gsb0, 0x0", "F2FP.BF16.F32.PACK_AB R6, R5, R4", "BAR.SYNC.DEFER_BLOCKING R7, 0x100"]
    bad = good[:2] + [good[4], good[2], good[3]] + good[5:]
    for seq, ok in ((good, True), (bad, False)):
        (loop,) = _loops(seq)
        assert _pv_wait_follows_exponentials(loop) is ok


_PRED_DEF = re.compile(r"^(?:@!?U?P\d+\s+)?(\S+)\s+(U?P\d+)\s*,")


def _branch_before_pv_wait_votes(loop: list) -> bool:
    """Whether the last conditional branch before the loop's first wait for P V (gsb0, 0x0) tests a predicate that a
    warp vote (VOTE / VOTEU) wrote last."""
    first = min(k for k, x in enumerate(loop) if "DEPBAR.LE gsb0, 0x0" in x)
    br = next((k for k in range(first - 1, -1, -1) if re.match(r"^@!?U?P\d+\s+BRA", loop[k])), None)
    if br is None:
        return False
    pred = re.match(r"^@!?(U?P\d+)", loop[br]).group(1)
    for k in range(br - 1, -1, -1):
        m = _PRED_DEF.match(loop[k])
        if m and m.group(2) == pred:
            return m.group(1).startswith(("VOTE", "VOTEU"))
    return False


def test_vote_branch_parser():
    """The parser on hand-written stretches: a branch on a VOTE's predicate is seen, one on an FSETP's is not."""
    head = ["WARPGROUP.DEPBAR.LE gsb0, 0x1", "MUFU.EX2 R4, R4"]
    vote = head + ["VOTE.ANY P0, P0", "FADD R5, R4, R5", "@!P0 BRA 0x100", "WARPGROUP.DEPBAR.LE gsb0, 0x0"]
    fsetp = head + ["VOTE.ANY P0, P0", "FSETP.GT.FTZ.AND P1, PT, R4, RZ, PT", "@P1 BRA 0x100",
                    "WARPGROUP.DEPBAR.LE gsb0, 0x0", "@!P0 BRA 0x200"]
    assert _branch_before_pv_wait_votes(vote) and not _branch_before_pv_wait_votes(fsetp)


@pytest.mark.parametrize("dtype,d,causal,keys,mod", CASES)
def test_pv_wait_follows_the_exponentials(dtype, d, causal, keys, mod):
    from bench import bench_micro as bm
    from cuflash._loader import compile_offline

    if bm.find_cuobjdump() is None:
        pytest.skip("cuobjdump not found (CUDA toolkit or the nvidia-cuda-cuobjdump wheel)")
    tile = _configs.sm90_fwd_tile(d, causal, keys)
    spec = _configs.sm90_fwd_spec(dtype, d, causal, tile, mod)
    sass, status = bm.cubin_sass(compile_offline(spec.filename, [spec.name], "90a", verbose=False)["cubin"])
    assert sass is not None, status
    loops = _loops(_instructions(sass))
    assert loops, "no main loop found"
    for loop in loops:
        assert _pv_wait_follows_exponentials(loop), spec.name
        assert not _branch_before_pv_wait_votes(loop), spec.name
