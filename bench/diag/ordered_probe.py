"""Diagnostic (GPU, compute capability 9.0): the Hopper backward's deterministic dQ strategy "ordered" under the
causal mask in its three visiting orders (cuda_src/flash_bwd_sm90.cu, ORDER; cuflash._bwd_sm90.CAUSAL_ORDER), or
without a mask in its two (--no-mask; cuflash._bwd_sm90.PLAIN_ORDER), next to the default "atomic" strategy and
SDPA's cuDNN backward, timed in turn (medians of rounds), on the FA2 grid's points (batch 16k / seqlen, 2048 / d
heads) and a few GQA points:

    python -m bench.diag.ordered_probe [--no-mask] [--rounds N] [--quick] [--seqlens S,S] [--headdims D,D]
                                       [--gqa-only] [--json FILE]
    python -m bench.diag.ordered_probe --model      (CPU: the scheduling model's prediction, no GPU)

Variants, causal: atomic (the package's walk and dispatch order for it); plain (ordered, KV tiles ascending from each
block's diagonal: the order before the change); kv_desc (ordered, KV tiles last first: the package's without GQA);
q_desc (ordered, Q tiles last first); heads_inner (ordered, the Q tiles last first outside and the KV head's query
heads inside, KV tiles ascending at each Q tile: the package's with GQA). --gqa-only keeps the GQA points. Without a
mask: atomic; plain (ordered, every block's Q tiles ascending, KV tile j adding after j - 1); rot (ordered, block x
at Q tile x - s mod M at step s: the package's where a head's KV tiles fit half the SMs). Each cuflash variant
is one plan (cuflash.backward._make_plan) called directly, `CALLS` back-to-back calls per timing (cuDNN through
autograd the same way, so its host latency overlaps too). Before timing, each ordered variant's gradients must equal
a second run bitwise and the atomic strategy's to fp32 rounding; a failure prints FAIL and sets exit status 1.
The table (last) gives ms and each variant's speed as a fraction of atomic's (atomic ms / variant ms).
--headdims (default 64,128): at head dim 256 the column-split kernel, its "ordered" turned on
(cuflash._bwd_sm90.SPLIT_ORDERED) for the probe, and without q_desc (a 128-key order)."""
from __future__ import annotations

import json
import sys

from cuflash._configs import DQ_ORDER_HEADS_INNER, DQ_ORDER_KV_DESC, DQ_ORDER_PLAIN, DQ_ORDER_Q_DESC, DQ_ORDER_ROT

CALLS = 5
VARIANTS = (("atomic", None), ("plain", DQ_ORDER_PLAIN), ("kv_desc", DQ_ORDER_KV_DESC), ("q_desc", DQ_ORDER_Q_DESC),
            ("heads_inner", DQ_ORDER_HEADS_INNER))
VARIANTS_NO_MASK = (("atomic", None), ("plain", DQ_ORDER_PLAIN), ("rot", DQ_ORDER_ROT))


def points(quick=False, headdims=(64, 128), seqlens=None):
    """(dtype, d, seqlen, batch, heads, kv heads): the FA2 grid's points at `headdims` (seqlens: those lengths), and
    four GQA points at those of them among 64 and 128 (the last, 64 / 8 heads at 8k, is suite bwd90_extra's)."""
    out = []
    for dt in ("float16", "bfloat16"):
        for d in headdims:
            for s in seqlens or ((2048, 16384) if quick else (2048, 4096, 8192, 16384)):
                out.append((dt, d, s, 16384 // s, 2048 // d, 2048 // d))
    out += [p for p in (("float16", 128, 4096, 4, 16, 2), ("float16", 128, 16384, 1, 16, 2),
                        ("float16", 64, 16384, 1, 32, 8), ("float16", 128, 8192, 2, 64, 8)) if p[1] in headdims]
    return out


def plan_call(views, causal, strategy, **knobs):
    """A call of one sm90 backward plan (cuflash.backward._make_plan) of the validated views, made with the
    cuflash._bwd_sm90 module knobs `knobs` (CAUSAL_ORDER, CAUSAL_GROUP, PERSIST, ...) set for the plan's making and
    put back after; the callable's `plan` is the plan."""
    from cuflash import _bwd_sm90, backward as bwd_mod

    old = {k: getattr(_bwd_sm90, k) for k in knobs}
    try:
        for k, v in knobs.items():
            setattr(_bwd_sm90, k, v)
        plan = bwd_mod._make_plan(*views, None, causal, strategy, strategy == "ordered", None, "auto", None,
                                  backend="sm90")
    finally:
        for k, v in old.items():
            setattr(_bwd_sm90, k, v)
    ptrs = tuple(a.ptr for a in views)
    fn = lambda: plan.run(*ptrs)  # noqa: E731
    fn.plan = plan  # (for a diagnostic that edits the plan)
    return fn


def _split(d):
    """Whether head dim d runs on the column-split kernel."""
    from cuflash._configs import kernel_headdim, sm90_bwd_tile

    return sm90_bwd_tile(kernel_headdim(d)).split


def _plan(views, causal, strategy, order):
    knob = "CAUSAL_ORDER" if causal else "PLAIN_ORDER"
    knobs = {} if order is None else {knob: order}
    if _split(views[1].shape[3]):
        knobs["SPLIT_ORDERED"] = True  # (the column-split kernel's "ordered", whether configured or not)
    return plan_call(views, causal, strategy, **knobs)


def _variants(d, causal):
    """The variants of a point: VARIANTS or VARIANTS_NO_MASK, the column-split kernel's without Q_DESC."""
    variants = VARIANTS if causal else VARIANTS_NO_MASK
    return tuple(v for v in variants if not (_split(d) and v[1] == DQ_ORDER_Q_DESC))


def causal_problem(dt, d, s, b, h, hk, causal=True):
    """A fresh random problem on the GPU (causal or without a mask): (q, k, v, dout, the backward's validated
    views)."""
    import torch

    import cuflash
    from cuflash.backward import check_backward_inputs

    tdt = getattr(torch, dt)
    q = torch.randn(b, s, h, d, device="cuda", dtype=tdt)
    k, v = (torch.randn(b, s, hk, d, device="cuda", dtype=tdt) for _ in range(2))
    out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    dout = torch.randn_like(out)
    return q, k, v, dout, check_backward_inputs(dout, q, k, v, out, lse)


def run_point(dt, d, s, b, h, hk, rounds, causal=True):
    import torch

    variants = _variants(d, causal)
    q, k, v, dout, views = causal_problem(dt, d, s, b, h, hk, causal)
    fns = {name: _plan(views, causal, "atomic" if order is None else "ordered", order) for name, order in variants}
    ok = True
    ref = [x.float() for x in fns["atomic"]()]
    for name, order in variants[1:]:
        a, again = fns[name](), fns[name]()
        torch.cuda.synchronize()
        bitwise = all(torch.equal(x, y) for x, y in zip(a, again))
        close = all((x.float() - r).abs().max().item() <= 2 ** -6 * r.abs().max().item() for x, r in zip(a, ref))
        if not (bitwise and close):
            ok = False
            print(f"FAIL {dt} d{d} s{s} h{h}/{hk} {name}: bitwise repeat {bitwise}, matches atomic {close}", flush=True)
        del a, again
    del ref
    return time_with_cudnn(fns, q, k, v, dout, rounds, f"{dt} d{d} s{s} h{h}/{hk}", causal), ok


def run_points(argv, pts, run, default_rounds):
    """On a compute capability 9.0 GPU: run(*point, rounds) -> ({name: ms}, ok) for every point (--rounds N), each
    printed as it ends, all written to --json FILE. Returns (rows of (point, ms, ok), all ok), or (None, False)
    without such a GPU."""
    import torch

    if torch.cuda.get_device_capability() != (9, 0):
        print("needs a compute capability 9.0 GPU (the sm90 backward)")
        return None, False
    rounds = int(argv[argv.index("--rounds") + 1]) if "--rounds" in argv else default_rounds
    rows, all_ok = [], True
    for pt in pts:
        ms, ok = run(*pt, rounds)
        all_ok &= ok
        rows.append((pt, ms, ok))
        print(pt, {k: round(v, 3) if v else v for k, v in ms.items()}, flush=True)
    if "--json" in argv:
        with open(argv[argv.index("--json") + 1], "w") as f:
            json.dump([dict(zip(("dtype", "d", "seqlen", "batch", "heads", "kv_heads", "causal"), p), ms=m, ok=ok)
                       for p, m, ok in rows], f, indent=1)
    return rows, all_ok


def time_with_cudnn(fns, q, k, v, dout, rounds, label, causal=True, timer=None):
    """{name: median ms per call} of the callables `fns` and SDPA cuDNN's backward on the same inputs (through
    autograd, native GQA), timed in turn for `rounds` rounds, `CALLS` back-to-back calls per timing (or `timer`: a
    callable's ms per call); `fns` is consumed (its plans freed with it)."""
    import torch

    from ..harness import sdpa, time_ms, time_rounds

    h, hk = q.shape[2], k.shape[2]
    qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
    dot = dout.transpose(1, 2).contiguous()
    try:
        ot = sdpa("cudnn")(qt, kt, vt, causal, None, hk != h)
        fns["cudnn"] = lambda: torch.autograd.grad(ot, (qt, kt, vt), dot, retain_graph=True)
    except RuntimeError as e:  # (a case cuDNN's SDPA backend refuses: no reference for this point)
        print(f"sdpa cudnn refused {label}: {str(e)[:200]}", flush=True)
    if timer is None:
        timer = lambda fn: time_ms(lambda: [fn() for _ in range(CALLS)], rep=5) / CALLS  # noqa: E731
    timed = time_rounds(fns, rounds, timer=timer)
    fns.clear()
    torch.cuda.empty_cache()
    return {name: ms for name, (ms, _) in timed.items()}


def model(quick=False):
    """The scheduling model behind bench/NOTES.md's prediction: 132 SMs, one block each, blocks started in grid
    order as SMs free up, one time unit per (head, Q tile), the writer's bulk add 0.25 units after the tile is
    staged and the turn has come, the consumers one staged tile ahead of the writer. Returns rows of (point,
    {variant: fraction of atomic's speed})."""
    import heapq

    def simulate(s, bm, h, hk, b, scheme, r=0.25, sms=132):
        bn, group = 128, h // hk
        n, m_total = -(-s // bn), -(-s // bm)
        blocks = [(bb, kh, j) for bb in range(b) for kh in range(hk)
                  for j in (range(n - 1, -1, -1) if scheme == "kv_desc" else range(n))]
        done, free, end = {}, [0.0] * sms, 0.0
        for bb, kh, j in blocks:
            t = w = heapq.heappop(free)
            ms = list(range(j * bn // bm, m_total))
            if scheme in ("q_desc", "heads_inner"):
                ms.reverse()
            if scheme == "heads_inner":
                walk = [(hh, m) for m in ms for hh in range(group)]
            else:
                walk = [(hh, m) for hh in range(group) for m in ms]
            for hh, m in walk:
                staged = max(t + 1.0, w)
                if scheme == "atomic":
                    dep = 0.0
                elif scheme == "kv_desc":
                    dep = done.get((bb, kh, hh, m, j + 1), 0.0) if j < min(n - 1, ((m + 1) * bm - 1) // bn) else 0.0
                else:
                    dep = done.get((bb, kh, hh, m, j - 1), 0.0) if j else 0.0
                w = max(staged, dep) + r
                done[(bb, kh, hh, m, j)] = w
                t = staged
            end = max(end, t, w)
            heapq.heappush(free, max(t, w))
        return end

    rows = []
    for dt, d, s, b, h, hk in points(quick):
        if dt != "float16":
            continue
        bm = 128 if d == 64 else 64
        t = {sc: simulate(s, bm, h, hk, b, sc) for sc in ("atomic",) + tuple(n for n, _ in VARIANTS[1:])}
        rows.append(((d, s, b, h, hk), {sc: t["atomic"] / t[sc] for sc in t}))
    return rows


def main(argv):
    if "--model" in argv:
        print("model (fraction of atomic's speed; fp16 and bf16 alike)")
        print(f"{'d':>4} {'seqlen':>6} {'b':>2} {'h/hk':>6} | " + " ".join(f"{n:>8}" for n, _ in VARIANTS[1:]))
        for (d, s, b, h, hk), fr in model("--quick" in argv):
            print(f"{d:>4} {s:>6} {b:>2} {f'{h}/{hk}':>6} | " + " ".join(f"{fr[n]:>8.2f}" for n, _ in VARIANTS[1:]))
        return 0
    causal = "--no-mask" not in argv
    variants = VARIANTS if causal else VARIANTS_NO_MASK
    seqlens = [int(x) for x in argv[argv.index("--seqlens") + 1].split(",")] if "--seqlens" in argv else None
    headdims = [int(x) for x in argv[argv.index("--headdims") + 1].split(",")] if "--headdims" in argv else (64, 128)
    pts = points("--quick" in argv, headdims=headdims, seqlens=seqlens)
    if "--gqa-only" in argv:
        pts = [p for p in pts if p[4] != p[5]]
    rows, all_ok = run_points(argv, pts, lambda *pt: run_point(*pt, causal=causal), default_rounds=2)
    if rows is None:
        return 2
    print(f"\n{'causal' if causal else 'no-mask'} backward, ms per call (atomic, cuDNN) and ordered's speed as a "
          "fraction of atomic's")
    print(f"{'dtype':>8} {'d':>4} {'seqlen':>6} {'h/hk':>6} | {'atomic':>7} {'cudnn':>7} | "
          + " ".join(f"{n:>8}" for n, _ in variants[1:]) + " | check")
    for (dt, d, s, b, h, hk), ms, ok in rows:
        a = ms.get("atomic")
        fr = " ".join(f"{a / ms[n]:>8.2f}" if a and ms.get(n) else f"{'-':>8}" for n, _ in variants[1:])
        cd = f"{ms['cudnn']:>7.3f}" if ms.get("cudnn") else f"{'-':>7}"
        print(f"{dt:>8} {d:>4} {s:>6} {f'{h}/{hk}':>6} | {a:>7.3f} {cd} | {fr} | {'ok' if ok else 'FAIL'}")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
