"""Input validation: every check runs before anything is launched, and every error names the argument."""
from __future__ import annotations

import math

from ._configs import HEADDIM_MULTIPLE, MAX_FWD_HEADDIM, MAX_HEADDIM
from ._interop import KIND_NAME, Arr, wrap

SUPPORTED_DTYPES = ("float16", "bfloat16")
MAX_ROW_STRIDE = 2**30  # elements: row strides in bytes must fit a signed 32-bit int (cuda_src/common/tile.cuh)


def check_layout(a: Arr, name: str, aligned: bool = False) -> None:
    """Last dim contiguous, no negative stride, sequence strides below MAX_ROW_STRIDE; with `aligned` also the other
    strides 16-byte multiples and the data 16-byte aligned (the paths without UA kernels: cuflash._configs.unaligned
    picks those for any other view)."""
    for size, stride in zip(a.shape, a.strides):
        if size > 1 and stride < 0:
            raise ValueError(f"{name} has a negative stride {a.strides}; pass a copy")
    if a.shape[-1] > 1 and a.strides[-1] != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension (stride 1); got strides {a.strides}")
    if len(a.shape) == 4 and a.shape[1] > 1 and a.strides[1] >= MAX_ROW_STRIDE:
        raise ValueError(f"{name} has a sequence stride of {a.strides[1]} elements; at most {MAX_ROW_STRIDE - 1} "
                         "is supported (32-bit row offsets in the kernels' tile loads); call .contiguous() first")
    if not aligned:
        return
    bad = [s for size, s in zip(a.shape[:-1], a.strides[:-1]) if size > 1 and s % 8]
    if bad or a.ptr % 16:
        raise ValueError(
            f"{name} must have strides that are multiples of 8 elements and 16-byte aligned data (16-byte "
            f"loads); got strides {a.strides} and address {a.ptr:#x}; call .contiguous() first"
        )


def check_headdim(d: int, name: str = "q") -> None:
    """Head dims the kernels run: 1 to 512, above 256 in the forward only (check_backward_headdim); the kernel of
    the next compiled head dim runs one that is not compiled (cuflash._configs.kernel_headdim), its UA variant one
    that is not a multiple of 8 (rows that are not 16-byte units: element-wise loads, cuflash._configs.unaligned)."""
    if d > MAX_FWD_HEADDIM or d < 1:
        raise ValueError(f"head dim {d} of {name} is not supported: 1 to {MAX_FWD_HEADDIM} (the forward), "
                         f"to {MAX_HEADDIM} with a backward or a KV cache")


def check_aligned(d: int, arrays, what: str) -> None:
    """NotImplementedError for a path without UA kernels (`what`) given rows that are not 16-byte units: a head
    dim that is not a multiple of HEADDIM_MULTIPLE, or views (Arr, name) with unaligned strides or data."""
    if d % HEADDIM_MULTIPLE:
        raise NotImplementedError(f"head dim {d}: {what} runs head dims that are multiples of {HEADDIM_MULTIPLE} "
                                  "(16-byte rows)")
    for a, name in arrays:
        check_layout(a, name, aligned=True)


def check_backward_headdim(d: int, what: str) -> None:
    """Head dims above 256 have forward kernels only (flash_attn_func without autograd): NotImplementedError
    naming `what` (the backward, the KV-cache path) otherwise."""
    if d > MAX_HEADDIM:
        raise NotImplementedError(f"head dim {d}: {what} runs head dims up to {MAX_HEADDIM}; above that cuflash has "
                                  "the forward only (flash_attn_func without autograd)")


def check_same(ref: Arr, ref_name: str, a: Arr, name: str) -> None:
    if a.kind != ref.kind:
        raise TypeError(f"{name} is a {KIND_NAME[a.kind]} array but {ref_name} is a {KIND_NAME[ref.kind]} "
                        f"array; pass all inputs of one kind")
    if a.device != ref.device:
        raise ValueError(f"{name} is on cuda:{a.device} but {ref_name} is on cuda:{ref.device}")


def check_dtype(a: Arr, name: str, ref: Arr | None = None, ref_name: str = "q") -> None:
    if a.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} must be float16 or bfloat16; got {a.dtype}")
    if ref is not None and a.dtype != ref.dtype:
        raise TypeError(f"{name} must have the dtype of {ref_name} ({ref.dtype}); got {a.dtype}")


def check_rank(a: Arr, name: str, rank: int, what: str) -> None:
    if len(a.shape) != rank:
        raise ValueError(f"{name} must have {rank} dimensions {what}; got shape {a.shape}")


def check_qkv(q, k, v, names=("q", "k", "v")):
    """Validate flash-attn layout q [b, sq, h, d], k/v [b, sk, hk, d]; return their Arr views."""
    qn, kn, vn = names
    qa, ka, va = wrap(q, qn), wrap(k, kn), wrap(v, vn)
    check_qkv_views(qa, ka, va, names)
    return qa, ka, va


def check_qkv_views(qa: Arr, ka: Arr, va: Arr, names=("q", "k", "v"), same_batch: bool = True) -> None:
    """The checks of check_qkv on already wrapped views (testable on a CPU with hand-made views); same_batch=False
    leaves k's batch to the caller (KV caches addressed through a batch index or a block table)."""
    qn, kn, vn = names
    for a, n in ((qa, qn), (ka, kn), (va, vn)):
        check_rank(a, n, 4, "(batch, seqlen, nheads, headdim)")
    check_same(qa, qn, ka, kn)
    check_same(qa, qn, va, vn)
    check_dtype(qa, qn)
    check_dtype(ka, kn, qa, qn)
    check_dtype(va, vn, qa, qn)
    b, sq, h, d = qa.shape
    if same_batch and ka.shape[0] != b:
        raise ValueError(f"{kn} has batch {ka.shape[0]} but {qn} has batch {b}")
    if va.shape != ka.shape:
        raise ValueError(f"{vn} must have the shape of {kn} {ka.shape}; got {va.shape}")
    if ka.shape[3] != d:
        raise ValueError(f"{kn} has head dim {ka.shape[3]} but {qn} has head dim {d}")
    check_headdim(d, qn)
    hk = ka.shape[2]
    if hk < 1 or h % hk:
        raise ValueError(f"the number of heads of {qn} ({h}) must be a multiple of that of {kn} ({hk})")
    if sq < 1:
        raise ValueError(f"{qn} must have seqlen >= 1; got shape {qa.shape}")
    for a, n in ((qa, qn), (ka, kn), (va, vn)):
        check_layout(a, n)


PAGE_MULTIPLE = 16  # paged K/V: page sizes are multiples of 16 keys (the decode kernel's page look-up per 16 keys)


def check_block_table(block_table, qa: Arr, batch: int, pages: Arr, pages_name: str) -> Arr:
    """A paged call's block table: int32 (batch, max_num_blocks_per_seq >= 1) next to q, last dim contiguous; and the
    page size (dim 1 of `pages`, the paged k) a multiple of PAGE_MULTIPLE. Returns its view."""
    bt = wrap(block_table, "block_table")
    check_same(qa, "q", bt, "block_table")
    if bt.dtype != "int32":
        raise TypeError(f"block_table must be int32; got {bt.dtype}")
    check_rank(bt, "block_table", 2, "(batch, max_num_blocks_per_seq)")
    if bt.shape[0] != batch or bt.shape[1] < 1:
        raise ValueError(f"block_table must have shape ({batch}, max_num_blocks_per_seq >= 1); got {bt.shape}")
    if bt.shape[1] > 1 and bt.strides[1] != 1:
        raise ValueError(f"block_table must be contiguous in its last dimension; got strides {bt.strides}")
    if pages.shape[1] % PAGE_MULTIPLE:
        raise ValueError(f"{pages_name}'s page size (dimension 1 with a block_table) must be a multiple of "
                         f"{PAGE_MULTIPLE}; got {pages.shape[1]}")
    return bt


def check_int_vector(x, name: str, qa: Arr, n: int, what: str) -> Arr:
    """A contiguous int32 device array of shape (n,) next to q (what: what it holds, for the message)."""
    a = wrap(x, name)
    check_same(qa, "q", a, name)
    if a.dtype != "int32":
        raise TypeError(f"{name} must be int32; got {a.dtype}")
    if a.shape != (n,) or (n > 1 and a.strides != (1,)):
        raise ValueError(f"{name} must be a contiguous int32 array of shape ({n},) ({what}); got shape {a.shape}")
    return a


def check_bool(x, name: str) -> None:
    if not isinstance(x, bool):
        raise TypeError(f"{name} must be a bool; got {type(x).__name__}")


def check_grad_inputs(qa: Arr, dout, out, lse, lse_shape: tuple, lse_what: str):
    """The backward's dout and out (q's kind, device, dtype, shape; kernel layout) and softmax_lse (float32 of
    `lse_shape`, contiguous) next to validated q: (dout, out, lse) views."""
    da, oa, la = wrap(dout, "dout"), wrap(out, "out"), wrap(lse, "softmax_lse")
    for a, n in ((da, "dout"), (oa, "out")):
        check_same(qa, "q", a, n)
        check_dtype(a, n, qa, "q")
        if a.shape != qa.shape:
            raise ValueError(f"{n} must have the shape of q {qa.shape}; got {a.shape}")
        check_layout(a, n)
    check_same(qa, "q", la, "softmax_lse")
    check_rank(la, "softmax_lse", len(lse_shape), lse_what)
    if la.shape != lse_shape or la.dtype != "float32":
        raise ValueError(f"softmax_lse must be float32 of shape {lse_shape}; got {la.dtype} {la.shape}")
    contiguous = tuple(math.prod(lse_shape[i + 1:]) for i in range(len(lse_shape)))
    if any(n > 1 and st != c for n, st, c in zip(lse_shape, la.strides, contiguous)):
        raise ValueError(f"softmax_lse must be contiguous; got strides {la.strides}")
    return da, oa, la


def check_score_options(dropout_p=0.0, window_size=(-1, -1), softcap=0.0) -> None:
    """flash-attn's option values, checked before anything else: dropout_p a number in [0, 1), window_size a pair
    of ints >= -1 (-1: unbounded), softcap a finite number >= 0. TypeError / ValueError naming the argument."""
    if (dropout_p.__class__ is float and softcap.__class__ is float and window_size.__class__ is tuple
            and dropout_p == 0.0 and softcap == 0.0 and window_size == (-1, -1)):
        return  # flash-attn's defaults, the common call: a few identity tests instead of the isinstance checks
    import math
    import numbers

    def real(x):
        return isinstance(x, numbers.Real) and not isinstance(x, bool)

    if not real(dropout_p):
        raise TypeError(f"dropout_p must be a float; got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1); got {dropout_p!r}")
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise TypeError(f"window_size must be a pair (left, right) of ints; got {window_size!r}") from None
    for side, w in (("left", left), ("right", right)):
        if not isinstance(w, numbers.Integral) or isinstance(w, bool):
            raise TypeError(f"window_size {side} must be an int; got {type(w).__name__}")
        if w < -1:
            raise ValueError(f"window_size {side} must be >= -1 (-1: unbounded); got {w}")
    if not real(softcap):
        raise TypeError(f"softcap must be a float; got {type(softcap).__name__}")
    if not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"softcap must be finite and >= 0 (0: off); got {softcap!r}")


def check_unsupported(dropout_p=0.0, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, *, scores=True) -> None:
    """flash-attn arguments a caller does not implement: bad values are a TypeError / ValueError
    (check_score_options), valid ones that are not the defaults a NotImplementedError, never ignored. scores:
    whether the caller implements the score modifiers and dropout (window_size, softcap, alibi_slopes, dropout_p;
    the V2 kernels do, the V1 kernels do not)."""
    check_score_options(dropout_p, window_size, softcap)
    if scores:
        return
    if dropout_p:
        raise NotImplementedError(f"dropout_p={dropout_p}: dropout runs on the V2 kernels (algorithm='v2'), not on "
                                  "algorithm='v1'")
    what = ("window_size" if tuple(window_size) != (-1, -1) else "softcap" if softcap
            else "alibi_slopes" if alibi_slopes is not None else None)
    if what:
        raise NotImplementedError(f"{what}: the score modifiers run on the V2 kernels (algorithm='v2'), not on "
                                  "algorithm='v1'")


def check_softmax_scale(softmax_scale) -> None:
    """None (1/sqrt(headdim)) or a finite number > 0: the kernels take row maxima of the raw scores."""
    if softmax_scale is None or (softmax_scale.__class__ is float and 0.0 < softmax_scale < math.inf):
        return  # the common call (a module's scale): one identity test and one comparison
    import numbers

    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a float or None; got {type(softmax_scale).__name__}")
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be finite and > 0; got {softmax_scale!r}")
