"""Shared test machinery: GPU detection, the kernel compile pass, fresh random inputs, the float64 reference and
the error rule.

Kernel compile pass: a test module that reads ptxas reports declares, in a module-level dict KERNEL_TASKS, the
compiles each of its tests reads ({test function name: function of the test's parameters returning a list of
cuflash._compile_check.Task}). Once collection is done, the union over the selected tests starts compiling
in the background, in one worker process per CPU (CUFLASH_COMPILE_JOBS overrides), each task once for the
whole run, while the other tests go on; a test gets the reports of its own tasks from the `kernel_report`
fixture, {name expression: report}, waiting only for those. CUFLASH_COMPILE_LOG=<file> writes every report
of the run there as JSON.

Error rule (as flash-attn's own tests): a cuflash kernel's max abs error against the float64 reference
must be at most 2x the error of torch's own attention computed in the same low precision on the same
inputs, plus a floor: half an ulp of the output dtype at the reference's largest magnitude (the error of
rounding the exact answer into that dtype; never less than ERR_FLOOR). Without it the rule compares two
maxima that are both set by the output's rounding, and an implementation as accurate as torch misses it
now and then: a float64 emulation of the backward's roundings (bench/NOTES.md) puts the median
dq error at 0.7 ulp for cuflash and 0.9 ulp for torch's fp16 math, yet 0.5-1% of random (b, h) problems of
shape (300, 17) causal or (257, 257) have cuflash's max above 2x torch's (a one-ulp rounding flip where
torch's max happened to be small); with the half-ulp floor, none of 1,200.
"""
from __future__ import annotations

import functools
import os

import numpy as np
import pytest

from cuflash import _compile_check, reference

ERR_FLOOR = 1e-5
_COMPILE_PASS = None


@functools.lru_cache(maxsize=None)
def gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def _skip_gpu_tests(items):
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none found: cupy.cuda.runtime.getDeviceCount failed)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _kernel_tasks(item):
    fn = getattr(getattr(item, "module", None), "KERNEL_TASKS", {}).get(getattr(item, "originalname", None))
    if fn is None:
        return []
    params = getattr(getattr(item, "callspec", None), "params", {})
    return list(fn(**params))


def _compile_pass():
    global _COMPILE_PASS
    if _COMPILE_PASS is None:
        _COMPILE_PASS = _compile_check.CompilePass()
    return _COMPILE_PASS


@pytest.hookimpl(trylast=True)  # after -k / -m / --deselect have dropped what will not run
def pytest_collection_modifyitems(config, items):
    """Without a GPU, mark the GPU tests skipped; start compiling every kernel the selected tests read (module
    docstring)."""
    _skip_gpu_tests(items)
    if config.option.collectonly:
        return
    tasks = []
    for item in items:
        try:
            tasks += _kernel_tasks(item)
        except Exception:  # e.g. a configuration table that does not import: the test itself reports it
            pass
    if tasks:
        _compile_pass().submit(tasks)


def pytest_sessionfinish():
    if _COMPILE_PASS is not None:
        _COMPILE_PASS.cancel()  # a run stopped early (-x, Ctrl-C) does not wait for the rest
        if os.environ.get("CUFLASH_COMPILE_LOG"):  # every ptxas report of the run, as JSON
            _COMPILE_PASS.dump(os.environ["CUFLASH_COMPILE_LOG"])


def pytest_terminal_summary(terminalreporter):
    p = _COMPILE_PASS
    if p is not None and p.results:
        versions = ", ".join(sorted(set(p.versions.values())))
        terminalreporter.write_line(
            f"kernel compile pass: {len(p.results)} NVRTC compiles (one kernel each; NVRTC {versions}), "
            f"{p.cpu_seconds():.0f} CPU s in {p.jobs} processes, {p.wall_s:.0f} s")


@pytest.fixture
def alt_nvrtc():
    """The second NVRTC's lib folder (CUFLASH_NVRTC_ALT); the test skips without it."""
    alt = os.environ.get("CUFLASH_NVRTC_ALT")
    if not alt:
        pytest.skip("CUFLASH_NVRTC_ALT not set (.ci/run sets it to NVRTC 13.0's lib folder)")
    return alt


@pytest.fixture
def kernel_report(request):
    """{name expression: ptxas report} of the current test's KERNEL_TASKS (one arch, one NVRTC), from the
    run's compile pass."""
    tasks = _kernel_tasks(request.node)
    assert tasks, f"{request.node.nodeid}: no KERNEL_TASKS entry"
    return _compile_check.by_name(_compile_pass().result(tasks))


@pytest.fixture(autouse=True)
def _poison_outputs(request):
    """GPU tests: every output cuflash allocates starts as NaN, so unwritten elements fail the check."""
    if "gpu" not in request.keywords:
        yield
        return
    from cuflash import _interop

    _interop.POISON = True
    yield
    _interop.POISON = False


def c_div(a: int, b: int) -> int:
    """C's integer division (toward zero), as the kernels' index arithmetic does it (CPU emulations of it)."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b > 0) else -q


def torch_inputs(shape_q, shape_kv, dtype, requires_grad=False, scale=1.0):
    """Fresh random q, k, v (standard normal times `scale`) as torch CUDA tensors."""
    import torch

    dt = getattr(torch, dtype)
    q = (torch.randn(shape_q, device="cuda") * scale).to(dt)
    k = (torch.randn(shape_kv, device="cuda") * scale).to(dt)
    v = torch.randn(shape_kv, device="cuda").to(dt)
    for x in (q, k, v):
        x.requires_grad_(requires_grad)
    return q, k, v


def to_np(x) -> np.ndarray:
    """float64 host copy of a torch tensor, CuPy array or NumPy array (any dtype, bf16 included)."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return x.detach().double().cpu().numpy()
    if isinstance(x, np.ndarray):
        return x.astype(np.float64)
    import cupy

    return cupy.asnumpy(x.astype(cupy.float64))


def torch_attention_lowp(q, k, v, softmax_scale, causal, window_size=(-1, -1), softcap=0.0, alibi=None,
                         dropout=None):
    """torch's own attention in the inputs' dtype (the yardstick of the error rule); bottom-right causal,
    rows with no visible key -> 0. The score modifiers as flash-attn's reference applies them: soft-cap, then the
    window's mask, then ALiBi's bias (`alibi`: a float32 tensor of slopes, (h,) or (b, h)). dropout: (keep mask
    [b, h, sq, sk], p): P * mask / (1 - p)."""
    import torch

    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    g = h // hk
    qh = q.transpose(1, 2)
    kh = k.transpose(1, 2).repeat_interleave(g, 1)
    vh = v.transpose(1, 2).repeat_interleave(g, 1)
    s = (qh @ kh.transpose(-1, -2)) * softmax_scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if tuple(window_size) != (-1, -1):
        vis = torch.from_numpy(reference.visible_mask(sq, sk, causal, window_size)).to(q.device)
        s = s.masked_fill(~vis, float("-inf"))
    elif causal:
        mask = torch.from_numpy(reference.causal_mask(sq, sk)).to(q.device)
        s = s.masked_fill(~mask, float("-inf"))
    if alibi is not None:
        bias = reference.alibi_bias(alibi.double().cpu().numpy(), b, h, sq, sk)
        s = s + torch.from_numpy(bias).to(q.device, q.dtype)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    if dropout is not None:
        mask, pd = dropout
        p = p * mask.to(p.dtype) / (1.0 - pd)
    return (p @ vh).transpose(1, 2)


_MANTISSA_BITS = {"bfloat16": 7, "float16": 10, "float32": 23, "float64": 52}


def half_ulp(x, ref: np.ndarray) -> float:
    """Half an ulp of x's dtype at max |ref| (0 for an empty or all-zero reference)."""
    m = float(np.max(np.abs(ref))) if ref.size else 0.0
    name = str(x.dtype)
    bits = next((b for n, b in _MANTISSA_BITS.items() if n in name), None)
    if m == 0.0 or bits is None:
        return 0.0
    return 0.5 * 2.0 ** (np.floor(np.log2(m)) - bits)


def max_err(a, ref: np.ndarray) -> float:
    return float(np.max(np.abs(to_np(a) - ref))) if ref.size else 0.0


def assert_close_to_ref(name, ours, torch_lowp, ref, factor=2.0):
    """ours must be within `factor` x torch's own low-precision error + the rounding floor (module docstring); no
    NaN anywhere."""
    o = to_np(ours)
    assert not np.isnan(o).any(), f"{name}: NaN in output"
    e_ours, e_torch = max_err(ours, ref), max_err(torch_lowp, ref)
    floor = max(ERR_FLOOR, half_ulp(ours, ref))
    assert e_ours <= factor * e_torch + floor, (
        f"{name}: max abs error {e_ours:.3e} > {factor} x torch's {e_torch:.3e} + {floor:.2e}")
    return e_ours, e_torch


# ------------------------------------------------------------------- host path with the GPU stood in (CPU)
_STAND_IN_PREAMBLE = r"""
import json, sys
sys.path.insert(0, {root!r})
from bench.diag import host_overhead as ho
torch = ho.install_fakes(record=True)
import cuflash
T = torch.Tensor
res = {{}}

def launches(fn):
    # the launches fn makes: [kernel name, grid, parameter bytes (hex)], and what fn returned
    ho.LAUNCHES.clear()
    out = fn()
    rec = [[r[0], list(r[1]), r[4].hex()] for r in ho.LAUNCHES]
    ho.LAUNCHES.clear()
    return rec, out

def err(fn):
    try:
        fn()
        return ["no error", ""]
    except (TypeError, ValueError, NotImplementedError) as e:
        return [type(e).__name__, str(e)]
"""


def compile_problems(specs, archs=(90,), alt_archs=(90,)) -> list:
    """Compile `specs` offline for `archs` with the pip NVRTC and for `alt_archs` with CUFLASH_NVRTC_ALT's (when set),
    each kernel alone, in parallel; the (name, arch, nvrtc, report) of every one _compile_check.bad_kernels rejects
    (an error, spills or local memory, a ptxas performance note)."""
    from cuflash._compile_check import CompilePass, bad_kernels, tasks

    alt = os.environ.get("CUFLASH_NVRTC_ALT")
    ts = tasks(specs, tuple(archs)) + (tasks(specs, tuple(alt_archs), alt) if alt and alt_archs else [])
    return [(t.name, t.arch, t.nvrtc, r) for t, r in CompilePass().result(ts).items() if bad_kernels({t.name: r})]


def run_result_script(code: str) -> dict:
    """Run the Python source `code` in a subprocess from the checkout's root; it prints its results as one line
    "RESULT" + JSON, which is returned (the last such line)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=root)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads([x for x in r.stdout.splitlines() if x.startswith("RESULT")][-1][len("RESULT"):])


def run_with_stand_ins(body: str) -> dict:
    """Run `body` in a subprocess whose torch, driver launches and compiler are bench.diag.host_overhead's
    stand-ins (the preamble above defines T, launches(), err() and a dict `res`); returns `res`, which the body
    fills with JSON-able values."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    return run_result_script(_STAND_IN_PREAMBLE.format(root=str(root)) + body + '\nprint("RESULT" + json.dumps(res))\n')


def launch_params(launch, zero=("o", "lse")) -> tuple:
    """(kernel name, grid, parameter bytes) of a recorded launch with the FwdParams fields `zero` (fresh
    allocations: out, lse) set to 0 -- and, with "o" among them, the base address in the Hopper forward's O map
    (the fourth map after FwdParams, o_tma)."""
    import struct

    from cuflash._fwd_sm90 import MAPS_OFFSET
    from cuflash._launch import FWD_FORMAT, FWD_PARAMS
    from cuflash._tma import MAP_BYTES

    names = [n for n, _ in FWD_PARAMS]
    name, grid, raw = launch
    raw = bytearray(bytes.fromhex(raw))
    p = list(struct.unpack_from(FWD_FORMAT, raw, 0))
    for f in zero:
        p[names.index(f)] = 0
    struct.pack_into(FWD_FORMAT, raw, 0, *p)
    o_map = MAPS_OFFSET + 3 * MAP_BYTES
    if "o" in zero and "flash_fwd_sm90_kernel<" in name and len(raw) >= o_map + 8:
        raw[o_map:o_map + 8] = bytes(8)
    return name, grid, bytes(raw)
