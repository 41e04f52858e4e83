"""Diagnostic (GPU, compute capability 9.0): every sm90 forward kernel (cuflash._configs.sm90_fwd_specs) on
small ragged shapes, checked against the float64 reference -- fast enough to run under compute-sanitizer:

    compute-sanitizer --tool memcheck  python -m bench.diag.sm90_check
    compute-sanitizer --tool racecheck python -m bench.diag.sm90_check --quick
    compute-sanitizer --tool synccheck python -m bench.diag.sm90_check --quick

and, with --errors, where the error of each case lies (max abs error per 64-row band and 64-column chunk), to
locate a wrong layout or a missed stage. Exit status 1 when a case misses the error rule's bound (conftest.py).
"""
from __future__ import annotations

import sys

import numpy as np


def _case(b, sq, sk, h, hk, d, dtype, causal, errors):
    import torch

    import cuflash
    from cuflash import reference

    dt = getattr(torch, dtype)
    q = torch.randn(b, sq, h, d, device="cuda", dtype=dt)
    k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=dt) for _ in range(2))
    out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=causal, backend="sm90", return_attn_probs=True)
    torch.cuda.synchronize()
    f = lambda x: x.detach().float().cpu().numpy().astype(np.float64)  # noqa: E731
    ref, ref_lse = reference.attention_forward(f(q), f(k), f(v), None, causal)
    o = f(out)
    err = np.abs(np.nan_to_num(o, nan=1e9) - ref)
    bound = 2e-2 if dtype == "bfloat16" else 4e-3
    fin = np.isfinite(ref_lse)
    lerr = float(np.abs(np.nan_to_num(f(lse)) - np.nan_to_num(ref_lse))[fin].max()) if fin.any() else 0.0
    ok = err.max() <= bound * max(1.0, np.abs(ref).max()) and lerr < 1e-3 and \
        np.array_equal(np.isneginf(f(lse)), np.isneginf(ref_lse))
    tag = f"{dtype} d={d} causal={causal} b={b} sq={sq} sk={sk} h={h}/{hk}"
    print(f"{'ok  ' if ok else 'FAIL'} {tag}: max|err| {err.max():.2e} lse {lerr:.2e} nan {int(np.isnan(o).sum())}",
          flush=True)
    if errors and not ok:
        e = err.max(axis=(0, 2))  # [sq, d]
        rows = [f"{e[i:i + 64].max():.1e}" for i in range(0, sq, 64)]
        cols = [f"{e[:, j:j + 64].max():.1e}" for j in range(0, d, 64)]
        print(f"     per 64 rows: {' '.join(rows[:24])}\n     per 64 cols: {' '.join(cols)}")
        print(f"     out[0,:4,0,:4] {o[0, :4, 0, :4].round(3).tolist()}\n     ref          {ref[0, :4, 0, :4].round(3).tolist()}")
    return ok


def main(argv):
    from cuflash._configs import SM90_HEADDIMS

    quick, errors = "--quick" in argv, "--errors" in argv
    shapes = [(1, 130, 77, 2, 1)] if quick else [(1, 130, 77, 2, 1), (2, 200, 333, 4, 2), (1, 64, 64, 1, 1)]
    bad = 0
    for dtype in ("float16", "bfloat16"):
        for d in SM90_HEADDIMS:
            for causal in (False, True):
                for b, sq, sk, h, hk in shapes:
                    bad += not _case(b, sq, sk, h, hk, d, dtype, causal, errors)
    print(f"{bad} failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
