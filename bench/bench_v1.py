"""From V1 to V2: the ladder of kernels between FlashAttention-1 and FlashAttention-2 (README.md, "From V1 to V2").

On the FlashAttention-2 grid (batch x seqlen = 16k tokens, hidden 2048, head dims 64 and 128, fp16), the
forward and the backward of each rung, timed with the harness, next to its numerical error against float64
and the device-memory traffic it moves (counted analytically, L2 assumed not to help):

  forward   1. v1-splitk            FlashAttention-1: KV tiles outer, O/m/l through HBM, warps split the keys
               v1-splitk-matched    the same with the KV tile of rung 2 (same HBM traffic as rung 2, so
                                    this -> 2 isolates the warp partition)
            2. v1-splitq            the same loop order, warps split the Q rows (no cross-warp reduction)
            3. v2-exp-precise       FlashAttention-2 (Q tiles outer, O in registers, parallel over Q tiles)
                                    with the softmax exponential as precise expf
            4. v2-exp-separate-mul  ... as ex2.approx(s * scale_log2 - m) with FMUL + FADD (no FFMA folding)
            5. v2                   the shipped V2 forward (FFMA + MUFU.EX2)
  backward  1. v1                   FlashAttention-1: m, l -> P, D_i recomputed per tile, dQ read-modify-write
            2. v2-loop              the V2 kernel with V1's parallelism (one block per head walks every KV tile)
            3. v2                   the shipped V2 backward (dQ through fp32 atomics, parallel over KV tiles)

The error columns come from a smaller problem (batch 1, 4 heads, seqlen 1024) in fp16 and bf16, with
SDPA (FLASH backend) and the naive baseline (cuflash.naive_attention; its backward: torch's own eager
attention in the input dtype) on the same inputs.
"""
from __future__ import annotations

import gc
import math

import numpy as np

from cuflash import v1
from cuflash.v1 import V1Tile
from cuflash._configs import BWD_ROW_PAD, BWD_TILES, fwd_spec, fwd_tile
from cuflash._launch import FWD_FORMAT, KernelSpec, get_launcher

from .harness import record, sdpa, time_ms

SEQLENS = (1024, 2048, 4096, 8192)
HEADDIMS = (64, 128)
TOKENS, HIDDEN = 16384, 2048
ERR_BATCH, ERR_HEADS, ERR_SEQLEN = 1, 4, 1024
ELEM = 2  # bytes per fp16 / bf16 element
LOG2E = math.log2(math.e)

FWD_RUNGS = ("v1-splitk", "v1-splitk-matched", "v1-splitq", "v2-exp-precise", "v2-exp-separate-mul", "v2")
# Split-K with the split-Q rung's KV tile (16 query rows, 4 warps): the O_i round trip per (j, i) pair then
# moves the same bytes in both partitions.
MATCHED_TILES = {d: V1Tile(16, v1.FWD_TILES["q"][d].block_n, 4) for d in v1.HEADDIMS}
BWD_RUNGS = ("v1", "v2-loop", "v2")
EXP_VARIANTS = {"v2-exp-precise": 1, "v2-exp-separate-mul": 2}  # cuda_src/flash_fwd.cu: enum ExpVariant


# ------------------------------------------------------------------------------------------ kernels
def v2_variant_spec(dtype: str, headdim: int, causal: bool, variant: int) -> KernelSpec:
    """The V2 forward with EXP_VARIANT = variant appended to its template arguments."""
    return fwd_spec(dtype, headdim, causal, False, exp_variant=variant)


def v2_forward_variant(qa, ka, va, causal, variant, softmax_scale=None):
    """cuflash.flash.forward's launch (non-split, grid order "qtile") of an EXP_VARIANT kernel; (out, lse)."""
    from cuflash import _interop

    b, sq, h, d = qa.shape
    sk, hk = ka.shape[1], ka.shape[2]
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    out = _interop.empty(qa, (b, sq, h, d), qa.dtype)
    lse = _interop.empty(qa, (b, h, sq), "float32")
    lau = get_launcher(v2_variant_spec(qa.dtype, d, causal, variant), qa.device)
    ob, orow, oh = sq * h * d, h * d, d  # out is freshly allocated, contiguous
    with _interop.device_guard(qa.device):
        lau.launch(
            (-(-sq // fwd_tile(d, causal).block_m), h, b), _interop.current_stream(qa), FWD_FORMAT,
            qa.ptr, ka.ptr, va.ptr, _interop.data_ptr(out), _interop.data_ptr(lse), 0, 0, 0,
            *qa.strides[:3], *ka.strides[:3], *va.strides[:3], ob, orow, oh,
            b, h, h // hk, sq, sk, 1, 0, 0, scale * LOG2E,
        )
    return out, lse


def sweep_specs():
    """Every kernel this section launches beyond the package's own list (for parallel precompile)."""
    specs = [v2_variant_spec(dt, d, c, var) for dt in ("float16", "bfloat16") for d in HEADDIMS for c in (False, True)
             for var in EXP_VARIANTS.values()]
    matched = [v1.fwd_spec(dt, d, c, "k", MATCHED_TILES[d]) for dt in ("float16", "bfloat16") for d in HEADDIMS
               for c in (False, True)]
    return specs + matched + v1.specs()


# ------------------------------------------------------------------------------ traffic (analytic)
def _cdiv(a, b):
    return -(-a // b)


def _visited_pairs(sq, sk, block_m, block_n, causal):
    """(KV tile j, Q tile i) pairs the kernels visit: causal skips pairs entirely above the diagonal
    (bottom-right aligned: query i sees key j iff j <= i + sk - sq)."""
    diag = sk - sq
    for j in range(_cdiv(sk, block_n)):
        n0 = j * block_n
        m_begin = (n0 - diag) // block_m if causal and n0 - diag > 0 else 0
        for i in range(m_begin, _cdiv(sq, block_m)):
            yield j, i


def _rows(i, block, n):
    return min(block, n - i * block)


def v1_fwd_bytes(b, h, sq, sk, d, causal, warp_split="k", tile=None):
    """V1 forward, per (batch, head) block: K_j and V_j read once per KV tile (2 sk d e); for every visited
    (j, i) pair Q_i read (r d e, r = real rows of tile i); O_i (fp32, r d 4), m_i and l_i (2 r 4) read except
    on the first visit (j = 0) and m_i, l_i written (2 r 4); O_i written in fp32 (r d 4) except at the last
    visit of tile i, which writes O_i in the input dtype (r d e) and LSE (r 4); rows no KV tile visits (causal,
    sq > sk) get out, m, l, LSE written once (d e + 12). e = 2 bytes."""
    t = tile or v1.FWD_TILES[warp_split][d]
    num_n = _cdiv(sk, t.block_n)
    diag = sk - sq
    m_first = _cdiv(sq, t.block_m) if num_n == 0 else (-diag // t.block_m if causal and diag < 0 else 0)
    per_head = 2 * sk * d * ELEM + min(sq, m_first * t.block_m) * (d * ELEM + 12)
    for j, i in _visited_pairs(sq, sk, t.block_m, t.block_n, causal):
        r = _rows(i, t.block_m, sq)
        last = min(num_n - 1, ((i + 1) * t.block_m - 1 + diag) // t.block_n) if causal else num_n - 1
        per_head += r * d * ELEM + 2 * r * 4
        if j > 0:
            per_head += r * d * 4 + 2 * r * 4
        per_head += (r * d * ELEM + r * 4) if j == last else r * d * 4
    return b * h * per_head


def v2_fwd_bytes(b, h, sq, sk, d, causal):
    """V2 forward, per (batch, head): Q read once (sq d e), O written once (sq d e) and LSE (sq 4); every Q
    tile i reads each KV tile it visits (2 keys d e), L2 counted as not helping."""
    t = fwd_tile(d, causal)
    per_head = 2 * sq * d * ELEM + sq * 4
    for j, _ in _visited_pairs(sq, sk, t.block_m, t.block_n, causal):
        per_head += 2 * _rows(j, t.block_n, sk) * d * ELEM
    return b * h * per_head


def v1_bwd_bytes(b, h, sq, sk, d, causal):
    """V1 backward (MHA): dQ_accum zeroed (sq_pad d 4 written per head); per (batch, head) block and KV tile j:
    K_j, V_j read and dK_j, dV_j written once (4 keys d e); per visited (j, i) pair: Q_i, dO_i, O_i read
    (3 r d e), m_i, l_i read (2 r 4), the fp32 dQ_i tile read and written (2 block_m d 4); then the convert
    reads dQ_accum (sq d 4) and writes dQ (sq d e)."""
    t = v1.BWD_TILES[d]
    sq_pad = _cdiv(sq, t.block_m) * t.block_m
    per_head = sq_pad * d * 4 + 4 * sk * d * ELEM + sq * d * (4 + ELEM)
    for _, i in _visited_pairs(sq, sk, t.block_m, t.block_n, causal):
        r = _rows(i, t.block_m, sq)
        per_head += 3 * r * d * ELEM + 2 * r * 4 + 2 * t.block_m * d * 4
    return b * h * per_head


def v2_bwd_bytes(b, h, sq, sk, d, causal):
    """V2 backward (MHA; "atomic" and "loop" move the same bytes): preprocess reads O, dO (2 sq d e) and LSE
    (sq 4), writes lse_log2 and D (2 sq_pad 4) and zeroes dQ_accum (sq_pad d 4); main: per KV tile K_j, V_j
    read and dK_j, dV_j written once (4 keys d e); per visited (j, i) pair Q_i, dO_i read (2 r d e),
    lse_log2_i and D_i read (2 block_m 4), dQ_i += (read and write, 2 block_m d 4); convert reads dQ_accum
    (sq d 4) and writes dQ (sq d e)."""
    t = BWD_TILES[d]
    sq_pad = _cdiv(sq, BWD_ROW_PAD) * BWD_ROW_PAD
    per_head = 2 * sq * d * ELEM + sq * 4 + 2 * sq_pad * 4 + sq_pad * d * 4 + 4 * sk * d * ELEM + sq * d * (4 + ELEM)
    for _, i in _visited_pairs(sq, sk, t.block_m, t.block_n, causal):
        r = _rows(i, t.block_m, sq)
        per_head += 2 * r * d * ELEM + 2 * t.block_m * 4 + 2 * t.block_m * d * 4
    return b * h * per_head


DRAM_BYTES = {
    ("v1-splitk", "fwd"): lambda *a: v1_fwd_bytes(*a, warp_split="k"),
    ("v1-splitk-matched", "fwd"): lambda b, h, sq, sk, d, c: v1_fwd_bytes(b, h, sq, sk, d, c, "k", MATCHED_TILES[d]),
    ("v1-splitq", "fwd"): lambda *a: v1_fwd_bytes(*a, warp_split="q"),
    ("v2-exp-precise", "fwd"): v2_fwd_bytes,
    ("v2-exp-separate-mul", "fwd"): v2_fwd_bytes,
    ("v2", "fwd"): v2_fwd_bytes,
    ("v1", "bwd"): v1_bwd_bytes,
    ("v2-loop", "bwd"): v2_bwd_bytes,
    ("v2", "bwd"): v2_bwd_bytes,
}


# ------------------------------------------------------------------------------------------- runners
def _fwd_runner(algo, qa, ka, va, causal):
    """fn() -> (out, lse) of one forward rung, on validated views."""
    from cuflash import flash

    if algo == "v1-splitk":
        return lambda: v1.forward(qa, ka, va, None, causal, "k")[:2]
    if algo == "v1-splitk-matched":
        return lambda: v1.forward(qa, ka, va, None, causal, "k", MATCHED_TILES[qa.shape[3]])[:2]
    if algo == "v1-splitq":
        return lambda: v1.forward(qa, ka, va, None, causal, "q")[:2]
    if algo in EXP_VARIANTS:
        return lambda: v2_forward_variant(qa, ka, va, causal, EXP_VARIANTS[algo])
    return lambda: flash.forward(qa, ka, va, None, causal)


def _bwd_runner(algo, q, k, v, dout, causal):
    """fn() -> (dq, dk, dv) of one backward rung (its own forward run once, outside the timed call)."""
    from cuflash import _interop
    from cuflash import backward as bwd_mod
    from cuflash import flash
    from cuflash._validate import check_qkv

    qa, ka, va = check_qkv(q, k, v)
    da = _interop.wrap(dout, "dout")
    if algo == "v1":
        out, _, m, l = v1.forward(qa, ka, va, None, causal, "k")
        oa = _interop.wrap(out, "out")
        return lambda: v1.backward(da, qa, ka, va, oa, m, l, None, causal)
    out, lse = flash.forward(qa, ka, va, None, causal)
    oa, la = _interop.wrap(out, "out"), _interop.wrap(lse, "softmax_lse")
    strategy = "loop" if algo == "v2-loop" else None
    return lambda: bwd_mod.backward(da, qa, ka, va, oa, la, None, causal, strategy)


def _time(fn):
    """harness.time_ms with fewer repetitions for the slow V1 rungs (keeps the section under 2 minutes)."""
    est = time_ms(fn, warmup=1, rep=1, min_warmup_ms=0.0)
    if est > 20.0:
        return time_ms(fn, warmup=1, rep=3, min_warmup_ms=0.0)
    if est > 5.0:
        return time_ms(fn, warmup=2, rep=5)
    return time_ms(fn)


# -------------------------------------------------------------------------------------------- errors
def _np(x):
    return x.detach().double().cpu().numpy()


def _err(got, ref):
    """(relative Frobenius norm, max abs) of lists of arrays against float64 references."""
    num = sum(float(np.sum((_np(g) - r) ** 2)) for g, r in zip(got, ref))
    den = sum(float(np.sum(r ** 2)) for r in ref)
    emax = max(float(np.max(np.abs(_np(g) - r))) for g, r in zip(got, ref))
    return math.sqrt(num / den) if den else 0.0, emax


def _torch_eager(q, k, v, scale, causal):
    """Attention in torch's eager ops in the inputs' dtype, [b, s, h, d] (the naive baseline's backward)."""
    import torch

    from cuflash import reference

    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
    s = (qh @ kh.transpose(-1, -2)) * scale
    if causal:
        mask = torch.from_numpy(reference.causal_mask(q.shape[1], k.shape[1])).to(q.device)
        s = s.masked_fill(~mask, float("-inf"))
    return (torch.softmax(s, dim=-1).nan_to_num(0.0) @ vh).transpose(1, 2)


def ladder_errors(headdims=HEADDIMS, dtypes=("float16", "bfloat16")):
    """{(provider_algo, mode, dtype, d, causal): (err_rel, err_max)} on one small problem per (d, dtype)."""
    import torch

    import cuflash
    from cuflash import reference
    from cuflash._validate import check_qkv

    errs = {}
    for d in headdims:
        scale = d ** -0.5
        for dtype in dtypes:
            dt = getattr(torch, dtype)
            shape = (ERR_BATCH, ERR_SEQLEN, ERR_HEADS, d)
            q, k, v, dout = (torch.randn(shape, device="cuda").to(dt) for _ in range(4))
            qa, ka, va = check_qkv(q, k, v)
            qn, kn, vn, don = (_np(x) for x in (q, k, v, dout))
            for causal in (False, True):
                ref_o, _ = reference.attention_forward(qn, kn, vn, scale, causal)
                ref_g = reference.attention_backward(don, qn, kn, vn, scale, causal)
                for algo in FWD_RUNGS:
                    errs[(algo, "fwd", dtype, d, causal)] = _err([_fwd_runner(algo, qa, ka, va, causal)()[0]], [ref_o])
                for algo in BWD_RUNGS:
                    errs[(algo, "bwd", dtype, d, causal)] = _err(list(_bwd_runner(algo, q, k, v, dout, causal)()),
                                                                 list(ref_g))
                # SDPA (FLASH backend) and the naive baseline, same inputs
                try:
                    qt, kt, vt = (x.transpose(1, 2).detach().clone().requires_grad_() for x in (q, k, v))
                    out_t = sdpa("flash")(qt, kt, vt, causal)
                    errs[("sdpa-flash", "fwd", dtype, d, causal)] = _err([out_t.transpose(1, 2)], [ref_o])
                    gq, gk, gv = torch.autograd.grad(out_t, (qt, kt, vt), dout.transpose(1, 2))
                    errs[("sdpa-flash", "bwd", dtype, d, causal)] = _err([x.transpose(1, 2) for x in (gq, gk, gv)],
                                                                         list(ref_g))
                except RuntimeError as e:  # backend refuses this case: no error columns for it
                    print(f"sdpa flash failed: {e}")
                errs[("naive", "fwd", dtype, d, causal)] = _err([cuflash.naive_attention(q, k, v, causal=causal)],
                                                                [ref_o])
                qe, ke, ve = (x.detach().clone().requires_grad_() for x in (q, k, v))
                errs[("naive", "bwd", dtype, d, causal)] = _err(
                    list(torch.autograd.grad(_torch_eager(qe, ke, ve, scale, causal), (qe, ke, ve), dout)),
                    list(ref_g))
            del q, k, v, dout
    return errs


# -------------------------------------------------------------------------------------------- ladder
def v1_ladder(headdims=HEADDIMS, seqlens=SEQLENS, causals=(False, True)) -> list[dict]:
    """Time every rung on the FlashAttention-2 grid (fp16), with error and traffic columns; plus one
    error-only record per (provider, mode, dtype, head dim, causal) of the small problem."""
    import torch

    from cuflash._validate import check_qkv

    errs = ladder_errors(headdims)
    recs = []
    for (algo, mode, dtype, d, causal), (rel, mx) in sorted(errs.items(), key=str):
        provider = {"sdpa-flash": "flash", "naive": "naive"}.get(algo, "cuflash")
        recs.append(record(provider, algo, mode, dtype, ERR_BATCH, ERR_HEADS, ERR_SEQLEN, ERR_SEQLEN, d, causal, None,
                           err_rel=rel, err_max=mx, dram_bytes=None, kind="error"))
    for d in headdims:
        h = HIDDEN // d
        for s in seqlens:
            b = TOKENS // s
            q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.float16) for _ in range(4))
            qa, ka, va = check_qkv(q, k, v)
            for causal in causals:
                line = []
                for mode, rungs in (("fwd", FWD_RUNGS), ("bwd", BWD_RUNGS)):
                    for rung, algo in enumerate(rungs, 1):
                        fn = (_fwd_runner(algo, qa, ka, va, causal) if mode == "fwd"
                              else _bwd_runner(algo, q, k, v, dout, causal))
                        ms = _time(fn)
                        nbytes = DRAM_BYTES[(algo, mode)](b, h, s, s, d, causal)
                        rel16, max16 = errs.get((algo, mode, "float16", d, causal), (None, None))
                        rel_bf, max_bf = errs.get((algo, mode, "bfloat16", d, causal), (None, None))
                        recs.append(record("cuflash", algo, mode, "float16", b, h, s, s, d, causal, ms, rung=rung,
                                           err_rel=rel16, err_max=max16, err_rel_bf16=rel_bf, err_max_bf16=max_bf,
                                           dram_bytes=nbytes, dram_gb_per_s=nbytes / (ms * 1e-3) / 1e9, kind="time"))
                        line.append(f"{algo}={ms:.2f}ms")
                        del fn
                print(f"v1 ladder d={d} s={s} causal={causal}: " + " ".join(line), flush=True)
            del q, k, v, dout, qa, ka, va
            gc.collect()
            torch.cuda.empty_cache()
    return recs
