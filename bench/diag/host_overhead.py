"""Diagnostic (CPU): host-side cost of one `flash_attn_with_kvcache` / `flash_attn_func` call, measured WITHOUT
a GPU.

    python -m bench.diag.host_overhead [--calls N] [--recycle]

Everything outside cuflash's own Python is replaced, in this process only, by near-free stand-ins: a fake
`torch` module (tensors that only carry a pointer, shape, strides, dtype), a no-op `cuLaunchKernel`, a
kernel loader that compiles nothing, and fixed device properties (132 SMs, 228 KB of shared memory per
SM). What is timed is therefore cuflash's own per-call Python path: validation, dispatch, configuration
look-ups, parameter packing. On a GPU machine each call additionally pays the real torch calls it makes
(counted here: `torch.empty` ~2-4 us each, `data_ptr()` / `stride()` / the current-stream query well under
1 us each) and the driver's cuLaunchKernel (~2-4 us each, counted here as `launches`).

The "hf step" rows time the Hugging Face integration's attention function (cuflash.integrations.transformers)
over greedy generation steps: per call, averaged over the layers and steps, whose keys and values grow by one key
a step (new arrays with new strides, as transformers' cache makes them).
"""
from __future__ import annotations

import argparse
import math
import statistics
import struct
import sys
import time
import types


class _Counters:
    empty = 0
    launches = 0


def _fake_torch():
    torch = types.ModuleType("torch")

    class dtype:
        def __init__(self, name, itemsize):
            self.name, self.itemsize = name, itemsize

        def __repr__(self):
            return f"torch.{self.name}"

    torch.float16, torch.bfloat16 = dtype("float16", 2), dtype("bfloat16", 2)
    torch.float32, torch.int32 = dtype("float32", 4), dtype("int32", 4)
    _next = [1 << 20]

    _strides_memo = {}

    def contiguous_strides(shape):
        st = _strides_memo.get(shape)
        if st is None:
            st, acc = [], 1
            for n in reversed(shape):
                st.insert(0, acc)
                acc *= n
            st = _strides_memo[shape] = tuple(st)
        return st

    class Tensor:
        """As cheap as possible, so that the timing is cuflash's, not the stand-in's."""

        __slots__ = ("shape", "dtype", "_strides", "_ptr", "_base")
        is_cuda = True
        requires_grad = False
        device = "cuda:0"

        def __init__(self, shape, dt, strides=None):
            self.shape = shape = tuple(shape)
            self.dtype = dt
            self._strides = contiguous_strides(shape) if strides is None else tuple(strides)
            self._ptr = _next[0]
            _next[0] += 1 << 16

        def stride(self):
            return self._strides

        def data_ptr(self):
            return self._ptr

        def get_device(self):
            return 0

        def fill_(self, v):
            return self

        def transpose(self, a, b):  # a view with dims a and b swapped
            t = Tensor.__new__(Tensor)
            sh, st = list(self.shape), list(self._strides)
            sh[a], sh[b], st[a], st[b] = sh[b], sh[a], st[b], st[a]
            t.shape, t.dtype, t._strides, t._ptr, t._base = tuple(sh), self.dtype, tuple(st), self._ptr, self
            return t

        def select(self, dim, i):  # a view, as torch's: one dim dropped, the base moved by i strides
            t = Tensor.__new__(Tensor)
            t.shape = self.shape[:dim] + self.shape[dim + 1:]
            t.dtype = self.dtype
            t._strides = self._strides[:dim] + self._strides[dim + 1:]
            t._ptr = self._ptr + i * self._strides[dim] * self.dtype.itemsize
            t._base = self  # a view keeps its base's address from being handed out again (--recycle)
            return t

    class Owned(Tensor):
        """A tensor made by torch.empty with RECYCLE on: its address goes back to a free list by size when it is
        dropped, and the next torch.empty of that size takes it (as torch's caching allocator hands blocks back)."""

        __slots__ = ("_key",)

        def __del__(self):
            _free.setdefault(self._key, []).append(self._ptr)

    _free = {}

    def empty(shape, dtype=None, device=None):
        _Counters.empty += 1
        if not RECYCLE[0]:
            return Tensor(shape, dtype)
        t = Owned(shape, dtype)
        t._key = key = math.prod(t.shape) * dtype.itemsize
        pool = _free.get(key)
        if pool:
            t._ptr = pool.pop()
        return t

    torch.Tensor = Tensor
    torch.empty = empty
    torch.zeros = empty
    torch.is_grad_enabled = lambda: False
    torch._C = types.SimpleNamespace(_cuda_getCurrentRawStream=lambda dev: 0)
    return torch


RECYCLE = [False]  # torch.empty's addresses: new every time, or recycled (--recycle)
LAUNCHES: list = []  # with record=True: (kernel name, grid, threads, smem, parameter bytes) per launch


def install_fakes(record=False):
    """Patch this process only: fake torch, no-op launches, no compilation, fixed device properties.
    record=True keeps every launch (kernel name expression, grid, threads, smem, the parameter block's
    bytes) in LAUNCHES, for tests of the host path."""
    import ctypes

    torch = _fake_torch()
    sys.modules["torch"] = torch
    from cupy.cuda import driver, runtime

    names = {}

    def launch(func, gx, gy, gz, bx, by, bz, smem, stream, argv, extra):
        _Counters.launches += 1
        if record:
            base = ctypes.cast(argv, ctypes.POINTER(ctypes.c_void_p))[0]
            LAUNCHES.append((names[func], (gx, gy, gz), bx, smem, ctypes.string_at(base, _MAX_PARAM_BYTES)))

    driver.launchKernel = launch
    driver.occupancyMaxActiveBlocksPerMultiprocessor = lambda func, threads, smem: 2
    runtime.getDevice = lambda: 0
    driver.ctxGetCurrent = lambda: 1  # a context is current (cuflash._interop.ensure_context)
    from cuflash import _loader
    from cuflash._launch import _MAX_PARAM_BYTES  # (the parameter buffer: every byte a launch could read)

    def get_function(filename, name, device, arch_suffix=""):
        raw = types.SimpleNamespace(kernel=types.SimpleNamespace(ptr=0x1000 + 16 * len(names)), num_regs=128,
                                    max_dynamic_shared_size_bytes=0)
        names[raw.kernel.ptr] = name
        return raw

    _loader.get_function = get_function
    _loader.device_cc = lambda device: 90  # the H200's (the backward picks its tiles by it; the forward its backend)
    from cuflash import _launch

    def launch_ex(cfg, func, argv, extra):  # cuLaunchKernelEx (Programmatic Dependent Launch): the same record
        if record:
            c = _launch.CUlaunchConfig.from_address(cfg)
            launch(func, c.gridDimX, c.gridDimY, c.gridDimZ, c.blockDimX, c.blockDimY, c.blockDimZ, c.sharedMemBytes,
                   c.hStream, argv, extra)
        else:
            _Counters.launches += 1
        return 0

    _launch._launch_ex, _launch._driver_version = launch_ex, 13000
    _launch._pdl_capable.cache_clear()
    from cuflash import _fwd_sm90, _tma

    def encode(addr, dtype, rank, ptr, dims, strides, box, estr, interleave, swizzle, l2, oob):
        # a stand-in CUtensorMap: the arguments themselves, so that a test can read what would be encoded
        blob = struct.pack("<QI", ptr, dtype) + b"".join(struct.pack("<QI", dims[i], box[i]) for i in range(rank))
        blob += b"".join(struct.pack("<Q", strides[i]) for i in range(rank - 1))
        ctypes.memmove(addr, blob.ljust(_tma.MAP_BYTES, b"\0"), _tma.MAP_BYTES)
        return 0

    _tma._encode_fn = encode
    _fwd_sm90._cc.clear()
    from cuflash import _walk

    # stream-K's workspace: a stand-in address, made once per stream as the real one (no device memory here)
    _walk._alloc_zeroed_flags = lambda device, stream, nbytes: types.SimpleNamespace(ptr=0x7000)
    props = dict(multiProcessorCount=132, sharedMemPerMultiprocessor=233472, maxThreadsPerMultiProcessor=2048,
                 regsPerMultiprocessor=65536, sharedMemPerBlockOptin=232448, reservedSharedMemPerBlock=1024)
    runtime.getDeviceProperties = lambda dev: props
    return torch


CASES = {
    # name: (batch, cache, heads, kv heads, head dim, extra kwargs)
    "b1 h8 hk8 4k d128 (small step)": (1, 4096, 8, 8, 128, {}),
    "b1 h32 hk8 32k d128 (GQA)": (1, 32768, 32, 8, 128, {}),
    "b8 h32 hk32 4k d128 (no split)": (8, 4096, 32, 32, 128, {}),
    "b1 h8 hk8 4k d128 return_softmax_lse": (1, 4096, 8, 8, 128, dict(return_softmax_lse=True)),
    "b1 h32 hk8 32k d128 append k, v": (1, 32768, 32, 8, 128, dict(append=True)),
}

FWD_CASES = {
    # name: (batch, seqlen, heads, kv heads, head dim, extra kwargs) of a flash_attn_func call (no autograd)
    "fwd b1 h8 s128 d64": (1, 128, 8, 8, 64, {}),
    "fwd b1 h8 s128 d64 causal": (1, 128, 8, 8, 64, dict(causal=True)),
    "fwd b2 h16 s1k d128": (2, 1024, 16, 16, 128, {}),
    "fwd b2 h32 hk8 s1k d128 (GQA)": (2, 1024, 32, 8, 128, {}),
}
GEN_CASES = {
    # name: (batch, prefill, heads, kv heads, head dim, sliding window): greedy generation steps through the Hugging
    # Face integration (cuflash.integrations.transformers, no padding), the cache one key longer each step
    "hf step b4 h16 hk4 d128 (GQA fold)": (4, 512, 16, 4, 128, None),
    "hf step b4 h16 hk16 d128 (sm90)": (4, 512, 16, 16, 128, None),
    "hf step b4 h16 hk4 d128 window 256": (4, 512, 16, 4, 128, 256),
}
GEN_LAYERS, GEN_STEPS = 8, 64
BWD_CASES = {  # flash_attn_backward: (b, s, h, hk, d, kwargs)
    "bwd b1 h8 s128 d64": (1, 128, 8, 8, 64, {}),
    "bwd b8 h16 s2k d128 causal": (8, 2048, 16, 16, 128, {"causal": True}),
}


def _time(fn, calls, repeats):
    """(median, best) us per call of fn, and (torch.empty, launches) of one warm call."""
    fn()  # warm: fills every memo
    e0, l0 = _Counters.empty, _Counters.launches
    fn()
    per_call = (_Counters.empty - e0, _Counters.launches - l0)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        ts.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(ts), min(ts), *per_call


def _integration(torch):
    """cuflash.integrations.transformers with a stand-in registry (transformers itself is not needed)."""
    if "transformers" not in sys.modules:
        tfm = types.ModuleType("transformers")
        tfm.AttentionInterface = types.SimpleNamespace(register=lambda name, fn: None)
        sys.modules["transformers"] = tfm
    from cuflash.integrations import transformers as integ

    return integ


def _time_generation(torch, b, prefill, h, hk, d, window, calls, repeats):
    """(median, best) us per attention call of GEN_STEPS greedy steps of GEN_LAYERS layers (each step's keys and
    values new [b, hk, keys, d] arrays, one key longer than the last step's), and (torch.empty, launches) per call."""
    integ = _integration(torch)
    module = types.SimpleNamespace(is_causal=True)
    kw = dict(dropout=0.0, scaling=d ** -0.5, sliding_window=window)
    rounds = max(1, calls // (GEN_STEPS * GEN_LAYERS))
    n = GEN_STEPS * GEN_LAYERS
    start = [prefill]

    def steps():  # the arrays of the next GEN_STEPS steps (made outside the timing)
        q = torch.Tensor((b, 1, h, d), torch.bfloat16).transpose(1, 2)
        out = [(q, [(torch.Tensor((b, hk, sk, d), torch.bfloat16), torch.Tensor((b, hk, sk, d), torch.bfloat16))
                    for _ in range(GEN_LAYERS)]) for sk in range(start[0] + 1, start[0] + 1 + GEN_STEPS)]
        start[0] += GEN_STEPS
        return out

    def run(arrays):
        for q, layers in arrays:
            for k, v in layers:
                integ.cuflash_attention_forward(module, q, k, v, None, **kw)

    run(steps())  # warm: the first step's plan
    e0, l0 = _Counters.empty, _Counters.launches
    run(steps())
    per_call = ((_Counters.empty - e0) / n, (_Counters.launches - l0) / n)
    ts = []
    for _ in range(repeats):
        t = 0.0
        for _ in range(rounds):
            arrays = steps()
            t0 = time.perf_counter()
            run(arrays)
            t += time.perf_counter() - t0
        ts.append(t / (rounds * n) * 1e6)
    return statistics.median(ts), min(ts), *per_call


def measure(calls=20000, repeats=5, kernels=(None,)):
    torch = install_fakes()
    import cuflash

    rows = []
    for name, (b, s, h, hk, d, kw) in CASES.items():
        q = torch.Tensor((b, 1, h, d), torch.float16)
        kc = torch.Tensor((b, s, hk, d), torch.float16)
        vc = torch.Tensor((b, s, hk, d), torch.float16)
        seqlens = torch.Tensor((b,), torch.int32)
        kw = dict(kw)
        if kw.pop("append", False):
            kw["k"] = torch.Tensor((b, 1, hk, d), torch.float16)
            kw["v"] = torch.Tensor((b, 1, hk, d), torch.float16)
        for kernel in kernels:
            kwargs = dict(kw, cache_seqlens=seqlens)
            if kernel is not None:
                kwargs["kernel"] = kernel

            def fn():
                return cuflash.flash_attn_with_kvcache(q, kc, vc, **kwargs)

            rows.append((name, kernel, *_time(fn, calls, repeats)))
    if kernels != (None,):
        return rows
    for name, (b, s, h, hk, d, kw) in FWD_CASES.items():
        q = torch.Tensor((b, s, h, d), torch.float16)
        k = torch.Tensor((b, s, hk, d), torch.float16)
        v = torch.Tensor((b, s, hk, d), torch.float16)

        def fn():
            return cuflash.flash_attn_func(q, k, v, **kw)

        rows.append((name, None, *_time(fn, calls, repeats)))
    for name, case in GEN_CASES.items():
        rows.append((name, None, *_time_generation(torch, *case, calls=calls, repeats=repeats)))
    for name, (b, s, h, hk, d, kw) in BWD_CASES.items():
        q, o, do = (torch.Tensor((b, s, h, d), torch.float16) for _ in range(3))
        k, v = torch.Tensor((b, s, hk, d), torch.float16), torch.Tensor((b, s, hk, d), torch.float16)
        lse = torch.Tensor((b, h, s), torch.float32)

        def fn():  # the autograd backward's path (FlashAttnFunction.backward) without torch's engine
            return cuflash.flash_attn_backward(do, q, k, v, o, lse, **kw)

        rows.append((name, None, *_time(fn, calls, repeats)))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--kernels", default="", help="comma list of kernel= values to pass (default: none)")
    ap.add_argument("--recycle", action="store_true",
                    help="torch.empty hands a dropped tensor's address to the next one of its size, as torch's "
                         "caching allocator does (default: a new address every time, every output's maps new)")
    args = ap.parse_args(argv)
    RECYCLE[0] = args.recycle
    kernels = tuple(args.kernels.split(",")) if args.kernels else (None,)
    for name, kernel, med, best, empties, launches in measure(args.calls, kernels=kernels):
        k = f" kernel={kernel}" if kernel else ""
        print(f"{name:40s}{k:20s} {med:6.2f} us/call (best {best:6.2f})  torch.empty x{empties:g}  "
              f"launches x{launches:g}")


if __name__ == "__main__":
    main()
