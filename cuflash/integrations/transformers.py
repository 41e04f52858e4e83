"""Hugging Face Transformers: importing this module registers "cufa" (cuflash attention) with transformers'
`AttentionInterface`, so that `attn_implementation="cufa"` runs a model's attention on cuflash:

    import cuflash.integrations.transformers  # noqa: F401
    model = AutoModelForCausalLM.from_config(config, attn_implementation="cufa")

(Not "cuflash": transformers takes every implementation name containing "flash" for a request of the flash-attn
package or of a flash kernel from its hub, and tries to load one.)

The attention takes transformers' [batch, heads, seqlen, headdim] query / key / value as [batch, seqlen, heads,
headdim] views (no copy) and returns cuflash's output in the [batch, seqlen, heads, headdim] layout the models
expect from their attention functions. Causal self-attention, GQA (key / value with fewer heads, not repeated),
generation with the model's cache (a query shorter than the keys is bottom-right aligned, as in flash-attn), the
module's scaling, dropout while training, sliding windows (`sliding_window`: the current key and the
sliding_window - 1 before it) and Gemma's soft-cap (`softcap`). The mask is transformers' flash-attention mask
(registered with `AttentionMaskInterface` under the same name): None for batches without padding; for a padded
batch, the 2-D padding mask [batch, keys] (1: a real token, left or right padding): the real tokens are gathered
into packed sequences and run through cuflash.flash_attn_varlen_func (each sequence causal on its own, bottom-right
aligned), and the output scattered back (zeros at padded query positions). The queries' own mask is the last
seqlen_q columns of the keys' (transformers' convention: prefill, or generation steps after left padding). A
generation step (one query per row, no dropout) whose mask is left padding (each row: padding, then tokens) needs
none of that: the keys stay where they are and cuflash.flash_attn_with_kvcache skips each row's padding
(`cache_leftpad`).

Host cost: a model call hands every layer the same mask tensor, so what a mask gives -- its packing (torch.nonzero,
which waits for the device, and the prefix sums) or its left padding (one comparison read back) -- is computed once
per mask tensor, in-place version and query length and reused by the other layers (`_per_mask`; not for inference
tensors, which have no version counter, nor under torch.compile, which traces the packing in every layer and takes
no left-padding route); a generation step with the model's cache runs one plan for every step (cuflash._fwd: the
plans of a growing KV cache).
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch

from .._interop import compiling
from ..flash import flash_attn_func

NAME = "cufa"


def cuflash_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                              scaling: Optional[float] = None, sliding_window: Optional[int] = None,
                              softcap: Optional[float] = None, is_causal: Optional[bool] = None, **kwargs):
    """transformers' attention-function contract: (attn_output [batch, seqlen, heads, headdim], attn_weights =
    None)."""
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("cuflash: attention sinks (s_aux) are not supported")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    window = (-1, -1)
    if sliding_window:
        window = (int(sliding_window) - 1, 0 if causal else int(sliding_window) - 1)
    opts = (float(dropout or 0.0), scaling, bool(causal), window, float(softcap or 0.0))
    if attention_mask is not None:
        return _padded(q, k, v, attention_mask, opts), None
    return flash_attn_func(q, k, v, *opts), None


def _packing(mask):
    """(flat indices of the set entries of mask [batch, seqlen], cu_seqlens int32 [batch + 1], the longest length as
    a 0-dim tensor)."""
    lens = mask.sum(dim=1, dtype=torch.int32)
    idx = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    cu = torch.nn.functional.pad(torch.cumsum(lens, dim=0, dtype=torch.int32), (1, 0))
    return idx, cu, lens.max()


def _left_padding(mask):
    """int32 [batch]: the padding entries of each row of mask [batch, keys] when every row is padding then tokens
    (left padding, as generation pads), else None. Reads one flag back from the device."""
    sk = mask.shape[1]
    lead = (sk - mask.sum(dim=1, dtype=torch.int32)).to(torch.int32)
    prefix = torch.arange(sk, device=mask.device)[None, :] >= lead[:, None]
    return lead.contiguous() if torch.equal(mask, prefix) else None


_MASKS: list = []  # (weak reference to a mask, its version, data pointer, what, its value), newest last
_MAX_MASKS = 4  # a model call's masks (models with sliding-window layers have two), and the previous call's


def _per_mask(attention_mask, what, make):
    """make(attention_mask.bool()), made once per mask tensor, in-place version and `what` (module docstring)."""
    # an inference tensor has no version counter (in-place changes unseen): made on every call, as under compile
    memo = not compiling() and not attention_mask.is_inference()
    if memo:
        ver, ptr = attention_mask._version, attention_mask.data_ptr()
        for ref, v, p, w, value in _MASKS:
            if ref() is attention_mask and v == ver and p == ptr and w == what:
                return value
    value = make(attention_mask.bool())
    if memo:
        if len(_MASKS) >= _MAX_MASKS:
            del _MASKS[0]
        _MASKS.append((weakref.ref(attention_mask), ver, ptr, what, value))
    return value


def _mask_packing(attention_mask, sq):
    """The packing of the keys (mask [batch, keys]) and of the queries (its last sq columns): ((idx, cu, max) of
    the keys, (idx, cu, max) of the queries), once per mask (_per_mask); the queries' is the keys' when sq is the
    key count."""
    def make(mask_k):
        pk = _packing(mask_k)
        return pk, pk if sq == mask_k.shape[1] else _packing(mask_k[:, -sq:])

    return _per_mask(attention_mask, sq, make)


def _padded(q, k, v, attention_mask, opts):
    """A padded batch through flash_attn_varlen_func (module docstring)."""
    from ..varlen import flash_attn_varlen_func

    if attention_mask.dim() != 2:
        raise ValueError(f"cuflash: expected transformers' 2-D padding mask [batch, keys]; got shape "
                         f"{tuple(attention_mask.shape)}")
    b, sq, h, d = q.shape
    sk = k.shape[1]
    if tuple(attention_mask.shape) != (b, sk):
        raise ValueError(f"cuflash: the padding mask has shape {tuple(attention_mask.shape)}, not (batch, keys) = "
                         f"{(b, sk)}")
    dropout, scaling, causal, window, softcap = opts
    if sq == 1 and not dropout and not compiling():  # a generation step: left padding needs no packing
        lead = _per_mask(attention_mask, "left", _left_padding)
        if lead is not None:
            from .. import kvcache

            mods = {} if window == (-1, -1) and not softcap else dict(window_size=window, softcap=softcap)
            return kvcache.flash_attn_with_kvcache(q, k, v, cache_leftpad=lead, softmax_scale=scaling, causal=causal,
                                                   **mods)
    (idx_k, cu_k, max_k), (idx_q, cu_q, max_q) = _mask_packing(attention_mask, sq)
    kp = k.reshape(b * sk, *k.shape[2:]).index_select(0, idx_k)
    vp = v.reshape(b * sk, *v.shape[2:]).index_select(0, idx_k)
    qp = q.reshape(b * sq, h, d).index_select(0, idx_q)
    out = flash_attn_varlen_func(qp, kp, vp, cu_q, cu_k, max_q, max_k, *opts)
    full = out.new_zeros((b * sq, h, d)).index_copy(0, idx_q, out)
    return full.view(b, sq, h, d)


def register(name: str = NAME) -> None:
    """Register the attention (and its mask function) under `name` (done on import for NAME); a name containing
    "flash" is refused (see the module docstring)."""
    if "flash" in name:
        raise ValueError(f"{name!r}: transformers takes names containing 'flash' for flash-attn kernels; pick another")
    from transformers import AttentionInterface

    AttentionInterface.register(name, cuflash_attention_forward)
    try:
        from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
    except ImportError:  # transformers without mask interfaces: its default mask for custom attention
        return
    AttentionMaskInterface.register(name, flash_attention_mask)


register()
