"""The one benchmark harness.

* `time_ms`: median of CUDA-event timings of a call, after warm-up.
* `time_rounds`: several providers timed in turn (A, B, C, A, B, C, ...), the median per provider, so that a
  clock change between loops lands on every provider alike.
* `host_us_per_call`: wall-clock microseconds per call of a loop of calls (small, latency-bound shapes).
* `sdpa`: torch SDPA pinned to one backend (FLASH, CUDNN, EFFICIENT, MATH), the reference in every grid.
* `record` / `flops`: one record per measurement, TFLOP/s by FlashAttention-2's formula
  (`cuflash.reference.attention_flops`: 4 * B * H * Sq * Sk * D, halved for causal, x2.5 for the backward;
  the only definition, every benchmark goes through `record`), and the kernel path of a cuflash record in
  its `backend` field.
* `header`: GPU, driver, clocks and library versions of a results file, the checkout's HEAD (`commit`) and the
  git trees of the code as it ran (`source`: cuflash/ and cuda_src/, uncommitted changes included).

Nothing here imports torch or CuPy at module level: `import bench` works on a machine without a GPU."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import tempfile
import time

SDPA_PROVIDERS = ("flash", "cudnn", "efficient")
FLOP_MODES = ("fwd", "bwd", "fwd_bwd")


def flops(batch, heads, seqlen_q, seqlen_k, headdim, causal=False, mode="fwd") -> float:
    """FlashAttention-2's FLOP count of one call (cuflash.reference.attention_flops)."""
    from cuflash.reference import attention_flops

    return attention_flops(batch, heads, seqlen_q, seqlen_k, headdim, causal=causal, mode=mode)


def tflops(ms, batch, heads, seqlen_q, seqlen_k, headdim, causal=False, mode="fwd"):
    """TFLOP/s of a call taking `ms` milliseconds (None when ms is missing)."""
    if not ms or mode not in FLOP_MODES:
        return None
    return flops(batch, heads, seqlen_q, seqlen_k, headdim, causal, mode) / (ms * 1e-3) / 1e12


def time_ms(fn, warmup=3, rep=20, min_warmup_ms=20.0) -> float:
    """Median of `rep` CUDA-event timings of fn() after warm-up (at least `warmup` calls and `min_warmup_ms` of work,
    at most 200 calls). The work is counted on the GPU: each warm-up call is waited for, since a host loop of
    asynchronous calls would count its launches instead and queue 200 calls of a long kernel (seconds each)."""
    import torch

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    n = 0
    while n < warmup or (time.perf_counter() - t0) * 1e3 < min_warmup_ms:
        fn()
        torch.cuda.synchronize()
        n += 1
        if n >= 200:
            break
    return event_median_ms(fn, rep)


def event_median_ms(fn, rep, before=None) -> float:
    """Median of `rep` CUDA-event timings of fn() (no warm-up); before(), if given, runs untimed ahead of each."""
    import torch

    times = []
    for _ in range(rep):
        if before is not None:
            before()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    return times[len(times) // 2]


_SPIN_CYCLES: dict = {}


def spin_cycles(ms: float = 3.0) -> int:
    """Cycles of torch.cuda._sleep (a spin kernel) that keep the current GPU busy about `ms` (measured once per
    device and ms)."""
    import torch

    key = (torch.cuda.current_device(), ms)
    if key not in _SPIN_CYCLES:
        n = 1_000_000
        torch.cuda._sleep(n)  # warm-up (the first launch loads the kernel)
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        torch.cuda._sleep(n)
        e.record()
        e.synchronize()
        _SPIN_CYCLES[key] = int(n * ms / max(s.elapsed_time(e), 1e-3))
    return _SPIN_CYCLES[key]


def time_queued_ms(fn, warmup=3, rep=10, spin_ms=3.0) -> float:
    """Median CUDA-event time of fn() queued behind a ~spin_ms spin kernel, its start event recorded after the spin
    (after warm-up as time_ms): what the host does before fn's first kernel (torch's autograd hand-off, Python) lies
    under the spin, so the time is fn's GPU time, as when the GPU is still busy with earlier work (a training step).
    The idle-GPU single call is time_ms; the difference is the host time a lone call exposes
    (bench.diag.bwd_handoff)."""
    import torch

    time_ms(fn, warmup=warmup, rep=1)
    cycles = spin_cycles(spin_ms)

    def spin():
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles)

    return event_median_ms(fn, rep, before=spin)


def queued_timer(rep=10) -> dict:
    """time_rounds' keywords for timing each call queued behind a spin kernel (time_queued_ms, `rep` calls): the
    suites' queued timing."""
    return dict(timer=lambda fn: time_queued_ms(fn, rep=rep))


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


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else None


def time_rounds(fns: dict, rounds: int = 1, timer=None, log=None, rotate: bool = False, **kw) -> dict:
    """{name: (median over the rounds, [one value per round])} of timer(fn, **kw) (default: time_ms) for each fn of
    `fns`, timed in turn in each round (A, B, C, A, B, C, ...), so that clock drift between loops lands on every
    provider alike; `rotate`: round r starts at the r-th provider (A, B, C, B, C, A, C, A, B, ...), so that no
    provider is always first after another's loop (each list stays in round order). A provider that raises RuntimeError
    (an SDPA backend refusing the case) gets (None, []). log: a label; each timing is then printed as it ends (round,
    provider, ms, wall seconds it took), so that a point that takes far longer than its kernels shows which provider
    does."""
    timer = timer or time_ms
    per = {name: [] for name in fns}
    failed = set()
    order = list(fns.items())
    for rnd in range(rounds):
        k = rnd % len(order) if rotate and order else 0
        for name, fn in order[k:] + order[:k]:
            if name in failed:
                continue
            t0 = time.perf_counter()
            try:
                per[name].append(timer(fn, **kw))
            except RuntimeError as e:
                failed.add(name)
                print(f"{name} failed: {e}")
                continue
            if log:
                print(f"  {log} round {rnd}: {name} {per[name][-1]:.3f} ms ({time.perf_counter() - t0:.1f} s)",
                      flush=True)
    return {name: (median(ms) if ms and name not in failed else None, ms) for name, ms in per.items()}


def sdpa(provider: str):
    """fn(q, k, v, causal, scale) calling torch SDPA pinned to one backend; layout [b, h, s, d]."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
               "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[provider]

    def call(q, k, v, causal=False, scale=None, enable_gqa=False):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=enable_gqa)

    return call


def backend_of(algo) -> str:
    """The kernel path of a cuflash record, from its algo label: "v1" (FlashAttention-1 kernels), "decode" (the
    dedicated decode kernel), "sm90" (the Hopper forward: an algo label naming it), "sm80" (the mma.sync kernels:
    V2 forward and backward, the split-KV forward)."""
    a = str(algo or "")
    if a.startswith("v1"):
        return "v1"
    if "sm90" in a:
        return "sm90"
    if a.startswith("decode"):
        return "decode"
    return "sm80"


# While bench.run runs a suite, every record made is also kept here, so that a suite stopped part-way (a time limit's
# SIGTERM) still leaves the points it measured (bench.run.run_suites saves them, marked partial).
LIVE: list | None = None


def record(provider, algo, mode, dtype, batch, heads, seqlen_q, seqlen_k, headdim, causal, ms, backend=None, **extra):
    """One measurement. TFLOP/s for modes fwd / bwd / fwd_bwd by `flops`; cuflash records carry `backend`."""
    r = dict(provider=provider, algo=algo, mode=mode, dtype=dtype, batch=batch, heads=heads, seqlen_q=seqlen_q,
             seqlen_k=seqlen_k, headdim=headdim, causal=causal, ms=ms,
             tflops=tflops(ms, batch, heads, seqlen_q, seqlen_k, headdim, causal, mode))
    if provider == "cuflash" or backend is not None:
        r["backend"] = backend or backend_of(algo)
    r.update(extra)
    if LIVE is not None:
        LIVE.append(r)
    return r


def _smi(query: str) -> str:
    try:
        return subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
    except Exception as e:  # noqa: BLE001 - recorded, not fatal
        return f"n/a ({e})"


def _version(mod: str):
    try:
        return __import__(mod).__version__
    except Exception:  # noqa: BLE001 - not installed
        return None


def git_commit(path=None):
    """HEAD of the checkout whose top level is `path` (default: this repository), or None: a folder inside some
    other checkout (an exported tree under this one) is not that checkout's HEAD. A tree exported without git (e.g.
    `git archive REV | tar -x`) names its commit in a file COMMIT at its root, which wins; a checkout with
    uncommitted changes to cuflash/ or cuda_src/ gets "+dirty"."""
    path = path or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    marker = os.path.join(str(path), "COMMIT")
    if os.path.isfile(marker):
        return open(marker).read().strip() or None
    try:
        top = subprocess.run(["git", "-C", str(path), "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                             timeout=10)
        if top.returncode or os.path.realpath(top.stdout.strip()) != os.path.realpath(str(path)):
            return None
        d = subprocess.run(["git", "-C", str(path), "status", "--porcelain", "--", "cuflash", "cuda_src"],
                           capture_output=True, text=True, timeout=10)
        dirty = "+dirty" if d.returncode == 0 and d.stdout.strip() else ""
        p = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        return (p.stdout.strip() + dirty) or None
    except Exception:  # noqa: BLE001
        return None


SOURCE_DIRS = ("cuflash", "cuda_src")


def source_trees(path=None):
    """{"cuflash": tree, "cuda_src": tree}: the git tree hashes of those folders as they are at `path` (any folder
    that holds them: a checkout's working tree with its uncommitted and untracked files, or a tree exported without
    git), made in a temporary repository whose work tree is `path`, so no checkout's index is touched; files that
    this repository's .gitignore or `path`'s own ignores are left out. A tree equals `git rev-parse COMMIT:cuflash`
    of every commit that holds exactly these files, so a run on a copy of the tree whose HEAD (git_commit) is older
    than its files, or on an export that names no commit, still names the code it ran: `git log --format='%H %T'
    ...` or `git rev-parse REV:cuflash` finds the commit. None without git or without those folders."""
    path = str(path or os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if not all(os.path.isdir(os.path.join(path, d)) for d in SOURCE_DIRS):
        return None
    ours = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".gitignore")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run(["git", "init", "-q", tmp], capture_output=True, timeout=60, check=True)
            git_dir = os.path.join(tmp, ".git")
            env = dict(os.environ, GIT_DIR=git_dir, GIT_WORK_TREE=path)
            env.pop("GIT_INDEX_FILE", None)

            def git(*args):
                r = subprocess.run(["git", *args], cwd=path, env=env, capture_output=True, text=True, timeout=60)
                if r.returncode:
                    raise RuntimeError(r.stderr.strip())
                return r.stdout.strip()

            with open(os.path.join(git_dir, "info", "exclude"), "a") as f:
                f.write(open(ours).read() if os.path.isfile(ours) else "__pycache__/\n")
            git("add", "-A", "--", *SOURCE_DIRS)
            tree = git("write-tree")
            return {d: git("rev-parse", f"{tree}:{d}") for d in SOURCE_DIRS}
    except Exception:  # noqa: BLE001 - no git: the header says None
        return None


def header() -> dict:
    """GPU, clocks, driver and library versions (torch, CUDA, CuPy, NVRTC, triton) of this run."""
    import cupy
    import torch

    p = torch.cuda.get_device_properties(0)
    return dict(
        gpu=p.name, sms=p.multi_processor_count, cc=f"{p.major}.{p.minor}",
        clocks=_smi("clocks.sm,clocks.max.sm,clocks.mem"), driver=_smi("driver_version"),
        torch=torch.__version__, torch_cuda=torch.version.cuda, cupy=cupy.__version__,
        cuda_runtime=cupy.cuda.runtime.runtimeGetVersion(), nvrtc=".".join(map(str, cupy.cuda.nvrtc.getVersion())),
        triton=_version("triton"), python=platform.python_version(), commit=git_commit(),
        source=source_trees(),
        date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    )


def save(path, head: dict, records: list) -> None:
    with open(path, "w") as f:
        json.dump({"header": head, "records": records}, f, indent=1)


def measure_ceilings() -> list:
    """Copy bandwidth (bytes read + written), cuBLAS bf16 matmul rate and read-only bandwidth, measured in this run.
    The read probe ("read": the bytes a kernel that only reads can stream, the yardstick of decoding, which reads
    the cache and writes almost nothing) is the fastest of two full reductions of 1 GiB in torch (sum in fp32, max;
    also recorded alone as "read_torch", the probe's definition before the kernels) and the read kernels of
    bench_read.PROBE_POINTS over the same GiB (one per load kind; a kernel whose block sums do not add up to the
    buffer's words, or that fails to compile or launch, is left out). torch's reductions streamed 4.02 TB/s on the
    H200 where cuDNN's decoder streamed 4.5: they are not the device's read bandwidth."""
    import torch

    x = torch.empty(2 ** 29, dtype=torch.float16, device="cuda").normal_()  # 1 GiB
    y = torch.empty_like(x)
    ms = time_ms(lambda: y.copy_(x))
    bw = 2 * x.numel() * 2 / (ms * 1e-3) / 1e12
    del y
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms_mm = time_ms(lambda: a @ b)
    del a, b
    ms_torch = min(time_ms(lambda: x.sum(dtype=torch.float32)), time_ms(lambda: x.max()))
    nbytes = x.numel() * 2
    ms_read, algo_read = ms_torch, "torch"
    for name, ms_k, nb in _read_kernel_probes(x):
        if ms_k * nbytes / nb < ms_read:  # per byte: a kernel may read a little less than the GiB (whole tiles)
            ms_read, algo_read = ms_k * nbytes / nb, name
    return [dict(provider="ceiling", algo="copy", mode="copy", ms=ms, tb_per_s=bw),
            dict(provider="ceiling", algo="cublas_bf16_8192", mode="matmul", ms=ms_mm,
                 tflops=2 * 8192 ** 3 / (ms_mm * 1e-3) / 1e12),
            dict(provider="ceiling", algo="read", mode="read", ms=ms_read, tb_per_s=nbytes / (ms_read * 1e-3) / 1e12,
                 read_kernel=algo_read),
            dict(provider="ceiling", algo="read_torch", mode="read", ms=ms_torch,
                 tb_per_s=nbytes / (ms_torch * 1e-3) / 1e12)]


def _read_kernel_probes(x) -> list:
    """[(name, ms, bytes read)] of bench_read.PROBE_POINTS over the tensor x (the ones that run and check out)."""
    import torch

    from . import bench_read as br

    cc = torch.cuda.get_device_capability()
    out = torch.zeros(1 << 16, dtype=torch.int32, device="cuda")
    words = x.view(torch.int32)
    stream = torch.cuda.current_stream().cuda_stream
    res = []
    for p in br.PROBE_POINTS:
        try:
            if p.spec().min_arch > cc[0] * 10 + cc[1]:
                continue
            prep = br.prepare(p, x.data_ptr(), x.numel() * x.element_size(), out.data_ptr(), stream=stream)
            out.zero_()
            prep.launch()
            if br.block_sums_total(out, prep.grid) != br.words_sum(words, *prep.check_range):
                print(f"read probe {p.name}: block sums do not add up; left out")
                continue
            res.append((p.name, time_ms(prep.launch), prep.bytes_read))
        except Exception as e:  # noqa: BLE001 - the probe falls back to torch's reductions
            print(f"read probe {p.name}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    return res


def read_bandwidth(ceilings) -> float | None:
    """Bytes per second of the read probe among measure_ceilings() records (None without one)."""
    r = next((c for c in ceilings if c.get("algo") == "read"), None)
    return r["tb_per_s"] * 1e12 if r and r.get("tb_per_s") else None
