"""Before / after: the same public calls timed on two trees in turn, to show a change left the speed alone.

    python -m bench compare --base DIR_OF_OLD_CHECKOUT --out OUTDIR [--suites fwd,bwd,decode,latency]
                            [--seqlens 1024,2048,4096,8192,16384] [--rounds 3] [--time-limit 9] [--queued]

The old tree's package is imported under another name (`cuflash_base`, from DIR/cuflash/__init__.py with
DIR/cuflash as its search location); its imports are relative and it finds its kernels through
`_loader.source_dir()` (`Path(__file__).parent.parent / "cuda_src"`), so the base runs the old tree's kernels
(both directories are printed and written to the header). Only the public API present in both trees is called:
`flash_attn_func(q, k, v, causal=...)` on torch tensors [batch, seqlen, nheads, headdim] (the backward through
torch autograd) and `flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=...)`.

Suites:
  fwd      the FlashAttention-2 grid (batch x seqlen = 16k tokens, hidden 2048, head dims 64 / 128, causal and
           not, fp16 and bf16, --seqlens), base, new, SDPA FLASH and cuDNN timed in turn, --rounds rounds
  bwd      the same grid, the backward through autograd (graph kept, one backward per timing)
           (fwd and bwd: single calls on an idle GPU, harness.time_ms; with --queued each call queued behind a ~3 ms
           spin kernel, harness.time_queued_ms: the GPU time alone, with the GPU busy when the call starts, as in a
           model -- no host time before the kernel and no clock ramp from idle in the timing)
  decode   decoding steps (q_len 1, 32 heads, head dim 128, fp16; a few batch / cache / KV-head cases), GPU time
           per call from CUDA-graph replays (event timing of single calls when capture fails)
  latency  a loop of small calls from Python (batch 1, 8 heads, 128 tokens, head dim 64; and a small decode step),
           microseconds per call

Each point's ratio is the speed of new over base (TFLOP/s new / base; for times, base us / new us): > 1 means
the new tree is faster. Summary per suite: the median ratio over its points and the worst point; the check
applied is "median within 2%, no point worse by more than 4%". Writes OUTDIR/results.json (records with
`tree` = "base" / "new"), OUTDIR/compare.md and the precompile logs."""
from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

from . import harness
from .harness import host_us_per_call, median, record, sdpa, time_ms, time_queued_ms, time_rounds

TOKENS, HIDDEN = 16384, 2048
SEQLENS = (1024, 2048, 4096, 8192, 16384)
SUITES = ("fwd", "bwd", "decode", "latency")
# (batch, cache length, KV heads) at 32 query heads, head dim 128, fp16
DECODE_CASES = ((1, 8192, 32), (1, 32768, 8), (8, 32768, 8), (64, 4096, 8), (1, 131072, 1), (8, 16384, 32))
GRAPH_CALLS = 20
MEDIAN_TOL, POINT_TOL = 0.02, 0.04
ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------------------- the trees
def load_tree(tree_dir, name="cuflash_base"):
    """Import DIR/cuflash as the package `name` (registered in sys.modules, so its relative imports resolve
    inside that tree)."""
    pkg = Path(tree_dir).resolve() / "cuflash"
    init = pkg / "__init__.py"
    if not init.is_file():
        raise SystemExit(f"{init} not found: --base must be the root of a cuflash checkout")
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(pkg)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[name]
        raise
    return mod


def kernel_dir(pkg) -> str:
    """The cuda_src/ directory a loaded cuflash package compiles from."""
    try:
        return str(importlib.import_module(pkg.__name__ + "._loader").source_dir())
    except Exception as e:  # noqa: BLE001 - a tree whose loader is elsewhere: say so
        return f"unknown ({type(e).__name__}: {e})"


def _precompile_both(base_dir, out_dir, jobs):
    """cuflash.precompile for both trees, in parallel subprocesses (fills CuPy's disk cache); failures only
    mean the kernels compile at their first call, outside the timings."""
    procs = []
    for label, cwd in (("new", ROOT), ("base", Path(base_dir).resolve())):
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(cwd) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        log = open(os.path.join(out_dir, f"precompile_{label}.log"), "w")
        try:
            p = subprocess.Popen([sys.executable, "-m", "cuflash.precompile", "-j", str(jobs)], cwd=cwd, env=env,
                                 stdout=log, stderr=subprocess.STDOUT)
            procs.append((label, p, log))
        except OSError as e:
            print(f"precompile {label}: {e}")
            log.close()
    for label, p, log in procs:
        try:
            rc = p.wait(timeout=300)
        except subprocess.TimeoutExpired:
            p.kill()
            rc = "timeout"
        log.close()
        print(f"precompile {label}: rc={rc}", flush=True)


# ---------------------------------------------------------------------------------------------- timing
class Clock:
    """The run's time limit: suites skip their remaining points once it is reached (recorded as skipped)."""

    def __init__(self, minutes):
        self.t0, self.limit = time.time(), minutes * 60.0

    def out(self):
        return time.time() - self.t0 > self.limit


def _extra(tree, rounds, per, backend):
    return dict(tree=tree, rounds=rounds, round_ms=per, backend=backend)


def _auto_path(mode, d):
    """The kernel path these public calls take (backend "auto": contiguous 16-bit tensors, no options): "sm90" on a
    compute capability 9.0 GPU at a head dim the Hopper forward (mode "fwd") or backward ("bwd") compiles, else
    "sm80"."""
    import torch

    from cuflash import _configs

    dims = _configs.SM90_BWD_HEADDIMS if mode == "bwd" else _configs.SM90_HEADDIMS
    sm90 = torch.cuda.get_device_capability() == (9, 0) and d in dims and d > _configs.SM80_ONLY_MAX_HEADDIM
    return "sm90" if sm90 else "sm80"


def _grid(dtypes, headdims, seqlens):
    for dtype in dtypes:
        for d in headdims:
            for s in seqlens:
                for causal in (False, True):
                    yield dtype, d, HIDDEN // d, s, TOKENS // s, causal


def _timer(queued):
    """time_rounds' keywords: single calls (its default, time_ms), or each call queued behind a spin kernel."""
    return dict(timer=time_queued_ms, rep=10) if queued else {}


def _mark(recs, queued):
    if queued:
        for r in recs:
            r["timing"] = "queued"
    return recs


def fwd(trees, seqlens=SEQLENS, dtypes=("float16", "bfloat16"), headdims=(64, 128), rounds=3, clock=None,
        providers=("flash", "cudnn"), queued=False):
    import torch

    recs = []
    for dtype, d, h, s, b, causal in _grid(dtypes, headdims, seqlens):
        if clock and clock.out():
            recs.append(dict(provider="skipped", mode="fwd", dtype=dtype, headdim=d, seqlen_q=s, causal=causal))
            continue
        dt = getattr(torch, dtype)
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dt) for _ in range(3))
        qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        fns = {t: (lambda m=m: m.flash_attn_func(q, k, v, causal=causal)) for t, m in trees.items()}
        fns.update({p: (lambda fn=sdpa(p): fn(qt, kt, vt, causal)) for p in providers})
        timed = time_rounds(fns, rounds, **_timer(queued))
        for name, (ms, per) in timed.items():
            if name in trees:
                recs.append(record("cuflash", "v2", "fwd", dtype, b, h, s, s, d, causal, ms,
                                   **_extra(name, rounds, per, _auto_path("fwd", d))))
            else:
                recs.append(record(name, "sdpa", "fwd", dtype, b, h, s, s, d, causal, ms, rounds=rounds, round_ms=per))
        _print_point(recs[-len(fns):])
        del q, k, v, qt, kt, vt, fns
        gc.collect()
    return _mark(recs, queued)


def bwd(trees, seqlens=SEQLENS, dtypes=("float16", "bfloat16"), headdims=(64, 128), rounds=3, clock=None,
        providers=("flash", "cudnn"), queued=False):
    import torch

    recs = []
    for dtype, d, h, s, b, causal in _grid(dtypes, headdims, seqlens):
        if clock and clock.out():
            recs.append(dict(provider="skipped", mode="bwd", dtype=dtype, headdim=d, seqlen_q=s, causal=causal))
            continue
        dt = getattr(torch, dtype)
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dt, requires_grad=True) for _ in range(3))
        dout = torch.randn(b, s, h, d, device="cuda", dtype=dt)
        qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
        doutt = dout.transpose(1, 2).contiguous()

        def grad_fn(out, inputs, g):
            return lambda: torch.autograd.grad(out, inputs, g, retain_graph=True)

        fns = {}
        for t, m in trees.items():
            fns[t] = grad_fn(m.flash_attn_func(q, k, v, causal=causal), (q, k, v), dout)
        for p in providers:
            try:
                fns[p] = grad_fn(sdpa(p)(qt, kt, vt, causal), (qt, kt, vt), doutt)
            except RuntimeError as e:
                print(f"sdpa {p} forward failed: {e}")
        timed = time_rounds(fns, rounds, **(_timer(queued) or dict(rep=10)))
        for name, (ms, per) in timed.items():
            if name in trees:
                recs.append(record("cuflash", "v2", "bwd", dtype, b, h, s, s, d, causal, ms,
                                   **_extra(name, rounds, per, _auto_path("bwd", d))))
            else:
                recs.append(record(name, "sdpa", "bwd", dtype, b, h, s, s, d, causal, ms, rounds=rounds, round_ms=per))
        _print_point(recs[-len(fns):])
        del q, k, v, dout, qt, kt, vt, doutt, fns, timed
        gc.collect()
        torch.cuda.empty_cache()
    return _mark(recs, queued)


def _graph(fn, calls=GRAPH_CALLS):
    """A CUDA graph of `calls` calls of fn, or None when the call cannot be captured."""
    from .bench_decode import capture_graph

    try:
        return capture_graph(fn, calls)
    except Exception as e:  # noqa: BLE001
        print(f"graph capture failed: {type(e).__name__}: {e}")
        return None


def decode(trees, cases=DECODE_CASES, rounds=3, clock=None, h=32, d=128):
    import torch

    recs = []
    for b, s, hk in cases:
        if clock and clock.out():
            recs.append(dict(provider="skipped", mode="decode", batch=b, seqlen_k=s, heads_k=hk))
            continue
        kc = torch.randn(b, s, hk, d, device="cuda", dtype=torch.float16)
        vc = torch.randn_like(kc)
        q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.float16)
        seqlens = torch.full((b,), s, dtype=torch.int32, device="cuda")
        calls = {t: (lambda m=m: m.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens)) for t, m in trees.items()}
        graphs = {t: _graph(fn) for t, fn in calls.items()}
        if all(g is not None for g in graphs.values()):
            timing, per_call = "graph", GRAPH_CALLS
            fns = {t: g.replay for t, g in graphs.items()}
        else:  # both trees timed the same way
            timing, per_call = "event", 1
            fns = calls
        timed = time_rounds(fns, rounds, rep=10, min_warmup_ms=5.0)
        kv_bytes = 2 * b * s * hk * d * 2
        for t, (ms, per) in timed.items():
            us = ms * 1e3 / per_call if ms else None
            recs.append(record("cuflash", "decode", "decode", "float16", b, h, 1, s, d, False,
                               ms / per_call if ms else None, us=us, heads_k=hk, kv_bytes=kv_bytes, timing=timing,
                               tree=t, rounds=rounds, round_us=[x * 1e3 / per_call for x in per]))
        _print_point(recs[-len(fns):])
        del kc, vc, q, graphs, fns, calls
        gc.collect()
        torch.cuda.empty_cache()
    return recs


def parse_decode_cases(text: str) -> tuple:
    """--decode-cases "B,S,HK;B,S,HK": ((batch, cache length, KV heads), ...), each a divisor of the 32 query
    heads."""
    cases = []
    for part in (p for p in text.split(";") if p.strip()):
        try:
            b, s, hk = (int(x) for x in part.split(","))
        except ValueError:
            raise SystemExit(f"--decode-cases: {part!r} is not B,S,HK") from None
        if b < 1 or s < 1 or hk < 1 or 32 % hk:
            raise SystemExit(f"--decode-cases: {part!r}: batch and length >= 1, KV heads a divisor of 32")
        cases.append((b, s, hk))
    if not cases:
        raise SystemExit("--decode-cases: no case given")
    return tuple(cases)


def latency(trees, rounds=5, clock=None):
    import torch

    recs = []
    q, k, v = (torch.randn(1, 128, 8, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    kc = torch.randn(1, 4096, 8, 128, device="cuda", dtype=torch.float16)
    vc = torch.randn_like(kc)
    qd = torch.randn(1, 1, 8, 128, device="cuda", dtype=torch.float16)
    seqlens = torch.full((1,), 4096, dtype=torch.int32, device="cuda")
    cases = [("fwd", False), ("fwd", True), ("decode", False)]
    for kind, causal in cases:
        if clock and clock.out():
            recs.append(dict(provider="skipped", mode="latency", algo=kind, causal=causal))
            continue
        if kind == "fwd":
            fns = {t: (lambda m=m: m.flash_attn_func(q, k, v, causal=causal)) for t, m in trees.items()}
            shape = (1, 8, 128, 128, 64)
        else:
            fns = {t: (lambda m=m: m.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=seqlens)) for t, m in trees.items()}
            shape = (1, 8, 1, 4096, 128)
        timed = time_rounds(fns, rounds, timer=host_us_per_call)
        for t, (us, per) in timed.items():
            recs.append(record("cuflash", "v2" if kind == "fwd" else "decode", "latency", "float16", *shape, causal,
                               us / 1e3 if us else None, backend=_auto_path("fwd", 64) if kind == "fwd" else None,
                               us_per_call=us, us=us, tree=t, rounds=rounds, round_us=per, case=kind))
        _print_point(recs[-len(fns):])
    torch.cuda.synchronize()
    return recs


def _print_point(rs):
    r0 = rs[0]
    parts = []
    for r in rs:
        name = r.get("tree") or r["provider"]
        if r.get("tflops"):
            parts.append(f"{name}={r['tflops']:.1f}")
        elif r.get("us"):
            parts.append(f"{name}={r['us']:.1f}us")
        else:
            parts.append(f"{name}=n/a")
    where = " ".join(f"{k}={r0.get(k)}" for k in ("mode", "dtype", "headdim", "batch", "seqlen_k", "heads_k", "causal")
                     if r0.get(k) is not None)
    print(f"{where}: " + " ".join(parts), flush=True)


# ----------------------------------------------------------------------------------------------- report
def _key(r):
    return (r.get("section"), r.get("mode"), r.get("case"), r.get("dtype"), r.get("headdim"), r.get("batch"),
            r.get("seqlen_k"), r.get("heads_k"), r.get("causal"))


def _speed(r):
    """Higher is faster: TFLOP/s where there is a FLOP count, else 1 / time."""
    if r.get("tflops"):
        return r["tflops"]
    t = r.get("us") or r.get("us_per_call") or r.get("ms")
    return 1.0 / t if t else None


def pairs(records):
    """[(key, base record, new record, {provider: sdpa record})] per point measured on both trees."""
    by = {}
    for r in records:
        if r.get("provider") in ("error", "skipped"):
            continue
        slot = by.setdefault(_key(r), {"sdpa": {}})
        if r.get("tree") in ("base", "new"):
            slot[r["tree"]] = r
        else:
            slot["sdpa"][r["provider"]] = r
    return [(k, v["base"], v["new"], v["sdpa"]) for k, v in by.items() if "base" in v and "new" in v]


def summarize(records):
    """{suite: dict(n, median, worst, worst_point, ok)} of the speed ratios new / base."""
    out = {}
    for key, base, new, _ in pairs(records):
        sb, sn = _speed(base), _speed(new)
        if not sb or not sn:
            continue
        out.setdefault(key[0], []).append((sn / sb, key))
    res = {}
    for suite, rs in out.items():
        ratios = sorted(x for x, _ in rs)
        worst, wkey = min(rs, key=lambda x: x[0])
        med = median(ratios)
        res[suite] = dict(n=len(rs), median=med, worst=worst, worst_point=_label(wkey),
                          ok=abs(med - 1.0) <= MEDIAN_TOL and worst >= 1.0 - POINT_TOL)
    return res


def _label(key):
    _, mode, case, dtype, d, b, sk, hk, causal = key
    if mode == "decode":
        return f"b{b} cache {sk} hk{hk}"
    if mode == "latency":
        return f"{case} causal={causal}"
    return f"{dtype} d{d} s{sk} {'causal' if causal else 'non-causal'}"


def _val(r):
    if r is None:
        return "-"
    if r.get("tflops"):
        return f"{r['tflops']:.1f}"
    t = r.get("us") or r.get("us_per_call")
    return f"{t:.1f} us" if t else "-"


def _trees(source) -> str:
    return f"cuda_src {source['cuda_src'][:12]}, cuflash {source['cuflash'][:12]}" if source else "unknown"


def markdown(head, records) -> str:
    lines = [f"# cuflash before / after\n",
             f"{head.get('gpu')} ({head.get('sms')} SMs), driver {head.get('driver')}, clocks {head.get('clocks')}, "
             f"torch {head.get('torch')}, cupy {head.get('cupy')}, NVRTC {head.get('nvrtc')}, {head.get('date')}.",
             f"base: `{head.get('base_dir')}` (commit {head.get('base_commit')}, kernels `{head.get('base_kernels')}`); "
             f"new: `{head.get('new_dir')}` (commit {head.get('new_commit')}, kernels `{head.get('new_kernels')}`).",
             f"Source trees (`git rev-parse COMMIT:cuda_src` / `:cuflash` of a commit that holds the same files): base "
             f"{_trees(head.get('base_source'))}; new {_trees(head.get('new_source'))}.",
             f"Rounds timed in turn (base, new, SDPA ...), medians"
             f"{'; fwd / bwd: each call queued behind a ~3 ms spin kernel (GPU time)' if head.get('timing') == 'queued' else ''}"
             f". Ratio: speed new / base (> 1: new faster). "
             f"Check: median within {MEDIAN_TOL:.0%}, no point worse by more than {POINT_TOL:.0%}.", ""]
    summ = summarize(records)
    lines += ["## Summary", "", "| suite | points | median new/base | worst | worst point | check |", "|---|---|---|---|---|---|"]
    for suite, s in summ.items():
        lines.append(f"| {suite} | {s['n']} | {s['median']:.3f} | {s['worst']:.3f} | {s['worst_point']} | "
                     f"{'pass' if s['ok'] else 'FAIL'} |")
    lines.append("")
    by_suite = {}
    for key, base, new, sd in pairs(records):
        by_suite.setdefault(key[0], []).append((key, base, new, sd))
    for suite, rows in by_suite.items():
        provs = sorted({p for *_, sd in rows for p in sd})
        unit = "TFLOP/s" if suite in ("fwd", "bwd") else "us per call"
        lines += [f"## {suite} ({unit})", "",
                  "| point | base | new | new/base | " + " | ".join(provs) +
                  "".join(f" | new/{p}" for p in provs) + " |",
                  "|" + "---|" * (4 + 2 * len(provs))]
        for key, base, new, sd in rows:
            sb, sn = _speed(base), _speed(new)
            ratio = f"{sn / sb:.3f}" if sb and sn else "-"
            cells = [_val(sd.get(p)) for p in provs]
            rel = [f"{sn / _speed(sd[p]):.2f}" if p in sd and _speed(sd[p]) and sn else "-" for p in provs]
            lines.append(f"| {_label(key)} | {_val(base)} | {_val(new)} | {ratio} | " + " | ".join(cells + rel) + " |")
        lines.append("")
    skipped = [r for r in records if r.get("provider") == "skipped"]
    errors = [r for r in records if r.get("provider") == "error"]
    if skipped:
        lines.append(f"{len(skipped)} points skipped (time limit).")
    for r in errors:
        lines += [f"\n### suite {r.get('section')} FAILED", "```", r.get("error", ""), "```"]
    return "\n".join(lines) + "\n"


def summary_lines(records):
    return [f"{suite}: median new/base {s['median']:.3f} over {s['n']} points, worst {s['worst']:.3f} "
            f"({s['worst_point']}): {'pass' if s['ok'] else 'FAIL'}" for suite, s in summarize(records).items()]


# ------------------------------------------------------------------------------------------------- main
def parser():
    ap = argparse.ArgumentParser(prog="python -m bench compare", description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="root of the old checkout (holds cuflash/ and cuda_src/)")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--suites", default=",".join(SUITES), help=f"comma list of {', '.join(SUITES)}")
    ap.add_argument("--seqlens", default=",".join(map(str, SEQLENS)), help="fwd / bwd grid seqlens")
    ap.add_argument("--dtypes", default="float16,bfloat16")
    ap.add_argument("--headdims", default="64,128")
    ap.add_argument("--rounds", type=int, default=3, help="rounds timed in turn (latency: rounds + 2)")
    ap.add_argument("--time-limit", type=float, default=9.0,
                    help="minutes; points left when it is reached are skipped (recorded as such)")
    ap.add_argument("--decode-cases", default=None, metavar="B,S,HK;...",
                    help="decode suite cases (batch, cache length, KV heads; 32 query heads, head dim 128); "
                         "default: DECODE_CASES")
    ap.add_argument("--queued", action="store_true",
                    help="fwd / bwd: time each call queued behind a ~3 ms spin kernel (GPU time) instead of single "
                         "calls on an idle GPU")
    ap.add_argument("--no-precompile", action="store_true")
    ap.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    return ap


def main(argv=None):
    args = parser().parse_args(argv)
    suites = [s for s in args.suites.split(",") if s]
    bad = [s for s in suites if s not in SUITES]
    if bad:
        raise SystemExit(f"unknown compare suite(s) {bad}; known: {', '.join(SUITES)}")
    decode_cases = parse_decode_cases(args.decode_cases) if args.decode_cases else DECODE_CASES
    clock = Clock(args.time_limit)
    os.makedirs(args.out, exist_ok=True)
    base_dir = Path(args.base).resolve()
    if not args.no_precompile:
        _precompile_both(base_dir, args.out, args.jobs)
    import cuflash

    base = load_tree(base_dir)
    trees = {"base": base, "new": cuflash}
    head = harness.header()
    new_dir = Path(cuflash.__file__).resolve().parent.parent
    head.update(base_dir=str(base_dir), base_commit=harness.git_commit(base_dir), base_kernels=kernel_dir(base),
                base_source=harness.source_trees(base_dir), new_dir=str(new_dir), new_commit=harness.git_commit(new_dir),
                new_source=harness.source_trees(new_dir), new_kernels=kernel_dir(cuflash), rounds=args.rounds, kind="compare",
                timing="queued" if args.queued else "single")
    print(f"base kernels: {head['base_kernels']}\nnew kernels:  {head['new_kernels']}", flush=True)
    if head["base_kernels"] == head["new_kernels"]:
        print("warning: both trees compile the same cuda_src/ directory", flush=True)
    grid = dict(seqlens=tuple(int(x) for x in args.seqlens.split(",") if x),
                dtypes=tuple(x for x in args.dtypes.split(",") if x),
                headdims=tuple(int(x) for x in args.headdims.split(",") if x))
    runs = {"fwd": lambda: fwd(trees, rounds=args.rounds, clock=clock, queued=args.queued, **grid),
            "bwd": lambda: bwd(trees, rounds=args.rounds, clock=clock, queued=args.queued, **grid),
            "decode": lambda: decode(trees, cases=decode_cases, rounds=args.rounds, clock=clock),
            "latency": lambda: latency(trees, rounds=args.rounds + 2, clock=clock)}
    records = []
    for name in suites:
        t1 = time.time()
        print(f"== {name}", flush=True)
        try:
            recs = runs[name]()
            for r in recs:
                r["section"] = name
            records += recs
        except Exception:  # noqa: BLE001 - one broken suite must not lose the others
            traceback.print_exc()
            records.append(dict(section=name, provider="error", error=traceback.format_exc()[-2000:]))
        head.setdefault("suite_seconds", {})[name] = round(time.time() - t1, 1)
        harness.save(os.path.join(args.out, "results.json"), head, records)
        print(f"== {name} done in {time.time() - t1:.0f}s", flush=True)
    with open(os.path.join(args.out, "compare.md"), "w") as f:
        f.write(markdown(head, records))
    print("\n".join(summary_lines(records)))
    print(f"total {time.time() - clock.t0:.0f}s; {os.path.join(args.out, 'compare.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
