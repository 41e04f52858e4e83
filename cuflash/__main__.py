"""`python -m cuflash`: check cuflash against a float64 reference on a few shapes and time it against
torch SDPA's FlashAttention-2 backend. Needs a CUDA GPU (and torch for the comparison)."""
from __future__ import annotations

import sys


NO_GPU = "no NVIDIA driver / GPU found"


def _driver_loadable() -> bool:
    """Whether the NVIDIA driver library (libcuda) can be loaded: without it no CUDA call can succeed, and
    the CUDA runtime's own error for that case ("driver version is insufficient") misleads."""
    import ctypes
    import ctypes.util

    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll", ctypes.util.find_library("cuda")):
        if name:
            try:
                ctypes.CDLL(name)
                return True
            except OSError:
                pass
    return False


def gpu_count() -> tuple:
    """(number of CUDA devices, why none) -- 0 with the reason when there is no usable GPU."""
    if not _driver_loadable():
        return 0, NO_GPU
    try:
        import cupy

        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - any failure here means: no usable GPU
        return 0, f"{NO_GPU}: {type(e).__name__}: {e}"
    return n, "" if n else NO_GPU


def main() -> int:
    ngpu, why = gpu_count()
    if ngpu == 0:
        print(f"cuflash demo needs a CUDA GPU (sm_80 or newer): {why}.\n"
              "The CPU test suite (python -m pytest -q) still checks the references, compilation and validation.")
        return 2
    try:
        import torch
    except ImportError:
        print("cuflash demo compares against torch SDPA: install torch (pip install -e '.[torch]').")
        return 2

    import numpy as np
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import cuflash
    from cuflash import reference

    print(f"GPU: {torch.cuda.get_device_name()}")
    ok = True
    for (b, sq, sk, h, hk, d, causal) in [(2, 333, 333, 4, 4, 64, True), (1, 1000, 700, 8, 2, 128, False)]:
        q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.float16, requires_grad=True)
        k = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.float16, requires_grad=True)
        v = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.float16, requires_grad=True)
        out = cuflash.flash_attn_func(q, k, v, causal=causal)
        dout = torch.randn_like(out)
        out.backward(dout)
        as64 = [x.detach().double().cpu().numpy() for x in (q, k, v, dout)]
        ref_o, _ = reference.attention_forward(*as64[:3], None, causal)
        ref_g = reference.attention_backward(as64[3], *as64[:3], None, causal)
        errs = [np.abs(out.detach().double().cpu().numpy() - ref_o).max()] + [
            np.abs(g.double().cpu().numpy() - r).max() for g, r in zip((q.grad, k.grad, v.grad), ref_g)]
        good = all(e < 5e-2 for e in errs) and torch.isfinite(out).all().item()
        ok &= good
        print(f"  b={b} sq={sq} sk={sk} h={h} hk={hk} d={d} causal={causal}: max abs err out {errs[0]:.1e}, "
              f"dq {errs[1]:.1e}, dk {errs[2]:.1e}, dv {errs[3]:.1e}  {'ok' if good else 'WRONG'}")

    def bench(fn, n=20):
        fn()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(n):
            fn()
        e.record()
        e.synchronize()
        return s.elapsed_time(e) / n

    print("forward, fp16, batch x seqlen = 16k, hidden 2048 (TFLOP/s; FlashAttention-2's formula):")
    for d in (64, 128):
        for s_ in (2048, 8192):
            b, h = 16384 // s_, 2048 // d
            q, k, v = (torch.randn(b, s_, h, d, device="cuda", dtype=torch.float16) for _ in range(3))
            qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
            flops = reference.attention_flops(b, h, s_, s_, d)
            ms_cu = bench(lambda: cuflash.flash_attn_func(q, k, v))
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                ms_fa = bench(lambda: F.scaled_dot_product_attention(qt, kt, vt))
            print(f"  d={d:3d} s={s_:5d}: cuflash {flops / ms_cu / 1e9:5.0f}   SDPA flash {flops / ms_fa / 1e9:5.0f}   "
                  f"ratio {ms_fa / ms_cu:.2f}")
    print("all checks passed" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
