"""Launch fast path: one cuLaunchKernel per op, parameters packed with one struct.pack_into.

Host time per call is part of attention's performance at small shapes (a CuPy RawKernel call costs
~10 us, torch.cuda.current_stream() 7 us). So kernels take a single by-value parameter block whose fields
are all 8 bytes wide (cuda_src/attn/params.cuh; the host schemas, filled by field name, are in
cuflash/_params.py); the host packs it into a reused per-thread buffer and calls the driver directly.
"""
from __future__ import annotations

import ctypes
import functools
import os
import struct
import threading
from dataclasses import dataclass

from ._interop import ensure_context
from ._params import BWD_PARAMS, FWD_PARAMS, ParamBlock, struct_format  # noqa: F401 (re-exported)

# The parameter blocks (cuda_src/attn/params.cuh), filled by field name: cuflash/_params.py.
FWD_FORMAT = FWD_PARAMS.format
BWD_FORMAT = BWD_PARAMS.format

_MAX_PARAM_BYTES = 1280  # the largest block: BwdParams at 0, the Hopper backward's six tensor maps at 512
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


@functools.lru_cache(maxsize=None)
def _props(device: int) -> dict:
    """The device's properties (cached: read once per device)."""
    from cupy.cuda import runtime

    return runtime.getDeviceProperties(device)


def sm_count(device: int) -> int:
    return _props(device)["multiProcessorCount"]


SMALLEST_SMEM_PER_BLOCK = 99 * 1024  # the least a GPU cuflash runs on allows a block (sm_86 / sm_89 / sm_120)


def _smem_cap() -> int | None:
    """CUFLASH_SMEM_PER_BLOCK (bytes), when set: the shared memory per block the host plans for, at most the
    device's (and per SM, that plus the 1 KB a block reserves): a larger GPU then runs the tiles a smaller one takes
    (cuflash._configs.fit_fwd_tile and the like; their GPU tests run an H200 as a 99 KB GPU this way)."""
    cap = os.environ.get("CUFLASH_SMEM_PER_BLOCK")
    return int(cap) if cap else None


def smem_per_sm(device: int) -> int:
    cap = _smem_cap()
    n = _props(device)["sharedMemPerMultiprocessor"]
    return n if cap is None else min(n, cap + 1024)


def smem_per_block(device: int) -> int:
    """The most dynamic shared memory one block may opt in to: 227 KB on sm_90, 163 KB on sm_80, 99 KB on sm_86 /
    sm_89 (RTX 30 / 40) and sm_120 (at most CUFLASH_SMEM_PER_BLOCK where that is set)."""
    cap = _smem_cap()
    n = _props(device)["sharedMemPerBlockOptin"]
    return n if cap is None else min(n, cap)


def check_smem(spec: KernelSpec, device: int) -> None:
    """NotImplementedError, before anything is compiled or launched, where the kernel's tile needs more shared memory
    per block than the device has (README, Caveats: the tiles are sized for A100 / H100-class GPUs)."""
    limit = smem_per_block(device)
    if spec.smem > limit:
        from ._loader import device_cc

        cc = device_cc(device)
        kernel = spec.name.split("<", 1)[0].removeprefix("cuflash::")
        raise NotImplementedError(
            f"this call's kernel ({kernel}, {spec.smem} bytes of shared memory per block) does not fit device "
            f"{device} (compute capability {cc // 10}.{cc % 10}: at most {limit} bytes per block); its tiles are "
            f"sized for A100 / H100-class GPUs, and smaller tiles for this GPU are not built")


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

        check_smem(spec, device_id)
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


# ------------------------------------------------------------------------- Programmatic Dependent Launch
# On sm_90 a kernel launched with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION may be scheduled before the
# kernel ahead of it in the stream has drained: its blocks start once every block of that one has executed
# griddepcontrol.launch_dependents (or exited), and its own griddepcontrol.wait blocks until that kernel has
# completed (cuda_src/common/ptx.cuh). What it saves is the gap between two dependent kernels (the second launch's
# latency and the first grid's tail): the decode step's combine after the split kernel, and the decode kernel
# after flash_attn_with_kvcache's append (bench/NOTES.md, "Decode"). A kernel launched so must wait before reading
# anything its primary writes; only such kernels are (cuflash/decode.py). CuPy has no cuLaunchKernelEx: it is
# called through ctypes on libcuda.so.1, with one CUlaunchConfig per (launch of a plan, stream), built once.
#
# PDL: the switch (environment CUFLASH_PDL=0 turns it off), read when a plan is made; a plan records whether it
# launches with PDL (HostPlan.pdl). Devices below compute capability 9.0, drivers before CUDA 12.3 (the first to
# keep programmatic edges in a captured CUDA graph) and a libcuda without cuLaunchKernelEx get plain launches.
PDL = os.environ.get("CUFLASH_PDL", "1") != "0"
PDL_MIN_CC = 90
PDL_MIN_DRIVER = 12030
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class CUlaunchAttributeValue(ctypes.Union):
    """cuda.h's CUlaunchAttributeValue: a 64-byte union (8-byte aligned: it holds pointers); the one member used."""

    _fields_ = [("pad", ctypes.c_char * 64), ("programmaticStreamSerializationAllowed", ctypes.c_int),
                ("_align", ctypes.c_void_p)]


class CUlaunchAttribute(ctypes.Structure):
    """cuda.h: CUlaunchAttributeID id; char pad[8 - sizeof(CUlaunchAttributeID)]; CUlaunchAttributeValue value."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", CUlaunchAttributeValue)]


class CUlaunchConfig(ctypes.Structure):
    """cuda.h's CUlaunchConfig (56 bytes: hStream at 32, attrs at 40, numAttrs at 48)."""

    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(CUlaunchAttribute)), ("numAttrs", ctypes.c_uint)]


# The one attribute every programmatic launch carries (read-only, shared by all configs).
_PDL_ATTR = CUlaunchAttribute(id=CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
_PDL_ATTR.value.programmaticStreamSerializationAllowed = 1

_launch_ex = None  # cuLaunchKernelEx(const CUlaunchConfig*, CUfunction, void** params, void** extra) -> CUresult
_driver_version = None


def launch_ex_fn():
    """libcuda's cuLaunchKernelEx through ctypes (looked up once), or None where the driver has none."""
    global _launch_ex
    if _launch_ex is None:
        try:
            fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
        except (OSError, AttributeError):
            fn = False
        else:
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        _launch_ex = fn
    return _launch_ex or None


def driver_version() -> int:
    """The driver's CUDA version (12030 for 12.3), looked up once."""
    global _driver_version
    if _driver_version is None:
        from cupy.cuda import runtime

        _driver_version = int(runtime.driverGetVersion())
    return _driver_version


@functools.lru_cache(maxsize=None)
def _pdl_capable(device: int) -> bool:
    from ._loader import device_cc

    if device_cc(device) < PDL_MIN_CC or launch_ex_fn() is None:
        return False
    try:
        return driver_version() >= PDL_MIN_DRIVER
    except Exception:  # noqa: BLE001 - no driver to ask: plain launches
        return False


def pdl_supported(device: int) -> bool:
    """Whether a plan made now on `device` launches its dependent kernels with PDL (the switch, the device's
    compute capability, the driver)."""
    return PDL and _pdl_capable(device)


class ProgrammaticLaunch:
    """One kernel of a plan launched with PDL: `(stream, argv)` launches it. Its CUlaunchConfig (grid, block, shared
    memory, the stream, the PDL attribute) is built once per stream and kept, so that a call reads one dict entry and
    calls the driver; nothing is written per call (the configs may be read by several threads at once). The cache is
    bounded: past MAX_STREAMS streams it starts afresh, the previous generation kept alive until the next reset (a
    launch in flight in another thread still reads it)."""

    __slots__ = ("fn", "dims", "configs", "_old")
    MAX_STREAMS = 64

    def __init__(self, fn: int, grid, threads: int, smem: int):
        self.fn = fn
        self.dims = (int(grid[0]), int(grid[1]), int(grid[2]), int(threads), 1, 1, int(smem))
        self.configs = {}  # stream -> (address of its CUlaunchConfig, the CUlaunchConfig)
        self._old = {}

    def config(self, stream: int) -> CUlaunchConfig:
        """The launch config for `stream` (built on its first use)."""
        return (self.configs.get(stream) or self._build(stream))[1]

    def _build(self, stream: int) -> tuple:
        gx, gy, gz, bx, by, bz, smem = self.dims
        cfg = CUlaunchConfig(gx, gy, gz, bx, by, bz, smem, stream, ctypes.pointer(_PDL_ATTR), 1)
        if len(self.configs) >= self.MAX_STREAMS:
            self._old, self.configs = self.configs, {}
        c = self.configs[stream] = (ctypes.addressof(cfg), cfg)
        return c

    def __call__(self, stream: int, argv: int) -> None:
        c = self.configs.get(stream) or self._build(stream)
        rc = _launch_ex(c[0], self.fn, argv, None)
        if rc:
            from cupy.cuda import driver

            raise driver.CUDADriverError(rc)
