"""Diagnostic (GPU, compute capability 9.0): every sm90 forward kernel (cuflash._configs.sm90_fwd_specs) on
small ragged shapes, checked against the float64 reference -- fast enough to run under compute-sanitizer:

    compute-sanitizer --tool memcheck  python -m bench.diag.sm90_check
    compute-sanitizer --tool racecheck python -m bench.diag.sm90_check --quick
    compute-sanitizer --tool synccheck python -m bench.diag.sm90_check --quick
    compute-sanitizer --tool memcheck  python -m bench.diag.sm90_check --persist
    compute-sanitizer --tool synccheck python -m bench.diag.sm90_check --persist --quick
    compute-sanitizer --tool memcheck  python -m bench.diag.sm90_check --bands
    compute-sanitizer --tool memcheck  python -m bench.diag.sm90_check --stream-k
    compute-sanitizer --tool synccheck python -m bench.diag.sm90_check --persist-mods --quick

(--persist: the persistent form's variants, cuflash._configs.SM90_FWD_PERSIST_VARIANTS, instead of the configured
tiles, each with its three tile walks, grid_order "qtile" and "bh" in fixed waves and "dynamic" (tiles handed out
by a counter), on grids of fewer tiles than blocks and of several tiles per block; --bands: the configured one-tile kernels of every head dim, causal and with sliding windows (and a
soft-capped causal band), on shapes whose Q tiles' warpgroups see different KV tiles -- sq < sk, sq > sk (rows that
see no key), tails of no tile's multiple -- the warpgroups' skipped KV tiles and empty turns; --stream-k: the
persistent variants walking by stream-K without a mask, tiles split between blocks; --persist-mods: the modifier
kernels' persistent form, cuflash._configs.sm90_fwd_mod_persist_tiles, with windows (hidden first and last KV tiles,
rows that see no key) and the soft-cap, under the fixed and the dynamic walk; with --quick float16 only, there and
with --persist)

and, with --errors, where the error of each case lies (max abs error per 64-row band and 64-column chunk), to
locate a wrong layout or a missed stage. Exit status 1 when a case misses the error rule's bound (conftest.py).
"""
from __future__ import annotations

import sys

import numpy as np


def _run(q, k, v, causal, walk, mods):
    """(out, lse) of the configured sm90 call (walk None; mods: flash_attn_func's window_size / softcap keywords), or
    of the tile walk = (tile, grid_order) with outputs poisoned (NaN) before the launch."""
    import torch

    import cuflash
    from cuflash import _fwd_sm90
    from cuflash._validate import check_qkv

    if walk is None:
        out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=causal, backend="sm90", return_attn_probs=True,
                                              **(mods or {}))
        return out, lse
    from cuflash._mods import mods_for

    tile, order = walk
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"), device="cuda", dtype=torch.float32)
    qa, ka, va = check_qkv(q, k, v)
    m = mods or {}
    mo = mods_for(qa, ka, causal, m.get("window_size", (-1, -1)), m.get("softcap", 0.0), None, None) if m else None
    _fwd_sm90.forward(qa, ka, va, None, causal, order, out=out, lse=lse, tile=tile, mods=mo)
    return out, lse


def _case(b, sq, sk, h, hk, d, dtype, causal, errors, walk=None, mods=None):
    import torch

    from cuflash import reference

    dt = getattr(torch, dtype)
    q = torch.randn(b, sq, h, d, device="cuda", dtype=dt)
    k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=dt) for _ in range(2))
    out, lse = _run(q, k, v, causal, walk, mods)
    torch.cuda.synchronize()
    f = lambda x: x.detach().float().cpu().numpy().astype(np.float64)  # noqa: E731
    ref, ref_lse = reference.attention_forward(f(q), f(k), f(v), None, causal, **(mods or {}))
    o = f(out)
    err = np.abs(np.nan_to_num(o, nan=1e9) - ref)
    bound = 2e-2 if dtype == "bfloat16" else 4e-3
    fin = np.isfinite(ref_lse)
    lerr = float(np.abs(np.nan_to_num(f(lse)) - np.nan_to_num(ref_lse))[fin].max()) if fin.any() else 0.0
    ok = err.max() <= bound * max(1.0, np.abs(ref).max()) and lerr < 1e-3 and \
        np.array_equal(np.isneginf(f(lse)), np.isneginf(ref_lse))
    tag = f"{dtype} d={d} causal={causal} b={b} sq={sq} sk={sk} h={h}/{hk}"
    if walk is not None:
        tag += f" {'persistent' if walk[0].persistent else 'one-tile'} n{walk[0].block_n} {walk[1]}"
    if mods:
        tag += " " + " ".join(f"{k}={v}" for k, v in mods.items())
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
    from cuflash._configs import (SM90_FWD_PERSIST_VARIANTS, SM90_FWD_TILES, SM90_HEADDIMS, sm90_fwd_mod_persist_tiles,
                                  sm90_fwd_persist_tiles)

    quick, errors = "--quick" in argv, "--errors" in argv
    shapes = [(1, 130, 77, 2, 1)] if quick else [(1, 130, 77, 2, 1), (2, 200, 333, 4, 2), (1, 64, 64, 1, 1)]
    bad = 0
    if "--persist" in argv:
        # 6 tiles (fewer than the blocks), and 2 x 8 heads x 11 Q tiles = 176 (1.33 per block on 132 SMs), sq > sk
        shapes = [(1, 300, 300, 2, 1), (2, 1333, 1000, 8, 2)]
        for dtype in ("float16",) if quick else ("float16", "bfloat16"):
            for d in sorted(SM90_FWD_PERSIST_VARIANTS):
                for tile in sm90_fwd_persist_tiles(d).values():
                    for causal in (False, True):
                        for order in ("qtile", "bh", "dynamic"):
                            for b, sq, sk, h, hk in shapes:
                                bad += not _case(b, sq, sk, h, hk, d, dtype, causal, errors, (tile, order))
        print(f"{bad} failed")
        return 1 if bad else 0
    if "--persist-mods" in argv:
        # as --persist (--quick: several tiles per block only), with the bands of --bands and the soft-cap (causal:
        # the band with right = 0)
        shapes = [(2, 1333, 1000, 8, 2)] if quick else [(1, 300, 300, 2, 1), (2, 1333, 1000, 8, 2)]
        bands = [dict(window_size=(100, 17)), dict(window_size=(300, -1)), dict(window_size=(-1, 0), softcap=20.0),
                 dict(softcap=20.0)]
        for dtype in ("float16",) if quick else ("float16", "bfloat16"):
            for d in sorted(SM90_FWD_PERSIST_VARIANTS):
                for tile in sm90_fwd_mod_persist_tiles(d).values():
                    for mods in bands:
                        for order in ("qtile", "dynamic"):
                            for b, sq, sk, h, hk in shapes:
                                bad += not _case(b, sq, sk, h, hk, d, dtype, False, errors, (tile, order), mods)
        print(f"{bad} failed")
        return 1 if bad else 0
    if "--stream-k" in argv:
        # stream-K (grid_order "stream_k", no mask): 144 / 168 tiles of 128 rows and 192 of 192 rows on 132 blocks --
        # ranges across tile boundaries, tiles split between two blocks, ragged last tiles (warpgroups without rows)
        for dtype in ("float16",) if quick else ("float16", "bfloat16"):
            for d in sorted(SM90_FWD_PERSIST_VARIANTS):
                shapes = [(2, 1000, 1500, 16, 4)] if d == 64 else [(2, 1000, 1500, 9, 3), (3, 777, 901, 8, 2)]
                for tile in sm90_fwd_persist_tiles(d).values():
                    for b, sq, sk, h, hk in shapes:
                        bad += not _case(b, sq, sk, h, hk, d, dtype, False, errors, (tile, "stream_k"))
        print(f"{bad} failed")
        return 1 if bad else 0
    if "--bands" in argv:
        # 200 / 64 / 192-row Q tiles against 80 / 128-key tiles: warpgroups whose last row's band ends a KV tile
        # before the tile's (causal, window right edges) or whose first row's begins one after (left edges)
        shapes = [(1, 500, 500, 2, 1), (2, 300, 700, 4, 2), (1, 700, 300, 2, 2)]
        bands = [dict(window_size=(100, 17)), dict(window_size=(0, 0)), dict(window_size=(300, -1)),
                 dict(window_size=(-1, 50)), dict(window_size=(-1, 0), softcap=20.0)]
        for dtype in ("float16",) if quick else ("float16", "bfloat16"):
            for d in SM90_HEADDIMS:
                for b, sq, sk, h, hk in shapes:
                    bad += not _case(b, sq, sk, h, hk, d, dtype, True, errors, (SM90_FWD_TILES[d], "auto"))
                for mods in bands:
                    for b, sq, sk, h, hk in shapes[1:]:
                        bad += not _case(b, sq, sk, h, hk, d, dtype, False, errors, None, mods)
        print(f"{bad} failed")
        return 1 if bad else 0
    for dtype in ("float16", "bfloat16"):
        for d in SM90_HEADDIMS:
            for causal in (False, True):
                for b, sq, sk, h, hk in shapes:
                    bad += not _case(b, sq, sk, h, hk, d, dtype, causal, errors)
    print(f"{bad} failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
