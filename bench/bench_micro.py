"""Instruction-level microbenchmarks (suite micro): why the attention kernels are shaped the way they are.

Kernels: cuda_src/micro/micro.cu. Every item is measured two ways:
  latency     one warp runs one long dependent chain; clock64 cycles / instructions (cycles per instruction)
  throughput  ILP independent chains per thread x warps per SM, swept until the rate stops growing; work per
              clock per SM from clock64 (a per-SM counter: blocks are grouped by %smid) and work per second for
              the whole GPU from CUDA events (median of REP launches of ~TARGET_MS each)
Every record names the kernel it timed and carries a SASS check of that kernel (the instruction it claims to
measure is there, no local memory), from one offline NVRTC compile of all kernels + `cuobjdump -sass`.

    python -m bench micro --out DIR

micro() -> list of records (harness.record, provider "micro"); sweep_specs() -> every KernelSpec it launches.
"""
from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import dataclass

from cuflash._launch import KernelSpec

FILE = "micro/micro.cu"
LAT_THREADS = 32  # latency: one warp
TPUT_THREADS = 128  # throughput: one warp per SM sub-partition per block
ILPS = (1, 2, 4, 8)  # independent chains per thread (template argument)
BLOCKS_PER_SM = (1, 2, 4, 8)  # x 4 warps = 4..32 warps per SM (run time)
TARGET_MS = 10.0  # length of one timed launch
REP = 5  # timed launches per point (median)
TIME_LIMIT_S = 52.0  # sweeps stop early past this (micro() must stay under a minute)
COUNT_N = 16  # SASS count kernels: <Op, N> and <Op, 2N>
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

# Architectural / published reference values (H200: 132 SMs, 1.98 GHz boost).
MMA_SYNC_ANCHOR_TFLOPS = 647.0  # shared/ANCHORS.md: mma.sync m16n8k16, registers only, measured
MMA_FLOP_PER_CLK_SM = MMA_SYNC_ANCHOR_TFLOPS * 1e12 / (132 * 1.98e9)  # ~2476
MUFU_PER_CLK_SM = 16.0
FP32_PER_CLK_SM = 128.0
SHFL_LANES_PER_CLK_SM = 32.0
SMEM_BYTES_PER_CLK_SM = 128.0
HBM_TB_S_PUBLISHED = 4.8  # H200 HBM3e, data sheet


# ------------------------------------------------------------------------------------------ the items
@dataclass(frozen=True)
class Chain:
    """One dependent-chain item of micro.cu (an `Op` of micro_chain_kernel)."""

    name: str
    variant: str
    op: str  # C++ op type for the throughput sweep
    lat_op: str  # C++ op type for the latency chain and the SASS count
    work: float  # work per warp-step (one warp-wide instruction or call)
    unit: str  # unit of work
    ref_per_clk: float  # architectural work / clock / SM
    expect: tuple  # SASS opcodes (regex, full match) that must be present
    p0: float = 0.0
    p1: float = 0.0
    count: bool = False  # report SASS instructions per step


def _ns(t: str) -> str:
    return f"cuflash::{t}"


SCALE_LOG2 = LOG2E / 8.0  # softmax_scale * log2(e) at head dim 64
ROW_MAX = 3.0
EXP_FUNCS = (  # (variant, C++ functor, base-2 input?, documented max error in units of 2^-23 relative, doc)
    ("ex2.approx.ftz.f32", "MicroEx2Approx", True, 2.0, "PTX ISA ex2.approx.f32: max rel. error 2^-22"),
    ("exp2f", "MicroExp2f", True, 2.0, "CUDA math: exp2f 2 ulp"),
    ("__expf", "MicroExpFast", False, 2.0 + int(1.173 * 30 * LN2), "CUDA math: __expf 2 + floor(|1.173 x|) ulp"),
    ("expf", "MicroExpf", False, 2.0, "CUDA math: expf 2 ulp"),
)

CHAIN_ITEMS = (
    Chain("mma.m16n8k16", "f16 x f16 -> f32", _ns("MicroMmaF32<__half>"), _ns("MicroMmaF32<__half>"), 4096.0,
          "FLOP", MMA_FLOP_PER_CLK_SM, (r"HMMA\.16816\.F32",), p0=1.0 / 16),
    Chain("mma.m16n8k16", "bf16 x bf16 -> f32", _ns("MicroMmaF32<__nv_bfloat16>"), _ns("MicroMmaF32<__nv_bfloat16>"),
          4096.0, "FLOP", MMA_FLOP_PER_CLK_SM, (r"HMMA\.16816\.F32\.BF16",), p0=1.0 / 16),
    Chain("mma.m16n8k16", "f16 x f16 -> f16", _ns("MicroMmaF16Acc"), _ns("MicroMmaF16Acc"), 4096.0, "FLOP",
          MMA_FLOP_PER_CLK_SM, (r"HMMA\.16816\.F16",), p0=1.0 / 16),
    *(Chain("exp", v, _ns(f"MicroExp<cuflash::{f}, true>"), _ns(f"MicroExp<cuflash::{f}, false>"), 32.0, "calls",
            MUFU_PER_CLK_SM, (r"MUFU\.EX2",), count=True) for v, f, _, _, _ in EXP_FUNCS),
    Chain("tanh", "tanh.approx.f32", _ns("MicroTanh"), _ns("MicroTanh"), 32.0, "calls", MUFU_PER_CLK_SM,
          (r"MUFU\.TANH",), count=True),
    Chain("tanh", "soft-capped score: tanh.approx + FFMA + ex2.approx", _ns("MicroCapExp"), _ns("MicroCapExp"), 32.0,
          "scores", MUFU_PER_CLK_SM / 2, (r"MUFU\.TANH", r"MUFU\.EX2", r"FFMA(\.\w+)*"), p0=2.0 * LOG2E,
          p1=2.0 * LOG2E, count=True),
    Chain("scale_fold", "(s - m) * scale: FADD + FMUL", _ns("MicroScaleUnfolded"), _ns("MicroScaleUnfolded"), 32.0,
          "ops", FP32_PER_CLK_SM / 2, (r"FADD(\.\w+)*", r"FMUL(\.\w+)*"), p0=SCALE_LOG2, p1=ROW_MAX, count=True),
    Chain("scale_fold", "s * scale - m*scale: FFMA", _ns("MicroScaleFolded"), _ns("MicroScaleFolded"), 32.0, "ops",
          FP32_PER_CLK_SM, (r"FFMA(\.\w+)*",), p0=SCALE_LOG2, p1=ROW_MAX * SCALE_LOG2, count=True),
    Chain("shfl", "shfl.sync.bfly", _ns("MicroShflBfly"), _ns("MicroShflBfly"), 32.0, "lanes",
          SHFL_LANES_PER_CLK_SM, (r"SHFL\.BFLY",), count=True),
    Chain("shfl", "quad_max (2 SHFL + 2 FMNMX)", _ns("MicroQuadMax"), _ns("MicroQuadMax"), 32.0, "calls",
          SHFL_LANES_PER_CLK_SM / 2, (r"SHFL\.BFLY", r"FMNMX(\.\w+)*"), count=True),
)

# ldmatrix: (X, trans) for latency; (X, trans, LDS) for bandwidth. LDS = K-tile row length in halves.
LDSM_LATENCY = ((1, False), (2, False), (4, False), (1, True), (2, True), (4, True))
LDSM_BANDWIDTH = ((4, False, 136), (4, True, 136), (2, False, 136), (1, False, 136), (4, False, 128), (4, True, 128))

# global -> shared copies: ("cp.async", STAGES) or ("ldg", U)
COPY_THREADS = 256
COPY_VARIANTS = (("cp.async", 2), ("cp.async", 4), ("ldg", 4), ("ldg", 8), ("ldg", 16))
COPY_BUFFER_BYTES = 1 << 30

# atomics: (variant, C++ op, elements per instruction, bytes per element, sm_90 only, SASS regex)
ATOMIC_THREADS = 256
ATOMIC_BLOCKS = 128
ATOMIC_TILE = 64 * 128
ATOMIC_OPS = (
    ("st.global.v4.f32 (plain store)", "MicroStoreV4", 4, 4, False, r"STG\.E\.128(\.\w+)*"),  # the reference
    ("st.global.f32 (plain store)", "MicroStoreF32", 1, 4, False, r"STG\.E(\.STRONG\.\w+)?"),
    ("atomicAdd f32, result used (ATOM)", "MicroAtomAddF32", 1, 4, False, r"ATOMG?\.E\.ADD\.F32(\.\w+)*"),
    ("red.global.add.f32", "MicroRedF32", 1, 4, False, r"REDG?\.E\.ADD\.F32(\.\w+)*"),
    ("red.global.add.v2.f32", "MicroRedV2F32", 2, 4, True, r"REDG?\.E\.ADD\.F32x2(\.\w+)*"),
    ("red.global.add.v4.f32", "MicroRedV4F32", 4, 4, True, r"REDG?\.E\.ADD\.F32x4(\.\w+)*"),
    ("atomicAdd(__half2*)", "MicroAtomAddF16x2", 2, 2, False, r"(ATOM|RED)G?\.E\.ADD\.F16x2(\.\w+)*"),
    ("atomicAdd(__nv_bfloat162*)", "MicroAtomAddBf16x2", 2, 2, True, r"(ATOM|RED)G?\.E\.ADD\.BF16x2(\.\w+)*"),
    ("red.global.add.noftz.f16x2", "MicroRedF16x2", 2, 2, False, r"REDG?\.E\.ADD\.F16x2(\.\w+)*"),
    ("red.global.add.noftz.bf16x2", "MicroRedBf16x2", 2, 2, True, r"REDG?\.E\.ADD\.BF16x2(\.\w+)*"),
)
ATOMIC_PATTERNS = (("one tile, all blocks (dQ)", 0), ("own tile per block", ATOMIC_TILE))


# ------------------------------------------------------------------------------------------ kernel specs
def chain_name(op: str, ilp: int) -> str:
    return f"cuflash::micro_chain_kernel<{op}, {ilp}>"


def count_name(op: str, n: int) -> str:
    return f"cuflash::micro_count_kernel<{op}, {n}>"


def ldsm_latency_name(x: int, trans: bool) -> str:
    return f"cuflash::micro_ldsm_latency_kernel<{x}, {str(trans).lower()}>"


def ldsm_bandwidth_name(x: int, trans: bool, lds: int) -> str:
    return f"cuflash::micro_ldsm_tput_kernel<{x}, {str(trans).lower()}, {lds}>"


def copy_spec(kind: str, k: int) -> KernelSpec:
    if kind == "cp.async":  # k = STAGES, 4 chunks of 16 B per thread per stage
        return KernelSpec(FILE, f"cuflash::micro_copy_cp_async_kernel<{k}>", COPY_THREADS, k * 4 * COPY_THREADS * 16)
    return KernelSpec(FILE, f"cuflash::micro_copy_ldg_kernel<{k}>", COPY_THREADS, k * COPY_THREADS * 16)


def atomic_spec(op: str) -> KernelSpec:
    return KernelSpec(FILE, f"cuflash::micro_atomic_kernel<cuflash::{op}>", ATOMIC_THREADS, 0)


def exp_eval_spec(func: str) -> KernelSpec:
    return KernelSpec(FILE, f"cuflash::micro_exp_eval_kernel<cuflash::{func}>", 256, 0)


def ldsm_expect(x: int, trans: bool) -> tuple:
    return (r"LDSM\.16\.M%s88%s" % ("T" if trans else "", "" if x == 1 else rf"\.{x}"),)


def copy_expect(kind: str) -> tuple:
    return (r"LDGSTS(\.\w+)*",) if kind == "cp.async" else (r"LDG\.E\.128(\.\w+)*", r"STS\.128")


EXP_EVAL_EXPECT = (r"MUFU\.EX2",)


def expectations() -> dict:
    """{kernel name: SASS opcode regexes its benchmark claims to measure} for every launched kernel."""
    exp = {}
    for it in CHAIN_ITEMS:
        exp[chain_name(it.lat_op, 1)] = it.expect
        for ilp in ILPS:
            exp[chain_name(it.op, ilp)] = it.expect
    for x, t in LDSM_LATENCY:
        exp[ldsm_latency_name(x, t)] = ldsm_expect(x, t)
    for x, t, lds in LDSM_BANDWIDTH:
        exp[ldsm_bandwidth_name(x, t, lds)] = ldsm_expect(x, t)
    for kind, k in COPY_VARIANTS:
        exp[copy_spec(kind, k).name] = copy_expect(kind)
    for _, op, _, _, _, pat in ATOMIC_OPS:
        exp[atomic_spec(op).name] = (pat,)
    for f in EXP_FUNCS:
        exp[exp_eval_spec(f[1]).name] = EXP_EVAL_EXPECT
    return exp


def _dedupe(specs):
    seen, out = set(), []
    for s in specs:
        if s not in seen:
            seen.add(s)
            out.append(s)
    return out


def sweep_specs() -> list:
    """Every KernelSpec micro() launches (for parallel precompilation)."""
    specs = []
    for it in CHAIN_ITEMS:
        specs.append(KernelSpec(FILE, chain_name(it.lat_op, 1), LAT_THREADS, 0))
        specs += [KernelSpec(FILE, chain_name(it.op, ilp), TPUT_THREADS, 0) for ilp in ILPS]
    specs += [KernelSpec(FILE, ldsm_latency_name(x, t), LAT_THREADS, 0) for x, t in LDSM_LATENCY]
    specs += [KernelSpec(FILE, ldsm_bandwidth_name(x, t, l), TPUT_THREADS, 0) for x, t, l in LDSM_BANDWIDTH]
    specs += [copy_spec(kind, k) for kind, k in COPY_VARIANTS]
    specs += [atomic_spec(op[1]) for op in ATOMIC_OPS]
    specs += [exp_eval_spec(f[1]) for f in EXP_FUNCS]
    return _dedupe(specs)


def count_specs() -> list:
    """Compiled for their SASS only (never launched): straight-line chains of N and 2N steps."""
    return [KernelSpec(FILE, count_name(it.lat_op, n), LAT_THREADS, 0) for it in CHAIN_ITEMS if it.count
            for n in (COUNT_N, 2 * COUNT_N)]


def sm90_only(spec: KernelSpec) -> bool:
    """Kernels whose instruction exists only on sm_90+ (micro.cu compiles a scalar fallback below that)."""
    return any(op in spec.name for _, op, _, _, sm90, _ in ATOMIC_OPS if sm90)


def all_kernel_names() -> list:
    return list(dict.fromkeys(s.name for s in sweep_specs() + count_specs()))


# ------------------------------------------------------------------------------------------ SASS (no GPU)
_SASS_INSTR = re.compile(r"^\s*/\*[0-9a-fA-F]{4,}\*/\s+(.*?)\s*;")
_SASS_FUNC = re.compile(r"Function\s*:\s*(\S+)")


def parse_sass(text: str) -> dict:
    """`cuobjdump -sass` text -> {mangled function name: [opcode with modifiers, in order]}. Guard predicates
    are dropped; an instruction guarded by a never-true predicate (@!PT, @!UPT) counts as a NOP."""
    funcs, cur = {}, None
    for line in text.splitlines():
        m = _SASS_FUNC.search(line)
        if m:
            cur = funcs.setdefault(m.group(1), [])
            continue
        m = _SASS_INSTR.match(line) if cur is not None else None
        if m:
            toks = m.group(1).split()
            if toks and toks[0] in ("@!PT", "@!UPT"):  # never executes: ptxas' scheduling filler
                toks = ["NOP"]
            elif toks and toks[0].startswith("@"):
                toks = toks[1:]
            if toks:
                cur.append(toks[0])
    return funcs


def sass_check(opcodes, expect) -> dict:
    """Are the expected opcodes (regex, full match) present, and is local memory (LDL/STL) absent?"""
    if opcodes is None:
        return {"status": "unavailable"}
    found = {p: sorted({o for o in opcodes if re.fullmatch(p, o)}) for p in expect}
    missing = [p for p, ops in found.items() if not ops]
    local = sorted({o for o in opcodes if o.split(".")[0] in ("LDL", "STL")})
    return {"ok": not missing and not local, "found": found, "missing": missing, "local_memory": local,
            "instructions": len(opcodes)}


def per_step_mix(ops_n, ops_2n, n: int):
    """SASS instructions (total and by opcode) of one step: (kernel with 2n steps - kernel with n steps) / n."""
    c1 = Counter(o for o in ops_n if o != "NOP")
    c2 = Counter(o for o in ops_2n if o != "NOP")
    mix = {k: (c2[k] - c1[k]) / n for k in sorted(set(c1) | set(c2)) if c2[k] != c1[k]}
    return (sum(c2.values()) - sum(c1.values())) / n, mix


def fix_cubin(b: bytes) -> bytes:
    """CuPy 14's nvrtc.getCUBIN drops the last byte of the ELF (nvrtcGetCUBINSize says one more), and cuobjdump
    then refuses the file. Pad with zeros up to the end the ELF64 header declares (the cut byte is the top byte
    of the last program header's alignment, always 0)."""
    if len(b) < 64 or b[:4] != b"\x7fELF" or b[4] != 2:
        return b
    phoff, shoff = struct.unpack_from("<QQ", b, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", b, 0x36)
    end = max(phoff + phentsize * phnum, shoff + shentsize * shnum)
    if len(b) < end <= len(b) + 64:
        b = b + bytes(end - len(b))
    return b


def find_cuobjdump():
    """(path to cuobjdump, extra PATH entries so it finds nvdisasm) or None."""
    extra = []
    try:
        import nvidia

        for base in nvidia.__path__:
            for sub in ("cu13/bin", "cuda_nvdisasm/bin", "cuda_cuobjdump/bin", "cu12/bin"):
                if os.path.isdir(os.path.join(base, sub)):
                    extra.append(os.path.join(base, sub))
    except ImportError:
        pass
    for d in (os.environ.get("CUDA_PATH", ""), os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"):
        if d and os.path.isdir(os.path.join(d, "bin")):
            extra.append(os.path.join(d, "bin"))
    path = shutil.which("cuobjdump")
    if path is None:
        for d in extra:
            if os.path.isfile(os.path.join(d, "cuobjdump")):
                path = os.path.join(d, "cuobjdump")
                break
    return (path, extra) if path else None


def cubin_sass(cubin: bytes) -> tuple:
    """(cuobjdump -sass text, "ok") of a cubin from cuflash._loader.compile_offline, or (None, why not)."""
    tool = find_cuobjdump()
    if tool is None:
        return None, "unavailable (no cuobjdump)"
    path, extra = tool
    env = dict(os.environ, PATH=os.pathsep.join([os.environ.get("PATH", "")] + extra))
    with tempfile.TemporaryDirectory() as d:
        f = os.path.join(d, "k.cubin")
        with open(f, "wb") as fh:
            fh.write(fix_cubin(cubin))
        p = subprocess.run([path, "-sass", f], capture_output=True, text=True, timeout=300, env=env)
    if p.returncode != 0 or "Function" not in p.stdout:
        return None, f"unavailable (cuobjdump rc={p.returncode}: {p.stderr.strip()[-300:]})"
    return p.stdout, "ok"


def sass_analysis(arch: int = 90, names=None) -> dict:
    """One offline compile of all micro kernels for sm_<arch>: ptxas resources and, when cuobjdump is
    available, each kernel's opcode list. {"status", "kernels": {name: {regs, stack, spill_st, spill_ld,
    lowered, opcodes (list or None)}}}."""
    from cuflash import _loader

    names = list(names or all_kernel_names())
    res = _loader.compile_offline(FILE, names, arch)
    kernels = {n: dict(info, opcodes=None) for n, info in res["kernels"].items()}
    sass, status = cubin_sass(res["cubin"])
    if sass is None:
        return {"status": status, "kernels": kernels}
    funcs = parse_sass(sass)
    for info in kernels.values():
        info["opcodes"] = funcs.get(info["lowered"])
    return {"status": "ok", "kernels": kernels}


# ------------------------------------------------------------------------------------------ pure helpers
def sm_rate(rows, work_per_block_step: float):
    """rows: per block (t0, t1, smid, steps) from micro_record_clock. Returns (work per clock per SM, mean
    cycles per SM, SMs seen). Clocks are compared only within one SM (clock64 is per SM); an SM's span is
    max(t1) - min(t0) over its blocks; the result is the mean over SMs of work / span."""
    per_sm = {}
    for t0, t1, sm, steps in rows:
        if steps <= 0 or t1 <= t0:
            continue
        a = per_sm.setdefault(int(sm), [t0, t1, 0.0])
        a[0], a[1] = min(a[0], t0), max(a[1], t1)
        a[2] += steps * work_per_block_step
    if not per_sm:
        raise RuntimeError("no block recorded a valid clock interval")
    rates = [w / (t1 - t0) for t0, t1, w in per_sm.values()]
    spans = [t1 - t0 for t0, t1, _ in per_sm.values()]
    return sum(rates) / len(rates), sum(spans) / len(spans), len(per_sm)


def exp_errors(out, ref):
    """Max relative error, max error in ulps of the fp32 result, and the index of the worst relative error."""
    import numpy as np

    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    err = np.abs(out - ref)
    rel = err / ref
    ulp = err / np.spacing(ref.astype(np.float32)).astype(np.float64)
    i = int(np.argmax(rel))
    return float(rel[i]), float(np.max(ulp)), i


def ldsm_chain_tile(trans: bool, base: int, row_bytes: int):
    """The 8x8 16-bit matrix 0 micro_ldsm_latency_kernel stores (mirror of micro_ldsm_chain_half)."""
    tile = [[0] * 8 for _ in range(8)]
    for row in range(8):
        for col in range(8):
            lane = 4 * col + row // 2 if trans else 4 * row + col // 2
            hi = (row & 1) if trans else (col & 1)
            a = base + lane * row_bytes
            tile[row][col] = (a >> 16) if hi else (a & 0xFFFF)
    return tile


def ldmatrix_r0(tile, trans: bool):
    """r[0] of every lane for an 8x8 b16 matrix (PTX ldmatrix fragment layout), low half = first element."""
    r = []
    for lane in range(32):
        g, t = lane // 4, lane % 4
        lo, hi = (tile[2 * t][g], tile[2 * t + 1][g]) if trans else (tile[g][2 * t], tile[g][2 * t + 1])
        r.append(lo | (hi << 16))
    return r


# ------------------------------------------------------------------------------------------ GPU side
def _rec(name, variant, metric, value, unit, ref=None, ms=None, dtype="", **extra):
    from .harness import record

    frac = value / ref if (value is not None and ref) else None
    r = record("micro", name, "micro", dtype, 0, 0, 0, 0, 0, False, ms, name=name, variant=variant, metric=metric,
               value=value, unit=unit, reference_value=ref, fraction=frac, **extra)
    v = "-" if value is None else f"{value:.4g}"
    rf = "" if ref is None else f"  ref {ref:.4g}"
    fr = "" if frac is None else f"  ({frac:.2f})"
    print(f"  {name:18s} {variant:36s} {metric:22s} {v:>10s} {unit}{rf}{fr}", flush=True)
    return r


def _err(name, variant, where="") -> dict:
    tb = traceback.format_exc()
    print(f"  {name} {variant}: FAILED {where}\n{tb[-800:]}", flush=True)
    r = _rec(name, variant, "error", None, "")
    r["error"] = tb[-2000:]
    return r


class _Ctx:
    """Device facts, shared scratch buffers, the stream, timing helpers."""

    def __init__(self, deadline: float):
        import torch

        self.torch = torch
        self.deadline = deadline
        self.dev = torch.cuda.current_device()
        p = torch.cuda.get_device_properties(self.dev)
        self.sms = p.multi_processor_count
        self.cc = p.major * 10 + p.minor
        self.stream = torch.cuda.current_stream().cuda_stream
        n_out = max(self.sms * 16, ATOMIC_BLOCKS, 64) * 256
        self.out = torch.zeros(n_out, dtype=torch.float32, device="cuda")
        self.clk = torch.zeros(self.sms * 16 * 4, dtype=torch.int64, device="cuda")
        self._ceilings = None

    def launcher(self, spec):
        from cuflash._launch import get_launcher

        return get_launcher(spec, self.dev)

    def max_blocks_per_sm(self, lau):
        try:
            from cupy.cuda import driver

            return int(driver.occupancyMaxActiveBlocksPerMultiprocessor(lau.ptr, lau.threads, lau.smem))
        except Exception:  # noqa: BLE001 - unknown: do not skip anything
            return None

    def clock_rows(self, blocks):
        return self.clk[: 4 * blocks].view(blocks, 4).tolist()

    def once_ms(self, fn) -> float:
        torch = self.torch
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        return s.elapsed_time(e)

    def timed(self, make, iters0: int, target_ms: float = TARGET_MS, rep: int = REP):
        """make(iters) -> a launch. Scale iters until one launch takes ~target_ms, then the median of `rep`."""
        from .harness import time_ms

        iters = max(1, int(iters0))
        make(iters)()  # first launch: module load, caches
        self.torch.cuda.synchronize()
        t = self.once_ms(make(iters))
        for _ in range(8):
            if t >= 0.2 * target_ms:
                break
            iters = int(iters * min(100.0, max(2.0, 0.5 * target_ms / max(t, 1e-3))))
            t = self.once_ms(make(iters))
        iters = max(1, min(int(iters * target_ms / max(t, 1e-3)), 1 << 40))
        return iters, time_ms(make(iters), warmup=0, rep=rep, min_warmup_ms=0.0)

    def ceilings(self):
        """(copy TB/s, cuBLAS bf16 TFLOP/s) measured in this run by harness.measure_ceilings()."""
        if self._ceilings is None:
            from .harness import measure_ceilings

            copy = mm = None
            try:
                for r in measure_ceilings():
                    if r.get("algo") == "copy":
                        copy = r.get("tb_per_s")
                    elif str(r.get("algo", "")).startswith("cublas"):
                        mm = r.get("tflops")
            except Exception:  # noqa: BLE001 - references only: the benchmarks still run
                traceback.print_exc()
            self._ceilings = (copy, mm)
            print(f"  ceilings: copy {copy} TB/s, cuBLAS bf16 {mm} TFLOP/s", flush=True)
        return self._ceilings


# ---------------------------------------------------------------------------- dependent chains (1, 4, 5, 7)
def _chain_latency(ctx, it: Chain):
    spec = KernelSpec(FILE, chain_name(it.lat_op, 1), LAT_THREADS, 0)
    lau = ctx.launcher(spec)
    fmt = "=QQqf4xf4x"
    out, clk = ctx.out.data_ptr(), ctx.clk.data_ptr()

    def make(iters):
        return lambda: lau.launch((1, 1, 1), ctx.stream, fmt, out, clk, iters, it.p0, it.p1)

    _, ms = ctx.timed(make, 64, target_ms=3.0, rep=3)
    t0, t1, _, steps = ctx.clock_rows(1)[0]
    if steps <= 0 or t1 <= t0:
        raise RuntimeError(f"bad clock record {t0} {t1} {steps}")
    return (t1 - t0) / steps, ms, spec.name


def _chain_point(ctx, it: Chain, ilp: int, bpsm: int, lau):
    grid = ctx.sms * bpsm
    fmt = "=QQqf4xf4x"
    out, clk = ctx.out.data_ptr(), ctx.clk.data_ptr()

    def make(iters):
        return lambda: lau.launch((grid, 1, 1), ctx.stream, fmt, out, clk, iters, it.p0, it.p1)

    iters, ms = ctx.timed(make, 16)
    rows = ctx.clock_rows(grid)
    warps = TPUT_THREADS // 32
    per_clk, span, nsm = sm_rate(rows, warps * it.work)
    total = sum(r[3] for r in rows) * warps * it.work
    return dict(ilp=ilp, warps_per_sm=bpsm * warps, iters=iters, ms=ms, per_clk_sm=per_clk, per_s=total / (ms * 1e-3),
                clock_ghz=span / (ms * 1e6), sms_seen=nsm)


def _sweep(ctx, point, ilps, bpsms, lau_of):
    """Run point(ilp, bpsm) over ilps x bpsms; within one ilp stop once more warps add < 3%."""
    pts, skipped = [], []
    for ilp in ilps:
        lau = lau_of(ilp)
        occ = ctx.max_blocks_per_sm(lau)
        row_best = 0.0
        for bpsm in bpsms:
            if occ is not None and bpsm > occ:
                skipped.append(dict(ilp=ilp, blocks_per_sm=bpsm, reason=f"occupancy {occ} blocks/SM"))
                break
            if time.time() > ctx.deadline and pts:
                skipped.append(dict(ilp=ilp, blocks_per_sm=bpsm, reason="time limit"))
                break
            p = point(ilp, bpsm, lau)
            pts.append(p)
            if p["per_clk_sm"] < 1.03 * row_best:
                break
            row_best = max(row_best, p["per_clk_sm"])
    if not pts:
        raise RuntimeError(f"no point measured: {skipped}")
    return max(pts, key=lambda p: p["per_clk_sm"]), pts, skipped


def _compact(pts):
    keys = ("ilp", "warps_per_sm", "per_clk_sm", "per_s", "ms", "clock_ghz")
    return [{k: (round(p[k], 4) if isinstance(p[k], float) else p[k]) for k in keys if k in p} for p in pts]


def bench_chains(ctx, recs, items=CHAIN_ITEMS):
    for it in items:
        try:
            lat, ms, kname = _chain_latency(ctx, it)
            recs.append(_rec(it.name, it.variant, "latency", lat, "clk", ms=ms, kernel=kname, _expect=it.expect))
        except Exception:  # noqa: BLE001
            recs.append(_err(it.name, it.variant, "latency"))
        try:
            def lau_of(ilp, it=it):
                return ctx.launcher(KernelSpec(FILE, chain_name(it.op, ilp), TPUT_THREADS, 0))

            best, pts, skipped = _sweep(ctx, lambda i, b, lau, it=it: _chain_point(ctx, it, i, b, lau), ILPS,
                                        BLOCKS_PER_SM, lau_of)
            kname = chain_name(it.op, best["ilp"])
            common = dict(kernel=kname, _expect=it.expect, best_ilp=best["ilp"], best_warps_per_sm=best["warps_per_sm"],
                          clock_ghz=best["clock_ghz"], sweep=_compact(pts), skipped=skipped)
            recs.append(_rec(it.name, it.variant, "throughput", best["per_clk_sm"], f"{it.unit}/clk/SM",
                             it.ref_per_clk, ms=best["ms"], **common))
            if it.unit == "FLOP":
                _, cublas = ctx.ceilings()
                recs.append(_rec(it.name, it.variant, "TFLOP/s", best["per_s"] / 1e12, "TFLOP/s", cublas,
                                 ms=best["ms"], reference="cuBLAS bf16 8192^3 (this run)",
                                 mma_sync_anchor_tflops=MMA_SYNC_ANCHOR_TFLOPS, kernel=kname, _expect=it.expect))
            else:
                ref = it.ref_per_clk * ctx.sms * best["clock_ghz"]  # at the clock this run measured
                recs.append(_rec(it.name, it.variant, "rate", best["per_s"] / 1e9, f"G{it.unit}/s", ref,
                                 ms=best["ms"], kernel=kname, _expect=it.expect))
        except Exception:  # noqa: BLE001
            recs.append(_err(it.name, it.variant, "throughput"))


def bench_exp_accuracy(ctx, recs):
    """Max error against float64 over the softmax's input range: 2^x, x in [-30, 0] (base-2 functions) or
    e^y with y = fp32(x ln 2) (base-e functions), same inputs for all, reference from numpy."""
    import numpy as np

    torch = ctx.torch
    n = 1 << 22
    rng = np.random.default_rng(0)
    x = rng.uniform(-30.0, 0.0, n).astype(np.float32)
    x[:3] = (-30.0, 0.0, -1.0)
    y = (x.astype(np.float64) * LN2).astype(np.float32)
    refs = {True: np.exp2(x.astype(np.float64)), False: np.exp(y.astype(np.float64))}
    xin = {True: torch.from_numpy(x).cuda(), False: torch.from_numpy(y).cuda()}
    res = torch.empty(n, dtype=torch.float32, device="cuda")
    for variant, func, base2, bound_ulp, doc in EXP_FUNCS:
        try:
            spec = exp_eval_spec(func)
            lau = ctx.launcher(spec)
            res.fill_(float("nan"))
            lau.launch((ctx.sms * 4, 1, 1), ctx.stream, "=QQq", xin[base2].data_ptr(), res.data_ptr(), n)
            torch.cuda.synchronize()
            rel, ulp, i = exp_errors(res.cpu().numpy(), refs[base2])
            worst_in = float(x[i]) if base2 else float(y[i])
            # value in units of 1e-7 so that the report table shows digits
            recs.append(_rec("exp", variant, "max_rel_err", rel * 1e7, "1e-7 (relative)", bound_ulp * 2.0 ** -23 * 1e7,
                             kernel=spec.name, _expect=EXP_EVAL_EXPECT, max_rel_err_raw=rel, max_ulp_err=ulp,
                             worst_input=worst_in,
                             input=("x in [-30, 0], 2^x" if base2 else "y = x ln2, e^y"), bound=doc))
        except Exception:  # noqa: BLE001
            recs.append(_err("exp", variant, "accuracy"))


# ---------------------------------------------------------------------------------------------- ldmatrix (2)
def bench_ldmatrix(ctx, recs):
    out, clk = ctx.out.data_ptr(), ctx.clk.data_ptr()
    for x, trans in LDSM_LATENCY:
        variant = f"x{x}{'.trans' if trans else ''}"
        try:
            spec = KernelSpec(FILE, ldsm_latency_name(x, trans), LAT_THREADS, 0)
            lau = ctx.launcher(spec)

            def make(iters, lau=lau):
                return lambda: lau.launch((1, 1, 1), ctx.stream, "=QQq", out, clk, iters)

            _, ms = ctx.timed(make, 64, target_ms=3.0, rep=3)
            chk = ctx.out[:32].view(ctx.torch.int32).tolist()
            if any(c == 0xDEADBEEF - (1 << 32) for c in chk):
                raise RuntimeError("ldmatrix chain layout mismatch: the kernel timed nothing")
            t0, t1, _, steps = ctx.clock_rows(1)[0]
            if steps <= 0 or t1 <= t0:
                raise RuntimeError(f"bad clock record {t0} {t1} {steps}")
            recs.append(_rec("ldmatrix", variant, "latency", (t1 - t0) / steps, "clk", ms=ms, kernel=spec.name,
                             _expect=ldsm_expect(x, trans), chain_ok=all(c == 0 for c in chk)))
        except Exception:  # noqa: BLE001
            recs.append(_err("ldmatrix", variant, "latency"))
    for x, trans, lds in LDSM_BANDWIDTH:
        padded = lds != 128
        variant = f"x{x}{'.trans' if trans else ''}, rows {'padded +8' if padded else 'unpadded'} (LDS={lds})"
        name = "smem_K_tile" if x == 4 else "ldmatrix"  # x4: the padded / unpadded K-tile pair
        try:
            spec = KernelSpec(FILE, ldsm_bandwidth_name(x, trans, lds), TPUT_THREADS, 0)
            lau = ctx.launcher(spec)
            try:  # as much shared memory per SM as the hardware allows
                lau.raw.preferred_shared_memory_carveout = 100
            except Exception:  # noqa: BLE001
                pass

            def point(ilp, bpsm, lau, x=x):
                grid = ctx.sms * bpsm

                def make(iters):
                    return lambda: lau.launch((grid, 1, 1), ctx.stream, "=QQq", out, clk, iters)

                iters, ms = ctx.timed(make, 16)
                rows = ctx.clock_rows(grid)
                warps = TPUT_THREADS // 32
                per_clk, span, nsm = sm_rate(rows, warps * x * 128)
                total = sum(r[3] for r in rows) * warps * x * 128
                return dict(ilp=32, warps_per_sm=bpsm * warps, iters=iters, ms=ms, per_clk_sm=per_clk,
                            per_s=total / (ms * 1e-3), clock_ghz=span / (ms * 1e6), sms_seen=nsm)

            best, pts, skipped = _sweep(ctx, point, (32,), BLOCKS_PER_SM, lambda ilp: lau)
            recs.append(_rec(name, variant, "bandwidth", best["per_clk_sm"], "B/clk/SM", SMEM_BYTES_PER_CLK_SM,
                             ms=best["ms"], kernel=spec.name, _expect=ldsm_expect(x, trans),
                             tb_per_s=best["per_s"] / 1e12,
                             best_warps_per_sm=best["warps_per_sm"], sweep=_compact(pts), skipped=skipped))
        except Exception:  # noqa: BLE001
            recs.append(_err(name, variant, "bandwidth"))


# ------------------------------------------------------------------------------------------- copies (3)
def bench_copy(ctx, recs):
    """Each variant at 1 block (256 threads) per SM, the occupancy of the attention kernels, and at the most
    blocks per SM that fit (capped at 8)."""
    torch = ctx.torch
    src = torch.empty(COPY_BUFFER_BYTES, dtype=torch.uint8, device="cuda").random_(1, 255)
    copy_tb, _ = ctx.ceilings()
    ref = copy_tb * 1000 if copy_tb else None
    out, clk = ctx.out.data_ptr(), ctx.clk.data_ptr()
    try:
        for kind, k in COPY_VARIANTS:
            variant = (f"cp.async.cg 16 B, {k} stages" if kind == "cp.async" else
                       f"ld.global.v4 -> st.shared, {k} / thread")
            try:
                spec = copy_spec(kind, k)
                lau = ctx.launcher(spec)
                try:
                    lau.raw.preferred_shared_memory_carveout = 100
                except Exception:  # noqa: BLE001
                    pass
                occ = ctx.max_blocks_per_sm(lau)
                chunks = 4 if kind == "cp.async" else k  # 16-byte chunks per thread per tile
                tile_bytes = chunks * COPY_THREADS * 16
                in_flight = COPY_THREADS * 16 * chunks * (k if kind == "cp.async" else 1)  # bytes per block
            except Exception:  # noqa: BLE001
                recs.append(_err("global->smem", variant))
                continue
            for bpsm in sorted({1, max(1, min(occ or 2, 8))}):
                try:
                    grid = ctx.sms * bpsm
                    n_tiles = (COPY_BUFFER_BYTES // tile_bytes) // grid * grid
                    if n_tiles < grid:
                        raise RuntimeError("buffer too small for the grid")

                    def make(total, lau=lau, grid=grid, n_tiles=n_tiles):
                        return lambda: lau.launch((grid, 1, 1), ctx.stream, "=QQQqq", src.data_ptr(), out, clk,
                                                  n_tiles, total)

                    total, ms = ctx.timed(make, n_tiles // grid)
                    gbs = grid * total * tile_bytes / (ms * 1e-3) / 1e9
                    recs.append(_rec("global->smem", f"{variant}, {bpsm} blk/SM", "bandwidth", gbs, "GB/s", ref, ms=ms,
                                     kernel=spec.name, _expect=copy_expect(kind), blocks_per_sm=bpsm,
                                     bytes_in_flight_per_sm=bpsm * in_flight, max_blocks_per_sm=occ,
                                     reference="device copy, read + write (this run)",
                                     hbm_published_tb_s=HBM_TB_S_PUBLISHED))
                except Exception:  # noqa: BLE001
                    recs.append(_err("global->smem", f"{variant}, {bpsm} blk/SM"))
    finally:
        del src


# ------------------------------------------------------------------------------------------ atomics (6)
def bench_atomics(ctx, recs):
    torch = ctx.torch
    dst = torch.zeros(ATOMIC_BLOCKS * ATOMIC_TILE, dtype=torch.float32, device="cuda")
    out = ctx.out.data_ptr()
    rates = {}
    for pattern, stride in ATOMIC_PATTERNS:
        for variant, op, elems, nbytes, sm90, pat in ATOMIC_OPS:
            if sm90 and ctx.cc < 90:
                recs.append(_rec("atomics", f"{variant} | {pattern}", "skipped", None, "", note="needs sm_90"))
                continue
            try:
                spec = atomic_spec(op)
                lau = ctx.launcher(spec)

                def make(iters, lau=lau, stride=stride):
                    return lambda: lau.launch((ATOMIC_BLOCKS, 1, 1), ctx.stream, "=QQqq", dst.data_ptr(), out, iters,
                                              stride)

                iters, ms = ctx.timed(make, 4)
                adds = ATOMIC_BLOCKS * iters * ATOMIC_TILE / (ms * 1e-3)
                rates[(pattern, op)] = adds
                ref = rates.get((pattern, "MicroStoreV4"))
                extra = {}
                if stride == ATOMIC_TILE and ("one tile, all blocks (dQ)", op) in rates:
                    extra["contended_over_own_tile"] = rates[("one tile, all blocks (dQ)", op)] / adds
                recs.append(_rec("atomics", f"{variant} | {pattern}", "elements/s", adds / 1e9, "G/s",
                                 None if op == "MicroStoreV4" or ref is None else ref / 1e9, ms=ms, kernel=spec.name,
                                 _expect=(pat,), gb_per_s=adds * nbytes / 1e9, blocks=ATOMIC_BLOCKS,
                                 elements_per_instruction=elems,
                                 reference="st.global.v4 of the same tiles", **extra))
            except Exception:  # noqa: BLE001
                recs.append(_err("atomics", f"{variant} | {pattern}"))
    del dst


# --------------------------------------------------------------------------------------- SASS records
def _attach_sass(recs, sass, check=None):
    """r["sass"] = sass_check(...) of the kernel the record timed (or check(info, expect): another suite's
    checker), or "unavailable" (reason in "sass_note"); r["ptxas"] = its registers / stack / spills from the same
    offline compile."""
    kernels = (sass or {}).get("kernels", {})
    status = (sass or {}).get("status", "unavailable")
    for r in recs:
        expect = r.pop("_expect", None)
        k = r.get("kernel")
        if k is None:
            continue
        info = kernels.get(k)
        if info is not None:
            r["ptxas"] = {key: info.get(key) for key in ("regs", "stack", "spill_st", "spill_ld")}
        if info is None or info.get("opcodes") is None:
            r["sass"] = "unavailable"
            r["sass_note"] = status if status != "ok" else "kernel not in the disassembly"
        else:
            r["sass"] = check(info, expect) if check else sass_check(info["opcodes"], expect or ())


def _count_records(sass):
    recs = []
    kernels = (sass or {}).get("kernels", {})
    for it in CHAIN_ITEMS:
        if not it.count:
            continue
        a = kernels.get(count_name(it.lat_op, COUNT_N), {}).get("opcodes")
        b = kernels.get(count_name(it.lat_op, 2 * COUNT_N), {}).get("opcodes")
        if a is None or b is None:
            recs.append(_rec(it.name, it.variant, "SASS instr/step", None, "instr", sass="unavailable"))
            continue
        total, mix = per_step_mix(a, b, COUNT_N)
        recs.append(_rec(it.name, it.variant, "SASS instr/step", total, "instr", mix=mix,
                         kernel=count_name(it.lat_op, 2 * COUNT_N), _expect=it.expect))
    return recs


# ------------------------------------------------------------------------------------------ entry point
def _start_background(specs, arch):
    """Parallel precompile of every launched kernel (fills CuPy's disk cache; a no-op after the precompile of
    `python -m bench all`) and the offline SASS analysis, in spawned processes. Returns (pool, sass future)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from cuflash.precompile import _compile

    jobs = max(2, min(16, os.cpu_count() or 2))
    pool = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"))
    fut = pool.submit(sass_analysis, arch)
    uniq = list({s.name: s for s in specs}.values())  # threads do not change the compiled code
    try:
        for _ in pool.map(_compile, uniq):
            pass
    except Exception:  # noqa: BLE001 - the benchmark then compiles (and reports) lazily
        traceback.print_exc()
    return pool, fut


def micro() -> list:
    t_start = time.time()
    import torch

    recs = []
    cc = torch.cuda.get_device_capability()
    arch = cc[0] * 10 + cc[1]
    pool = fut = None
    try:
        pool, fut = _start_background(sweep_specs(), arch)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    print(f"  micro: kernels ready in {time.time() - t_start:.1f}s", flush=True)
    ctx = _Ctx(deadline=t_start + TIME_LIMIT_S)
    for bench in (lambda: bench_chains(ctx, recs, CHAIN_ITEMS[:3]), lambda: bench_chains(ctx, recs, CHAIN_ITEMS[3:]),
                  lambda: bench_exp_accuracy(ctx, recs), lambda: bench_ldmatrix(ctx, recs),
                  lambda: bench_copy(ctx, recs), lambda: bench_atomics(ctx, recs)):
        try:
            bench()
        except Exception:  # noqa: BLE001 - one broken benchmark must not lose the others
            recs.append(_err("micro", "benchmark setup"))
    sass = None
    try:
        sass = fut.result(timeout=180) if fut is not None else sass_analysis(arch)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        sass = {"status": f"unavailable ({traceback.format_exc(limit=1).strip()[-300:]})", "kernels": {}}
    finally:
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
    try:
        recs += _count_records(sass)
    except Exception:  # noqa: BLE001
        recs.append(_err("exp", "SASS count"))
    _attach_sass(recs, sass)
    bad = [f"{r['name']} {r['variant']}" for r in recs
           if isinstance(r.get("sass"), dict) and r["sass"].get("ok") is False]
    print(f"  micro: {len(recs)} records in {time.time() - t_start:.1f}s; SASS {sass.get('status')}; "
          f"SASS check failed for: {bad or 'none'}", flush=True)
    return recs


def readme_numbers(records) -> dict:
    """{placeholder: formatted value} for the numbers table of the README's microbenchmark section."""
    def get(name, variant_prefix, metric):
        for r in records:
            if r.get("name") == name and str(r.get("variant", "")).startswith(variant_prefix) and \
                    r.get("metric") == metric and r.get("value") is not None:
                return r.get("max_rel_err_raw", r["value"])
        return None

    spec = {
        "mma_f16_latency": ("mma.m16n8k16", "f16 x f16 -> f32", "latency", 1),
        "mma_f16_tflops": ("mma.m16n8k16", "f16 x f16 -> f32", "TFLOP/s", 0),
        "mma_bf16_tflops": ("mma.m16n8k16", "bf16", "TFLOP/s", 0),
        "mma_f16acc_tflops": ("mma.m16n8k16", "f16 x f16 -> f16", "TFLOP/s", 0),
        "mma_flop_per_clk": ("mma.m16n8k16", "f16 x f16 -> f32", "throughput", 0),
        "ldsm_x4_latency": ("ldmatrix", "x4", "latency", 1),
        "ldsm_x1_latency": ("ldmatrix", "x1", "latency", 1),
        "smem_padded_bw": ("smem_K_tile", "x4, rows padded", "bandwidth", 1),
        "smem_unpadded_bw": ("smem_K_tile", "x4, rows unpadded", "bandwidth", 1),
        "cp_async_gbs": ("global->smem", "cp.async.cg 16 B, 4 stages, 1 blk/SM", "bandwidth", 0),
        "ldg_gbs": ("global->smem", "ld.global.v4 -> st.shared, 16 / thread, 1 blk/SM", "bandwidth", 0),
        "ldg4_gbs": ("global->smem", "ld.global.v4 -> st.shared, 4 / thread, 1 blk/SM", "bandwidth", 0),
        "ex2_latency": ("exp", "ex2.approx", "latency", 1),
        "ex2_per_clk": ("exp", "ex2.approx", "throughput", 2),
        "expf_per_clk": ("exp", "expf", "throughput", 2),
        "expf_instr": ("exp", "expf", "SASS instr/step", 1),
        "expfast_instr": ("exp", "__expf", "SASS instr/step", 1),
        "ex2_rel_err": ("exp", "ex2.approx", "max_rel_err", None),
        "expfast_rel_err": ("exp", "__expf", "max_rel_err", None),
        "fold_ffma_latency": ("scale_fold", "s * scale", "latency", 1),
        "fold_unfolded_latency": ("scale_fold", "(s - m)", "latency", 1),
        "red_f32_dq": ("atomics", "red.global.add.f32 | one tile", "elements/s", 1),
        "red_v4_dq": ("atomics", "red.global.add.v4.f32 | one tile", "elements/s", 1),
        "red_f32_own": ("atomics", "red.global.add.f32 | own", "elements/s", 1),
        "tanh_latency": ("tanh", "tanh.approx", "latency", 1),
        "tanh_per_clk": ("tanh", "tanh.approx", "throughput", 2),
        "capexp_per_clk": ("tanh", "soft-capped", "throughput", 2),
        "shfl_latency": ("shfl", "shfl.sync.bfly", "latency", 1),
        "shfl_per_clk": ("shfl", "shfl.sync.bfly", "throughput", 1),
    }
    res = {}
    for key, (name, var, metric, nd) in spec.items():
        v = get(name, var, metric)
        res["{{" + key + "}}"] = "n/a" if v is None else (f"{v:.2e}" if nd is None else f"{v:.{nd}f}")
    return res


if __name__ == "__main__":
    micro()
