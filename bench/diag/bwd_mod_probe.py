"""Diagnostic (GPU, compute capability 9.0): where the Hopper backward's score-modifier cost comes from, in parts.

    python -m bench.diag.bwd_mod_probe [--rounds N] [--seqlens 4096,8192,16384] [--headdims 64,128]

The backward counterpart of bench/diag/mod_tile_probe.py. Suite `scores` compares each modifier's backward with the
configured plain causal backward, which at some lengths is the persistent form (cuflash._configs.
SM90_BWD_PERSIST_MAX_SEQLEN_K: head dim 64 up to 4k keys under the causal mask), while the modifier kernels
(MOD_SCORE) ran one block per KV tile. A window of 4096 keys at 4k, which hides nothing the causal mask does not, cost
15% there at head dim 64 (H100). This probe times the parts apart, each backward's main kernel and its preprocess and
dQ convert through one plan (cuflash.backward._make_plan, then the plan's run: no validation in the timed call), fp16,
causal, batch x seqlen = 16k tokens, hidden 2048, dQ "atomic", timed in turn (bench.harness.time_rounds, rotated),
medians of `rounds` rounds; every variant's out and LSE from the forward with the same modifiers:
  plain     the configured plain causal backward
  plain1    the plain kernel one block per KV tile (cuflash._bwd_sm90.PERSIST = False when its plan is made)
  wcausal   the modifier kernel one block per KV tile (PERSIST = False, as for w4096, alibi and softcap) with a
            window that hides nothing the causal mask does not (left = seqlen_k, right = 0): the same tiles and
            products as plain1 -- the modifier kernel's own cost at equal work
  w4096     the window (4096, 0)
  alibi     BLOOM's ALiBi slopes on the causal mask
  softcap   soft-cap 50 on the causal mask (the configured CAP_ONLY form where it is)
  *_p       wcausal, w4096, alibi and softcap again on the persistent modifier kernel (forced: cuflash._bwd_sm90.
            PERSIST = True), at the head dims that have one (cuflash._configs.SM90_BWD_PERSIST_MOD_HEADDIMS); softcap_p
            in its CAP_ONLY form where that is configured
The table: ms per variant, plain1 / plain (the persistent form's share), wcausal / plain1 (the modifier kernel at equal
work), w4096's time per tile of its band over wcausal's, alibi / wcausal and softcap / wcausal (the value modifiers
alone), and each modifier's cost over the configured plain kernel (one block per tile -> persistent where *_p ran).
"""
from __future__ import annotations

import sys

from .alibi_check import bloom_slopes
from .mod_tile_probe import CAP, HIDDEN, TOKENS, WINDOW, parts_table, probe_main, time_point

NAMES = ("plain", "plain1", "wcausal", "w4096", "alibi", "softcap")


def run(rounds: int, seqlens, headdims) -> list:
    import torch

    from cuflash import _bwd_sm90, _configs, _fwd_sm90
    from cuflash import backward as bwd
    from cuflash._mods import mods_for
    from cuflash._validate import check_qkv

    rows = []
    for d in headdims:
        h = HIDDEN // d
        slopes = bloom_slopes(h, "cuda")
        tile = _configs.sm90_bwd_tile(d)
        for s in seqlens:
            b = max(1, TOKENS // s)
            q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.float16) for _ in range(4))
            qa, ka, va = check_qkv(q, k, v)

            def plan_of(window=(-1, -1), cap=0.0, alibi=None, persist=None):
                causal = True  # (the kernels' mode comes from the modifiers: a window is the band, right = 0)
                mods = mods_for(qa, ka, causal, window, cap, alibi, None)
                out, lse = _fwd_sm90.forward(qa, ka, va, None, causal, mods=mods)
                views = bwd.check_backward_inputs(dout, q, k, v, out, lse)
                saved = _bwd_sm90.PERSIST
                _bwd_sm90.PERSIST = persist
                try:
                    plan = bwd._make_plan(*views, None, causal, "atomic", False, None, "auto", mods, backend="sm90")
                finally:
                    _bwd_sm90.PERSIST = saved
                ptrs = tuple(a.ptr for a in views)
                keep = (out, lse)  # (alive while the plan's pointers are used)
                return lambda: (plan.run(*ptrs), keep)

            mods = {"wcausal": dict(window=(s, 0)), "w4096": dict(window=(WINDOW, 0)), "alibi": dict(alibi=slopes),
                    "softcap": dict(cap=CAP)}
            fns = {"plain": plan_of(), "plain1": plan_of(persist=False),
                   **{n: plan_of(**kw, persist=False) for n, kw in mods.items()}}
            if d in _configs.SM90_BWD_PERSIST_MOD_HEADDIMS:
                fns.update({n + "_p": plan_of(**kw, persist=True) for n, kw in mods.items()})
            time_point(fns, rounds, d, s, tile, rows)
    report(rows)
    return rows


def report(rows) -> None:
    """The tables of run()'s rows: (head dim, seqlen, w4096's band, {variant: ms})."""
    parts_table(rows)
    print("\nCost over the configured plain kernel (time / plain's - 1; w4096: per tile of its band; one block per "
          "tile -> persistent where the persistent modifier kernel ran):\n")
    print("| hdim | seqlen | plain1 | wcausal | w4096 | alibi | softcap |")
    print("|---" * 7 + "|")
    for d, s, band, r in rows:
        def pct(n):
            f = band if n.startswith("w4096") else 1.0
            return f"{100 * (r[n] / f / r['plain'] - 1):+.1f}%"

        def cost(n):
            if not (r.get(n) and r.get("plain")):
                return "n/a"
            return pct(n) + (f" -> {pct(n + '_p')}" if r.get(n + "_p") else "")

        print(f"| {d} | {s} | " + " | ".join(cost(n) for n in NAMES[1:]) + " |")


def main(argv=None) -> int:
    return probe_main(argv, __doc__, run, "the Hopper backward")


if __name__ == "__main__":
    sys.exit(main())
