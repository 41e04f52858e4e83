"""Zero-copy views of torch tensors, CuPy arrays and DLPack producers; outputs of the same kind.

Fast path: torch tensors and CuPy arrays are read directly (data pointer, shape, strides in elements,
device, and the caller's current stream as a raw handle) -- no wrapper objects per call. Any other
producer of `__dlpack__` goes through `cupy.from_dlpack` (zero-copy) and gets CuPy arrays back.
"""
from __future__ import annotations

import sys
from contextlib import nullcontext

TORCH, CUPY = 0, 1
# Tests set POISON = True: every output cuflash allocates starts as NaN (float) or -1 (int), so an
# element a kernel forgets to write cannot pass as a plausible value.
POISON = False
KIND_NAME = {TORCH: "torch", CUPY: "cupy"}


class Arr:
    """A device array seen by cuflash: kind, object, pointer, shape, strides (elements), dtype, device."""

    __slots__ = ("kind", "obj", "ptr", "shape", "strides", "dtype", "device")

    def __init__(self, kind, obj, ptr, shape, strides, dtype, device):
        self.kind, self.obj, self.ptr, self.shape = kind, obj, ptr, shape
        self.strides, self.dtype, self.device = strides, dtype, device


def _torch_dtypes(torch):
    return {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32", torch.int32: "int32"}


_TORCH_DT = None


def wrap(x, name: str) -> Arr:
    """View `x` without copying. TypeError (naming `name`) for anything that is not a CUDA array."""
    global _TORCH_DT
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        if not x.is_cuda:
            raise TypeError(f"{name} must be a CUDA tensor; got a torch tensor on {x.device}")
        if _TORCH_DT is None:
            _TORCH_DT = _torch_dtypes(torch)
        dt = _TORCH_DT.get(x.dtype) or str(x.dtype).replace("torch.", "")
        return Arr(TORCH, x, x.data_ptr(), tuple(x.shape), x.stride(), dt, x.get_device())
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(x, cupy.ndarray):
        isz = x.itemsize
        return Arr(CUPY, x, x.data.ptr, x.shape, tuple(s // isz for s in x.strides), x.dtype.name, x.device.id)
    if type(x).__module__ == "numpy" or hasattr(x, "__array_interface__"):
        raise TypeError(f"{name} must be a CUDA array (torch CUDA tensor or CuPy array); got a host "
                        f"{type(x).__module__}.{type(x).__name__}")
    if hasattr(x, "__dlpack__"):
        import cupy

        dev = x.__dlpack_device__() if hasattr(x, "__dlpack_device__") else None
        if dev is not None and int(dev[0]) not in (2, 13):  # kDLCUDA, kDLCUDAManaged
            raise TypeError(f"{name} must be a CUDA array; got a DLPack producer on device type {dev[0]}")
        return wrap(cupy.from_dlpack(x), name)
    raise TypeError(f"{name} must be a CUDA array (torch CUDA tensor, CuPy array or DLPack producer); "
                    f"got {type(x).__name__}")


def compiling() -> bool:
    """Whether torch.compile (Dynamo) is tracing the caller: then cuflash's entry points return custom-operator
    nodes (cuflash._torch_ops) instead of launching. False without torch imported (and cheap: one dict look-up and
    one call in eager mode)."""
    compiler = getattr(sys.modules.get("torch"), "compiler", None)
    return compiler is not None and compiler.is_compiling()


def empty(like: Arr, shape, dtype: str):
    """Uninitialised array of `like`'s kind and device (NaN-filled when POISON is set)."""
    if like.kind == TORCH:
        import torch

        x = torch.empty(shape, dtype=getattr(torch, dtype), device=like.obj.device)
    else:
        import cupy

        dt = like.obj.dtype if dtype == like.dtype else dtype
        with device_guard(like.device):
            x = cupy.empty(shape, dtype=dt)
    if POISON:
        bad = float("nan") if "float" in dtype else 255 if dtype.startswith("uint") else -1
        x.fill(bad) if like.kind == CUPY else x.fill_(bad)
    return x


def zeros(like: Arr, shape, dtype: str):
    if like.kind == TORCH:
        import torch

        return torch.zeros(shape, dtype=getattr(torch, dtype), device=like.obj.device)
    import cupy

    dt = like.obj.dtype if dtype == like.dtype else dtype
    with device_guard(like.device):
        return cupy.zeros(shape, dtype=dt)


def data_ptr(x) -> int:
    """Device pointer of an array that cuflash allocated (torch or CuPy)."""
    p = getattr(x, "data_ptr", None)
    return p() if p is not None else x.data.ptr


def current_stream(a: Arr) -> int:
    """The caller's current stream on a's device, as a raw handle: torch's for torch, CuPy's for CuPy."""
    if a.kind == TORCH:
        return sys.modules["torch"]._C._cuda_getCurrentRawStream(a.device)
    import cupy

    return cupy.cuda.get_current_stream(a.device).ptr


# ------------------------------------------------------------------------------- memoized host paths
# The memoized plans (cuflash/_plan.py): a call whose arrays match a memoized plan's key skips validation.
_TT = None  # torch.Tensor, once torch is imported
_CT = None  # cupy.ndarray, once cupy is imported


def desc(x):
    """(pointer, memo-key part) of a plain torch tensor or CuPy array; (None, None) for anything else
    (subclasses, DLPack producers, host arrays): those take the validating path on every call."""
    global _TT, _CT
    t = type(x)
    if t is _TT:
        return x.data_ptr(), (x.dtype, x.shape, x.stride(), x.get_device())
    if t is _CT:
        return x.data.ptr, (x.dtype, x.shape, x.strides, x.device.id)
    if _TT is None and "torch" in sys.modules:
        _TT = sys.modules["torch"].Tensor
        if t is _TT:
            return desc(x)
    if _CT is None and "cupy" in sys.modules:
        _CT = sys.modules["cupy"].ndarray
        if t is _CT:
            return desc(x)
    return None, None


_launch_kernel = None
_get_device_fn = None


def launch_fn():
    """cupy.cuda.driver.launchKernel, looked up once."""
    global _launch_kernel
    if _launch_kernel is None:
        from cupy.cuda import driver

        _launch_kernel = driver.launchKernel
    return _launch_kernel


def get_device() -> int:
    """The current device (cupy.cuda.runtime.getDevice, looked up once)."""
    return (_get_device_fn or get_device_fn())()


def get_device_fn():
    """cupy.cuda.runtime.getDevice, looked up once."""
    global _get_device_fn
    if _get_device_fn is None:
        from cupy.cuda import runtime

        _get_device_fn = runtime.getDevice
    return _get_device_fn


_ctx_current = None
_set_device = None


def ctx_current_fn():
    """cupy.cuda.driver.ctxGetCurrent, looked up once (ensure_context's test, for callers that inline it)."""
    ensure_context()
    return _ctx_current


def ensure_context() -> None:
    """Make the current device's primary context current in this thread when no context is. The driver's
    cuLaunchKernel needs one, and a thread that has not used the CUDA runtime yet has none: a user's fresh thread,
    or torch's autograd device thread when no torch kernel ran there before cuflash's backward (torch only calls
    cudaSetDevice when the device changes)."""
    global _ctx_current, _set_device
    if _ctx_current is None:
        from cupy.cuda import driver, runtime

        _ctx_current, _set_device = driver.ctxGetCurrent, runtime.setDevice
    if not _ctx_current():
        _set_device(get_device())


def device_guard(device: int):
    """Make `device` current for a launch (a no-op in the common single-device case)."""
    from cupy.cuda import runtime

    if runtime.getDevice() == device:
        return nullcontext()
    import cupy

    return cupy.cuda.Device(device)
