"""GPU: ring attention (cuflash.distributed) with cuflash's kernels. The in-process simulation of N ranks on one
GPU (the ring loop of a real rank, SimRing for the transfers) against the float64 reference with the error rule
of conftest.py (2x torch's own error for out, 3x for the gradients) and against the unsharded cuflash call;
autograd through RingFlashAttnFunction; a 2-process gloo ring on one GPU (transfers through host memory: gloo's
send/recv take host tensors); NCCL under torchrun over all visible GPUs (skipped with fewer than 2).
(CPU: tests/test_distributed_cpu.py.)"""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import cuflash
from cuflash import distributed as cd
from cuflash import reference
from conftest import assert_close_to_ref, to_np, torch_attention_lowp, torch_inputs

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parent.parent


def _lowp_grads(q, k, v, dout, scale, causal):
    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = torch_attention_lowp(qq, kk, vv, scale, causal)
    out.backward(dout)
    return out, qq.grad, kk.grad, vv.grad


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("h,hk,d", [(4, 4, 64), (8, 2, 128)])
def test_simulated_ring_matches_reference(dtype, causal, layout, n, h, hk, d):
    import torch

    per = 2 if layout == "zigzag" else 1
    seqlen = n * per * 72  # 72-row chunks: ragged against every kernel tile
    q, k, v = torch_inputs((2, seqlen, h, d), (2, seqlen, hk, d), dtype)
    dout = torch.randn_like(q)
    scale = d ** -0.5

    def sh(x):  # leaf shards, as each rank would hold them
        return [cd.shard(x, r, n, layout).contiguous().requires_grad_() for r in range(n)]

    qs, ks, vs = (sh(x) for x in (q, k, v))
    outs, lses = cd.simulated_ring_flash_attn_func(qs, ks, vs, causal=causal, layout=layout, return_lse=True)
    torch.autograd.backward(outs, [cd.shard(dout, r, n, layout) for r in range(n)])
    out = cd.unshard(outs, layout)
    lse = cd.unshard(lses, layout, dim=2)
    grads = [cd.unshard([x.grad for x in xs], layout) for xs in (qs, ks, vs)]
    ref_o, ref_lse = reference.attention_forward(to_np(q), to_np(k), to_np(v), scale, causal)
    ref_g = reference.attention_backward(to_np(dout), to_np(q), to_np(k), to_np(v), scale, causal)
    lowp = _lowp_grads(q, k, v, dout, scale, causal)
    tag = f"N={n} {layout} {dtype} causal={causal} h={h}/{hk} d={d}"
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert_close_to_ref(f"out {tag}", out, lowp[0], ref_o, factor=2.0)
    assert np.abs(to_np(lse) - ref_lse).max() < 1e-3
    for name, ours, lp, r in zip(("dq", "dk", "dv"), grads, lowp[1:], ref_g):
        assert ours.shape == lp.shape and ours.dtype == lp.dtype
        assert_close_to_ref(f"{name} {tag}", ours, lp, r, factor=3.0)
    # the unsharded cuflash call: the ring adds at most the merge's roundings
    q1, k1, v1 = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out1 = cuflash.flash_attn_func(q1, k1, v1, causal=causal)
    out1.backward(dout)
    for name, ours, one, r in zip(("out", "dq", "dk", "dv"), [out] + grads, (out1, q1.grad, k1.grad, v1.grad),
                                  [ref_o] + list(ref_g)):
        assert_close_to_ref(f"{name} vs one call {tag}", ours, one, r, factor=3.0)


def test_simulated_ring_forward_only_and_errors():
    import torch

    q, k, v = torch_inputs((1, 512, 4, 64), (1, 512, 4, 64), "bfloat16")
    n = 4
    qs, ks, vs = ([cd.shard(x, r, n) for r in range(n)] for x in (q, k, v))
    with torch.no_grad():
        outs = cd.simulated_ring_flash_attn_func(qs, ks, vs, causal=True)
    ref = cuflash.flash_attn_func(q, k, v, causal=True)
    assert (to_np(cd.unshard(outs)) - to_np(ref)).__abs__().max() < 2e-2
    with pytest.raises(TypeError):
        cd.simulated_ring_flash_attn_func([x.float() for x in qs], ks, vs)
    with pytest.raises(ValueError, match="q's local seqlen"):
        cd.simulated_ring_flash_attn_func([x[:, :127] for x in qs], [x[:, :127] for x in ks],
                                          [x[:, :127] for x in vs])


def _torchrun(n, *args, timeout=300):
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={n}", "--standalone",
           str(ROOT / "bench" / "diag" / "ring_check.py"), *args]
    r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    return r.returncode, r.stdout + r.stderr


def test_two_processes_gloo_on_one_gpu():
    """Two ranks on one GPU over gloo (its send/recv take host tensors: TorchRing stages through host memory)."""
    rc, log = _torchrun(2, "check", "--backend", "gloo", "--chunk", "48")
    assert rc == 0 and "RING_CHECK PASS" in log, log[-4000:]


def test_nccl_ring_over_all_gpus():
    import torch

    n = torch.cuda.device_count()
    if n < 2:
        pytest.skip(f"NCCL ring needs at least 2 GPUs (one rank per GPU); {n} visible")
    rc, log = _torchrun(n, "check", "--backend", "nccl")
    assert rc == 0 and "RING_CHECK PASS" in log, log[-4000:]
