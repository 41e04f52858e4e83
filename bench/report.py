"""Markdown tables and plots from a results.json, and the README's result blocks.

    python -m bench.report --results bench/results/results.json [--readme README.md] [--plots-dir DIR] [--md FILE]

writes results.md (every table; default: next to the results file) and the plots (default: the results
file's folder), and with --readme replaces the text between the marker lines `<!-- results:NAME -->` and
`<!-- /results:NAME -->` with a freshly rendered table (NAME: one of README_BLOCKS). matplotlib is imported only
inside the plotting functions; without it the plots are skipped with a note."""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import defaultdict

MMA_SYNC_PEAK = 647.0  # TFLOP/s, measured mma.sync m16n8k16 peak on the H200 (section micro)


def _fmt(x, nd=0):
    return "-" if x is None else f"{x:.{nd}f}"


def tf(r):
    """A record's TFLOP/s, rounded ("-" without a record or a rate)."""
    return _fmt((r or {}).get("tflops") or None)


def _sec(records, *sections, mode=None):
    return [r for r in records if r.get("section") in sections and r.get("provider") not in ("error", "skipped")
            and (mode is None or r.get("mode") == mode)]


def _name(r):
    return r["provider"] if r["provider"] != "cuflash" else f"cuflash-{r['algo']}"


def grid_table(records, mode, title="", sections=None):
    """TFLOP/s per (dtype, hdim, causal, provider) x seqlen, then cuflash's ratios to flash and cudnn."""
    rs = _sec(records, *(sections or (mode,)), mode=mode)
    if not rs:
        return ""
    seqlens = sorted({r["seqlen_q"] for r in rs})
    keyed = defaultdict(dict)
    for r in rs:
        keyed[(r["dtype"], r["headdim"], r["causal"], _name(r))][r["seqlen_q"]] = r.get("tflops")
    lines = [f"### {title or mode} TFLOP/s", "", "| dtype | hdim | causal | provider | " +
             " | ".join(str(s) for s in seqlens) + " |", "|" + "---|" * (4 + len(seqlens))]
    for g in sorted({k[:3] for k in keyed}):
        provs = sorted(p for (*gg, p) in keyed if tuple(gg) == g)
        for p in provs:
            row = keyed[g + (p,)]
            lines.append(f"| {g[0]} | {g[1]} | {g[2]} | {p} | " + " | ".join(_fmt(row.get(s)) for s in seqlens) + " |")
        for c in [p for p in provs if p.startswith("cuflash")]:
            for base in ("flash", "cudnn"):
                if base in provs:
                    a, b = keyed[g + (c,)], keyed[g + (base,)]
                    lines.append(f"| {g[0]} | {g[1]} | {g[2]} | **{c} / {base}** | " + " | ".join(
                        _fmt(a[s] / b[s], 2) if a.get(s) and b.get(s) else "-" for s in seqlens) + " |")
            if mode == "fwd":
                a = keyed[g + (c,)]
                lines.append(f"| {g[0]} | {g[1]} | {g[2]} | {c} / mma.sync peak | " + " | ".join(
                    _fmt(a[s] / MMA_SYNC_PEAK, 2) if a.get(s) else "-" for s in seqlens) + " |")
    return "\n".join(lines) + "\n"


def headline_table(records, section, mode, second=None):
    """The README's headline: per (dtype, hdim, causal) and seqlen, cuflash TFLOP/s (ratio to SDPA FLASH /
    cuDNN of the same rounds); `second`: a later run of the same suite, its ratio to FLASH after a semicolon."""
    rs = _sec(records, section, mode=mode)
    if not rs:
        return ""

    def cells(rows):
        c = defaultdict(dict)
        for r in rows:
            c[(r["dtype"], r["headdim"], r["causal"])].setdefault(r["seqlen_q"], {})[r["provider"]] = r.get("tflops")
        return c

    main, again = cells(rs), cells(_sec(records, second, mode=mode)) if second else {}
    seqlens = sorted({r["seqlen_q"] for r in rs})
    lines = ["| dtype | hdim | causal | " + " | ".join(str(s) for s in seqlens) + " |",
             "|" + "---|" * (3 + len(seqlens))]
    for key in sorted(main, key=lambda k: (k[0] != "float16", k[1], k[2])):
        vals = []
        for s in seqlens:
            p = main[key].get(s, {})
            cu, fl, cd = p.get("cuflash"), p.get("flash"), p.get("cudnn")
            if cu is None:
                vals.append("-")
                continue
            ratios = [f"{cu / x:.2f}" if x else "-" for x in (fl, cd)]
            q = again.get(key, {}).get(s, {})
            tail = f"; {q['cuflash'] / q['flash']:.2f}" if q.get("cuflash") and q.get("flash") else ""
            vals.append(f"{cu:.0f} ({' / '.join(ratios)}{tail})")
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(vals) + " |")
    return "\n".join(lines) + "\n"


def strategies_table(records, section="bwd_strategies"):
    """Every dQ strategy: TFLOP/s (cuflash / FLASH) per seqlen."""
    rs = _sec(records, section, mode="bwd")
    if not rs:
        return ""
    seqlens = sorted({r["seqlen_q"] for r in rs})
    fl = {(r["dtype"], r["headdim"], r["causal"], r["seqlen_q"]): r.get("tflops") for r in rs if r["provider"] == "flash"}
    cell = defaultdict(dict)
    for r in rs:
        if r["provider"] == "cuflash":
            cell[(r["dtype"], r["headdim"], r["causal"], r.get("dq_strategy"))][r["seqlen_q"]] = r.get("tflops")
    order = {"atomic": 0, "seqpar": 1, "loop": 2}
    lines = ["| dtype | hdim | causal | strategy | " + " | ".join(str(s) for s in seqlens) + " |",
             "|" + "---|" * (4 + len(seqlens))]
    for key in sorted(cell, key=lambda k: (k[0] != "float16", k[1], k[2], order.get(k[3], 9))):
        vals = []
        for s in seqlens:
            t, f = cell[key].get(s), fl.get(key[:3] + (s,))
            vals.append("-" if t is None else f"{t:.0f} ({t / f:.2f})" if f else f"{t:.0f}")
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | `{key[3]}` | " + " | ".join(vals) + " |")
    return "\n".join(lines) + "\n"


def pair_table(records, section, mode, a="cuflash", b="flash", by=None):
    """hdim | causal | per seqlen: A / B TFLOP/s (A / B); by: the field that names the two (default provider)."""
    rs = _sec(records, section, mode=mode)
    if not rs:
        return ""
    seqlens = sorted({r["seqlen_q"] for r in rs})
    cell = defaultdict(dict)
    for r in rs:
        cell[(r["dtype"], r["headdim"], r["causal"])][(r.get(by) if by else r["provider"], r["seqlen_q"])] = r.get("tflops")
    multi = len({k[0] for k in cell}) > 1
    lines = [("| dtype " if multi else "") + "| hdim | causal | " + " | ".join(str(s) for s in seqlens) + " |",
             "|" + "---|" * (2 + multi + len(seqlens))]
    for key in sorted(cell):
        vals = []
        for s in seqlens:
            x, y = cell[key].get((a, s)), cell[key].get((b, s))
            vals.append(f"{_fmt(x)} / {_fmt(y)}" + (f" ({x / y:.2f})" if x and y and by is None else ""))
        lines.append((f"| {key[0]} " if multi else "") + f"| {key[1]} | {key[2]} | " + " | ".join(vals) + " |")
    return "\n".join(lines) + "\n"


def latency_table(records, section="latency"):
    rs = _sec(records, section)
    if not rs:
        return ""

    def key(r):
        return f"cuflash-{r['backend']}" if r["provider"] == "cuflash" and r.get("backend") else r["provider"]

    names = {"cuflash": "cuflash", "cuflash-sm80": "cuflash sm80", "cuflash-sm90": "cuflash sm90",
             "flash": "SDPA flash", "cudnn": "SDPA cudnn", "efficient": "SDPA efficient"}
    provs = [p for p in names if any(key(r) == p for r in rs)]
    lines = ["| causal | " + " | ".join(names[p] for p in provs) + " |", "|" + "---|" * (1 + len(provs))]
    for causal in sorted({r["causal"] for r in rs}):
        us = {key(r): r.get("us_per_call") for r in rs if r["causal"] == causal}
        lines.append(f"| {causal} | " + " | ".join(f"{us[p]:.1f} us" if us.get(p) else "-" for p in provs) + " |")
    return "\n".join(lines) + "\n"


def memory_table(records, section="memory"):
    rs = _sec(records, section)
    if not rs:
        return ""
    provs = [p for p in ("cuflash", "flash", "naive") if any(r["provider"] == p for r in rs)]
    names = {"cuflash": "cuflash", "flash": "SDPA flash", "naive": "naive"}
    lines = ["| seqlen | " + " | ".join(names[p] for p in provs) + " |", "|" + "---|" * (1 + len(provs))]
    for s in sorted({r["seqlen_q"] for r in rs}):
        b = {r["provider"]: r.get("peak_bytes") for r in rs if r["seqlen_q"] == s}
        lines.append(f"| {s} | " + " | ".join(f"{b[p] / 2 ** 20:.0f} MiB" if b.get(p) is not None else "-"
                                             for p in provs) + " |")
    return "\n".join(lines) + "\n"


def decode_table(records, section="decode", big="decode_big_gqa"):
    """One row per decoding case: cuflash's decode kernel (event us / GPU us, splits, % of the copy and read-only
    bandwidth), unsplit and the split-KV prefill path in GPU time, SDPA FLASH and cuDNN (event / GPU us),
    cuflash's speed-up over FLASH (event, GPU) and over cuDNN (GPU: graph replay).
    Rows marked * come from `big` (FLASH with native GQA next to cuflash in one loop)."""
    rs = _sec(records, section, mode="decode")
    if not rs:
        return ""
    cases = defaultdict(dict)
    for r in rs + [dict(x, _big=True) for x in _sec(records, big, mode="decode")]:
        key = (r.get("heads_k"), r["batch"], r["seqlen_k"])
        name = r["algo"] if r["provider"] == "cuflash" else r["provider"]
        if r.get("_big") or name not in cases[key]:
            cases[key][name] = r
    lines = ["| KV heads | batch | cache | K/V MB | floor us | cuflash decode: us / GPU us (splits; tile, row fragments) "
             "| % of copy bw (GPU) "
             "| % of read bw (GPU) | unsplit GPU us | previous path GPU us | SDPA flash: us / GPU us | SDPA cudnn: us / "
             "GPU us | vs flash (us, GPU) | vs cudnn (GPU) |",
             "|" + "---|" * 14]

    def k(n):
        return f"{n // 1024}k" if n >= 1024 else str(n)

    def ratio(a, b):
        return f"{a / b:.2f}x" if a and b else "-"

    for key in sorted(cases, key=lambda x: (-x[0], x[1], x[2])):
        c = cases[key]
        cu, fl = c.get("decode-split"), c.get("flash")
        if cu is None or cu.get("skipped"):
            continue
        star = "*" if cu.get("_big") else ""
        splits = cu.get("num_splits")
        unsplit, prev, cd = c.get("decode-unsplit"), c.get("fwd_split-split"), c.get("cudnn") or {}
        gbw, grd = cu.get("graph_bw_fraction"), cu.get("graph_read_fraction")
        vs = "-"
        if fl and fl.get("us") and cu.get("us"):
            vs = f"{fl['us'] / cu['us']:.2f}x, {ratio(fl.get('graph_us'), cu.get('graph_us'))}"
        lines.append(
            f"| {key[0]} | {key[1]} | {k(key[2])}{star} | {cu.get('kv_bytes', 0) / 1e6:.0f} | {_fmt(cu.get('floor_us'))} | "
            f"{_fmt(cu.get('us'))} / {_fmt(cu.get('graph_us'))} ({splits if splits is not None else '-'}"
            f"{'; ' + cu['geometry'] if cu.get('geometry') else ''}) | "
            f"{f'{gbw:.0%}' if gbw else '-'} | {f'{grd:.0%}' if grd else '-'} | "
            f"{_fmt((unsplit or {}).get('graph_us'))} | "
            f"{_fmt((prev or {}).get('graph_us'))} | {_fmt((fl or {}).get('us'))} / {_fmt((fl or {}).get('graph_us'))} | "
            f"{_fmt(cd.get('us'))} / {_fmt(cd.get('graph_us'))} | {vs} | "
            f"{ratio(cd.get('graph_us'), cu.get('graph_us'))} |")
    lat = [r for r in _sec(records, section) if r.get("mode") == "decode_latency"]
    if lat:
        lines += ["", "Small step (a loop of calls from Python, batch 1, 8 heads, 8 KV heads, 4k cache): " + ", ".join(
            f"{r['algo'] if r['provider'] == 'cuflash' else 'SDPA ' + r['provider']} {r['us']:.1f} us" for r in lat) + "."]
    return "\n".join(lines) + "\n"


def paged_table(records, section="decode_paged"):
    """One row per case: the contiguous cache's GPU time and % of read bandwidth, then each page size's, and its
    bandwidth relative to the contiguous cache; the rotary append step where it ran."""
    rs = _sec(records, section, mode="decode")
    if not rs:
        return ""
    sizes = sorted({r.get("page_size") for r in rs if r["algo"] == "decode-paged"})
    cases = defaultdict(dict)
    for r in rs:
        cases[(r["batch"], r["seqlen_k"], r.get("heads_k"))][(r["algo"], r.get("page_size"))] = r
    lines = ["| batch | cache | KV heads | K/V MB | contiguous: GPU us (% of read bw) | " + " | ".join(
        f"page {p}: GPU us (% of read bw, vs contiguous)" for p in sizes) + " | rotary append + attend (page "
        f"{sizes[0] if sizes else '-'}) GPU us |", "|" + "---|" * (6 + len(sizes))]

    def cell(r, rel=False):
        if not r or not r.get("graph_us"):
            return "-"
        frac = r.get("graph_read_fraction")
        extra = f", {r['vs_contiguous_bw']:.2f}x" if rel and r.get("vs_contiguous_bw") else ""
        return f"{r['graph_us']:.1f} ({f'{frac:.0%}' if frac else '-'}{extra})"

    for key in sorted(cases, key=lambda x: (-x[0] * x[1] * x[2], x)):
        c = cases[key]
        base = c.get(("decode-contiguous", 0))
        rot = next((r for (a, _), r in c.items() if a == "decode-paged-rotary-append"), None)
        s = f"{key[1] // 1024}k" if key[1] >= 1024 else str(key[1])
        lines.append(f"| {key[0]} | {s} | {key[2]} | {(base or {}).get('kv_bytes', 0) / 1e6:.0f} | {cell(base)} | "
                     + " | ".join(cell(c.get(("decode-paged", p)), True) for p in sizes)
                     + f" | {_fmt((rot or {}).get('graph_us'))} |")
    return "\n".join(lines) + "\n"


def partition_readme_table(records, section="bwd_partition"):
    """hdim | causal | per seqlen: TFLOP/s of the partitions "kv" / "q" / "2d"."""
    rs = [r for r in _sec(records, section) if r["provider"] == "cuflash"]
    if not rs:
        return ""
    seqlens = sorted({r["seqlen_q"] for r in rs})
    parts = [p for p in ("kv", "q", "2d") if any(r.get("warp_partition") == p for r in rs)]
    cell = defaultdict(dict)
    for r in rs:
        cell[(r["headdim"], r["causal"])][(r.get("warp_partition"), r["seqlen_q"])] = r.get("tflops")
    lines = ["| hdim | causal | " + " | ".join(str(s) for s in seqlens) + " |", "|" + "---|" * (2 + len(seqlens))]
    for key in sorted(cell):
        lines.append(f"| {key[0]} | {key[1]} | " + " | ".join(
            " / ".join(_fmt(cell[key].get((p, s))) for p in parts) for s in seqlens) + " |")
    return "\n".join(lines) + "\n"


MICRO_ROWS = (  # (figure, measured: format with the readme_numbers placeholders, reference)
    ("HMMA.16816 f16 -> f32 latency", "{{mma_f16_latency}} clk", "-"),
    ("mma.sync f16 -> f32 / bf16 -> f32 / f16 -> f16", "{{mma_f16_tflops}} / {{mma_bf16_tflops}} / "
     "{{mma_f16acc_tflops}} TFLOP/s", "647 (anchor), cuBLAS bf16 this run"),
    ("mma.sync f16 -> f32 per SM", "{{mma_flop_per_clk}} FLOP/clk/SM", "2476"),
    ("ldmatrix x1 / x4 latency", "{{ldsm_x1_latency}} / {{ldsm_x4_latency}} clk", "-"),
    ("K tile via ldmatrix.x4, padded / unpadded rows", "{{smem_padded_bw}} / {{smem_unpadded_bw}} B/clk/SM", "128"),
    ("global -> smem at 1 block/SM: cp.async 4 stages / ldg 16 / ldg 4 per thread",
     "{{cp_async_gbs}} / {{ldg_gbs}} / {{ldg4_gbs}} GB/s", "copy bandwidth this run"),
    ("ex2.approx latency / throughput", "{{ex2_latency}} clk / {{ex2_per_clk}} per clk/SM", "- / 16"),
    ("expf throughput, instructions per call", "{{expf_per_clk}} per clk/SM, {{expf_instr}}", "16"),
    ("__expf instructions per call", "{{expfast_instr}}", "2"),
    ("max rel. error ex2.approx / __expf on [-30, 0]", "{{ex2_rel_err}} / {{expfast_rel_err}}", "2.4e-7 / 3.1e-6"),
    ("tanh.approx latency / throughput; soft-capped scores (tanh + FFMA + ex2)",
     "{{tanh_latency}} clk / {{tanh_per_clk}} per clk/SM; {{capexp_per_clk}} scores per clk/SM", "- / 16; 8"),
    ("FFMA vs FADD + FMUL latency per score", "{{fold_ffma_latency}} / {{fold_unfolded_latency}} clk", "-"),
    ("red.f32 / red.v4.f32 into one dQ tile", "{{red_f32_dq}} / {{red_v4_dq}} G elements/s", "plain v4 stores"),
    ("red.f32, own tile per block", "{{red_f32_own}} G elements/s", "plain v4 stores"),
    ("SHFL.BFLY latency / throughput", "{{shfl_latency}} clk / {{shfl_per_clk}} lanes/clk/SM", "- / 32"),
)


def micro_table(records, section="micro"):
    """The README's numbers table of the microbenchmarks (bench_micro.readme_numbers)."""
    rs = [r for r in records if r.get("section") == section]
    if not rs:
        return ""
    from .bench_micro import readme_numbers

    nums = readme_numbers(rs)
    lines = ["| figure | measured | reference |", "|---|---|---|"]
    for fig, measured, ref in MICRO_ROWS:
        for key, val in nums.items():
            measured = measured.replace(key, val)
        lines.append(f"| {fig} | {measured} | {ref} |")
    return "\n".join(lines) + "\n"


def ladder_tables(records, section="ladder"):
    """Forward and backward TFLOP/s of every rung (non-causal / causal), then the error table (head dim 128)."""
    rs = [r for r in _sec(records, section) if r.get("kind") == "time"]
    if not rs:
        return ""
    out = []
    for mode, title in (("fwd", "Forward"), ("bwd", "Backward")):
        sub = [r for r in rs if r["mode"] == mode]
        if not sub:
            continue
        seqlens = sorted({r["seqlen_q"] for r in sub})
        cell = defaultdict(dict)
        for r in sub:
            cell[(r["headdim"], r.get("rung") or 0, r["algo"])][(r["seqlen_q"], r["causal"])] = r.get("tflops")
        lines = [f"{title}, TFLOP/s (non-causal / causal):", "", "| rung | d | " + " | ".join(map(str, seqlens)) + " |",
                 "|" + "---|" * (2 + len(seqlens))]
        for d, rung, algo in sorted(cell):
            c = cell[(d, rung, algo)]
            lines.append(f"| {rung} {algo} | {d} | " + " | ".join(
                f"{_fmt(c.get((s, False)))} / {_fmt(c.get((s, True)))}" for s in seqlens) + " |")
        out.append("\n".join(lines) + "\n")
    errs = [r for r in _sec(records, section) if r.get("kind") == "error" and r["headdim"] == 128 and not r["causal"]]
    if errs:
        cell = defaultdict(dict)
        for r in errs:
            cell[r["algo"]][(r["mode"], r["dtype"])] = (r.get("err_rel"), r.get("err_max"))
        cols = [("fwd", "float16"), ("fwd", "bfloat16"), ("bwd", "float16"), ("bwd", "bfloat16")]
        lines = ["Error against float64 (head dim 128, non-causal; relative Frobenius norm / max abs):", "",
                 "| version | fwd fp16 | fwd bf16 | bwd fp16 | bwd bf16 |", "|---|---|---|---|---|"]
        for algo in sorted(cell):
            lines.append(f"| {algo} | " + " | ".join(
                f"{cell[algo][c][0]:.1e} / {cell[algo][c][1]:.1e}" if c in cell[algo] else "-" for c in cols) + " |")
        out.append("\n".join(lines) + "\n")
    return "\n".join(out)


def traffic_readme_table(records, section="traffic"):
    """Measured / counted GB per rung and (head dim, seqlen), non-causal."""
    rs = [r for r in _sec(records, section) if r.get("kind") == "traffic" and not r.get("causal")]
    if not rs:
        return ""
    pts = sorted({(r["headdim"], r["seqlen_q"]) for r in rs})
    cell = defaultdict(dict)
    for r in rs:
        cell[(r["mode"] != "fwd", r.get("rung") or 0, r["mode"], r["algo"])][(r["headdim"], r["seqlen_q"])] = r
    lines = ["| rung | " + " | ".join(f"d={d}, s={s} measured / counted" for d, s in pts) + " |",
             "|" + "---|" * (1 + len(pts))]
    for key in sorted(cell):
        vals = []
        for p in pts:
            r = cell[key].get(p)
            vals.append("-" if r is None else f"{_gb(r.get('dram_bytes_measured'))} / {_gb(r.get('dram_bytes_counted'))}")
        lines.append(f"| {key[2]} {key[1]} {key[3]} | " + " | ".join(vals) + " |")
    return "\n".join(lines) + "\n"


def _fwd90_grid(r) -> bool:
    """A point of the FA2 grid (batch x seqlen = 16k, all heads their own K/V) rather than an extra point."""
    return r["batch"] * r["seqlen_q"] == 16384 and r.get("kv_heads", r["heads"]) == r["heads"]


def hopper_table(records, section="fwd90"):
    """The Hopper forward: per (dtype, hdim, causal) and seqlen, cuflash sm90 TFLOP/s (its ratio to cuDNN / to
    FLASH; the sm80 kernels' ratio to cuDNN) -- the FA2 grid, then the extra points (1 x 64k, GQA)."""
    rs = _sec(records, section, mode="fwd")
    if not rs:
        return ""

    def cell(p):
        s9, s8, fl, cd = (p.get(k) for k in ("sm90", "sm80", "flash", "cudnn"))
        if s9 is None:
            return "-"
        r = lambda a, b: f"{a / b:.2f}" if a and b else "-"  # noqa: E731
        return f"{s9:.0f} ({r(s9, cd)} / {r(s9, fl)}; {r(s8, cd)})"

    def key_of(r):
        return r.get("backend") if r["provider"] == "cuflash" else r["provider"]

    grid = defaultdict(dict)
    extra = defaultdict(dict)
    for r in rs:
        k = (r["dtype"], r["headdim"], r["causal"])
        if _fwd90_grid(r):
            grid[k].setdefault(r["seqlen_q"], {})[key_of(r)] = r.get("tflops")
        else:
            extra[k + (r["batch"], r["seqlen_q"], r["heads"], r.get("kv_heads"))][key_of(r)] = r.get("tflops")
    seqlens = sorted({s for v in grid.values() for s in v})
    lines = ["| dtype | hdim | causal | " + " | ".join(str(s) for s in seqlens) + " |",
             "|" + "---|" * (3 + len(seqlens))]
    for k in sorted(grid, key=lambda k: (k[0] != "float16", k[1], k[2])):
        lines.append(f"| {k[0]} | {k[1]} | {k[2]} | " + " | ".join(cell(grid[k].get(s, {})) for s in seqlens) + " |")
    if extra:
        lines += ["", "| dtype | hdim | causal | batch x seqlen | heads / KV heads | cuflash sm90 (/ cuDNN / FLASH; "
                  "sm80 / cuDNN) |", "|---|---|---|---|---|---|"]
        for k in sorted(extra, key=lambda k: (k[0] != "float16", k[1], k[2], k[4])):
            lines.append(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} x {k[4]} | {k[5]} / {k[6]} | {cell(extra[k])} |")
    return "\n".join(lines) + "\n"


def hopper_bwd_table(records, section="bwd90"):
    """The Hopper backward: per (dtype, hdim, causal) and seqlen, cuflash sm90 TFLOP/s with the default dQ strategy,
    then its ratio to cuDNN / to FLASH, and after the semicolon the deterministic "ordered" strategy's ratio to it
    and the sm80 kernels' ratio to cuDNN (all timed in turn in one run)."""
    rs = _sec(records, section, mode="bwd")
    if not rs:
        return ""

    def key_of(r):
        if r["provider"] != "cuflash":
            return r["provider"]
        return r.get("backend") if r.get("dq_strategy") == "atomic" else r.get("dq_strategy")

    grid = defaultdict(dict)
    for r in rs:
        grid[(r["dtype"], r["headdim"], r["causal"])].setdefault(r["seqlen_q"], {})[key_of(r)] = r.get("tflops")

    def cell(p):
        s9, s8, od, fl, cd = (p.get(k) for k in ("sm90", "sm80", "ordered", "flash", "cudnn"))
        if s9 is None:
            return "-"
        r = lambda a, b: f"{a / b:.2f}" if a and b else "-"  # noqa: E731
        return f"{s9:.0f} ({r(s9, cd)} / {r(s9, fl)}; {r(od, s9)}, {r(s8, cd)})"

    seqlens = sorted({s for v in grid.values() for s in v})
    lines = ["| dtype | hdim | causal | " + " | ".join(str(s) for s in seqlens) + " |",
             "|" + "---|" * (3 + len(seqlens))]
    for k in sorted(grid, key=lambda k: (k[0] != "float16", k[1], k[2])):
        lines.append(f"| {k[0]} | {k[1]} | {k[2]} | " + " | ".join(cell(grid[k].get(s, {})) for s in seqlens) + " |")
    return "\n".join(lines) + "\n"


def hopper_ceiling_table(records, section="fwd90"):
    """Each cuflash sm90 point as a fraction of the wgmma ceiling (min-max over seqlen, per dtype/hdim/causal)."""
    rs = [r for r in _sec(records, section, mode="fwd") if r.get("backend") == "sm90" and r.get("wgmma_fraction")]
    if not rs:
        return ""
    by = defaultdict(list)
    for r in rs:
        if _fwd90_grid(r):
            by[(r["dtype"], r["headdim"], r["causal"])].append(r["wgmma_fraction"])
    ceils = sorted({round(r["wgmma_ceiling_tflops"]) for r in rs if r.get("wgmma_ceiling_tflops")})
    ceil = (f"{ceils[0]} TFLOP/s" if len(ceils) == 1 else f"{ceils[0]}-{ceils[-1]} TFLOP/s, each run's own") if ceils \
        else "not recorded"
    lines = [f"| dtype | hdim | causal | fraction of the wgmma ceiling ({ceil}) |", "|---|---|---|---|"]
    for k in sorted(by, key=lambda k: (k[0] != "float16", k[1], k[2])):
        lines.append(f"| {k[0]} | {k[1]} | {k[2]} | {min(by[k]):.2f}-{max(by[k]):.2f} |")
    return "\n".join(lines) + "\n"


def micro90_table(records, section="micro90"):
    """The Hopper microbenchmarks: per (item, metric, unit), the range over the variants measured."""
    rs = [r for r in records if r.get("section") == section and r.get("value") is not None]
    if not rs:
        return ""
    by = defaultdict(list)
    for r in rs:
        by[(r["name"], r["metric"], r["unit"], r.get("dtype") or "")].append(r)
    lines = ["| item | dtype | metric | measured (range over variants) | reference |", "|---|---|---|---|---|"]
    for (name, metric, unit, dt), group in sorted(by.items()):
        vals = [g["value"] for g in group]
        refs = {g.get("reference_value") for g in group} - {None}
        ref = f"{refs.pop():.4g}" if len(refs) == 1 else "-"
        rng = f"{min(vals):.4g}" if min(vals) == max(vals) else f"{min(vals):.4g}-{max(vals):.4g}"
        lines.append(f"| {name} | {dt or '-'} | {metric} | {rng} {unit} ({len(vals)}) | {ref} |")
    return "\n".join(lines) + "\n"


def scores_table(records, section="scores"):
    """The score modifiers: per (mode, backend, hdim, option), the time ratio to the plain causal kernel at each
    seqlen (>1: faster), with the window's visible fraction of the causal pairs; SDPA's plain causal rates
    beside."""
    rs = _sec(records, section)
    if not rs:
        return ""
    seqlens = sorted({r["seqlen_q"] for r in rs})
    cell = defaultdict(dict)
    for r in rs:
        if r["provider"] != "cuflash":
            continue
        k = (r["mode"], r.get("backend"), r["dtype"], r["headdim"], r.get("option"))
        ratio, tf = r.get("ratio_to_plain"), r.get("tflops")
        frac = r.get("visible_fraction")
        txt = f"{tf:.0f}" if tf else "-"
        if r.get("option") != "plain" and ratio:
            txt += f" ({ratio:.2f}x" + (f"; band {frac:.2f}" if frac is not None and frac < 1 else "") + ")"
        cell[k][r["seqlen_q"]] = txt
    sd = defaultdict(dict)
    for r in rs:
        if r["provider"] in ("flash", "cudnn") and r.get("tflops"):
            sd[(r["mode"], r["dtype"], r["headdim"])].setdefault(r["seqlen_q"], []).append(f"{r['provider']} {r['tflops']:.0f}")
    order = {"plain": 0, "window": 1, "softcap": 2, "alibi": 3, "all": 4}
    lines = ["| mode | backend | dtype | hdim | option | " + " | ".join(str(s) for s in seqlens) + " |",
             "|" + "---|" * (5 + len(seqlens))]
    for k in sorted(cell, key=lambda k: (k[0] != "fwd", k[1] != "sm90", k[2], k[3], order.get(k[4], 9))):
        lines.append("| " + " | ".join(str(x) for x in k) + " | " +
                     " | ".join(cell[k].get(s, "-") for s in seqlens) + " |")
    for k in sorted(sd):
        lines.append(f"| {k[0]} | SDPA | {k[1]} | {k[2]} | plain | " +
                     " | ".join(", ".join(sd[k].get(s, ["-"])) for s in seqlens) + " |")
    return "\n".join(lines) + "\n"


def dropout_table(records, section="dropout"):
    """Dropout: per (mode, hdim, seqlen, causal), TFLOP/s of cuflash with and without dropout (its time ratio) and of
    SDPA FLASH / cuDNN with and without it; cuflash / cuDNN with dropout."""
    rs = _sec(records, section)
    if not rs:
        return ""
    cell = defaultdict(dict)
    for r in rs:
        k = (r["mode"], r["headdim"], r["seqlen_q"], r["causal"])
        name = r["provider"] + ("+drop" if r.get("dropout_p") else "") + ("/sm80" if r.get("algo") == "v2-sm80-plain"
                                                                           else "")
        cell[k][name] = r
    lines = ["| mode | hdim | seqlen | causal | cuflash plain (path) | cuflash dropout (path) | x plain | "
             "FLASH / +dropout | cuDNN / +dropout | dropout: cuflash / cuDNN |", "|" + "---|" * 10]

    for k in sorted(cell, key=lambda k: (k[0] != "fwd", k[1], k[2], k[3])):
        c = cell[k]
        plain, drop = c.get("cuflash"), c.get("cuflash+drop")
        ratio = drop.get("ratio_to_plain") if drop else None
        cud = c.get("cudnn+drop")
        vs = (f"{drop['tflops'] / cud['tflops']:.2f}x" if drop and cud and drop.get("tflops") and cud.get("tflops")
              else "-")
        lines.append(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | {tf(plain)} ({plain.get('backend') if plain else '-'}) | "
                     f"{tf(drop)} ({drop.get('backend') if drop else '-'}) | {f'{ratio:.2f}' if ratio else '-'} | "
                     f"{tf(c.get('flash'))} / "
                     f"{tf(c.get('flash+drop'))} | {tf(c.get('cudnn'))} / {tf(cud)} | {vs} |")
    return "\n".join(lines) + "\n"


def headdims_table(records, section="headdims"):
    """Head dims: per (mode, causal), TFLOP/s (the inputs' own head dim counted) of cuflash (the kernel head dim that
    runs it) and SDPA FLASH / cuDNN at each head dim."""
    rs = _sec(records, section)
    if not rs:
        return ""
    from cuflash._configs import FWD_HEADDIMS, kernel_headdim

    dims = sorted({r["headdim"] for r in rs})
    cell = defaultdict(dict)
    for r in rs:
        k = (r["mode"], r["causal"], r["provider"])
        txt = f"{r['tflops']:.0f}" if r.get("tflops") else "-"
        kd = r.get("kernel_headdim") or kernel_headdim(r["headdim"], FWD_HEADDIMS)  # (the configuration's rule)
        if r["provider"] == "cuflash" and kd != r["headdim"]:
            txt += f" (on {kd})"
        cell[k][r["headdim"]] = txt
    lines = ["| mode | causal | provider | " + " | ".join(str(d) for d in dims) + " |", "|" + "---|" * (3 + len(dims))]
    order = {"cuflash": 0, "flash": 1, "cudnn": 2}
    for k in sorted(cell, key=lambda k: (k[0] != "fwd", k[1], order.get(k[2], 9))):
        lines.append(f"| {k[0]} | {k[1]} | {k[2]} | " + " | ".join(cell[k].get(d, "-") for d in dims) + " |")
    return "\n".join(lines) + "\n"


def varlen_table(records, section="varlen"):
    """Packed sequences: per (mix, mode, causal), TFLOP/s of the real tokens for cuflash's varlen call (its path), and
    for the padded batch run by cuflash's fixed-length kernels and SDPA FLASH / cuDNN; the varlen call's speed-up
    over the padded cuDNN call (time ratio)."""
    rs = _sec(records, section)
    if not rs:
        return ""
    cell = defaultdict(dict)
    for r in rs:
        k = (r.get("mix"), r["mode"], r["causal"])
        cell[k][(r["provider"], r.get("layout"))] = r
    lines = ["| mix (sequences, max) | mode | causal | cuflash varlen (path) | cuflash padded | FLASH padded | "
             "cuDNN padded | varlen / cuDNN padded |", "|" + "---|" * 8]

    mixes = list(dict.fromkeys(k[0] for k in cell))
    for k in sorted(cell, key=lambda k: (mixes.index(k[0]), k[1] != "fwd", k[2])):
        c = cell[k]
        vl = c.get(("cuflash", "varlen"))
        cud = c.get(("cudnn", "padded"))
        sp = cud.get("varlen_speedup") if cud else None
        desc = f"{k[0]} ({len(vl['lengths'])}, {vl['max_len']})" if vl else k[0]
        lines.append(f"| {desc} | {k[1]} | {k[2]} | {tf(vl)} ({vl.get('backend') if vl else '-'}) | "
                     f"{tf(c.get(('cuflash', 'padded')))} | {tf(c.get(('flash', 'padded')))} | {tf(cud)} | "
                     f"{f'{sp:.2f}x' if sp else '-'} |")
    return "\n".join(lines) + "\n"


def integrations_table(records):
    """torch.compile and Transformers: per case, cuflash's and SDPA's step time (ms) and SDPA's / cuflash's."""
    rows = []
    for section in ("compile_block", "hf_llama"):
        cell = defaultdict(dict)
        for r in _sec(records, section):
            cell[(r["algo"].replace("hf-llama-", "llama "), r["dtype"], r["batch"], r["seqlen_q"])][r["provider"]] = r
        for k, c in cell.items():
            ours, sd = c.get("cuflash"), c.get("sdpa")
            ms = (lambda r: (f"{r['ms_per_token']:.2f} / token" if r.get("ms_per_token") else f"{r['ms']:.2f}")
                  if r and r.get("ms") else "-")
            ratio = ours.get("ratio_to_sdpa") if ours else None
            rows.append(f"| {k[0]} | {k[1]} | {k[2]} x {k[3]} | {ms(ours)} | {ms(sd)} | "
                        f"{f'{ratio:.2f}x' if ratio else '-'} |")
    if not rows:
        return ""
    return "\n".join(["| case | dtype | tokens | cuflash ms | SDPA ms | SDPA / cuflash |", "|" + "---|" * 6, *rows]) + "\n"


# The README's result blocks: <!-- results:NAME --> ... <!-- /results:NAME -->
README_BLOCKS = {
    "fwd": lambda rs: headline_table(rs, "fwd", "fwd"),
    "bwd": lambda rs: headline_table(rs, "bwd", "bwd", second="bwd_run2"),
    "bwd_strategies": strategies_table,
    "bwd_loop": lambda rs: pair_table(rs, "bwd_loop", "bwd"),
    "bwd_partition": partition_readme_table,
    "latency": latency_table,
    "grid_order": lambda rs: pair_table(rs, "grid_order", "fwd", a="qtile", b="bh", by="grid_order"),
    "memory": memory_table,
    "decode": decode_table,
    "decode_paged": paged_table,
    "micro": micro_table,
    "fwd90": hopper_table,
    "fwd90_ceiling": hopper_ceiling_table,
    "fwd90_queued": lambda rs: hopper_table(rs, "fwd90_queued"),
    "bwd90": hopper_bwd_table,
    "bwd90_queued": lambda rs: hopper_bwd_table(rs, "bwd90_queued"),
    "bwd90_extra": lambda rs: hopper_bwd_table(rs, "bwd90_extra"),
    "micro90": micro90_table,
    "scores": scores_table,
    "scores_queued": lambda rs: scores_table(rs, "scores_queued"),
    "dropout": dropout_table,
    "headdims": headdims_table,
    "varlen": varlen_table,
    "integrations": integrations_table,
    "ladder": ladder_tables,
    "traffic": traffic_readme_table,
}
_MARKER = re.compile(r"(<!-- results:(?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /results:(?P=name) -->)", re.S)


def fill_readme(text: str, records, blocks=None) -> tuple[str, list, list]:
    """Replace every block between `<!-- results:NAME -->` and `<!-- /results:NAME -->` (each marker on its own
    line) with the rendered table of NAME. Returns (new text, names filled, names unknown or without records;
    those blocks are left as they were)."""
    blocks = README_BLOCKS if blocks is None else blocks
    filled, skipped = [], []

    def repl(m):
        name = m.group("name")
        fn = blocks.get(name)
        body = fn(records) if fn else ""
        if not body:
            skipped.append(name)
            return m.group(0)
        filled.append(name)
        return m.group(1) + body.rstrip("\n") + "\n" + m.group(4)

    new = _MARKER.sub(repl, text)
    opened = set(re.findall(r"<!-- results:([\w.-]+) -->", text))
    closed = set(re.findall(r"<!-- /results:([\w.-]+) -->", text))
    skipped += sorted((opened ^ closed) - set(skipped))  # a marker without its partner
    return new, filled, skipped


def simple_table(records, section, cols, title):
    rs = _sec(records, section)
    if not rs:
        return ""
    lines = [f"### {title}", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rs:
        vals = []
        for c in cols:
            v = r.get(c)
            vals.append(_fmt(v, 3 if isinstance(v, float) and abs(v) < 10 else 1) if isinstance(v, float) else str(v))
        lines.append("| " + " | ".join(vals) + " |")
    return "\n".join(lines) + "\n"


def interleaved_table(records):
    """Suite fwd_interleaved (bench/bench_fwd.py: interleaved): per point and tile, the ratio to SDPA FLASH
    formed within each round (FLASH timed right before), median and range over the rounds."""
    rs = _sec(records, "fwd_interleaved")
    if not rs:
        return ""

    def round_key(r):  # one round of one point in one run
        return r["dtype"], r["headdim"], r["causal"], r["seqlen_q"], r.get("run", 0), r["round"]

    flash = {round_key(r): r["ms"] for r in rs if r["provider"] == "flash"}
    ratios = defaultdict(list)
    for r in rs:
        if r["provider"] == "cuflash":
            ratios[(r["dtype"], r["headdim"], r["causal"], r["seqlen_q"], r["algo"], bool(r.get("configured")),
                    r.get("run", 0))].append(flash[round_key(r)] / r["ms"])
    lines = ["### Forward, interleaved timing: cuflash / SDPA FLASH per round (FLASH timed just before)", "",
             "| dtype | hdim | causal | seqlen | tile | configured | run | rounds | median | min | max |",
             "|" + "---|" * 11]
    for (dt, d, c, sq, algo, conf, run), v in sorted(ratios.items(), key=str):
        v = sorted(v)
        lines.append(f"| {dt} | {d} | {c} | {sq} | {algo} | {conf} | {run} | {len(v)} | {v[len(v) // 2]:.3f} | "
                     f"{v[0]:.3f} | {v[-1]:.3f} |")
    return "\n".join(lines) + "\n"


def partition_table(records):
    """Section bwd_partition (bench/bench_bwd.py): the backward's warp partitions, TFLOP/s per seqlen and each
    one's ratio to "kv". Empty when the section is absent."""
    rs = [r for r in records if r.get("section") == "bwd_partition" and r.get("provider") == "cuflash"]
    if not rs:
        return ""
    seqlens = sorted({r["seqlen_q"] for r in rs})
    cell = defaultdict(dict)
    tiles = {}
    for r in rs:
        part = r.get("warp_partition")
        cell[(r["dtype"], r["headdim"], r["causal"])][(part, r["seqlen_q"])] = r.get("tflops")
        tiles[(r["headdim"], part)] = r.get("tile")
    parts = [p for p in ("kv", "q", "2d") if any(k[1] == p for k in tiles)]
    lines = ["### Backward warp partition (atomic dQ): TFLOP/s, warps split the KV rows (kv) / the Q rows (q) / "
             "32-row warp tiles in every product (2d)", "",
             "Cells: " + " / ".join(parts) + " (each / kv). Tiles (block_m x block_n x warps): " + ", ".join(
                 f"d{d} {p} {t}" for (d, p), t in sorted(tiles.items())) + ".", "",
             "| dtype | hdim | causal | " + " | ".join(str(s) for s in seqlens) + " |",
             "|" + "---|" * (3 + len(seqlens))]
    for key in sorted(cell):
        row = cell[key]
        vals = []
        for s in seqlens:
            kv = row.get(("kv", s))
            xs = [row.get((p, s)) for p in parts]
            ratios = [f"{x / kv:.2f}" for p, x in zip(parts, xs) if p != "kv" and x and kv]
            vals.append(" / ".join(_fmt(x) for x in xs) + (f" ({' / '.join(ratios)})" if ratios else ""))
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(vals) + " |")
    return "\n".join(lines) + "\n"



BWD_TILE_LEGEND = (
    "Candidate: partition-block_m x block_n x warps-u(k16 steps unrolled, 0 = all), then its options: -bulk (sm_90: "
    "dQ staged in shared memory, added by cp.reduce.async.bulk, deferred to the next step, two dO buffers), "
    "-pregs (dS takes P from registers), -load1 / -load2 (the next Q tile requested after S = QK^T / after P "
    "and dP), -expil (P's exps interleaved with the k16 steps of dP). Older records also carry labels of options "
    "measured and removed since (-do2, -issue0..3, -load3, -r16, ...; bench/NOTES.md). cuflash is called "
    "directly (no autograd), FLASH through autograd (its ~0.4 ms of host latency per call inside its timing). "
    "configured: the tile the package ran by default when the record was made.")


def bwd_sweep_table(records, section="bwd_tiles"):
    """Suites bwd_tiles*: every candidate backward tile next to SDPA FLASH measured in the same loop."""
    rs = _sec(records, section)
    if not rs:
        return ""
    seqlens = sorted({r["seqlen_q"] for r in rs})
    rounds = max((r.get("rounds") or 1) for r in rs)
    cell = defaultdict(dict)
    for r in rs:
        cell[(r["dtype"], r["headdim"], r["causal"], r["provider"] if r["provider"] != "cuflash" else r["algo"])][
            r["seqlen_q"]] = r.get("tflops")
    title = f"Backward tile candidates (section {section}; TFLOP/s, and / SDPA FLASH of the same loop" + (
        f", timed in turn, median of {rounds} rounds)" if rounds > 1 else ")")
    lines = [f"### {title}", "", "| dtype | hdim | causal | candidate | " + " | ".join(str(s) for s in seqlens) + " |",
             "|" + "---|" * (4 + len(seqlens))]
    for key in sorted(cell, key=lambda k: (k[0], k[1], k[2], k[3] == "flash", k[3])):
        row, fl = cell[key], cell.get(key[:3] + ("flash",), {})
        vals = [_fmt(row.get(s)) + (f" ({row[s] / fl[s]:.2f})" if key[3] != "flash" and row.get(s) and fl.get(s)
                                   else "") for s in seqlens]
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | " + " | ".join(vals) + " |")
    return "\n".join(lines) + "\n"


def errors(records):
    errs = [r for r in records if r.get("provider") == "error"]
    return "".join(f"\n### suite {r['section']} FAILED\n```\n{r['error']}\n```\n" for r in errs)


def header_line(head) -> str:
    line = (f"{head.get('gpu')} ({head.get('sms')} SMs), clocks {head.get('clocks')}, driver {head.get('driver')}, "
            f"torch {head.get('torch')} (CUDA {head.get('torch_cuda')}), cupy {head.get('cupy')}, NVRTC "
            f"{head.get('nvrtc')}" + (f", triton {head['triton']}" if head.get("triton") else "") + f", {head.get('date')}.")
    runs = head.get("runs")
    if runs:
        line += (f" Merged from {len(runs)} runs (header `runs`; a record's `run` indexes its run, ratios are only "
                 f"formed within one run), {min(r.get('date', '') for r in runs)} to {max(r.get('date', '') for r in runs)}.")
    return line


def markdown(head, records) -> str:
    secs = {r.get("section") for r in records}
    parts = [f"# cuflash results\n\n{header_line(head)}\n"]
    parts.append(simple_table(records, "ceilings", ["algo", "ms", "tb_per_s", "tflops"], "Ceilings measured in this run"))
    parts.append(grid_table(records, "fwd", sections=("fwd",), title="Forward, FlashAttention-2 grid (batch x seqlen = "
                            "16k, hidden 2048), cuflash / FLASH / cuDNN timed in turn, medians of the rounds (suite fwd)"))
    h90 = hopper_table(records)
    if h90:
        parts.append("### Forward on Hopper (suite fwd90): cuflash sm90 TFLOP/s (sm90 / cuDNN / sm90 / FLASH; sm80 / "
                     "cuDNN), the four timed in turn, medians of the rounds\n\n" + h90)
        parts.append(hopper_ceiling_table(records))
    parts.append(grid_table(records, "fwd", sections=("fwd90",), title="Forward on Hopper, every provider (suite fwd90; "
                            "FA2-grid points and the extra points of the same seqlen share a column)"))
    b90 = hopper_bwd_table(records)
    if b90:
        parts.append("### Backward on Hopper (suite bwd90): cuflash sm90 TFLOP/s, default dQ strategy (sm90 / cuDNN / "
                     "sm90 / FLASH; deterministic 'ordered' / default, sm80 / cuDNN), timed in turn\n\n" + b90)
        parts.append(grid_table(records, "bwd", sections=("bwd90",), title="Backward on Hopper, every provider "
                                "(suite bwd90)"))
    for sec, what in (("fwd90_queued", "Forward on Hopper"), ("bwd90_queued", "Backward on Hopper")):
        q90 = (hopper_table if sec.startswith("fwd") else hopper_bwd_table)(records, sec)
        if q90:
            parts.append(f"### {what}, every call queued behind a spin kernel (suite {sec}: GPU time; the cells as in "
                         f"the suite without queueing)\n\n" + q90)
    x90 = hopper_bwd_table(records, "bwd90_extra")
    if x90:
        parts.append("### Backward on Hopper at the extra points, every call queued behind a spin kernel (suite "
                     "bwd90_extra: 65536 = batch 1 x 64k; 8192 = GQA 64 query / 8 KV heads, batch 2; the cells as in "
                     "suite bwd90)\n\n" + x90)
    sc = scores_table(records)
    if sc:
        parts.append("### Score modifiers (suite scores): TFLOP/s by the causal FLOP count, the time ratio to the plain "
                     "kernel of the same backend (> 1: faster), the window's share of the causal pairs\n\n" + sc)
    scq = scores_table(records, "scores_queued")
    if scq:
        parts.append("### Score modifiers, every call queued behind a spin kernel (suite scores_queued: GPU time; the "
                     "cells as in suite scores)\n\n" + scq)
    m90 = micro90_table(records)
    if m90:
        parts.append("### Hopper microbenchmarks (suite micro90)\n\n" + m90)
    parts.append(grid_table(records, "fwd", sections=("fwd_single",), title="Forward, FlashAttention-2 grid, one call "
                            "per timing, with EFFICIENT and the naive baseline (suite fwd_single)"))
    parts.append(grid_table(records, "bwd", sections=("bwd",), title="Backward, FlashAttention-2 grid, default dQ "
                            "strategy, cuflash / FLASH / cuDNN timed in turn, medians of the rounds (suite bwd)"))
    parts.append(grid_table(records, "bwd", sections=("bwd_run2",), title="The same suite run again with the same "
                            "code (section bwd_run2)"))
    parts.append(grid_table(records, "bwd", sections=("bwd_strategies",), title="Backward, every dQ strategy (one call "
                            "per timing; suite bwd_strategies)"))
    parts.append(grid_table(records, "bwd", sections=("bwd_loop",), title="Backward, 10 back-to-back calls per "
                            "timing (host latency overlapped; suite bwd_loop)"))
    parts.append(partition_table(records))
    tiles = sorted(s for s in secs if s and s.startswith("bwd_tiles"))
    if tiles:
        parts.append(BWD_TILE_LEGEND + "\n")
        parts += [bwd_sweep_table(records, sec) for sec in tiles]
    parts.append(simple_table(records, "latency", ["provider", "backend", "causal", "us_per_call"],
                              "Per-call latency from Python (batch 1, 8 heads, 128 tokens, hdim 64)"))
    parts.append(simple_table(records, "grid_order", ["headdim", "seqlen_q", "causal", "grid_order", "ms", "tflops"],
                              "Grid order: Q tile in grid x vs (batch, head) in grid x"))
    parts.append(simple_table(records, "fwd_tiles", ["headdim", "seqlen_q", "causal", "algo", "configured", "ms",
                                                     "tflops"], "Forward tile sweep (fp16)"))
    parts.append(interleaved_table(records))
    parts.append(simple_table(records, "memory", ["provider", "seqlen_q", "peak_bytes"],
                              "Peak device memory of one forward (batch 1, 16 heads, hdim 128), bytes"))
    for sec, cols, title in EXTRA_TABLES:
        parts.append(simple_table(records, sec, cols, title))
    parts.append(traffic_table(records))
    parts.append(errors(records))
    return "\n".join(p for p in parts if p)


EXTRA_TABLES = [
    ("dq_memory", ["dq_strategy", "batch", "heads", "seqlen_q", "headdim", "extra_bytes"], "dQ strategies: extra memory"),
    ("decode_sweep", ["algo", "heads_k", "batch", "seqlen_k", "num_splits", "us", "floor_us", "bw_fraction"],
     "Decoding tile / split sweep (hdim 128, fp16)"),
    ("decode", ["provider", "algo", "mode", "batch", "heads", "heads_k", "seqlen_k", "num_splits", "us", "graph_us",
                "kv_bytes", "floor_us", "bw_fraction", "graph_bw_fraction"],
     "Decoding (q_len 1, 32 heads, hdim 128, fp16; us: one call from Python, graph_us: GPU time per call in a "
     "CUDA graph; mode decode_latency: per-call time of a loop of calls, batch 1, 8 heads, cache 4k)"),
    ("decode_big_gqa", ["provider", "algo", "batch", "heads", "heads_k", "seqlen_k", "us", "graph_us", "kv_bytes",
                        "floor_us", "graph_bw_fraction"],
     "Decoding, the large GQA/MQA cases: SDPA FLASH with enable_gqa=True (caches not expanded), same loop"),
    ("decode_paged", ["algo", "page_size", "batch", "heads", "heads_k", "seqlen_k", "us", "graph_us", "kv_bytes",
                      "graph_read_fraction", "vs_contiguous_bw"],
     "Decoding from paged caches (page_size 0: the contiguous cache; hdim 128, fp16, 32 heads): GPU time, % of the "
     "read-only bandwidth, bandwidth relative to the contiguous cache"),
    ("layout", ["provider", "algo", "headdim", "seqlen_q", "causal", "memory_layout", "ms", "tflops"],
     "Same memory for both: forward on [b, s, h, d]- vs [b, h, s, d]-contiguous data (fp16)"),
    ("micro", ["name", "variant", "metric", "value", "unit", "reference_value", "fraction"], "Microbenchmarks"),
    ("ladder", ["algo", "mode", "dtype", "headdim", "seqlen_q", "causal", "ms", "tflops", "err_rel", "err_max",
                "dram_bytes"], "From V1 to V2"),
]


def _gb(x):
    return "-" if x is None else f"{x / 1e9:.2f}"


def traffic_table(records):
    """Suite "traffic" (bench/bench_traffic.py): Nsight Compute's measured DRAM bytes of each V1 -> V2 ladder
    version next to bench_v1's counted bytes and the time; the ladder's own CUDA-event time (section ladder)
    when that section is in the same results. Empty when the section is absent."""
    rs = [r for r in records if r.get("section") == "traffic" and r.get("provider") != "error"]
    if not rs:
        return ""
    rows = [r for r in rs if r.get("kind") == "traffic"]
    general = [r for r in rs if r.get("kind") == "traffic_error"]
    ladder = {(r.get("algo"), r.get("mode"), r.get("dtype"), r.get("headdim"), r.get("seqlen_q"), r.get("causal")):
              r.get("ms") for r in records if r.get("section") == "ladder" and r.get("kind") == "time"}
    lines = ["### Device-memory traffic of the V1 -> V2 ladder (Nsight Compute, measured vs counted)", "",
             "`ncu --clock-control none --cache-control all` (L2 flushed before every kernel), metrics "
             "`dram__bytes_read.sum`, `dram__bytes_write.sum`, `gpu__time_duration.sum` summed over the kernels of "
             "one call after one warm-up; counted: bench_v1's analytic model (L2 assumed not to help). ncu ms: "
             "kernel time under the profiler (cold L2, kernels serialized); ladder ms: the ladder suite's "
             "CUDA-event median. fp16, batch x seqlen = 16k, hidden 2048.", ""]
    if rows:
        lines += ["| version | dir | d | seqlen | causal | read GB | write GB | measured GB | counted GB | "
                  "measured / counted | kernels | ncu ms | ladder ms |", "|" + "---|" * 13]
        order = sorted(rows, key=lambda r: (r.get("mode") != "fwd", r.get("headdim") or 0, bool(r.get("causal")),
                                            r.get("seqlen_q") or 0, r.get("rung") or 0))
        for r in order:
            lms = ladder.get((r.get("algo"), r.get("mode"), r.get("dtype"), r.get("headdim"), r.get("seqlen_q"),
                              r.get("causal")))
            ratio = r.get("measured_over_counted")
            lines.append(
                f"| {r.get('rung') or ''} {r.get('algo')} | {r.get('mode')} | {r.get('headdim')} | "
                f"{r.get('seqlen_q')} | {r.get('causal')} | {_gb(r.get('dram_read_bytes'))} | "
                f"{_gb(r.get('dram_write_bytes'))} | {_gb(r.get('dram_bytes_measured'))} | "
                f"{_gb(r.get('dram_bytes_counted'))} | {_fmt(ratio, 2)} | {_fmt(r.get('kernels'))} | "
                f"{_fmt(r.get('ms'), 2)} | {_fmt(lms, 2)} |")
    notes = [f"- {r.get('error')}" for r in general]
    seen = set()
    for r in rows:
        e = r.get("error")
        if e and e not in seen:
            seen.add(e)
            where = [f"{x.get('mode')} {x.get('algo')} d={x.get('headdim')} s={x.get('seqlen_q')} "
                     f"causal={x.get('causal')}" for x in rows if x.get("error") == e]
            first = e.strip().splitlines()[0][:300] if e.strip() else e
            notes.append(f"- {first} ({len(where)} rows: {', '.join(where[:3])}{', ...' if len(where) > 3 else ''})")
    if notes:
        lines += ["", "Not measured:", ""] + notes
    return "\n".join(lines) + "\n"


_NOTED = []


def _pyplot():
    """matplotlib.pyplot with the Agg backend, or None (with a printed note, once) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        if not _NOTED:
            print("report: matplotlib not installed (pip install -e '.[bench]'): plots skipped", flush=True)
            _NOTED.append(True)
        return None
    return plt


def plots(records, out_dir):
    """fwd_tflops.png, bwd_tflops.png: TFLOP/s vs seqlen per (dtype, hdim, causal), every provider."""
    wanted = {"fwd": ("fwd",), "bwd": ("bwd",)}
    if not any(_sec(records, *secs, mode=mode) for mode, secs in wanted.items()):
        return
    plt = _pyplot()
    if plt is None:
        return
    for mode, secs in wanted.items():
        rs = [r for r in _sec(records, *secs, mode=mode) if r.get("tflops")]
        if not rs:
            continue
        groups = sorted({(r["dtype"], r["headdim"], r["causal"]) for r in rs})
        ncol = (len(groups) + 1) // 2
        fig, axes = plt.subplots(2, ncol, figsize=(4 * ncol, 7), squeeze=False)
        for ax, g in zip(axes.flat, groups):
            sub = [r for r in rs if (r["dtype"], r["headdim"], r["causal"]) == g]
            for p in sorted({_name(r) for r in sub}):
                pts = sorted((r["seqlen_q"], r["tflops"]) for r in sub if _name(r) == p)
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=p)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{mode} {g[0]} d={g[1]} causal={g[2]}", fontsize=9)
            ax.set_xlabel("seqlen")
            ax.set_ylabel("TFLOP/s")
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, f"{mode}_tflops.png"), dpi=80)
        plt.close(fig)


def micro_plots(records, out_dir):
    """Throughput sweeps of the microbenchmarks: work per clock per SM vs warps per SM, one line per ILP."""
    rs = [r for r in records if r.get("section") == "micro" and r.get("metric") == "throughput" and r.get("sweep")]
    if not rs:
        return
    plt = _pyplot()
    if plt is None:
        return
    cols = 4
    rows = -(-len(rs) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
    for ax, r in zip(axes.flat, rs):
        for ilp in sorted({p["ilp"] for p in r["sweep"]}):
            pts = sorted((p["warps_per_sm"], p["per_clk_sm"]) for p in r["sweep"] if p["ilp"] == ilp)
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=f"ILP {ilp}")
        if r.get("reference_value"):
            ax.axhline(r["reference_value"], color="gray", ls="--", lw=1, label="reference")
        ax.set_title(f"{r['name']} {r['variant']}"[:48], fontsize=8)
        ax.set_xlabel("warps per SM", fontsize=8)
        ax.set_ylabel(r["unit"], fontsize=8)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(rs):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "micro_throughput.png"), dpi=70)
    plt.close(fig)


def write_all(head, records, out_dir, md_path=None):
    """results.md and the plots into out_dir."""
    with open(md_path or os.path.join(out_dir, "results.md"), "w") as f:
        f.write(markdown(head, records))
    plots(records, out_dir)
    micro_plots(records, out_dir)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="?", help="a results.json or the folder holding it (same as --results)")
    ap.add_argument("--results", dest="results_opt", help="results.json (default: bench/results/results.json)")
    ap.add_argument("--readme", help="README to update in place: the blocks between <!-- results:NAME --> markers")
    ap.add_argument("--plots-dir", help="where the plots go (default: the results file's folder)")
    ap.add_argument("--md", help="results.md to write (default: next to the results file); 'none' to skip")
    args = ap.parse_args(argv)
    path = args.results_opt or args.results or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                             "results.json")
    if os.path.isdir(path):
        path = os.path.join(path, "results.json")
    with open(path) as f:
        data = json.load(f)
    head, records = data.get("header", {}), data["records"]
    folder = os.path.dirname(os.path.abspath(path))
    if args.md != "none":
        md = args.md or os.path.join(folder, "results.md")
        with open(md, "w") as f:
            f.write(markdown(head, records))
        print(f"report: {md}")
    plots_dir = args.plots_dir or folder
    plots(records, plots_dir)
    micro_plots(records, plots_dir)
    if args.readme:
        with open(args.readme) as f:
            text = f.read()
        new, filled, skipped = fill_readme(text, records)
        if new != text:
            with open(args.readme, "w") as f:
                f.write(new)
        print(f"report: {args.readme}: blocks filled {filled or 'none'}"
              + (f"; left as they were (unknown name, no records, or a marker without its partner): {skipped}"
                 if skipped else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
