"""Hopper instruction microbenchmarks (suite micro90): the instructions of the sm_90a forward, one at a time.

Kernels: cuda_src/micro/micro_sm90.cu, compiled for sm_90a. Items and the kernel decision each informs:
  wgmma.ss   wgmma.mma_async m64nNk16, A and B in shared memory (K-major): the forward's S = Q K^T (N = BLOCK_N)
  wgmma.rs   A in registers, B in shared memory MN-major: the forward's O += P V with P in registers (N = head
             dim); wgmma.rs.kmajor (B K-major) separates "A from registers" from "B transposed"
             both: TFLOP/s and FLOP/clk/SM with random operands (fresh normal data, not zeros), swept over
             warpgroups per SM and independent accumulators per warpgroup; latency on one warpgroup (one
             product, or 4 dependent k16 steps, then wait_group 0); every product is checked against numpy
  tma.load   cp.async.bulk.tensor.4d boxes of K/V tiles (64 columns x ROWS rows, 128-byte swizzle) from a 1 GiB
             [b, s, h, d] or [b, h, s, d] tensor into a ring of STAGES shared-memory stages completing on
             mbarriers, one or more CTAs per SM: bytes per second against the HBM data-sheet figure and this
             run's device copy bandwidth (the producer warpgroup's K/V loads: STAGES x tile bytes in flight)
  mbarrier   arrive + try_wait.parity round trip between two sides of 1 / 32 / 128 threads, and one thread's
             arrive + wait (the producer / consumer stage handoff: full_k / empty_k of every KV tile)
  bulk.reduce  cp.reduce.async.bulk .add.f32 of 16 / 32 KB fp32 tiles from shared memory into global memory,
             one thread per block, 1 or 4 blocks per SM adding into one tile, 8 tiles or a tile each (the Hopper
             backward's dQ writer: every KV tile's dQ partial of a Q tile into the same accumulator tile), waiting
             for the source read ("atomic") or for the adds ("ordered"): GB/s and clocks per reduction; each
             run's sums are checked exactly
Every record names the kernel it timed and carries a SASS check of that kernel from one offline NVRTC compile
+ `cuobjdump -sass` (HGMMA of the right shape, dtype and A operand form; UTMALDG; SYNCS.*; UBLKRED; no local memory;
no ptxas "wgmma serialized" note), and its `informs` field says which decision it is for.

Reading the numbers: FLOP/clk/SM comes from clock64 (per SM, so the clock the GPU chose cancels out) and says
whether the tensor cores are saturated (architectural 4096); TFLOP/s comes from CUDA events and also carries
the clock the GPU runs at under random operands (its record's clock_ghz), which is below the 1.98 GHz boost.
The latency records' one_warpgroup_fraction_of_peak is the tensor-core rate one warpgroup gets when it waits
for every group: what the sm90 forward's overlapped issue and PINGPONG must make up.

    python -m bench micro90 --out DIR

micro90() -> list of records (harness.record, provider "micro"); sweep_specs() -> every KernelSpec it launches.
"""
from __future__ import annotations

import ctypes
import os
import re
import struct
import time
import traceback

from cuflash._launch import KernelSpec

from . import bench_micro as bm

FILE = "micro/micro_sm90.cu"
ARCH = "90a"
TARGET_MS = 5.0  # length of one timed launch
REP = 5
TIME_LIMIT_S = 50.0  # the sweeps stop early past this (the suite must stay under a minute)

# Published / architectural references (H100 / H200 SXM: 132 SMs).
DENSE_TFLOPS_PUBLISHED = 989.4  # fp16 / bf16 dense tensor-core TFLOP/s, data sheet
WGMMA_FLOP_PER_CLK_SM = 4096.0  # 4 tensor cores x 512 FMA per clock (989.4 TFLOP/s at 1.83 GHz, 132 SMs)
HBM_GB_S_PUBLISHED = 4800.0  # H200 HBM3e, data sheet

DTYPES = (("f16", "__half"), ("bf16", "__nv_bfloat16"))
NS = (64, 128, 192, 256)


class Form:
    """One operand form of wgmma: A from shared memory or registers, B K-major (0) or MN-major (1)."""

    def __init__(self, name, rs, trans_b, informs):
        self.name, self.rs, self.trans_b, self.informs = name, rs, trans_b, informs


FORM_SS = Form("wgmma.ss", False, 0,
               "S = Q K^T of the sm_90a forward (flash_fwd_sm90.cu issue_qk): Q and K both in shared memory, K-major; "
               "N = BLOCK_N (64..256). ss vs rs at the same N: what reading A from shared memory costs")
FORM_RS = Form("wgmma.rs", True, 1,
               "O += P V of the sm_90a forward (issue_pv): P in registers (the S accumulator converted in place, no "
               "shared-memory trip), V in shared memory MN-major; N = head dim (64..256)")
FORM_RS_K = Form("wgmma.rs.kmajor", True, 0,
                 "control for ss vs rs: A in registers with B K-major as in ss, so rs vs ss separates the A operand's "
                 "source from B's major-ness")
FORMS = (FORM_SS, FORM_RS)
CONTROL = ((FORM_RS_K, "f16", 128), (FORM_RS_K, "f16", 256))  # measured for throughput only
WG_POINTS = ((1, 1), (2, 1), (3, 1), (2, 2))  # (warpgroups per CTA, CTAs per SM): 1..4 warpgroups per SM
LAT_GROUPS = (1, 4)  # dependent wgmma per commit / wait_group 0

# TMA: (STAGES, ROWS) -- a stage is a ROWS x 128 (head dim 128) 16-bit tile, 2 boxes of 64 columns
TMA_VARIANTS = ((2, 128), (4, 128), (4, 64), (8, 64))
TMA_THREADS = 128
TMA_SHAPE = (8, 16384, 32, 128)  # [b, s, h, d]: 1 GiB of 16-bit elements, >> L2
TMA_LAYOUTS = ("bshd", "bhsd")  # rows 8 KB apart (heads interleaved, the library's layout) / rows contiguous
TMA_INFORMS = ("K/V tile loads of the sm_90a forward's producer warpgroup (tma_load_4d into STAGES stages of "
               "BLOCK_N x D): the bytes in flight per SM it takes to reach HBM bandwidth")

MBAR_SIDES = (1, 32, 128)
MBAR_INFORMS = ("the producer/consumer stage handoff cost of the sm_90a forward (full_k / empty_k, full_v / empty_v "
                "per KV tile: one round trip per stage) against the time of the tile's products")

# Bulk reductions: tile bytes (the Hopper backward's dQ tile: BLOCK_M x D fp32 = 32 KB at d64 / d128, 24 KB at d96),
# blocks per SM, destination tiles ("one": every block into one tile; "8"; "distinct": a tile per block), and the
# wait after each reduction (False: wait_group.read, the source read; True: wait_group, the adds done)
BULK_TILES = (16384, 32768)
BULK_BLOCKS_PER_SM = (1, 4)
BULK_DESTS = ("one", "8", "distinct")
BULK_WAITS = ((False, BULK_TILES), (True, (32768,)))  # (wait for the adds, the tiles measured with it)
BULK_THREADS = 128
BULK_INFORMS = ("dQ through the TMA unit: the Hopper backward's dQ writer (flash_bwd_sm90.cu) adds each staged "
                "[BLOCK_M, D] fp32 tile with one cp.reduce.async.bulk, all KV tiles of a Q tile into one accumulator "
                "tile; wait_group.read is the atomic strategy's handoff, wait_group (the adds done) ordered's turn")
BULK_EXPECT = (r"UBLKRED(\.\w+)*",)  # seen: UBLKRED.G.S.ADD.F32.RN (NVRTC 13.x)


# ------------------------------------------------------------------------------------------ kernel names / specs
def _b(x: bool) -> str:
    return "true" if x else "false"


def tput_name(t: str, n: int, form: Form, ch: int) -> str:
    return f"cuflash::micro90_wgmma_tput_kernel<{t}, {n}, {_b(form.rs)}, {form.trans_b}, {ch}>"


def latency_name(t: str, n: int, form: Form, g: int) -> str:
    return f"cuflash::micro90_wgmma_latency_kernel<{t}, {n}, {_b(form.rs)}, {form.trans_b}, {g}>"


def tma_name(stages: int, rows: int) -> str:
    return f"cuflash::micro90_tma_load_kernel<{stages}, {rows}>"


def pingpong_name(p: int) -> str:
    return f"cuflash::micro90_mbar_pingpong_kernel<{p}>"


SELF_NAME = "cuflash::micro90_mbar_self_kernel"


def bulk_name(tile_bytes: int, wait_done: bool) -> str:
    return f"cuflash::micro90_bulk_reduce_kernel<{tile_bytes}, {_b(wait_done)}>"


def bulk_dests(dest: str, grid: int) -> int:
    """Destination tiles of a BULK_DESTS entry for `grid` blocks (block b adds into tile b % n)."""
    return {"one": 1, "8": 8, "distinct": grid}[dest]


def chains(n: int) -> tuple:
    """Independent accumulators per warpgroup to try: 1, and 2 while 2 N <= 256 (at most 128 registers)."""
    return (1, 2) if 2 * n <= 256 else (1,)


def tput_max_threads(n: int, rs: bool, ch: int) -> int:
    """micro90_tput_threads (micro_sm90.cu): the throughput kernel's __launch_bounds__."""
    return 384 if ch * n // 2 + (16 if rs else 0) <= 128 else 256


def wgmma_smem(n: int, rs: bool) -> int:
    return 1024 + (0 if rs else 3 * 8192) + n * 128


def tma_smem(stages: int, rows: int) -> int:
    return 1024 + stages * rows * 256


def _spec(name, threads, smem) -> KernelSpec:
    return KernelSpec(FILE, name, threads, smem, min_arch=90, arch_suffix="a")


def tput_spec(t, n, form, ch, nwg) -> KernelSpec:
    return _spec(tput_name(t, n, form, ch), 128 * nwg, wgmma_smem(n, form.rs))


def latency_spec(t, n, form, g) -> KernelSpec:
    return _spec(latency_name(t, n, form, g), 128, wgmma_smem(n, form.rs))


def tma_spec(stages, rows) -> KernelSpec:
    return _spec(tma_name(stages, rows), TMA_THREADS, tma_smem(stages, rows))


def pingpong_spec(p) -> KernelSpec:
    return _spec(pingpong_name(p), 256, 0)


SELF_SPEC = KernelSpec(FILE, SELF_NAME, 32, 0, min_arch=90, arch_suffix="a")


def bulk_spec(tile_bytes, wait_done) -> KernelSpec:
    return _spec(bulk_name(tile_bytes, wait_done), BULK_THREADS, 1024 + tile_bytes)


def bulk_configs():
    """(tile bytes, wait for the adds) of every bulk-reduction kernel."""
    return [(t, w) for w, tiles in BULK_WAITS for t in tiles]


def tput_configs():
    """(form, dtype label, C++ type, N) of every throughput item: the main grid, then the controls."""
    out = [(f, d, t, n) for f in FORMS for d, t in DTYPES for n in NS]
    tmap = dict(DTYPES)
    out += [(f, d, tmap[d], n) for f, d, n in CONTROL]
    return out


def latency_configs():
    return [(f, d, t, n) for f in FORMS for d, t in DTYPES for n in NS]


def sweep_specs() -> list:
    """Every KernelSpec micro90() launches (one per (kernel, threads))."""
    specs = []
    for form, _, t, n in tput_configs():
        for ch in chains(n):
            for nwg in sorted({p[0] for p in WG_POINTS}):
                if 128 * nwg <= tput_max_threads(n, form.rs, ch):
                    specs.append(tput_spec(t, n, form, ch, nwg))
    for form, _, t, n in latency_configs():
        specs += [latency_spec(t, n, form, g) for g in LAT_GROUPS]
    specs += [tma_spec(s, r) for s, r in TMA_VARIANTS]
    specs += [pingpong_spec(p) for p in MBAR_SIDES] + [SELF_SPEC]
    specs += [bulk_spec(t, w) for t, w in bulk_configs()]
    return bm._dedupe(specs)


def all_kernel_names() -> list:
    return list(dict.fromkeys(s.name for s in sweep_specs()))


# ------------------------------------------------------------------------------------------ SASS expectations
def hgmma_opcode(n: int, dtype: str) -> str:
    """The SASS opcode of wgmma m64nNk16 with fp32 accumulators (full match: .BF16 is another opcode)."""
    return rf"HGMMA\.64x{n}x16\.F32" + (r"\.BF16" if dtype == "bf16" else "")


TMA_EXPECT = (r"UTMALDG\.4D(\.\w+)*", r"SYNCS\.ARRIVE\.TRANS64(\.\w+)*", r"SYNCS\.PHASECHK\.TRANS64(\.\w+)*")
MBAR_EXPECT = (r"SYNCS\.ARRIVE\.TRANS64(\.\w+)*", r"SYNCS\.PHASECHK\.TRANS64(\.\w+)*")


def expectations() -> dict:
    """{kernel name: (SASS opcode regexes it must hold, HGMMA A-operand form "ss" / "rs" or None)}."""
    exp = {}
    for form, d, t, n in tput_configs():
        for ch in chains(n):
            exp[tput_name(t, n, form, ch)] = ((hgmma_opcode(n, d),), "rs" if form.rs else "ss")
    for form, d, t, n in latency_configs():
        for g in LAT_GROUPS:
            exp[latency_name(t, n, form, g)] = ((hgmma_opcode(n, d),), "rs" if form.rs else "ss")
    for s, r in TMA_VARIANTS:
        exp[tma_name(s, r)] = (TMA_EXPECT, None)
    for p in MBAR_SIDES:
        exp[pingpong_name(p)] = (MBAR_EXPECT, None)
    exp[SELF_NAME] = (MBAR_EXPECT, None)
    for t, w in bulk_configs():
        exp[bulk_name(t, w)] = (BULK_EXPECT, None)
    return exp


_SASS_LINE = re.compile(r"^\s*/\*[0-9a-fA-F]{4,}\*/\s+(.*?)\s*;")


def parse_hgmma(text: str) -> dict:
    """`cuobjdump -sass` text -> {mangled function: [(HGMMA opcode, A operand text, B operand text)]}. The A
    operand is a register (R..) for rs, a descriptor (gdesc[UR..], which then stands for A and B) for ss."""
    funcs, cur = {}, None
    for line in text.splitlines():
        m = bm._SASS_FUNC.search(line)
        if m:
            cur = funcs.setdefault(m.group(1), [])
            continue
        m = _SASS_LINE.match(line) if cur is not None else None
        if not m:
            continue
        toks = m.group(1).split(None, 1)
        if toks and toks[0].startswith("@"):
            toks = toks[1].split(None, 1) if len(toks) > 1 else []
        if len(toks) == 2 and toks[0].startswith("HGMMA"):
            ops = [o.strip() for o in toks[1].split(",")]
            cur.append((toks[0], ops[1] if len(ops) > 1 else "", ops[2] if len(ops) > 2 else ""))
    return funcs


def hgmma_form(hgmmas) -> str | None:
    """"rs" when every HGMMA reads A from a register, "ss" when every one reads shared-memory descriptors."""
    if not hgmmas:
        return None
    kinds = {"rs" if re.match(r"R\d+", a) else "ss" if a.startswith("gdesc") else "?" for _, a, _ in hgmmas}
    return kinds.pop() if len(kinds) == 1 else "mixed"


_PERF_LOSS = re.compile(r"Potential Performance Loss: (.*?) for the function '([^']+)'")


def perf_notes(log: str) -> dict:
    """ptxas' "Potential Performance Loss" notes (e.g. C7512: wgmma serialized) by mangled function."""
    out = {}
    for m in _PERF_LOSS.finditer(log):
        out.setdefault(m.group(2), []).append(m.group(1))
    return out


def sass_check90(info: dict, expect) -> dict:
    """bench_micro.sass_check plus the HGMMA A-operand form and ptxas' performance notes."""
    opcodes = info.get("opcodes")
    if opcodes is None:
        return {"status": "unavailable"}
    pats, form = expect
    chk = bm.sass_check(opcodes, pats)
    notes = info.get("perf_notes") or []
    chk["perf_notes"] = notes
    if form is not None:
        got = hgmma_form(info.get("hgmma") or [])
        chk["hgmma_form"] = got
        chk["ok"] = chk["ok"] and got == form
    chk["ok"] = chk["ok"] and not notes
    return chk


def sass_chunk(names) -> dict:
    """One offline compile (sm_90a) of `names` + cuobjdump: {"status", "kernels": {name: {regs, stack, spill_st,
    spill_ld, lowered, opcodes, hgmma, perf_notes}}}."""
    from cuflash import _loader

    names = list(names)
    res = _loader.compile_offline(FILE, names, ARCH)
    notes = perf_notes(res["log"])
    kernels = {n: dict(info, opcodes=None, hgmma=None, perf_notes=notes.get(info["lowered"], []))
               for n, info in res["kernels"].items()}
    sass, status = bm.cubin_sass(res["cubin"])
    if sass is None:
        return {"status": status, "kernels": kernels}
    funcs, hg = bm.parse_sass(sass), parse_hgmma(sass)
    for info in kernels.values():
        info["opcodes"] = funcs.get(info["lowered"])
        info["hgmma"] = hg.get(info["lowered"], [])
    return {"status": "ok", "kernels": kernels}


def _chunks(names, k):
    names = list(names)
    k = max(1, min(k, len(names)))
    return [names[i::k] for i in range(k)]


def merge_sass(parts) -> dict:
    kernels, status = {}, "ok"
    for p in parts:
        kernels.update(p.get("kernels", {}))
        if p.get("status") != "ok":
            status = p.get("status")
    return {"status": status, "kernels": kernels}


def sass_analysis(names=None, jobs: int = 1) -> dict:
    """sass_chunk over all micro90 kernels, in `jobs` programs compiled one after the other (see _start_background
    for the parallel form)."""
    return merge_sass([sass_chunk(c) for c in _chunks(names or all_kernel_names(), jobs)])


# ------------------------------------------------------------------------------------------ pure helpers
def sw128_offset(r: int, c: int) -> int:
    """Byte offset of 16-bit element (r, c < 64) of a 128-byte-swizzled chunk (micro90_sw128)."""
    return r * 128 + ((((c >> 3) ^ (r & 7)) << 4) | ((c & 7) << 1))


def bf16_bits(x):
    """float array -> bf16 bit patterns (uint16), round to nearest even."""
    import numpy as np

    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bits_to_float(bits, dtype: str):
    import numpy as np

    bits = np.asarray(bits, dtype=np.uint16)
    if dtype == "f16":
        return bits.view(np.float16).astype(np.float64)
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def random_operands(n: int, dtype: str, seed: int = 0):
    """(a bits [3, 64, 64], b bits [n, 64], a as float64, b as float64): standard normal, rounded to dtype."""
    import numpy as np

    rng = np.random.default_rng(seed)
    a = rng.standard_normal((3, 64, 64)).astype(np.float32)
    b = rng.standard_normal((n, 64)).astype(np.float32)
    if dtype == "f16":
        ab, bb = a.astype(np.float16).view(np.uint16), b.astype(np.float16).view(np.uint16)
    else:
        ab, bb = bf16_bits(a), bf16_bits(b)
    return ab, bb, bits_to_float(ab, dtype), bits_to_float(bb, dtype)


def wgmma_reference(a64, b64, wg: int, times: int):
    """The accumulator of warpgroup wg after `times` products: times * A_wg[64 x 64] @ B[64 x N] (B[k][n] =
    b[n][k])."""
    return times * (a64[wg % 3] @ b64.T)


def rel_err(out, ref) -> float:
    import numpy as np

    return float(np.max(np.abs(np.asarray(out, dtype=np.float64) - ref)) / max(1e-30, float(np.max(np.abs(ref)))))


def tma_layout_strides(layout: str, shape=TMA_SHAPE, itemsize: int = 2):
    """Byte strides (row, head, batch) of the TMA tensor for layout "bshd" ([b, s, h, d]) or "bhsd"."""
    b, s, h, d = shape
    row = d * itemsize
    if layout == "bshd":
        return h * row, row, s * h * row
    return row, s * row, h * s * row


def tma_map_args(layout: str, rows: int, shape=TMA_SHAPE):
    """(dims innermost first, strides of dims 1..3 in bytes, box) of the benchmark's 4-d tensor map."""
    b, s, h, d = shape
    srow, shead, sbatch = tma_layout_strides(layout, shape)
    return (d, s, h, b), (srow, shead, sbatch), (64, rows, 1, 1)


def tma_n_tiles(rows: int, shape=TMA_SHAPE) -> int:
    b, s, h, _ = shape
    return b * h * (s // rows)


def tma_word_offsets(layout: str, stages: int, rows: int, grid: int, total: int, shape=TMA_SHAPE):
    """Byte offsets in the tensor of the 4-byte words micro90_tma_load_kernel reads: [grid, 128 threads, total]
    (thread tid reads byte tid * stage_bytes / 128 of each tile it receives, through the 128-byte swizzle)."""
    import numpy as np

    b, s, h, d = shape
    srow, shead, sbatch = tma_layout_strides(layout, shape)
    rblocks, n_tiles = s // rows, tma_n_tiles(rows, shape)
    box_bytes, stage_bytes = rows * 128, rows * 256
    out = np.zeros((grid, 128, total), dtype=np.int64)
    for blk in range(grid):
        t = blk
        for j in range(total):
            rb, bh = t % rblocks, t // rblocks
            head, batch = bh % h, bh // h
            for tid in range(128):
                o = tid * (stage_bytes // 128)
                box, ob = o // box_bytes, o % box_bytes
                r, piece, byte = ob // 128, (ob % 128) // 16, ob % 16
                col = box * 128 + (piece ^ (r % 8)) * 16 + byte
                out[blk, tid, j] = batch * sbatch + head * shead + (rb * rows + r) * srow + col
            t = (t + grid) % n_tiles
    return out


# ------------------------------------------------------------------------------------------ GPU side
class _Ctx(bm._Ctx):
    """bench_micro's context (device facts, clock buffer, timing) plus the launches with a tensor-map parameter."""

    def __init__(self, deadline: float):
        super().__init__(deadline)
        self.stats_out = self.torch.zeros(self.sms * 16 * 384, dtype=self.torch.float32, device="cuda")
        self.full_out = self.torch.zeros(3 * 2 * 64 * 256, dtype=self.torch.float32, device="cuda")

    def launch_with_map(self, lau, grid, tmap: bytes, fmt: str, *values):
        """Launch a kernel whose first parameter is a 128-byte TmaDesc, then 8-byte slots packed by `fmt`."""
        from cupy.cuda import driver

        from cuflash._interop import ensure_context

        if len(tmap) != 128:
            raise ValueError("a tensor map is 128 bytes")
        tail = struct.pack(fmt, *values)
        nslots = len(tail) // 8
        buf = ctypes.create_string_buffer(128 + len(tail) + 64)
        base = (ctypes.addressof(buf) + 63) & ~63
        ctypes.memmove(base, tmap, 128)
        ctypes.memmove(base + 128, tail, len(tail))
        argv = (ctypes.c_void_p * (1 + nslots))(base, *(base + 128 + 8 * i for i in range(nslots)))
        ensure_context()
        driver.launchKernel(lau.ptr, grid, 1, 1, lau.threads, 1, 1, lau.smem, self.stream, ctypes.addressof(argv), 0)


def _rec(name, variant, metric, value, unit, ref=None, ms=None, dtype="", **extra):
    return bm._rec(name, variant, metric, value, unit, ref, ms, dtype, **extra)


def _err(name, variant, where="") -> dict:
    return bm._err(name, variant, where)


def _upload_operands(ctx, n, dtype, seed):
    torch = ctx.torch
    ab, bb, a64, b64 = random_operands(n, dtype, seed)
    a_t = torch.from_numpy(ab.view("int16").copy()).cuda()
    b_t = torch.from_numpy(bb.view("int16").copy()).cuda()
    return a_t, b_t, a64, b64


def check_wgmma_tput(ctx, form, dtype, t, n, ch, nwg, seed=1) -> float:
    """Run the throughput kernel on 2 blocks for 3 trips; max relative error of block 0's accumulators against
    3 A_wg B (numpy, float64 of the same 16-bit inputs)."""
    import numpy as np

    spec = tput_spec(t, n, form, ch, nwg)
    lau = ctx.launcher(spec)
    a_t, b_t, a64, b64 = _upload_operands(ctx, n, dtype, seed)
    ctx.full_out.fill_(float("nan"))
    iters = 3
    lau.launch((2, 1, 1), ctx.stream, "=QQQQQq", a_t.data_ptr(), b_t.data_ptr(), ctx.full_out.data_ptr(),
               ctx.stats_out.data_ptr(), ctx.clk.data_ptr(), iters)
    ctx.torch.cuda.synchronize()
    got = ctx.full_out[: nwg * ch * 64 * n].cpu().numpy().reshape(nwg, ch, 64, n)
    if not np.isfinite(got).all():
        return float("inf")
    return max(rel_err(got[w, c], wgmma_reference(a64, b64, w, iters)) for w in range(nwg) for c in range(ch))


def check_wgmma_latency(ctx, form, dtype, t, n, g, seed=2) -> float:
    import numpy as np

    spec = latency_spec(t, n, form, g)
    lau = ctx.launcher(spec)
    a_t, b_t, a64, b64 = _upload_operands(ctx, n, dtype, seed)
    ctx.full_out.fill_(float("nan"))
    iters = 2
    lau.launch((1, 1, 1), ctx.stream, "=QQQQq", a_t.data_ptr(), b_t.data_ptr(), ctx.full_out.data_ptr(),
               ctx.clk.data_ptr(), iters)
    ctx.torch.cuda.synchronize()
    got = ctx.full_out[: 64 * n].cpu().numpy().reshape(64, n)
    if not np.isfinite(got).all():
        return float("inf")
    return rel_err(got, wgmma_reference(a64, b64, 0, iters * g))  # a trip: 4 steps x g k16 steps = g products


CHECK_TOL = 1e-3  # fp32 accumulation of 64-term dot products of O(1) values, 3 times over


def bench_wgmma_tput(ctx, recs, quick=False):
    configs = tput_configs()
    if quick:
        configs = [c for c in configs if c[3] in (64, 256) and c[0] in FORMS]
    for form, dtype, t, n in configs:
        variant = f"m64n{n}k16 {dtype} -> f32"
        try:
            a_t, b_t, _, _ = _upload_operands(ctx, n, dtype, seed=n)
            pts, skipped, errs = [], [], {}
            for ch in chains(n):
                maxwg = tput_max_threads(n, form.rs, ch) // 128
                errs[ch] = check_wgmma_tput(ctx, form, dtype, t, n, ch, min(2, maxwg))
                if not errs[ch] < CHECK_TOL:
                    raise RuntimeError(f"{tput_name(t, n, form, ch)}: accumulators differ from numpy (max rel. error "
                                       f"{errs[ch]:.3g}): wrong descriptors or swizzle, nothing timed")
                for nwg, bpsm in (WG_POINTS[1:2] if quick else WG_POINTS):
                    if nwg > maxwg:
                        skipped.append(dict(chains=ch, wg_per_cta=nwg, reason=f"launch bounds: {maxwg} warpgroups"))
                        continue
                    if time.time() > ctx.deadline and pts:
                        skipped.append(dict(chains=ch, wg_per_cta=nwg, ctas_per_sm=bpsm, reason="time limit"))
                        continue
                    lau = ctx.launcher(tput_spec(t, n, form, ch, nwg))
                    occ = ctx.max_blocks_per_sm(lau)
                    if occ is not None and occ < bpsm:
                        skipped.append(dict(chains=ch, wg_per_cta=nwg, ctas_per_sm=bpsm, reason=f"occupancy {occ}"))
                        continue
                    grid = ctx.sms * bpsm

                    def make(iters, lau=lau, grid=grid):
                        return lambda: lau.launch((grid, 1, 1), ctx.stream, "=QQQQQq", a_t.data_ptr(), b_t.data_ptr(),
                                                  ctx.full_out.data_ptr(), ctx.stats_out.data_ptr(),
                                                  ctx.clk.data_ptr(), iters)

                    iters, ms = ctx.timed(make, 64, target_ms=1.0 if quick else TARGET_MS, rep=2 if quick else REP)
                    rows = ctx.clock_rows(grid)
                    flop = 2.0 * 64 * n * 16
                    per_clk, span, nsm = bm.sm_rate(rows, nwg * flop)
                    total = sum(r[3] for r in rows) * nwg * flop
                    pts.append(dict(chains=ch, wg_per_cta=nwg, ctas_per_sm=bpsm, warpgroups_per_sm=nwg * bpsm,
                                    iters=iters, ms=ms, per_clk_sm=per_clk, per_s=total / (ms * 1e-3),
                                    clock_ghz=span / (ms * 1e6), sms_seen=nsm))
            if not pts:
                raise RuntimeError(f"no point measured: {skipped}")
            best = max(pts, key=lambda p: p["per_s"])
            kname = tput_name(t, n, form, best["chains"])
            sweep = [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in p.items()} for p in pts]
            common = dict(kernel=kname, _expect=expectations()[kname], informs=form.informs, n=n,
                          operand_form=form.name.split(".", 1)[1], best_chains=best["chains"],
                          best_warpgroups_per_sm=best["warpgroups_per_sm"], clock_ghz=best["clock_ghz"],
                          check_max_rel_err=max(errs.values()), random_operands="standard normal, rounded to " + dtype,
                          sweep=sweep, skipped=skipped)
            recs.append(_rec(form.name, variant, "TFLOP/s", best["per_s"] / 1e12, "TFLOP/s", DENSE_TFLOPS_PUBLISHED,
                             ms=best["ms"], dtype=dtype, reference="dense fp16/bf16 tensor-core peak, data sheet",
                             peak_at_measured_clock_tflops=WGMMA_FLOP_PER_CLK_SM * ctx.sms * best["clock_ghz"] / 1e3,
                             **common))
            recs.append(_rec(form.name, variant, "throughput", best["per_clk_sm"], "FLOP/clk/SM",
                             WGMMA_FLOP_PER_CLK_SM, ms=best["ms"], dtype=dtype, **common))
        except Exception:  # noqa: BLE001
            recs.append(_err(form.name, variant, "throughput"))


def bench_wgmma_latency(ctx, recs, quick=False):
    configs = latency_configs()
    if quick:
        configs = [c for c in configs if c[3] in (64, 256)]
    for form, dtype, t, n in configs:
        variant = f"m64n{n}k16 {dtype} -> f32"
        a_t, b_t, _, _ = _upload_operands(ctx, n, dtype, seed=7)
        for g in LAT_GROUPS:
            metric = "latency" if g == 1 else f"latency, {g} dependent"
            try:
                err = check_wgmma_latency(ctx, form, dtype, t, n, g)
                if not err < CHECK_TOL:
                    raise RuntimeError(f"{latency_name(t, n, form, g)}: result differs from numpy ({err:.3g})")
                spec = latency_spec(t, n, form, g)
                lau = ctx.launcher(spec)

                def make(iters, lau=lau):
                    return lambda: lau.launch((1, 1, 1), ctx.stream, "=QQQQq", a_t.data_ptr(), b_t.data_ptr(),
                                              ctx.full_out.data_ptr(), ctx.clk.data_ptr(), iters)

                _, ms = ctx.timed(make, 64, target_ms=0.5 if quick else 2.0, rep=1 if quick else 3)
                t0, t1, _, steps = ctx.clock_rows(1)[0]
                if steps <= 0 or t1 <= t0:
                    raise RuntimeError(f"bad clock record {t0} {t1} {steps}")
                per_step = (t1 - t0) / steps
                recs.append(_rec(form.name, variant, metric, per_step, "clk", ms=ms, dtype=dtype, kernel=spec.name,
                                 _expect=expectations()[spec.name], n=n, dependent_wgmma_per_step=g,
                                 clk_per_wgmma=per_step / g, check_max_rel_err=err,
                                 one_warpgroup_fraction_of_peak=g * 2.0 * 64 * n * 16 / WGMMA_FLOP_PER_CLK_SM
                                 / per_step,
                                 informs=("wgmma latency (issue -> wait_group 0): how many products must be in flight "
                                          "to hide it, i.e. the overlapped issue (the next S = Q K^T with the current "
                                          "O += P V) and PINGPONG (two consumer warpgroups) of flash_fwd_sm90.cu; "
                                          + form.informs)))
            except Exception:  # noqa: BLE001
                recs.append(_err(form.name, variant, metric))


def tma_check(ctx, buf, layout, stages, rows, grid=2, total=None) -> bool:
    """A short run on `grid` blocks: every thread's xor of the words it read equals the xor of the same words
    gathered from the tensor on the host side (tma_word_offsets): the boxes land where the swizzle says."""
    import numpy as np

    from cuflash import _tma

    torch = ctx.torch
    total = total or stages + 3
    lau = ctx.launcher(tma_spec(stages, rows))
    dims, strides, box = tma_map_args(layout, rows)
    tmap = _tma.encode_tiled(buf.data_ptr(), "float16", dims, strides, box, swizzle=128)
    out = torch.zeros(grid * 128, dtype=torch.int32, device="cuda")
    ctx.launch_with_map(lau, grid, tmap, "=QQqqqq", out.data_ptr(), ctx.clk.data_ptr(), tma_n_tiles(rows), total,
                        TMA_SHAPE[1] // rows, TMA_SHAPE[2])
    torch.cuda.synchronize()
    offs = torch.from_numpy(tma_word_offsets(layout, stages, rows, grid, total)).cuda()
    words = torch.stack([buf[offs + i].to(torch.int64) for i in range(4)], -1)
    w = (words[..., 0] | (words[..., 1] << 8) | (words[..., 2] << 16) | (words[..., 3] << 24)).cpu().numpy()
    expect = np.bitwise_xor.reduce(w.astype(np.uint32), axis=-1)
    got = out.cpu().numpy().view(np.uint32).reshape(grid, 128)
    return bool((got == expect).all())


def bench_tma(ctx, recs, quick=False):
    from cuflash import _tma

    torch = ctx.torch
    nbytes = TMA_SHAPE[0] * TMA_SHAPE[1] * TMA_SHAPE[2] * TMA_SHAPE[3] * 2
    buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 256)
    copy_tb, _ = (None, None) if quick else ctx.ceilings()
    out = torch.zeros(ctx.sms * 8 * TMA_THREADS, dtype=torch.int32, device="cuda")
    variants = TMA_VARIANTS[1:2] if quick else TMA_VARIANTS
    try:
        for layout in (TMA_LAYOUTS[:1] if quick else TMA_LAYOUTS):
            for stages, rows in variants:
                base_variant = f"[{','.join(layout)}] box 64x{rows}, {stages} stages of {rows * 256 // 1024} KB"
                try:
                    spec = tma_spec(stages, rows)
                    lau = ctx.launcher(spec)
                    if not tma_check(ctx, buf, layout, stages, rows):
                        raise RuntimeError(f"{spec.name}: the words read differ from the tensor's (box coordinates "
                                           f"or swizzle wrong): nothing timed")
                    occ = ctx.max_blocks_per_sm(lau)
                    dims, strides, box = tma_map_args(layout, rows)
                    tmap = _tma.encode_tiled(buf.data_ptr(), "float16", dims, strides, box, swizzle=128)
                except Exception:  # noqa: BLE001
                    recs.append(_err("tma.load", base_variant))
                    continue
                for bpsm in sorted({1, max(1, min(occ or 1, 4))}):
                    variant = f"{base_variant}, {bpsm} CTA/SM"
                    try:
                        if time.time() > ctx.deadline and bpsm > 1:
                            recs.append(_rec("tma.load", variant, "skipped", None, "", note="time limit"))
                            continue
                        grid = ctx.sms * bpsm
                        n_tiles = tma_n_tiles(rows)

                        def make(total, lau=lau, grid=grid, tmap=tmap, n_tiles=n_tiles):
                            return lambda: ctx.launch_with_map(lau, grid, tmap, "=QQqqqq", out.data_ptr(),
                                                               ctx.clk.data_ptr(), n_tiles, total,
                                                               TMA_SHAPE[1] // rows, TMA_SHAPE[2])

                        total, ms = ctx.timed(make, 64, target_ms=1.0 if quick else TARGET_MS, rep=2 if quick else REP)
                        gbs = grid * total * rows * 256 / (ms * 1e-3) / 1e9
                        recs.append(_rec("tma.load", variant, "bandwidth", gbs, "GB/s", HBM_GB_S_PUBLISHED, ms=ms,
                                         kernel=spec.name, _expect=expectations()[spec.name], informs=TMA_INFORMS,
                                         layout=layout, stages=stages, box_rows=rows, ctas_per_sm=bpsm,
                                         bytes_in_flight_per_sm=bpsm * stages * rows * 256, max_ctas_per_sm=occ,
                                         copy_tb_per_s=copy_tb, check="words read match the tensor",
                                         reference="HBM3e data sheet (copy_tb_per_s: device copy, read + write, "
                                                   "this run)"))
                    except Exception:  # noqa: BLE001
                        recs.append(_err("tma.load", variant))
    finally:
        del buf


def bench_mbarrier(ctx, recs, quick=False):
    torch = ctx.torch
    out = torch.zeros(256, dtype=torch.int32, device="cuda")
    items = [(pingpong_spec(p), f"round trip, {p} thread{'s' if p > 1 else ''} per side", p) for p in MBAR_SIDES]
    items.append((SELF_SPEC, "arrive + wait, one thread", 0))
    for spec, variant, p in items:
        try:
            lau = ctx.launcher(spec)
            grid_threads = 256 if p else 32

            def make(iters, lau=lau):
                return lambda: lau.launch((1, 1, 1), ctx.stream, "=QQq", out.data_ptr(), ctx.clk.data_ptr(), iters)

            iters, ms = ctx.timed(make, 64, target_ms=0.5 if quick else 2.0, rep=1 if quick else 3)
            seen = out.cpu().numpy()[:grid_threads]
            if p:
                want = [8 * iters if (i % 128) < p else None for i in range(256)]
                if any(w is not None and s != w for s, w in zip(seen, want)):
                    raise RuntimeError("a side did not finish its round trips")
            t0, t1, _, steps = ctx.clock_rows(1)[0]
            if steps <= 0 or t1 <= t0:
                raise RuntimeError(f"bad clock record {t0} {t1} {steps}")
            recs.append(_rec("mbarrier", variant, "latency", (t1 - t0) / steps, "clk", ms=ms, kernel=spec.name,
                             _expect=expectations()[spec.name], informs=MBAR_INFORMS, threads_per_side=p or 1))
        except Exception:  # noqa: BLE001
            recs.append(_err("mbarrier", variant))


def bulk_check(ctx, lau, src, dst, grid, n_dst, tile_bytes, iters=2) -> bool:
    """A short run: every destination tile holds exactly iters x the sum of its blocks' source tiles (sixteenths
    below 1: the fp32 sums are exact in any order)."""
    torch = ctx.torch
    floats = tile_bytes // 4
    dst[: n_dst * floats].zero_()
    lau.launch((grid, 1, 1), ctx.stream, "=QQQqq", src.data_ptr(), dst.data_ptr(), ctx.clk.data_ptr(), iters, n_dst)
    torch.cuda.synchronize()
    rows = src[: grid * floats].view(grid, floats)
    expect = torch.zeros(n_dst, floats, dtype=torch.float32, device="cuda")
    expect.index_add_(0, torch.arange(grid, device="cuda") % n_dst, rows)
    return bool(torch.equal(dst[: n_dst * floats].view(n_dst, floats), iters * expect))


def bench_bulk_reduce(ctx, recs, quick=False):
    torch = ctx.torch
    max_grid = ctx.sms * max(BULK_BLOCKS_PER_SM)
    src = torch.randint(0, 16, (max_grid * max(BULK_TILES) // 4,), device="cuda").float() / 16
    dst = torch.zeros_like(src)
    try:
        for tile_bytes, wait_done in bulk_configs():
            spec = bulk_spec(tile_bytes, wait_done)
            for bpsm in (BULK_BLOCKS_PER_SM[-1:] if quick else BULK_BLOCKS_PER_SM):
                for dest in BULK_DESTS:
                    grid = ctx.sms * bpsm
                    n_dst = bulk_dests(dest, grid)
                    variant = (f"{tile_bytes // 1024} KB, {bpsm} CTA/SM into {dest} tile{'s' if n_dst > 1 else ''}, "
                               f"{'wait done' if wait_done else 'wait read'}")
                    try:
                        lau = ctx.launcher(spec)
                        if not bulk_check(ctx, lau, src, dst, grid, n_dst, tile_bytes):
                            raise RuntimeError(f"{spec.name}: the destination tiles' sums are wrong: nothing timed")

                        def make(iters, lau=lau, grid=grid, n_dst=n_dst):
                            return lambda: lau.launch((grid, 1, 1), ctx.stream, "=QQQqq", src.data_ptr(),
                                                      dst.data_ptr(), ctx.clk.data_ptr(), iters, n_dst)

                        iters, ms = ctx.timed(make, 16, target_ms=1.0 if quick else 2.0, rep=2 if quick else 3)
                        rows = ctx.clock_rows(grid)
                        clk = sorted((t1 - t0) / steps for t0, t1, _, steps in rows if steps > 0 and t1 > t0)
                        gbs = grid * iters * tile_bytes / (ms * 1e-3) / 1e9
                        recs.append(_rec("bulk.reduce", variant, "bandwidth", gbs, "GB/s", ms=ms, kernel=spec.name,
                                         _expect=expectations()[spec.name], informs=BULK_INFORMS,
                                         tile_bytes=tile_bytes, ctas_per_sm=bpsm, dest_tiles=n_dst,
                                         wait="done" if wait_done else "read",
                                         g_elements_per_s=gbs / 4, clk_per_reduction_median=clk[len(clk) // 2],
                                         check="destination sums exact",
                                         reference="suite micro: red.global.add.v4.f32 of 128 blocks into one "
                                                   "32 KB tile (G elements/s)"))
                    except Exception:  # noqa: BLE001
                        recs.append(_err("bulk.reduce", variant))
    finally:
        del src, dst


def _attach_sass(recs, sass):
    bm._attach_sass(recs, sass, check=lambda info, expect: sass_check90(info, expect or ((), None)))


def _start_background(specs, jobs=None):
    """Parallel compile of every launched kernel (fills the sm_90a cubin cache) and the offline SASS analysis in
    spawned processes. Returns (pool, [sass futures])."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from cuflash.precompile import _compile

    jobs = jobs or max(2, min(16, os.cpu_count() or 2))
    pool = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"))
    futs = [pool.submit(sass_chunk, c) for c in _chunks(all_kernel_names(), max(1, jobs // 2))]
    uniq = list({s.name: s for s in specs}.values())
    try:
        for _ in pool.map(_compile, uniq):
            pass
    except Exception:  # noqa: BLE001 - the benchmark then compiles (and reports) lazily
        traceback.print_exc()
    return pool, futs


def wgmma_ceiling() -> float | None:
    """The wgmma rate of this GPU on random operands in TFLOP/s, measured now (quick: N = 64 and 256, fp16 and bf16, ss and
    rs, one warpgroup point each; the best of them), for benchmarks that report a fraction of it; None when it
    cannot be measured here."""
    import torch

    if torch.cuda.get_device_capability() != (9, 0):
        return None
    ctx = _Ctx(deadline=time.time() + 30.0)
    recs = []
    bench_wgmma_tput(ctx, recs, quick=True)
    rates = [r["value"] for r in recs if r.get("metric") == "TFLOP/s" and r.get("value")]
    return max(rates) if rates else None


def micro90(quick: bool = False) -> list:
    """The suite. quick=True: a few points of each item at short launches (the GPU test's smoke run)."""
    t_start = time.time()
    import torch

    cc = torch.cuda.get_device_capability()
    if cc != (9, 0):
        return [_rec("micro90", "all", "skipped", None, "", note=f"needs sm_90 (sm_90a kernels); device is "
                                                                  f"sm_{cc[0]}{cc[1]}")]
    recs = []
    pool = futs = None
    try:
        pool, futs = _start_background(sweep_specs())
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    print(f"  micro90: kernels ready in {time.time() - t_start:.1f}s", flush=True)
    ctx = _Ctx(deadline=t_start + TIME_LIMIT_S)
    for bench in (bench_wgmma_tput, bench_wgmma_latency, bench_tma, bench_mbarrier, bench_bulk_reduce):
        try:
            bench(ctx, recs, quick)
        except Exception:  # noqa: BLE001 - one broken benchmark must not lose the others
            recs.append(_err("micro90", bench.__name__))
    sass = None
    try:
        sass = merge_sass([f.result(timeout=180) for f in futs]) if futs else sass_analysis()
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        sass = {"status": f"unavailable ({traceback.format_exc(limit=1).strip()[-300:]})", "kernels": {}}
    finally:
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
    _attach_sass(recs, sass)
    bad = [f"{r['name']} {r['variant']}" for r in recs
           if isinstance(r.get("sass"), dict) and r["sass"].get("ok") is False]
    print(f"  micro90: {len(recs)} records in {time.time() - t_start:.1f}s; SASS {sass.get('status')}; "
          f"SASS check failed for: {bad or 'none'}", flush=True)
    return recs


if __name__ == "__main__":
    micro90()
