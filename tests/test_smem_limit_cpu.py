"""CPU: the kernels a call launches fit the device's shared memory per block. On a GPU of 99 KB a block (sm_86 /
sm_89 / sm_120) the configured tiles that do not fit give way to the fitted ones (cuflash._configs.fit_fwd_tile,
fit_bwd_partition, fit_decode_tile); a kernel that still does not fit (the backward at head dim 256, a partition
asked for by name) is refused with a NotImplementedError naming the kernel, its bytes, the compute capability and
the limit, before anything is compiled or launched. On an A100 and the H200 nothing changes (the launches of the
configured tables). The GPU is replaced by bench's host_overhead stand-ins in a subprocess, whose device properties
are then those of an sm_89 GPU (99 KB a block, 100 KB an SM), an A100 (163 / 164 KB), the H200 (227 / 228 KB), or the
H200 planned as a 99 KB GPU (CUFLASH_SMEM_PER_BLOCK, as the GPU tests of the fitted tiles run it)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICES = {  # compute capability, SMs, opt-in shared memory per block, shared memory per SM, threads per SM, cap
    "sm89": (89, 128, 99 * 1024, 100 * 1024, 1536, None),
    "sm80": (80, 108, 163 * 1024, 164 * 1024, 2048, None),
    "sm90": (90, 132, 227 * 1024, 228 * 1024, 2048, None),
    "sm90-capped": (90, 132, 227 * 1024, 228 * 1024, 2048, 99 * 1024),
}
SMALL = ("sm89", "sm90-capped")
# name: (call, head dim, causal): forward / backward / decode step, fp16, GQA 4 / 8 heads for the decode step
CALLS = [(c, d, causal) for d in (32, 64, 96, 128, 256) for c in ("fwd", "bwd", "decode") for causal in (False, True)
         if not (c == "decode" and causal)]

_SCRIPT = r"""
import json, os, sys
sys.path.insert(0, ROOT)
from bench.diag import host_overhead as ho
torch = ho.install_fakes(record=True)
from cupy.cuda import runtime
from cuflash import _launch, _loader
import cuflash
cc, sms, per_block, per_sm, threads, cap = DEVICE
if cap:
    os.environ["CUFLASH_SMEM_PER_BLOCK"] = str(cap)
props = dict(multiProcessorCount=sms, sharedMemPerMultiprocessor=per_sm, maxThreadsPerMultiProcessor=threads,
             regsPerMultiprocessor=65536, sharedMemPerBlockOptin=per_block, reservedSharedMemPerBlock=1024)
runtime.getDeviceProperties = lambda dev: props
_loader.device_cc = lambda dev: cc
_launch._props.cache_clear()
compiled = []
real_get_function = _loader.get_function
def get_function(filename, name, device, arch_suffix=""):
    compiled.append(name)
    return real_get_function(filename, name, device, arch_suffix)
_loader.get_function = get_function
T = torch.Tensor
res = {}
for call, d, causal in CALLS:
    q, k = T((2, 300, 8, d), torch.float16), T((2, 300, 4, d), torch.float16)
    if call == "fwd":
        fn = lambda: cuflash.flash_attn_func(q, k, k, causal=causal)
    elif call == "bwd":
        fn = lambda: cuflash.flash_attn_backward(q, q, k, k, q, T((2, 8, 300), torch.float32), causal=causal)
    else:
        fn = lambda: cuflash.flash_attn_with_kvcache(T((2, 1, 32, d), torch.float16), T((2, 4096, 8, d), torch.float16),
                                                     T((2, 4096, 8, d), torch.float16))
    ho.LAUNCHES.clear()
    compiled.clear()
    try:
        fn()
        err = None
    except NotImplementedError as e:
        err = str(e)
    res[f"{call} {d} {causal}"] = dict(err=err, launches=[[r[0], r[3]] for r in ho.LAUNCHES], compiled=list(compiled))
print("RESULT" + json.dumps(res))
"""


@pytest.fixture(scope="module", params=list(DEVICES))
def device(request):
    code = (_SCRIPT.replace("ROOT", repr(ROOT)).replace("DEVICE", repr(DEVICES[request.param]))
            .replace("CALLS", repr(CALLS)))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT")][-1]
    return request.param, json.loads(line[len("RESULT"):])


def _limit(name):
    _, _, per_block, _, _, cap = DEVICES[name]
    return min(per_block, cap or per_block)


def test_refused_before_launch_or_compile(device):
    """Each call either launches kernels that all fit the planned-for limit, or raises before it launches or
    compiles anything, with the kernel, its bytes, the compute capability and the limit in the message."""
    name, res = device
    cc = DEVICES[name][0]
    limit = _limit(name)
    for key, r in res.items():
        if r["err"] is None:
            assert r["launches"], key
            assert all(smem <= limit for _, smem in r["launches"]), (key, r["launches"])
        else:
            assert r["launches"] == [] and r["compiled"] == [], (key, r)
            assert f"compute capability {cc // 10}.{cc % 10}" in r["err"] and f"at most {limit} bytes" in r["err"]
            needed = int(r["err"].split(", ", 1)[1].split(" bytes", 1)[0])
            assert needed > limit and "kernel (flash_" in r["err"], r["err"]


def _kernel(res, key, prefix):
    (name,) = [n for n, _ in res[key]["launches"] if n.startswith(prefix)]
    return name


def test_what_runs_where(device):
    """Every call runs but the backward at head dim 256 on a 99 KB GPU (no partition's tile fits it). There the
    fitted kernels run: the forward's 32-key tile at head dim 128 without a mask, the backward's Q-row partition
    from head dim 64 (its sm_80 tiles: 73-97 KB), the decode kernel's fitted tiles at head dims 96-256; on the
    larger GPUs the configured ones."""
    from cuflash import _configs as C

    name, res = device
    refused = sorted(k for k, r in res.items() if r["err"] is not None)
    small = name in SMALL
    assert refused == (["bwd 256 False", "bwd 256 True"] if small else [])
    limit = _limit(name)
    cc = 80 if name == "sm80" or small else 90
    for d in (32, 64, 96, 128, 256):
        for causal in (False, True):
            tile = C.fwd_tile(d, causal)
            if small:
                tile = C.fit_fwd_tile(d, tile, limit)
            spec = C.fwd_spec("float16", d, causal, False, tile)
            if name != "sm90" or d == 32:  # the Hopper forward takes head dims 64-256 on the H200
                assert _kernel(res, f"fwd {d} {causal}", "cuflash::flash_fwd_kernel") == spec.name
            if d == 256 and small:
                continue
            part = C.BWD_AUTO_PARTITION.get(d, "kv")
            bt = C.bwd_tile(d, part, cc, "float16")
            if small:
                part, bt = C.fit_bwd_partition(d, part, cc, "float16", 0, False, limit)
            if name != "sm90" or d == 32:  # the Hopper backward from head dim 40 on the H200
                assert _kernel(res, f"bwd {d} {causal}", "cuflash::flash_bwd_kernel<") == \
                    C.bwd_spec("float16", d, causal, bt, part).name
    for d in (96, 128, 256):  # the decode kernels whose configured tiles take more than 99 KB
        (smem,) = [s for n, s in res[f"decode {d} False"]["launches"] if n.startswith("cuflash::flash_decode_kernel<")]
        configured = C.decode_smem_bytes(d, C.decode_tile(d), C.decode_mf(d, 4))
        assert smem <= limit and (smem < configured if small else smem == configured), (d, smem, configured)


def test_fitted_tiles_and_specs():
    """The fit functions return the configured tile where it fits and otherwise one that fits, for every head dim,
    mask mode and partition; every fitted kernel is among the configurations CI compiles (all_specs)."""
    from cuflash import _configs as C

    lim = C.SMALL_SMEM_PER_BLOCK
    for d in C.FWD_HEADDIMS:
        for causal, m in (*C.MASK_MODES, (False, C.MOD_SCORE_DROPOUT)):
            tile = C.fwd_tile(d, causal, m)
            fit = C.fit_fwd_tile(d, tile, lim)
            assert fit == tile if C.fwd_smem_bytes(d, tile) <= lim else fit is None or (
                C.fwd_smem_bytes(d, fit) <= lim and fit.nwarps == tile.nwarps and fit.o_split == tile.o_split)
            assert C.fit_fwd_tile(d, tile, 227 * 1024) == tile
    assert C.fit_fwd_tile(512, C.fwd_tile(512, False), lim) is None
    for d in C.HEADDIMS:
        for m in (0, C.MOD_SCORE, C.MOD_SCORE_DROPOUT):
            auto = C.BWD_AUTO_PARTITION.get(d, "kv")
            fit = C.fit_bwd_partition(d, auto, 80, "float16", m, False, lim)
            if d == 256:
                assert fit is None
                continue
            part, tile = fit
            assert C.bwd_smem_bytes(d, tile, part) <= lim and tile == C.bwd_tile(d, part, 80, "float16", m)
            assert (part == auto) == (C.bwd_smem_bytes(d, C.bwd_tile(d, auto, 80, "float16", m), auto) <= lim)
            assert C.fit_bwd_partition(d, auto, 80, "float16", m, False, 163 * 1024) == (
                auto, C.bwd_tile(d, auto, 80, "float16", m))
        for mf in range(1, C.DECODE_MAX_MF[d] + 1):
            for tile in [C.decode_tile(d)] + [t[d] for t in (C.DECODE_WIDE_TILES, C.DECODE_DEEP_TILES) if d in t]:
                fit = C.fit_decode_tile(d, tile, mf, lim)
                assert fit is not None and C.decode_smem_bytes(d, fit, mf) <= lim
                assert (fit == tile) == (C.decode_smem_bytes(d, tile, mf) <= lim)
    for m in (C.MOD_SCORE, C.MOD_SCORE_DROPOUT):  # packed / UA with the modifiers at head dim 128: none spill-free
        assert C.fit_bwd_partition(128, "2d", 80, "bfloat16", m, True, lim) is None
    assert C.fit_bwd_partition(128, "2d", 80, "bfloat16", 0, True, lim)[0] == "q"
    fitted = C.fitted_specs()
    assert fitted and set(fitted) <= set(C.all_specs())
    assert all(s.smem <= lim for s in fitted)


@pytest.mark.parametrize("name", list(DEVICES))
def test_precompile_compiles_what_the_device_launches(name, monkeypatch):
    """`python -m cuflash.precompile` on a 99 KB GPU compiles the fitted kernels in place of those it cannot launch;
    elsewhere the configurations of its arch, unchanged."""
    from cuflash import _configs as C, _launch, _loader, precompile

    cc, sms, per_block, per_sm, threads, cap = DEVICES[name]
    props = dict(multiProcessorCount=sms, sharedMemPerMultiprocessor=per_sm, sharedMemPerBlockOptin=per_block)
    monkeypatch.setattr(_launch, "_props", lambda dev: props)
    monkeypatch.setattr(_loader, "device_cc", lambda dev: cc)
    if cap:
        monkeypatch.setenv("CUFLASH_SMEM_PER_BLOCK", str(cap))
    specs = C.all_specs()
    got = precompile.for_device(specs)
    arch = [s for s in specs if s.min_arch <= cc and (not s.arch_suffix or s.min_arch == cc)]
    limit = _limit(name)
    assert all(s.smem <= limit for s in got) and len(set(got)) == len(got)
    if name in SMALL:
        fitted = C.fitted_specs(limit)
        assert set(got) == {s for s in arch if s.smem <= limit} | set(fitted)
    else:
        assert got == arch
