"""Standard attention, the way frameworks computed it before fusion (the speed and memory baseline).

S = Q K^T is materialized in device memory by cuBLAS (torch.matmul for torch inputs, cupy.matmul for
CuPy inputs), our softmax kernel turns S into P in place (cuda_src/softmax.cu), and cuBLAS computes
O = P V. Memory grows as seqlen^2: [batch, heads, seqlen_q, seqlen_k] elements of S/P.
"""
from __future__ import annotations

import math
from typing import Any, Optional

from . import _interop
from ._configs import softmax_spec
from ._launch import get_launcher
from ._validate import check_qkv

SOFTMAX_FORMAT = "=Qqqf4xi4x"  # (T* s, int64 seqlen_q, int64 seqlen_k, float scale_log2, int causal)


def naive_attention(q: Any, k: Any, v: Any, softmax_scale: Optional[float] = None, causal: bool = False) -> Any:
    """Unfused attention (the baseline): S = Q K^T by cuBLAS, softmax by cuflash's kernel in place, O = P V by cuBLAS.

    q [batch, seqlen_q, nheads, headdim], k, v [batch, seqlen_k, nheads_k, headdim] (flash-attn layout; nheads a
    multiple of nheads_k), float16 or bfloat16, torch CUDA tensors or CuPy arrays, checked like flash_attn_func's
    inputs. softmax_scale: None -> headdim ** -0.5; causal: bottom-right aligned mask. Returns out
    [batch, seqlen_q, nheads, headdim] like q (a permuted view of the [b, h, sq, d] product). Memory: S / P take
    batch * nheads * seqlen_q * seqlen_k elements. Raises TypeError / ValueError (naming the argument) for
    inputs flash_attn_func would reject.
    """
    qa, ka, va = check_qkv(q, k, v)
    b, sq, h, d = qa.shape
    sk, hk = ka.shape[1], ka.shape[2]
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    g = h // hk
    if qa.kind == _interop.TORCH:
        qh = q.permute(0, 2, 1, 3)  # [b, h, sq, d]
        kh = k.permute(0, 2, 1, 3)  # [b, hk, sk, d]
        vh = v.permute(0, 2, 1, 3)
        if g > 1:
            kh, vh = kh.repeat_interleave(g, dim=1), vh.repeat_interleave(g, dim=1)
        s = qh @ kh.transpose(-1, -2)  # S = Q K^T  [b, h, sq, sk], cuBLAS
    else:
        import cupy

        qh, kh, vh = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        if g > 1:
            kh, vh = cupy.repeat(kh, g, axis=1), cupy.repeat(vh, g, axis=1)
        with _interop.device_guard(qa.device):
            s = cupy.matmul(qh, kh.transpose(0, 1, 3, 2))
    lau = get_launcher(softmax_spec(qa.dtype), qa.device)
    with _interop.device_guard(qa.device):
        lau.launch((b * h * sq, 1, 1), _interop.current_stream(qa), SOFTMAX_FORMAT,
                   _interop.data_ptr(s), sq, sk, scale * math.log2(math.e), int(bool(causal)))
        o = s @ vh  # O = P V  [b, h, sq, d], cuBLAS
    return o.permute(0, 2, 1, 3) if qa.kind == _interop.TORCH else o.transpose(0, 2, 1, 3)
