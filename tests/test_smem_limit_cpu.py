"""CPU: a kernel whose tile needs more shared memory per block than the device allows is refused with a
NotImplementedError naming the kernel, its bytes, the device's compute capability and limit -- before anything is
compiled or launched -- where the driver would fail the launch with an opaque error (README, Caveats: the tiles are
sized for A100 / H100-class GPUs; an RTX 40's sm_89 allows 99 KB a block). The GPU is replaced by bench's
host_overhead stand-ins in a subprocess, whose device properties are then those of an sm_89 GPU (99 KB per block,
100 KB per SM), an A100 (163 / 164 KB) or the H200 (227 / 228 KB)."""
import json
import os
import subprocess
import sys

import pytest

from cuflash import _configs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICES = {  # compute capability, SMs, opt-in shared memory per block, shared memory per SM, threads per SM
    "sm89": (89, 128, 99 * 1024, 100 * 1024, 1536),
    "sm80": (80, 108, 163 * 1024, 164 * 1024, 2048),
    "sm90": (90, 132, 227 * 1024, 228 * 1024, 2048),
}
# name: (call, head dim, causal): forward / backward / decode step, fp16, GQA 4 / 8 heads for the decode step
CALLS = [(c, d, causal) for d in (32, 64, 96, 128, 256) for c in ("fwd", "bwd", "decode") for causal in (False, True)
         if not (c == "decode" and causal)]

_SCRIPT = r"""
import json, sys
sys.path.insert(0, ROOT)
from bench.diag import host_overhead as ho
torch = ho.install_fakes(record=True)
from cupy.cuda import runtime
from cuflash import _launch, _loader
import cuflash
cc, sms, per_block, per_sm, threads = DEVICE
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


def test_refused_before_launch_or_compile(device):
    """Each call either launches kernels that all fit the device's per-block limit, or raises before it launches or
    compiles anything, with the kernel, its bytes, the compute capability and the limit in the message."""
    name, res = device
    cc, _, per_block, _, _ = DEVICES[name]
    for key, r in res.items():
        if r["err"] is None:
            assert r["launches"], key
            assert all(smem <= per_block for _, smem in r["launches"]), (key, r["launches"])
        else:
            assert r["launches"] == [] and r["compiled"] == [], (key, r)
            assert f"compute capability {cc // 10}.{cc % 10}" in r["err"] and f"at most {per_block} bytes" in r["err"]
            needed = int(r["err"].split(", ", 1)[1].split(" bytes", 1)[0])
            assert needed > per_block and "kernel (flash_" in r["err"], r["err"]


def test_what_runs_where(device):
    """A100 and H200: every call runs. sm_89: what the tables' footprints predict -- the forward's tiles at head dims
    32-256 fit 99 KB except the non-causal head-dim-128 tile (128 x 64, 102 KB), the backward's from head dim 64 do
    not, nor the decode kernel's at head dims 96-256."""
    name, res = device
    refused = sorted(k for k, r in res.items() if r["err"] is not None)
    if name != "sm89":
        assert refused == []
        return
    expected = sorted(["fwd 128 False"] + [f"bwd {d} {c}" for d in (64, 96, 128, 256) for c in (False, True)]
                      + [f"decode {d} False" for d in (96, 128, 256)])
    assert refused == expected
    # the refused forward is the configured tile's footprint, read from the same table the launch uses
    tile = _configs.fwd_tile(128, False, _configs.MOD_NONE)
    assert str(_configs.fwd_smem_bytes(128, tile)) in res["fwd 128 False"]["err"]
