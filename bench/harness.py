"""One benchmark harness: CUDA-event medians after warm-up, FlashAttention-2's FLOP formula
(cuflash.reference.attention_flops), torch SDPA backends measured in the same run, and a results file
with the GPU, clocks and library versions recorded."""
from __future__ import annotations

import json
import platform
import subprocess
import time

from cuflash.reference import attention_flops

SDPA_PROVIDERS = ("flash", "cudnn", "efficient")


def time_ms(fn, warmup=3, rep=20, min_warmup_ms=20.0) -> float:
    """Median of `rep` CUDA-event timings of fn() after warm-up (at least `min_warmup_ms` of work)."""
    import torch

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    n = 0
    while n < warmup or (time.perf_counter() - t0) * 1e3 < min_warmup_ms:
        fn()
        n += 1
        if n >= 200:
            break
    torch.cuda.synchronize()
    times = []
    for _ in range(rep):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    return times[len(times) // 2]


def host_us_per_call(fn, n=200) -> float:
    """Wall-clock microseconds per call of a loop of calls from Python (latency-bound small shapes)."""
    import torch

    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def time_rounds(fns: dict, rounds: int = 1, **kw) -> dict:
    """{name: (median ms over the rounds, [ms per round])} of time_ms(fn, **kw) for each fn of `fns`, timed in
    turn in each round (A, B, C, A, B, C, ...), so that clock drift between loops lands on every provider alike.
    A provider that raises RuntimeError (an SDPA backend refusing the case) gets (None, [])."""
    per = {name: [] for name in fns}
    failed = set()
    for _ in range(rounds):
        for name, fn in fns.items():
            if name in failed:
                continue
            try:
                per[name].append(time_ms(fn, **kw))
            except RuntimeError as e:
                failed.add(name)
                print(f"{name} failed: {e}")
    return {name: (sorted(ms)[len(ms) // 2] if ms and name not in failed else None, ms) for name, ms in per.items()}


def sdpa(provider: str):
    """fn(q, k, v, causal, scale) calling torch SDPA pinned to one backend; layout [b, h, s, d]."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
               "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[provider]

    def call(q, k, v, causal=False, scale=None, enable_gqa=False):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=enable_gqa)

    return call


def record(provider, algo, mode, dtype, batch, heads, seqlen_q, seqlen_k, headdim, causal, ms, **extra):
    fl = attention_flops(batch, heads, seqlen_q, seqlen_k, headdim, causal=causal, mode=mode) if mode in (
        "fwd", "bwd", "fwd_bwd") else 0.0
    r = dict(provider=provider, algo=algo, mode=mode, dtype=dtype, batch=batch, heads=heads, seqlen_q=seqlen_q,
             seqlen_k=seqlen_k, headdim=headdim, causal=causal, ms=ms,
             tflops=(fl / (ms * 1e-3) / 1e12) if (ms and fl) else None)
    r.update(extra)
    return r


def _smi(query: str) -> str:
    try:
        return subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
    except Exception as e:  # noqa: BLE001 - recorded, not fatal
        return f"n/a ({e})"


def header() -> dict:
    import cupy
    import torch

    p = torch.cuda.get_device_properties(0)
    return dict(
        gpu=p.name, sms=p.multi_processor_count, cc=f"{p.major}.{p.minor}",
        clocks=_smi("clocks.sm,clocks.max.sm,clocks.mem"), driver=_smi("driver_version"),
        torch=torch.__version__, torch_cuda=torch.version.cuda, cupy=cupy.__version__,
        cuda_runtime=cupy.cuda.runtime.runtimeGetVersion(), nvrtc=".".join(map(str, cupy.cuda.nvrtc.getVersion())),
        python=platform.python_version(), date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    )


def save(path, head: dict, records: list) -> None:
    with open(path, "w") as f:
        json.dump({"header": head, "records": records}, f, indent=1)


def measure_ceilings() -> list:
    """Copy bandwidth (bytes read + written) and cuBLAS bf16 matmul rate, measured in this run."""
    import torch

    x = torch.empty(2 ** 29, dtype=torch.float16, device="cuda").normal_()  # 1 GiB
    y = torch.empty_like(x)
    ms = time_ms(lambda: y.copy_(x))
    bw = 2 * x.numel() * 2 / (ms * 1e-3) / 1e12
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms_mm = time_ms(lambda: a @ b)
    return [dict(provider="ceiling", algo="copy", mode="copy", ms=ms, tb_per_s=bw),
            dict(provider="ceiling", algo="cublas_bf16_8192", mode="matmul", ms=ms_mm,
                 tflops=2 * 8192 ** 3 / (ms_mm * 1e-3) / 1e12)]
