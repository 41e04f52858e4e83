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
(registered with `AttentionMaskInterface` under the same name): None for batches without padding; a padded batch
(a 2-D mask) needs variable-length attention, which cuflash does not have yet: a NotImplementedError saying so.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..flash import flash_attn_func

NAME = "cufa"


def cuflash_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                              scaling: Optional[float] = None, sliding_window: Optional[int] = None,
                              softcap: Optional[float] = None, is_causal: Optional[bool] = None, **kwargs):
    """transformers' attention-function contract: (attn_output [batch, seqlen, heads, headdim], attn_weights =
    None)."""
    if attention_mask is not None:
        raise NotImplementedError(
            "cuflash: this batch has padding (a 2-D attention mask); padded batches need variable-length attention "
            "(flash_attn_varlen_func), which cuflash does not have yet. Pass batches without padding")
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("cuflash: attention sinks (s_aux) are not supported")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    window = (-1, -1)
    if sliding_window:
        window = (int(sliding_window) - 1, 0 if causal else int(sliding_window) - 1)
    out = flash_attn_func(q, k, v, float(dropout or 0.0), scaling, bool(causal), window, float(softcap or 0.0))
    return out, None


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
