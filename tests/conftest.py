"""Shared test machinery: GPU detection, fresh random inputs, the float64 reference and the error rule.

Error rule (as flash-attn's own tests): a cuflash kernel's max abs error against the float64 reference
must be at most 2x the error of torch's own attention computed in the same low precision on the same
inputs, plus a tiny floor for cases where torch happens to be (nearly) exact.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest

from cuflash import reference

ERR_FLOOR = 1e-5


@functools.lru_cache(maxsize=None)
def gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none found: cupy.cuda.runtime.getDeviceCount failed)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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
    """float64 host copy of a torch tensor or CuPy array (any dtype, bf16 included)."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return x.detach().double().cpu().numpy()
    import cupy

    return cupy.asnumpy(x.astype(cupy.float64))


def torch_attention_lowp(q, k, v, softmax_scale, causal):
    """torch's own attention in the inputs' dtype (the yardstick of the error rule); bottom-right causal,
    rows with no visible key -> 0."""
    import torch

    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    g = h // hk
    qh = q.transpose(1, 2)
    kh = k.transpose(1, 2).repeat_interleave(g, 1)
    vh = v.transpose(1, 2).repeat_interleave(g, 1)
    s = (qh @ kh.transpose(-1, -2)) * softmax_scale
    if causal:
        mask = torch.from_numpy(reference.causal_mask(sq, sk)).to(q.device)
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return (p @ vh).transpose(1, 2)


def max_err(a, ref: np.ndarray) -> float:
    return float(np.max(np.abs(to_np(a) - ref))) if ref.size else 0.0


def assert_close_to_ref(name, ours, torch_lowp, ref, factor=2.0):
    """ours must be within `factor` x torch's own low-precision error (+ floor); no NaN anywhere."""
    o = to_np(ours)
    assert not np.isnan(o).any(), f"{name}: NaN in output"
    e_ours, e_torch = max_err(ours, ref), max_err(torch_lowp, ref)
    assert e_ours <= factor * e_torch + ERR_FLOOR, (
        f"{name}: max abs error {e_ours:.3e} > {factor} x torch's {e_torch:.3e} + {ERR_FLOOR}")
    return e_ours, e_torch
