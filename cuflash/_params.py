"""Host schemas of the kernel parameter blocks of cuda_src/attn/params.cuh, filled by field name.

Every kernel family takes one struct by value (FwdParams, BwdParams, V1FwdParams, V1BwdParams) whose fields
are all 8 bytes wide: pointers, int64_t, and float32 scalars in 8-byte slots (`f32_slot`, cuda_src/common/ptx.cuh:
the value and 4 zero bytes; the kernels read floats, with no FP64 conversion in device code). `ParamBlock` lists a
struct's fields in declaration order (tests/test_params_layout.py parses the header and checks every name, offset and
size against these lists) and precompiles its `struct.Struct` once. Host code never fills a block by position:

* `block.values(**fields)` -> the tuple of every field value in declaration order (a missing or unknown name
  raises KeyError; `block.values(0, **fields)` sets the fields not named to 0);
* `block.bind(dynamic, **constants)` -> a `BoundBlock` for memoized plans: the fields that change per call
  (`dynamic`, a prefix of the field order, e.g. the data pointers) are passed positionally, in that order, to
  `bound.pack_into(buf, *dynamic_values)`, which costs exactly one `Struct.pack_into`.
"""
from __future__ import annotations

import struct

POINTER, INT64, FLOAT = "P", "q", "f"
_CODE = {POINTER: "Q", INT64: "q", FLOAT: "f4x"}
_MISSING = object()


def struct_format(fields) -> str:
    """The struct format of ((name, kind), ...) fields: kind "P" pointer, "q" int64, "f" float32 in an 8-byte slot."""
    return "=" + "".join(_CODE[kind] for _, kind in fields)


class BoundBlock:
    """A parameter block with every field but a leading run of `dynamic` ones fixed (see ParamBlock.bind)."""

    __slots__ = ("block", "dynamic", "rest", "struct")

    def __init__(self, block: ParamBlock, dynamic: tuple, rest: tuple):
        self.block, self.dynamic, self.rest, self.struct = block, dynamic, rest, block.struct

    def pack_into(self, buf, *dynamic_values) -> None:
        """Write the block into `buf` at offset 0: the dynamic fields (in `dynamic` order), then the constants."""
        self.struct.pack_into(buf, 0, *dynamic_values, *self.rest)

    def constant(self, name: str):
        """The value bound to a constant field."""
        return self.rest[self.block.index[name] - len(self.dynamic)]


class ParamBlock:
    """The fields of one C++ parameter struct, in declaration order; iterating yields (name, kind) pairs."""

    __slots__ = ("cname", "fields", "names", "index", "format", "struct", "size")

    def __init__(self, cname: str, fields):
        self.cname = cname
        self.fields = tuple(fields)
        self.names = tuple(n for n, _ in self.fields)
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"{cname}: duplicate field names")
        self.index = {n: i for i, n in enumerate(self.names)}
        self.format = struct_format(self.fields)
        self.struct = struct.Struct(self.format)
        self.size = self.struct.size

    def __iter__(self):
        return iter(self.fields)

    def __len__(self):
        return len(self.fields)

    def __repr__(self):
        return f"ParamBlock({self.cname}, {len(self.fields)} fields)"

    def offsets(self) -> dict:
        """{field name: (byte offset, byte size)} of the packed block (every field is 8 bytes wide; a FLOAT's value is
        its slot's first 4 bytes)."""
        return {n: (8 * i, 8) for i, n in enumerate(self.names)}

    def values(self, fill=_MISSING, /, **fields) -> tuple:
        """Every field's value in declaration order, from keyword arguments named like the C++ fields.
        Without `fill`, every field must be named; with it, fields not named take `fill`."""
        unknown = fields.keys() - self.index.keys()
        if unknown:
            raise KeyError(f"{self.cname} has no field(s) {sorted(unknown)}")
        if fill is _MISSING:
            missing = [n for n in self.names if n not in fields]
            if missing:
                raise KeyError(f"{self.cname}: field(s) {missing} not given")
            return tuple(fields[n] for n in self.names)
        return tuple(fields.get(n, fill) for n in self.names)

    def pack(self, fill=_MISSING, /, **fields) -> bytes:
        return self.struct.pack(*self.values(fill, **fields))

    def unpack(self, data) -> dict:
        """{field name: value} of a packed block (tests, benchmarks)."""
        return dict(zip(self.names, self.struct.unpack_from(data, 0)))

    def bind(self, dynamic, **constants) -> BoundBlock:
        """A block whose fields other than `dynamic` (names of the block's first len(dynamic) fields, in order)
        are fixed to `constants` (every one of them named)."""
        dynamic = tuple(dynamic)
        if self.names[:len(dynamic)] != dynamic:
            raise ValueError(f"{self.cname}: dynamic fields {dynamic} must be the first fields, in order "
                             f"({self.names[:len(dynamic)]})")
        overlap = set(dynamic) & constants.keys()
        if overlap:
            raise KeyError(f"{self.cname}: field(s) {sorted(overlap)} are both dynamic and constant")
        rest = self.values(**dict.fromkeys(dynamic, 0), **constants)[len(dynamic):]
        return BoundBlock(self, dynamic, rest)


def stride_fields(name: str, strides) -> dict:
    """{name_batch_stride, name_row_stride, name_head_stride}: the fields of a [b, s, h, d] view's strides."""
    return {f"{name}_batch_stride": strides[0], f"{name}_row_stride": strides[1], f"{name}_head_stride": strides[2]}


def contiguous_strides(shape) -> tuple:
    """The element strides of a contiguous [b, s, h, d] array of `shape`."""
    _, s, h, d = shape
    return (s * h * d, h * d, d, 1)


def contiguous_fields(name: str, shape) -> dict:
    """The stride fields of a contiguous [b, s, h, d] array of `shape`."""
    return stride_fields(name, contiguous_strides(shape))


def _strides(*tensors) -> tuple:
    return tuple((f"{t}_{s}_stride", INT64) for t in tensors for s in ("batch", "row", "head"))


def _ptrs(*names) -> tuple:
    return tuple((n, POINTER) for n in names)


def _ints(*names) -> tuple:
    return tuple((n, INT64) for n in names)


# The score-modifier, head-dim and dropout fields at the end of FwdParams and BwdParams, and the pointer
# alibi_slopes after the other pointers (cuflash/_mods.py fills them).
_MODS = (("alibi_batch_stride", INT64), ("window_left", INT64), ("window_right", INT64),
         ("softcap_pre", FLOAT), ("alibi_mul", FLOAT), ("head_dim", INT64),
         ("rng_seed", INT64), ("rng_offset", INT64), ("dropout_keep", INT64), ("dropout_scale", FLOAT))
# The KV-cache indirections of FwdParams (the decode kernel's): pointers after seqlens_k, sizes at the end.
_CACHE_PTRS = ("block_table", "cache_batch_idx", "leftpad_k", "rotary_cos", "rotary_sin")
_CACHE_INTS = ("block_table_batch_stride", "page_size", "rotary_dim", "rotary_interleaved", "rotary_q_per_row",
               "seqlen_ro")
# cuda_src/attn/params.cuh: struct FwdParams (V2 forward, split-KV, decode, combine).
FWD_PARAMS = ParamBlock("FwdParams", (
    *_ptrs("q", "k", "v", "o", "lse", "o_accum", "lse_accum", "seqlens_k", *_CACHE_PTRS, "cu_seqlens_q",
           "cu_seqlens_k", "alibi_slopes"),
    *_strides("q", "k", "v", "o"),
    *_ints("batch", "nheads", "heads_per_kv", "seqlen_q", "seqlen_k", "num_splits", "seqlen_k_new", "grid_order"),
    ("scale_log2", FLOAT), *_MODS, *_ints(*_CACHE_INTS), *_ints("walk_group", "walk_slot"),
))
# FwdParams with no KV-cache indirection (every kernel but the decode kernel's cache calls).
NO_CACHE = dict.fromkeys(("seqlens_k", *_CACHE_PTRS, *_CACHE_INTS), 0)
# FwdParams of a kernel other than the Hopper forward's persistent form (its tile walk: cuflash/_walk.py).
NO_WALK = dict(walk_group=0, walk_slot=-1)
# struct BwdParams (V2 backward: preprocess, main, dQ convert).
BWD_PARAMS = ParamBlock("BwdParams", (
    *_ptrs("q", "k", "v", "o", "dout", "lse", "lse_log2", "delta", "dq_accum", "dq", "dk", "dv", "cu_seqlens_q",
           "cu_seqlens_k", "alibi_slopes", "sk_workspace"),
    *_strides("q", "k", "v", "o", "do", "dq", "dk", "dv"),
    *_ints("batch", "nheads", "heads_per_kv", "seqlen_q", "seqlen_k", "seqlen_q_pad", "dq_strategy", "num_dq_splits"),
    ("scale_log2", FLOAT), ("softmax_scale", FLOAT), *_MODS,
))
# struct V1FwdParams (FlashAttention-1 forward).
V1_FWD_PARAMS = ParamBlock("V1FwdParams", (
    *_ptrs("q", "k", "v", "o", "o_accum", "m", "l", "lse"),
    *_strides("q", "k", "v", "o"),
    *_ints("batch", "nheads", "heads_per_kv", "seqlen_q", "seqlen_k"),
    ("scale_log2", FLOAT),
))
# struct V1BwdParams (FlashAttention-1 backward: main, dQ convert).
V1_BWD_PARAMS = ParamBlock("V1BwdParams", (
    *_ptrs("q", "k", "v", "o", "dout", "m", "l", "dq_accum", "dq", "dk", "dv"),
    *_strides("q", "k", "v", "o", "do", "dq", "dk", "dv"),
    *_ints("batch", "nheads", "heads_per_kv", "seqlen_q", "seqlen_k", "seqlen_q_pad"),
    ("scale_log2", FLOAT), ("softmax_scale", FLOAT),
))
PARAM_BLOCKS = (FWD_PARAMS, BWD_PARAMS, V1_FWD_PARAMS, V1_BWD_PARAMS)

# The plain arguments of kvcache_append_kernel (cuda_src/flash_fwd.cu), one 8-byte slot each (cuflash/_launch.py:
# _scratch), so they pack like a struct of these fields.
APPEND_ARGS = ParamBlock("kvcache_append_kernel", (
    *_ptrs("k_cache", "v_cache", "k_new", "v_new", "seqlens", "block_table", "cache_batch_idx", "rotary_cos",
           "rotary_sin"),
    *_ints("kc_bs", "kc_rs", "kc_hs", "vc_bs", "vc_rs", "vc_hs", "kn_bs", "kn_rs", "kn_hs", "vn_bs", "vn_rs", "vn_hs",
           "batch", "seqlen_new", "nheads_k", "seqlen_cache", "headdim", "bt_stride", "page_size", "rotary_dim",
           "rotary_interleaved", "seqlen_ro"),
))

# The plain arguments of paged_kv_gather_kernel (cuda_src/flash_fwd.cu), one 8-byte slot each.
GATHER_ARGS = ParamBlock("paged_kv_gather_kernel", (
    *_ptrs("k_out", "v_out", "k_pages", "v_pages", "cu_seqlens_k", "block_table"),
    *_ints("kp_ps", "kp_rs", "kp_hs", "vp_ps", "vp_rs", "vp_hs", "batch", "rows", "nheads_k", "headdim", "bt_stride",
           "page_size"),
))
