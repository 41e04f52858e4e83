"""TMA tensor maps (CUtensorMap) for the sm_90a kernels, encoded on the host with the driver's
cuTensorMapEncodeTiled (through ctypes on libcuda.so.1: no compiled extension).

A tensor map describes one global tensor (rank, sizes, byte strides, base address) and the box a TMA load copies
into shared memory. The kernels take the 128-byte maps by value (cuda_src/common/sm90.cuh: TmaDesc). Attention
tensors [batch, seqlen, heads, headdim] become 4-d maps (headdim, seqlen, heads, batch), innermost first, with
boxes of 64 columns (128 bytes: the 128-byte swizzle) by a tile's rows; rows past seqlen and columns past
headdim read as zeros.

`TensorMapSpec` holds everything but the base address (fixed per memoized plan); `encode` adds the address.
`tma_compatible` says whether a strided view can be described at all (16-byte aligned base and strides).
"""
from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

DTYPE_CODE = {"float16": 6, "bfloat16": 9}  # CU_TENSOR_MAP_DATA_TYPE_FLOAT16 / _BFLOAT16
SWIZZLE_CODE = {0: 0, 32: 1, 64: 2, 128: 3}  # CU_TENSOR_MAP_SWIZZLE_NONE / 32B / 64B / 128B
L2_PROMOTION_256B = 3  # CU_TENSOR_MAP_L2_PROMOTION_L2_256B
MAX_STRIDE = 1 << 40
MAX_DIM = 1 << 32
MAP_BYTES = 128

_lock = threading.Lock()
_encode_fn = None


def _driver_encode():
    global _encode_fn
    if _encode_fn is None:
        with _lock:
            if _encode_fn is None:
                lib = ctypes.CDLL("libcuda.so.1")
                fn = lib.cuTensorMapEncodeTiled
                fn.restype = ctypes.c_int
                fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                               ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
                               ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
                               ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
                _encode_fn = fn
    return _encode_fn


def check_map_args(dtype: str, dims, strides_bytes, box, swizzle: int) -> None:
    """The driver's constraints on a tiled map (cuTensorMapEncodeTiled), checked before it is called: ValueError
    naming the one that fails."""
    if dtype not in DTYPE_CODE:
        raise ValueError(f"tensor map dtype must be one of {tuple(DTYPE_CODE)}; got {dtype!r}")
    if swizzle not in SWIZZLE_CODE:
        raise ValueError(f"swizzle must be one of {tuple(SWIZZLE_CODE)}; got {swizzle!r}")
    rank = len(dims)
    if not 1 <= rank <= 5 or len(strides_bytes) != rank - 1 or len(box) != rank:
        raise ValueError(f"tensor map of rank {rank}: {rank - 1} strides and {rank} box sizes needed")
    for i, n in enumerate(dims):
        if not 1 <= n <= MAX_DIM:
            raise ValueError(f"tensor map dim {i} = {n}: must be in [1, 2^32]")
    for i, s in enumerate(strides_bytes):
        if s <= 0 or s % 16 or s >= MAX_STRIDE:
            raise ValueError(f"tensor map stride {i + 1} = {s} bytes: must be a positive multiple of 16 below 2^40")
    for i, b in enumerate(box):
        if not 1 <= b <= 256:
            raise ValueError(f"tensor map box {i} = {b}: must be in [1, 256]")
    if box[0] * 2 % 16:
        raise ValueError(f"tensor map box inner size {box[0] * 2} bytes: must be a multiple of 16")
    if swizzle and box[0] * 2 > swizzle:
        raise ValueError(f"tensor map box inner size {box[0] * 2} bytes exceeds the {swizzle}-byte swizzle span")


@dataclass(frozen=True)
class TensorMapSpec:
    """A tiled tensor map less its base address (see the module docstring)."""

    dtype: str
    dims: tuple  # innermost first, in elements
    strides_bytes: tuple  # of dims 1.., in bytes
    box: tuple  # innermost first, in elements
    swizzle: int = 128

    def __post_init__(self):
        check_map_args(self.dtype, self.dims, self.strides_bytes, self.box, self.swizzle)

    def encode(self, ptr: int) -> bytes:
        """The 128-byte CUtensorMap of this spec at global address `ptr` (16-byte aligned)."""
        if ptr % 16:
            raise ValueError(f"tensor map base address {ptr:#x} is not 16-byte aligned")
        args = self.__dict__.get("_args")
        if args is None:  # the driver's arguments but the addresses, made once per spec (plans encode it per pointer)
            args = self._encode_args()
        fn, code, rank, dims, strides, box, estr, swizzle = args
        addr = getattr(_tls, "addr", None) or _map_buffer()
        rc = fn(addr, code, rank, ptr, dims, strides, box, estr, 0, swizzle, L2_PROMOTION_256B, 0)
        if rc != 0:
            raise RuntimeError(f"cuTensorMapEncodeTiled failed (CUresult {rc}) for {self}")
        return ctypes.string_at(addr, MAP_BYTES)

    def _encode_args(self) -> tuple:
        rank = len(self.dims)
        args = (_driver_encode(), DTYPE_CODE[self.dtype], rank, (ctypes.c_uint64 * rank)(*self.dims),
                (ctypes.c_uint64 * max(rank - 1, 1))(*self.strides_bytes), (ctypes.c_uint32 * rank)(*self.box),
                (ctypes.c_uint32 * rank)(*([1] * rank)), SWIZZLE_CODE[self.swizzle])
        object.__setattr__(self, "_args", args)  # not a field: equality and hashing stay the fields'
        return args


_tls = threading.local()


def _map_buffer() -> int:
    """This thread's 64-byte aligned CUtensorMap buffer (the driver writes a map there; encode copies it out)."""
    buf = ctypes.create_string_buffer(MAP_BYTES + 64)
    _tls.buf, _tls.addr = buf, (ctypes.addressof(buf) + 63) & ~63
    return _tls.addr


def encode_tiled(ptr: int, dtype: str, dims, strides_bytes, box, swizzle: int = 128) -> bytes:
    """The 128-byte CUtensorMap of a tiled map (see TensorMapSpec) at global address ptr."""
    return TensorMapSpec(dtype, tuple(dims), tuple(strides_bytes), tuple(box), swizzle).encode(ptr)


def _byte_strides(shape, strides, itemsize: int):
    """Byte strides of the outer dims (seqlen, heads, batch order of the map: dims 1..3); a dim of size 1 is
    never stepped over, so whatever stride it carries (torch gives such dims arbitrary ones) is replaced by
    a valid one."""
    b, s, h, d = shape
    row = max(16, -(-d * itemsize // 16) * 16)
    out = []
    for n, st in ((s, strides[1]), (h, strides[2]), (b, strides[0])):
        out.append(st * itemsize if n > 1 else row)
    return tuple(out)


def tma_compatible(shape, strides, ptr: int, itemsize: int = 2) -> bool:
    """Whether a [batch, seqlen, heads, headdim] view can be read through a tensor map: every size >= 1, the
    head dim contiguous, the base 16-byte aligned and the strides of the other dims positive multiples of 16
    bytes (a stride of 0, e.g. an expanded head, is not) -- dims of size 1 excepted."""
    if len(shape) != 4 or min(shape) < 1 or shape[3] * itemsize % 16 or ptr % 16:
        return False
    if strides[3] != 1 and shape[3] > 1:
        return False
    return all(0 < s < MAX_STRIDE and s % 16 == 0 for s in _byte_strides(shape, strides, itemsize))


def attention_map_spec(dtype: str, shape, strides, rows: int, itemsize: int = 2) -> TensorMapSpec:
    """The map of a [batch, seqlen, heads, headdim] tensor with element strides `strides` (the head dim
    contiguous), boxes of 64 columns x `rows` rows (tma_compatible must hold)."""
    b, s, h, d = shape
    return TensorMapSpec(dtype, (d, s, h, b), _byte_strides(shape, strides, itemsize), (64, rows, 1, 1), 128)


def cache_map_spec(dtype: str, shape, strides, rows: int, itemsize: int = 2) -> TensorMapSpec:
    """The decode kernel's map of a [batch, seqlen, heads, headdim] KV cache (headdim a multiple of 64, contiguous;
    tma_compatible must hold): 5-d (64 columns, seqlen, headdim / 64 column chunks, heads, batch), innermost first,
    the chunks 128 bytes apart, so that one box (64, rows, headdim / 64, 1, 1) is a whole warp tile of `rows` keys,
    written as its headdim / 64 chunks of [rows][128 bytes], 128-byte swizzled (cuda_src/flash_decode.cu: DecodeMaps).
    Rows past seqlen read as zeros."""
    b, s, h, d = shape
    if d % 64:
        raise ValueError(f"a cache map needs a head dim that is a multiple of 64; got {d}")
    row, head, batch = _byte_strides(shape, strides, itemsize)
    return TensorMapSpec(dtype, (64, s, d // 64, h, b), (row, 128, head, batch), (64, rows, d // 64, 1, 1), 128)
