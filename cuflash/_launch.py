"""Launch fast path: one cuLaunchKernel per op, parameters packed with one struct.pack_into.

Host time per call is part of attention's performance at small shapes (a CuPy RawKernel call costs
~10 us, torch.cuda.current_stream() 7 us). So kernels take a single by-value parameter block whose fields
are all 8 bytes wide (cuda_src/attn/params.cuh; the host schemas, filled by field name, are in
cuflash/_params.py); the host packs it into a reused per-thread buffer and calls the driver directly.
"""
from __future__ import annotations

import ctypes
import struct
import threading
from dataclasses import dataclass

from ._interop import ensure_context
from ._params import BWD_PARAMS, FWD_PARAMS, ParamBlock, struct_format  # noqa: F401 (re-exported)

# The parameter blocks (cuda_src/attn/params.cuh), filled by field name: cuflash/_params.py.
FWD_FORMAT = FWD_PARAMS.format
BWD_FORMAT = BWD_PARAMS.format

_MAX_PARAM_BYTES = 1024
_tls = threading.local()


def _scratch():
    """Per-thread parameter buffer and the void* array the driver reads kernel parameters through.

    argv[i] points at byte 8*i of the buffer. A kernel whose only parameter is a struct (FwdParams) reads
    it whole from argv[0]; a kernel with plain parameters reads parameter i from its 8-byte slot i (pack
    4-byte values as "i4x" / "f4x"). The driver copies the parameters during the launch call, so the
    buffer is free again as soon as launchKernel returns.
    """
    s = getattr(_tls, "s", None)
    if s is None:
        buf = ctypes.create_string_buffer(_MAX_PARAM_BYTES)
        base = ctypes.addressof(buf)
        argv = (ctypes.c_void_p * (_MAX_PARAM_BYTES // 8))(*(base + 8 * i for i in range(_MAX_PARAM_BYTES // 8)))
        s = _tls.s = (buf, ctypes.addressof(argv), argv)
    return s


@dataclass(frozen=True)
class KernelSpec:
    """Everything needed to compile and launch one kernel instantiation (built in _configs.py)."""

    filename: str
    name: str  # template name expression, e.g. cuflash::flash_fwd_kernel<__half, 128, ...>
    threads: int
    smem: int  # dynamic shared memory bytes
    min_arch: int = 80  # the oldest sm_<arch> it compiles for (90: sm_90-only PTX or more than sm_80's smem)
    arch_suffix: str = ""  # "a": compiled for sm_<min_arch>a exactly (wgmma, setmaxnreg), runs on that arch only


class Launcher:
    """A compiled kernel bound to one device: launch(grid, stream_ptr, fmt, *values)."""

    __slots__ = ("ptr", "threads", "smem", "spec", "raw")

    def __init__(self, spec: KernelSpec, device_id: int):
        from . import _loader

        raw = _loader.get_function(spec.filename, spec.name, device_id, spec.arch_suffix)
        if spec.smem > 48 * 1024:  # opt in to more than 48 KB of dynamic shared memory
            raw.max_dynamic_shared_size_bytes = spec.smem
        self.raw = raw
        self.ptr = raw.kernel.ptr
        self.threads = spec.threads
        self.smem = spec.smem
        self.spec = spec

    def launch(self, grid, stream: int, fmt: str, *values):
        """Launch with plain 8-byte-slot arguments packed by `fmt` (a struct format string)."""
        from cupy.cuda import driver

        buf, argv_addr, _ = _scratch()
        ensure_context()
        struct.pack_into(fmt, buf, 0, *values)
        driver.launchKernel(self.ptr, grid[0], grid[1], grid[2], self.threads, 1, 1, self.smem, stream, argv_addr, 0)

    def launch_block(self, grid, stream: int, block: ParamBlock, values: tuple):
        """Launch with one parameter struct: `values` from `block.values(...)` (every field by name)."""
        from cupy.cuda import driver

        buf, argv_addr, _ = _scratch()
        ensure_context()
        block.struct.pack_into(buf, 0, *values)
        driver.launchKernel(self.ptr, grid[0], grid[1], grid[2], self.threads, 1, 1, self.smem, stream, argv_addr, 0)


_launchers: dict = {}
_launchers_lock = threading.Lock()


def get_launcher(spec: KernelSpec, device_id: int) -> Launcher:
    key = (spec, device_id)
    lau = _launchers.get(key)
    if lau is None:
        with _launchers_lock:
            lau = _launchers.get(key)
            if lau is None:
                lau = _launchers[key] = Launcher(spec, device_id)
    return lau
