"""Markdown tables and plots from results.json (regenerate: python -m bench.report bench/results)."""
from __future__ import annotations

import json
import os
import sys
from collections import defaultdict

MMA_SYNC_PEAK = 647.0  # TFLOP/s, measured mma.sync m16n8k16 peak on the H200 (shared/ANCHORS.md)


def _fmt(x, nd=0):
    return "-" if x is None else f"{x:.{nd}f}"


def grid_table(records, mode, algo_of_cuflash=("v2",), title="", sections=None):
    """TFLOP/s per (dtype, hdim, causal, provider) x seqlen, then cuflash's ratios to flash and cudnn."""
    sections = sections or (mode, mode + "_quick")
    rs = [r for r in records if r.get("section") in sections and r.get("mode") == mode]
    if not rs:
        return ""
    seqlens = sorted({r["seqlen_q"] for r in rs})
    keyed = defaultdict(dict)
    for r in rs:
        name = r["provider"] if r["provider"] != "cuflash" else f"cuflash-{r['algo']}"
        keyed[(r["dtype"], r["headdim"], r["causal"], name)][r["seqlen_q"]] = r.get("tflops")
    lines = [f"### {title or mode} TFLOP/s", "", "| dtype | hdim | causal | provider | " +
             " | ".join(str(s) for s in seqlens) + " |", "|" + "---|" * (4 + len(seqlens))]
    groups = sorted({k[:3] for k in keyed})
    for g in groups:
        provs = sorted(p for (*gg, p) in keyed if tuple(gg) == g)
        for p in provs:
            row = keyed[g + (p,)]
            lines.append(f"| {g[0]} | {g[1]} | {g[2]} | {p} | " + " | ".join(_fmt(row.get(s)) for s in seqlens) + " |")
        cu = [p for p in provs if p.startswith("cuflash")]
        for c in cu:
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


def simple_table(records, section, cols, title):
    rs = [r for r in records if r.get("section") == section and r.get("provider") != "error"]
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
    """Section fwd_interleaved (bench/bench_fwd.py: interleaved): per point and tile, the ratio to SDPA FLASH
    formed within each round (FLASH timed right before), median and range over the rounds."""
    rs = [r for r in records if r.get("section") == "fwd_interleaved" and r.get("provider") != "error"]
    if not rs:
        return ""

    def round_key(r):  # one round of one point in one call
        return r["dtype"], r["headdim"], r["causal"], r["seqlen_q"], r.get("call", 0), r["round"]

    flash = {round_key(r): r["ms"] for r in rs if r["provider"] == "flash"}
    ratios = defaultdict(list)
    for r in rs:
        if r["provider"] == "cuflash":
            ratios[(r["dtype"], r["headdim"], r["causal"], r["seqlen_q"], r["algo"], bool(r.get("configured")))].append(
                flash[round_key(r)] / r["ms"])
    lines = ["### Forward, interleaved timing: cuflash / SDPA FLASH per round (FLASH timed just before)", "",
             "| dtype | hdim | causal | seqlen | tile | configured | rounds | median | min | max |",
             "|" + "---|" * 10]
    for (dt, d, c, sq, algo, conf), v in sorted(ratios.items(), key=str):
        v = sorted(v)
        lines.append(f"| {dt} | {d} | {c} | {sq} | {algo} | {conf} | {len(v)} | {v[len(v) // 2]:.3f} | {v[0]:.3f} | "
                     f"{v[-1]:.3f} |")
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


_BWD_SWEEP_TITLES = {
    "bwd_tile_sweep": "Backward tile sweep (fp16, atomic dQ; TFLOP/s, and / SDPA FLASH of the same loop)",
    "bwd_tile_sweep_bf16": "Backward tile sweep, bf16 (section bwd_tile_sweep_bf16)",
    "bwd_tile_rounds": "Backward tile sweep, candidates and FLASH timed in turn, median of 3 rounds (fp16; section "
                       "bwd_tile_rounds)",
    "bwd_tile_rounds_bf16": "The same in bf16 (section bwd_tile_rounds_bf16)",
    "bwd_tile_rounds_d64": "Backward tile candidates at head dim 64 (session 9), timed in turn, median of 3 rounds (fp16; "
                           "section bwd_tile_rounds_d64)",
    "bwd_tile_rounds_d64_bf16": "The same in bf16 (section bwd_tile_rounds_d64_bf16)",
    "bwd_tile_rounds_d128": "Backward tile candidates at head dim 128 (session 10), timed in turn, median of 3 rounds "
                            "(fp16; section bwd_tile_rounds_d128)",
    "bwd_tile_rounds_d128_bf16": "The same in bf16 (section bwd_tile_rounds_d128_bf16)",
}


def bwd_sweep_table(records, section="bwd_tile_sweep"):
    """Sections bwd_tile_sweep(_bf16) / bwd_tile_rounds: every candidate backward tile next to SDPA FLASH measured in
    the same loop."""
    rs = [r for r in records if r.get("section") == section]
    if not rs:
        return ""
    seqlens = sorted({r["seqlen_q"] for r in rs})
    cell = defaultdict(dict)
    for r in rs:
        cell[(r["headdim"], r["causal"], r["provider"] if r["provider"] != "cuflash" else r["algo"])][r["seqlen_q"]] = \
            r.get("tflops")
    lines = [f"### {_BWD_SWEEP_TITLES[section]}", ""]
    if section == "bwd_tile_sweep":
        lines += ["Candidate: partition-block_m x block_n x warps-u(k16 steps unrolled, 0 = all), then the options: "
                  "-bulk (dQ staged in shared memory, added by cp.reduce.async.bulk; sm_90), -do2 (two dO buffers "
                  "beyond sm_80's shared memory), -pregs (dS takes P from registers), -issue1 (the bulk reductions "
                  "issued from warp-uniform operands), -issue2 (the same, deferred to the top of the next step), "
                  "-load1 / -load2 (the next Q tile requested after S = QK^T / after P and dP), -expil (P's exps "
                  "interleaved with the k16 steps of dP). In older records (history/ and the session-9 rounds tables): "
                  "session 4's -do, -scalar, -rot, session 6's -late (dQ after dV), session 8's -r16 (16-row dQ warp "
                  "tiles), session 9's -issue3 (one bulk reduction per block) and -load3 (next Q tile after dS), "
                  "measured and removed (bench/NOTES.md). cuflash is called directly (no autograd), FLASH through "
                  "autograd (its ~0.4 ms of host latency per call inside its timing).", ""]
    lines += ["| hdim | causal | candidate | " + " | ".join(str(s) for s in seqlens) + " |",
              "|" + "---|" * (3 + len(seqlens))]
    for key in sorted(cell, key=lambda k: (k[0], k[1], k[2] == "flash", k[2])):
        row, fl = cell[key], cell.get((key[0], key[1], "flash"), {})
        vals = [_fmt(row.get(s)) + (f" ({row[s] / fl[s]:.2f})" if key[2] != "flash" and row.get(s) and fl.get(s)
                                   else "") for s in seqlens]
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(vals) + " |")
    return "\n".join(lines) + "\n"


def errors(records):
    errs = [r for r in records if r.get("provider") == "error"]
    return "".join(f"\n### section {r['section']} FAILED\n```\n{r['error']}\n```\n" for r in errs)


def markdown(head, records) -> str:
    parts = [f"# cuflash results\n\n{head.get('gpu')} ({head.get('sms')} SMs), clocks {head.get('clocks')}, driver "
             f"{head.get('driver')}, torch {head.get('torch')} (CUDA {head.get('torch_cuda')}), cupy {head.get('cupy')}, "
             f"NVRTC {head.get('nvrtc')}, {head.get('date')}.\n"]
    parts.append(simple_table(records, "ceilings", ["algo", "ms", "tb_per_s", "tflops"], "Ceilings measured in this run"))
    parts.append(grid_table(records, "fwd", title="Forward, FlashAttention-2 grid (batch x seqlen = 16k, hidden 2048)"))
    parts.append(grid_table(records, "fwd", sections=("fwd_rounds",), title="Forward, FlashAttention-2 grid, "
                            "cuflash / FLASH / cuDNN timed in turn, median of 3 rounds (section fwd_rounds)"))
    parts.append(grid_table(records, "bwd", sections=("bwd_grid",), title="Backward, FlashAttention-2 grid, default "
                            "dQ strategy (atomic), seqlen 1k-16k (one call per timing; section bwd_grid)"))
    parts.append(grid_table(records, "bwd", sections=("bwd_rounds",), title="Backward, FlashAttention-2 grid, "
                            "default dQ strategy, cuflash / FLASH / cuDNN timed in turn, median of 3 rounds (section "
                            "bwd_rounds)"))
    parts.append(grid_table(records, "bwd", sections=("bwd_rounds_repeat",), title="The same, repeated in a later "
                            "call with the same code (section bwd_rounds, filed as bwd_rounds_repeat)"))
    parts.append(grid_table(records, "bwd", title="Backward, FlashAttention-2 grid, every dQ strategy (one call per "
                            "timing; sections bwd / bwd_quick)"))
    parts.append(grid_table(records, "bwd", sections=("bwd_loop",), title="Backward, 10 back-to-back calls per "
                            "timing (host latency overlapped; section bwd_loop)"))
    parts.append(partition_table(records))
    parts += [bwd_sweep_table(records, sec) for sec in _BWD_SWEEP_TITLES]
    parts.append(simple_table(records, "latency", ["provider", "causal", "us_per_call"],
                              "Per-call latency from Python (batch 1, 8 heads, 128 tokens, hdim 64)"))
    parts.append(simple_table(records, "grid_order", ["headdim", "seqlen_q", "causal", "grid_order", "ms", "tflops"],
                              "Grid order: Q tile in grid x vs (batch, head) in grid x"))
    parts.append(simple_table(records, "tile_sweep", ["headdim", "seqlen_q", "causal", "algo", "configured", "ms",
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
    ("layout", ["provider", "algo", "headdim", "seqlen_q", "causal", "memory_layout", "ms", "tflops"],
     "Same memory for both: forward on [b, s, h, d]- vs [b, h, s, d]-contiguous data (fp16)"),
    ("micro", ["name", "variant", "metric", "value", "unit", "reference_value", "fraction"], "Microbenchmarks"),
    ("v1_ladder", ["algo", "mode", "dtype", "headdim", "seqlen_q", "causal", "ms", "tflops", "err_rel", "err_max",
                   "dram_bytes"], "From V1 to V2"),
]


def _gb(x):
    return "-" if x is None else f"{x / 1e9:.2f}"


def traffic_table(records):
    """Section "traffic" (bench/bench_traffic.py): Nsight Compute's measured DRAM bytes of each V1 -> V2 ladder
    version next to bench_v1's counted bytes and the time; the ladder's own CUDA-event time (section v1_ladder)
    when that section is in the same results. Empty when the section is absent."""
    rs = [r for r in records if r.get("section") == "traffic" and r.get("provider") != "error"]
    if not rs:
        return ""
    rows = [r for r in rs if r.get("kind") == "traffic"]
    general = [r for r in rs if r.get("kind") == "traffic_error"]
    ladder = {(r.get("algo"), r.get("mode"), r.get("dtype"), r.get("headdim"), r.get("seqlen_q"), r.get("causal")):
              r.get("ms") for r in records if r.get("section") == "v1_ladder" and r.get("kind") == "time"}
    lines = ["### Device-memory traffic of the V1 -> V2 ladder (Nsight Compute, measured vs counted)", "",
             "`ncu --clock-control none --cache-control all` (L2 flushed before every kernel), metrics "
             "`dram__bytes_read.sum`, `dram__bytes_write.sum`, `gpu__time_duration.sum` summed over the kernels of "
             "one call after one warm-up; counted: bench_v1's analytic model (L2 assumed not to help). ncu ms: "
             "kernel time under the profiler (cold L2, kernels serialized); ladder ms: the v1_ladder section's "
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


def plots(records, out_dir):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    for mode in ("fwd", "bwd"):
        rs = [r for r in records if r.get("mode") == mode and r.get("section") in (mode, mode + "_quick") and r.get("tflops")]
        if not rs:
            continue
        groups = sorted({(r["dtype"], r["headdim"], r["causal"]) for r in rs})
        fig, axes = plt.subplots(2, (len(groups) + 1) // 2, figsize=(4 * ((len(groups) + 1) // 2), 7), squeeze=False)
        for ax, g in zip(axes.flat, groups):
            sub = [r for r in rs if (r["dtype"], r["headdim"], r["causal"]) == g]
            for p in sorted({r["provider"] + ("-" + r["algo"] if r["provider"] == "cuflash" else "") for r in sub}):
                pts = sorted((r["seqlen_q"], r["tflops"]) for r in sub
                             if r["provider"] + ("-" + r["algo"] if r["provider"] == "cuflash" else "") == p)
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rs = [r for r in records if r.get("section") == "micro" and r.get("metric") == "throughput" and r.get("sweep")]
    if not rs:
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


def write_all(head, records, out_dir):
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(markdown(head, records))
    plots(records, out_dir)
    micro_plots(records, out_dir)


if __name__ == "__main__":
    d = sys.argv[1]
    data = json.load(open(os.path.join(d, "results.json")))
    write_all(data["header"], data["records"], d)
