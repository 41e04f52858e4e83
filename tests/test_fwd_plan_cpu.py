"""CPU: the memoized host path of flash_attn_func (cuflash/_fwd.py `_FwdPlan`) makes exactly the launch
`forward` makes -- kernel, grid, block, shared memory, parameter bytes (out / lse pointers aside) -- for
ragged lengths, GQA, MQA with the seqlen_q == 1 fold, causal, grid order "bh", strided views and the grid
fallback; a repeated call skips validation; bad inputs still raise after valid calls. The GPU is replaced
by bench's host_overhead stand-ins in a subprocess (they replace sys.modules["torch"] for the process).
GPU: the memoized path on real torch / CuPy arrays against `forward`."""
import json
import math
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from cuflash._launch import FWD_FORMAT, FWD_PARAMS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HO = "bench.diag.host_overhead" if os.path.exists(os.path.join(ROOT, "bench", "diag", "host_overhead.py")) \
    else "bench.host_overhead"  # the CPU stand-ins for torch, the driver and the loader
NAMES = [n for n, _ in FWD_PARAMS]
NBYTES = struct.calcsize(FWD_FORMAT)
O_SLOT, LSE_SLOT = NAMES.index("o"), NAMES.index("lse")

# name: (q shape, kv shape, dtype, kwargs of flash_attn_func); "packed": q, k, v are slices of one
# [b, s, 3, h, d] tensor (row stride 3*h*d, k / v offset by h*d elements)
CASES = {
    "basic": ((1, 128, 8, 64), (1, 128, 8, 64), "float16", {}),
    "basic_causal": ((1, 128, 8, 64), (1, 128, 8, 64), "float16", dict(causal=True)),
    "ragged": ((2, 77, 4, 128), (2, 1000, 4, 128), "bfloat16", dict(causal=True, softmax_scale=0.3)),
    "ragged_kv_short": ((1, 1000, 2, 32), (1, 17, 2, 32), "float16", dict(causal=True)),
    "gqa": ((2, 300, 32, 128), (2, 513, 8, 128), "float16", {}),
    "mqa_fold": ((3, 1, 16, 64), (3, 4096, 1, 64), "float16", dict(causal=True)),
    "gqa_fold_bh": ((1, 1, 32, 128), (1, 100, 8, 128), "bfloat16", dict(grid_order="bh")),
    "mqa_fold_d256": ((2, 1, 64, 256), (2, 333, 1, 256), "bfloat16", {}),
    "sq1_no_gqa": ((2, 1, 8, 96), (2, 50, 8, 96), "float16", dict(causal=True)),
    "bh": ((2, 256, 8, 96), (2, 256, 8, 96), "float16", dict(grid_order="bh", causal=True)),
    "packed": ((2, 200, 8, 64), (2, 200, 8, 64), "float16", dict(packed=True)),
    "grid_fallback": ((70000, 16, 1, 32), (70000, 16, 1, 32), "float16", {}),
    "scale_float": ((1, 64, 2, 64), (1, 64, 2, 64), "float16", dict(softmax_scale=0.125)),
    "auto_long_causal": ((1, 8192, 2, 128), (1, 8192, 2, 128), "float16", dict(causal=True, backend="sm80")),
    "auto_long": ((1, 8192, 2, 128), (1, 8192, 2, 128), "float16", dict(backend="sm80")),
    "auto_long_causal_d64": ((1, 8192, 2, 64), (1, 8192, 2, 64), "float16", dict(causal=True, backend="sm80")),
    "sm90_long_causal": ((2, 8192, 16, 128), (2, 8192, 16, 128), "float16", dict(causal=True)),
    "scale_np32": ((1, 64, 2, 64), (1, 64, 2, 64), "float16", dict(softmax_scale="np32:0.125")),
    "forced_sm80": ((2, 77, 4, 128), (2, 1000, 4, 128), "bfloat16", dict(causal=True, backend="sm80")),
    "forced_sm90": ((2, 77, 4, 128), (2, 1000, 2, 128), "float16", dict(backend="sm90")),
}

_SCRIPT = r"""
import json, struct, sys
sys.path.insert(0, ROOT)
import importlib
ho = importlib.import_module(HO_MODULE)
torch = ho.install_fakes(record=True)
import numpy as np
import cuflash
from cuflash import _fwd as flash  # the V2 forward's launch code and plan memo
from cuflash._launch import FWD_FORMAT
T = torch.Tensor
CASES = json.loads(CASES_JSON)
res = {}
checks = [0]
real_check_qkv = flash.check_qkv

def counting_check_qkv(*a, **kw):
    checks[0] += 1
    return real_check_qkv(*a, **kw)

flash.check_qkv = counting_check_qkv

def launch_rec():
    (r,) = ho.LAUNCHES
    ho.LAUNCHES.clear()
    return dict(name=r[0], grid=list(r[1]), threads=r[2], smem=r[3], raw=r[4][:struct.calcsize(FWD_FORMAT)].hex(),
                maps=r[4][512:512 + 3 * 128].hex())

def make(qs, kvs, dt, packed):
    dt = getattr(torch, dt)
    if not packed:
        return T(qs, dt), T(kvs, dt), T(kvs, dt)
    b, s, h, d = qs
    base = T((b, s, 3, h, d), dt)
    st = (s * 3 * h * d, 3 * h * d, d, 1)
    xs = [T(qs, dt, st) for _ in range(3)]
    for i, x in enumerate(xs):
        x._ptr = base._ptr + i * h * d * 2
    return xs

def scale_of(kw):
    s = kw.get("softmax_scale")
    if isinstance(s, str):
        kw["softmax_scale"] = np.float32(float(s.split(":")[1]))

for tag, (qs, kvs, dt, kw) in CASES.items():
    kw = dict(kw)
    scale_of(kw)
    q, k, v = make(qs, kvs, dt, kw.pop("packed", False))
    ho.LAUNCHES.clear()
    qa, ka, va = real_check_qkv(q, k, v)
    out_ref, lse_ref = flash.forward(qa, ka, va, kw.get("softmax_scale"), kw.get("causal", False),
                                     kw.get("grid_order", "auto"), backend=kw.get("backend", "auto"))
    ref = launch_rec()
    plans0, c0 = len(flash._PLANS), checks[0]
    out, lse, none = cuflash.flash_attn_func(q, k, v, return_attn_probs=True, **kw)
    first = launch_rec()
    plans1, c1 = len(flash._PLANS), checks[0]
    out2, lse2, _ = cuflash.flash_attn_func(q, k, v, return_attn_probs=True, **kw)
    second = launch_rec()
    res[tag] = dict(ref=ref, first=first, second=second, new_plans=plans1 - plans0, plans_after=len(flash._PLANS),
                    checks_first=c1 - c0, checks_second=checks[0] - c1, none=none is None,
                    out=[list(out.shape), out.dtype.name, list(out.stride()), out.data_ptr()],
                    lse=[list(lse.shape), lse.dtype.name, list(lse.stride()), lse.data_ptr()],
                    out_ref=[list(out_ref.shape), out_ref.dtype.name, list(out_ref.stride())],
                    lse_ref=[list(lse_ref.shape), lse_ref.dtype.name, list(lse_ref.stride())],
                    ptrs2=[out2.data_ptr(), lse2.data_ptr()])

# not memoized: a tensor subclass, an unhashable argument (validated on every call, same launch)
class Sub(T):
    __slots__ = ()

for tag, args, kw in (("subclass", (Sub((1, 64, 2, 64), torch.float16), T((1, 64, 2, 64), torch.float16),
                                    T((1, 64, 2, 64), torch.float16)), {}),
                      ("unhashable_causal", (T((1, 64, 2, 64), torch.float16), T((1, 64, 2, 64), torch.float16),
                                             T((1, 64, 2, 64), torch.float16)), dict(causal=[1]))):
    ho.LAUNCHES.clear()
    flash.forward(*real_check_qkv(*args), None, kw.get("causal", False), backend="auto")
    ref = launch_rec()
    recs = []
    for _ in range(2):
        p0, c0 = len(flash._PLANS), checks[0]
        cuflash.flash_attn_func(*args, **kw)
        recs.append(dict(launch=launch_rec(), new_plans=len(flash._PLANS) - p0, checks=checks[0] - c0))
    res[tag] = dict(ref=ref, calls=recs)

# bad inputs after valid calls of other (and, for the pointer, the same) shapes
q, k, v = T((1, 128, 8, 64), torch.float16), T((1, 128, 8, 64), torch.float16), T((1, 128, 8, 64), torch.float16)
cuflash.flash_attn_func(q, k, v)
ho.LAUNCHES.clear()
class CpuT(T):
    __slots__ = ()
    is_cuda = False
    device = "cpu"

def bad(tag, fn):
    try:
        fn()
        res.setdefault("bad", {})[tag] = ["no error", ""]
    except (TypeError, ValueError, NotImplementedError) as e:
        res.setdefault("bad", {})[tag] = [type(e).__name__, str(e)]

misaligned = T((1, 128, 8, 64), torch.float16); misaligned._ptr += 2
bad("misaligned_q", lambda: cuflash.flash_attn_func(misaligned, k, v))
bad("misaligned_v", lambda: cuflash.flash_attn_func(q, k, misaligned))
bad("float32", lambda: cuflash.flash_attn_func(T((1, 128, 8, 64), torch.float32), k, v))
bad("dtype_mix", lambda: cuflash.flash_attn_func(q, T((1, 128, 8, 64), torch.bfloat16), v))
bad("headdim", lambda: cuflash.flash_attn_func(q, T((1, 128, 8, 128), torch.float16),
                                               T((1, 128, 8, 128), torch.float16)))
bad("heads", lambda: cuflash.flash_attn_func(q, T((1, 128, 3, 64), torch.float16), T((1, 128, 3, 64), torch.float16)))
bad("stride", lambda: cuflash.flash_attn_func(T((1, 128, 8, 64), torch.float16, (128 * 8 * 68, 8 * 68, 68, 1)), k, v))
bad("seqlen0", lambda: cuflash.flash_attn_func(T((1, 0, 8, 64), torch.float16), k, v))
bad("cpu", lambda: cuflash.flash_attn_func(CpuT((1, 128, 8, 64), torch.float16), k, v))
bad("host", lambda: cuflash.flash_attn_func(np.zeros((1, 128, 8, 64), np.float16), k, v))
bad("scale", lambda: cuflash.flash_attn_func(q, k, v, softmax_scale=-1.0))
bad("scale_type", lambda: cuflash.flash_attn_func(q, k, v, softmax_scale="x"))
bad("grid_order", lambda: cuflash.flash_attn_func(q, k, v, grid_order="xy"))
bad("algorithm", lambda: cuflash.flash_attn_func(q, k, v, algorithm="v3"))
bad("warp_partition", lambda: cuflash.flash_attn_func(q, k, v, warp_partition="z"))
bad("dropout", lambda: cuflash.flash_attn_func(q, k, v, dropout_p=0.1, algorithm="v1"))
bad("window", lambda: cuflash.flash_attn_func(q, k, v, window_size=(4, -4)))
bad("alibi_shape", lambda: cuflash.flash_attn_func(q, k, v, alibi_slopes=T((7,), torch.float32)))
bad("alibi_dtype", lambda: cuflash.flash_attn_func(q, k, v, alibi_slopes=T((8,), torch.float16)))
bad("v1_window", lambda: cuflash.flash_attn_func(q, k, v, window_size=(4, 4), algorithm="v1"))
bad("too_large", lambda: cuflash.flash_attn_func(T((70000, 70000 * 128, 1, 32), torch.float16),
                                                 T((70000, 16, 1, 32), torch.float16),
                                                 T((70000, 16, 1, 32), torch.float16)))
res["bad_launches"] = len(ho.LAUNCHES)
res["still_valid"] = (cuflash.flash_attn_func(q, k, v).shape, len(ho.LAUNCHES))

# the memo is bounded
flash._PLANS.clear()
saved = flash._MAX_PLANS
flash._MAX_PLANS = 3
sizes = []
for s in range(1, 8):
    cuflash.flash_attn_func(T((1, s, 2, 64), torch.float16), T((1, s, 2, 64), torch.float16),
                            T((1, s, 2, 64), torch.float16))
    sizes.append(len(flash._PLANS))
flash._MAX_PLANS = saved
res["memo_sizes"] = sizes
print("RESULT" + json.dumps(res))
"""


@pytest.fixture(scope="module")
def host():
    code = _SCRIPT.replace("CASES_JSON", repr(json.dumps(CASES))).replace("ROOT", repr(ROOT)).replace("HO_MODULE", repr(HO))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT")][-1]
    return json.loads(line[len("RESULT"):])


def _params(rec):
    return list(struct.unpack_from(FWD_FORMAT, bytes.fromhex(rec["raw"]), 0))


def _masked(rec):
    """The launch with the out / lse pointers (fresh allocations) zeroed: name, grid, block, smem, bytes."""
    p = _params(rec)
    p[O_SLOT] = p[LSE_SLOT] = 0
    raw = struct.pack(FWD_FORMAT, *p)
    assert len(bytes.fromhex(rec["raw"])) == NBYTES and raw[:8 * O_SLOT] == bytes.fromhex(rec["raw"])[:8 * O_SLOT]
    return rec["name"], rec["grid"], rec["threads"], rec["smem"], raw


@pytest.mark.parametrize("tag", list(CASES))
def test_memoized_launch_equals_forward(host, tag):
    r = host[tag]
    assert _masked(r["first"]) == _masked(r["ref"])
    assert _masked(r["second"]) == _masked(r["ref"])
    if "sm90" in r["ref"]["name"]:  # the tensor maps (the stand-in encoding: the encoder's arguments) too
        assert r["first"]["maps"] == r["ref"]["maps"] == r["second"]["maps"]
    # the fresh out / lse are the ones the kernel writes, shaped and typed like forward's
    for call, ptrs in (("first", r["out"][3:] + r["lse"][3:]), ("second", r["ptrs2"])):
        p = _params(r[call])
        assert [p[O_SLOT], p[LSE_SLOT]] == ptrs and all(ptrs)
    assert r["out"][:3] == r["out_ref"] and r["lse"][:3] == r["lse_ref"] and r["none"]
    p = dict(zip(NAMES, _params(r["first"])))
    assert (p["o_accum"], p["lse_accum"], p["seqlens_k"], p["num_splits"], p["seqlen_k_new"]) == (0, 0, 0, 1, 0)


def test_memo_hit_skips_validation(host):
    for tag in CASES:
        r = host[tag]
        assert r["checks_first"] == 1 and r["checks_second"] == 0, tag
    assert host["basic"]["new_plans"] == 1 and host["basic_causal"]["new_plans"] == 1  # causal: its own plan
    # np.float32(0.125) == 0.125, but the scale's type is in the key (its product with log2 e differs)
    assert host["scale_np32"]["new_plans"] == 1
    assert host["scale_float"]["new_plans"] == 1


def test_specific_geometry(host):
    def p(tag):
        return dict(zip(NAMES, _params(host[tag]["first"])))

    # MQA fold: 16 query heads of the one KV head become 16 rows; causal dropped (1 row sees every key)
    f = p("mqa_fold")
    assert (f["nheads"], f["seqlen_q"], f["heads_per_kv"]) == (1, 16, 1)
    assert (f["q_row_stride"], f["q_head_stride"], f["o_row_stride"], f["o_head_stride"]) == (64, 16 * 64, 64, 16 * 64)
    assert "false" in host["mqa_fold"]["first"]["name"].split(",")[5]
    g = p("gqa_fold_bh")
    assert (g["nheads"], g["seqlen_q"], g["grid_order"]) == (8, 4, 1) and host["gqa_fold_bh"]["first"]["grid"][0] == 8
    pk = p("packed")
    assert (pk["q_batch_stride"], pk["q_row_stride"], pk["k_row_stride"]) == (200 * 3 * 512, 3 * 512, 3 * 512)
    assert pk["k"] - pk["q"] == 512 * 2 and pk["v"] - pk["k"] == 512 * 2
    assert (pk["o_batch_stride"], pk["o_row_stride"]) == (200 * 512, 512)  # out is contiguous
    # grid_order="auto" (the default): batch/head first for long causal problems only
    assert p("auto_long_causal")["grid_order"] == 1 and host["auto_long_causal"]["first"]["grid"] == [2, 64, 1]
    assert p("auto_long")["grid_order"] == 0 and host["auto_long"]["first"]["grid"] == [64, 2, 1]
    assert p("auto_long_causal_d64")["grid_order"] == 0
    fb = p("grid_fallback")
    assert fb["grid_order"] == 1 and host["grid_fallback"]["first"]["grid"] == [70000, 1, 1]
    # the block holds scale * log2 e rounded once to float32 (an f32_slot), whichever type the scale came in
    assert p("scale_np32")["scale_log2"] == float(np.float32(np.float32(0.125) * math.log2(math.e)))
    assert p("scale_float")["scale_log2"] == float(np.float32(0.125 * math.log2(math.e)))


def _fake_map(rec, i):
    """(base address, dtype code, dims, box, byte strides) of tensor map i of a launch (host_overhead's
    stand-in encoder writes its arguments)."""
    raw = bytes.fromhex(rec["maps"])[128 * i:128 * (i + 1)]
    ptr, dt = struct.unpack_from("<QI", raw, 0)
    dims, box = zip(*(struct.unpack_from("<QI", raw, 12 + 12 * j) for j in range(4)))
    strides = struct.unpack_from("<3Q", raw, 12 + 48)
    return ptr, dt, dims, box, strides


def test_sm90_launches(host):
    """With the H200's compute capability (the stand-ins'), "auto" takes the sm90 kernels where they apply and
    the sm80 kernels elsewhere; an sm90 launch carries Q, K and V's tensor maps."""
    sm90 = {t for t in CASES if "flash_fwd_sm90" in host[t]["first"]["name"]}
    assert sm90 == {"basic", "basic_causal", "ragged", "gqa", "bh", "packed", "scale_float", "sm90_long_causal",
                    "scale_np32", "forced_sm90", "sq1_no_gqa"}, sm90
    r = host["forced_sm90"]["first"]
    p = dict(zip(NAMES, _params(r)))
    for i, (name, rows, heads) in enumerate((("q", 128, 4), ("k", 128, 2), ("v", 128, 2))):
        ptr, dt, dims, box, strides = _fake_map(r, i)
        seqlen = 77 if name == "q" else 1000
        assert ptr == p[name] and dt == 6 and dims == (128, seqlen, heads, 2) and box == (64, rows, 1, 1)
        assert strides == (heads * 128 * 2, 128 * 2, seqlen * heads * 128 * 2)
    from cuflash._configs import sm90_fwd_tile

    # 1000 keys at head dim 128: the persistent form, one block per Q tile here (1 x 4 heads x 2 < the SMs)
    assert sm90_fwd_tile(128, False, 1000).persistent and "flash_fwd_sm90" in r["name"] and r["name"].endswith(", true>")
    assert r["threads"] == 384 and r["grid"] == [8, 1, 1]
    # 8192 causal keys at head dim 128: the 160-key persistent form (2 x 16 heads x 64 Q tiles on the 132 SMs), its
    # tiles walked in order of work (grid_order 1: from SM90_PERSIST_BH_MIN_ROWS query rows where the list model finds
    # the (batch, head) walk unbalanced, as here)
    c = host["sm90_long_causal"]
    t = sm90_fwd_tile(128, True, 8192)
    assert t.persistent and t.block_n == 160 and c["first"]["name"].endswith(", true>")
    assert c["first"]["grid"] == [132, 1, 1] and dict(zip(NAMES, _params(c["first"])))["grid_order"] == 1
    pk = host["packed"]["first"]
    assert [_fake_map(pk, i)[4] for i in range(3)] == [(3 * 512 * 2, 64 * 2, 200 * 3 * 512 * 2)] * 3


def test_not_memoized_paths(host):
    for tag in ("subclass", "unhashable_causal"):
        r = host[tag]
        for c in r["calls"]:
            assert c["new_plans"] == 0 and c["checks"] == 1, tag
            assert _masked(c["launch"]) == _masked(r["ref"]), tag


@pytest.mark.parametrize("tag,exc,words", [
    ("misaligned_q", "no error", []),  # (rows that are not 16-byte units: the UA kernels, cuflash._configs.unaligned)
    ("misaligned_v", "no error", []),
    ("float32", "TypeError", ["q", "float16 or bfloat16"]),
    ("dtype_mix", "TypeError", ["k", "dtype of q"]),
    ("headdim", "ValueError", ["k", "head dim"]),
    ("heads", "ValueError", ["multiple"]),
    ("stride", "no error", []),
    ("seqlen0", "ValueError", ["q", "seqlen"]),
    ("cpu", "TypeError", ["q", "CUDA tensor"]),
    ("host", "TypeError", ["q", "host"]),
    ("scale", "ValueError", ["softmax_scale"]),
    ("scale_type", "TypeError", ["softmax_scale"]),
    ("grid_order", "ValueError", ["grid_order"]),
    ("algorithm", "ValueError", ["algorithm"]),
    ("warp_partition", "ValueError", ["warp_partition"]),
    ("dropout", "NotImplementedError", ["dropout"]),
    ("window", "ValueError", ["window_size right"]),
    ("alibi_shape", "ValueError", ["alibi_slopes", "shape"]),
    ("alibi_dtype", "TypeError", ["alibi_slopes", "float32"]),
    ("v1_window", "NotImplementedError", ["window_size", "v1"]),
    ("too_large", "ValueError", ["too large"]),
])
def test_bad_inputs_after_valid_calls(host, tag, exc, words):
    got_exc, msg = host["bad"][tag]
    assert got_exc == exc, (tag, got_exc, msg)
    for w in words:
        assert w in msg, (w, msg)


def test_nothing_launched_for_bad_inputs(host):
    assert host["bad_launches"] == 3  # misaligned_q, misaligned_v, stride: accepted (the UA kernel), one launch each
    assert host["still_valid"] == [[1, 128, 8, 64], 4]


def test_memo_is_bounded(host):
    assert max(host["memo_sizes"]) <= 3 and host["memo_sizes"][-1] >= 1


# ------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["torch", "cupy"])
@pytest.mark.parametrize("b,sq,sk,h,hk,d,causal,grid_order", [
    (2, 77, 300, 4, 2, 64, True, "qtile"),
    (1, 1, 500, 16, 2, 128, False, "bh"),
    (3, 128, 128, 8, 8, 32, False, "qtile"),
])
def test_memoized_path_matches_forward_gpu(kind, b, sq, sk, h, hk, d, causal, grid_order):
    """Repeated calls (memo hits) on fresh data of the same shapes: bit-identical to `forward`."""
    import cuflash
    from cuflash import flash
    from cuflash._validate import check_qkv
    from conftest import to_np

    for seed in range(3):
        if kind == "torch":
            import torch

            gen = torch.Generator(device="cuda").manual_seed(seed)
            q, k, v = (torch.randn(s, device="cuda", generator=gen).half() for s in
                       ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d)))
        else:
            import cupy

            rs = cupy.random.RandomState(seed)
            q, k, v = (rs.standard_normal(s).astype(cupy.float16) for s in
                       ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d)))
        out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=causal, grid_order=grid_order, return_attn_probs=True)
        ref_out, ref_lse = flash.forward(*check_qkv(q, k, v), None, causal, grid_order, backend="auto")
        assert type(out) is type(ref_out) and out.shape == ref_out.shape and out.dtype == ref_out.dtype
        assert np.array_equal(to_np(out), to_np(ref_out)) and np.array_equal(to_np(lse), to_np(ref_lse))
        assert not np.isnan(to_np(out)).any()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["torch", "cupy"])
@pytest.mark.parametrize("b,h,hk,d,window", [
    (4, 16, 4, 128, (-1, -1)),  # single-query GQA: the mma.sync fold
    (2, 8, 8, 128, (-1, -1)),  # the Hopper kernels on sm_90 (new K / V maps each step)
    (2, 8, 2, 64, (40, 0)),  # a window: its left bound follows the key count
])
def test_growing_kv_cache_matches_forward_gpu(kind, b, h, hk, d, window):
    """Generation steps with a KV cache in transformers' [b, hk, keys, d] layout, one key longer each step (a new
    array, new strides): the steps after the first run the first step's plan with their own key count and strides
    (cuflash._fwd._KV_PLANS), bit-identical to `forward` on the same views, with fresh random data each step."""
    import cuflash
    from cuflash import _fwd, flash
    from cuflash._mods import mods_for
    from cuflash._validate import check_qkv
    from conftest import to_np

    _fwd._KV_PLANS.clear()
    for step, sk in enumerate(range(20, 90, 7)):
        if kind == "torch":
            import torch

            gen = torch.Generator(device="cuda").manual_seed(step)
            q = torch.randn((b, h, 1, d), device="cuda", generator=gen).bfloat16().transpose(1, 2)
            k, v = (torch.randn((b, hk, sk, d), device="cuda", generator=gen).bfloat16().transpose(1, 2)
                    for _ in range(2))
        else:
            import cupy

            rs = cupy.random.RandomState(step)
            q = rs.standard_normal((b, h, 1, d)).astype(cupy.float16).transpose(0, 2, 1, 3)
            k, v = (rs.standard_normal((b, hk, sk, d)).astype(cupy.float16).transpose(0, 2, 1, 3) for _ in range(2))
        before = len(_fwd._PLANS)
        out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=True, window_size=window, return_attn_probs=True)
        assert (len(_fwd._PLANS) - before) == (1 if step == 0 else 0)  # later steps: the KV plan, no new one
        qa, ka, va = check_qkv(q, k, v)
        mods = mods_for(qa, ka, True, window, 0.0, None, None)
        ref_out, ref_lse = flash.forward(qa, ka, va, None, True, backend="auto", mods=mods)
        assert np.array_equal(to_np(out), to_np(ref_out)) and np.array_equal(to_np(lse), to_np(ref_lse))
        assert not np.isnan(to_np(out)).any()
