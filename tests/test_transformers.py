"""GPU: Hugging Face Transformers with attn_implementation="cufa" (cuflash.integrations.transformers) on small
randomly initialised models (no downloads), against the same weights with "sdpa" in bf16: Llama (causal, GQA)
logits, loss and every gradient; generation with the model's cache (prefill, then one-token steps: the scores of
each step); Mistral's sliding window; padded batches (left and right padding, through flash_attn_varlen_func):
logits at the real tokens, gradients, and generation from a left-padded batch; the attention function alone on a
generation step with a left-padded mask (the KV-cache route) and with a hole (the packed route)."""
import pytest

pytestmark = pytest.mark.gpu


def close(a, b, rel=2e-2):
    """bf16 agreement: max |a - b| within rel of max |b| (plus a floor)."""
    return float((a.float() - b.float()).abs().max()) <= rel * float(b.float().abs().max()) + 1e-3


def assert_same_step(ref, ours, out_r, out_o):
    """The losses' backward on both models: every parameter's gradient within bf16 agreement."""
    out_r.loss.backward()
    out_o.loss.backward()
    for (name, pr), (_, po) in zip(ref.named_parameters(), ours.named_parameters()):
        assert close(po.grad, pr.grad, rel=5e-2), name


def pair(cls, cfg):
    import torch

    import cuflash.integrations.transformers  # noqa: F401  (registers "cufa")

    torch.manual_seed(0)
    ref = cls._from_config(cfg, attn_implementation="sdpa").to(device="cuda", dtype=torch.bfloat16)
    ours = cls._from_config(cfg, attn_implementation="cufa").to(device="cuda", dtype=torch.bfloat16)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def llama_config(**kw):
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, **kw)


def test_llama_logits_loss_and_gradients():
    import torch
    from transformers import LlamaForCausalLM

    ref, ours = pair(LlamaForCausalLM, llama_config())
    ids = torch.randint(0, 1000, (2, 300), device="cuda")
    out_r, out_o = ref(ids, labels=ids), ours(ids, labels=ids)
    assert close(out_o.logits, out_r.logits)
    assert abs(float(out_o.loss) - float(out_r.loss)) <= 1e-2 * float(out_r.loss)
    assert_same_step(ref, ours, out_r, out_o)


def test_llama_generation_with_cache():
    import torch
    from transformers import LlamaForCausalLM

    ref, ours = pair(LlamaForCausalLM, llama_config())
    ids = torch.randint(0, 1000, (2, 77), device="cuda")
    kw = dict(max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True,
              attention_mask=torch.ones_like(ids))
    with torch.no_grad():
        gr = ref.generate(ids, **kw)
        go = ours.generate(ids, **kw)
    # the first steps are the same prefix; compare each step's scores while the tokens agree
    for step, (sr, so) in enumerate(zip(gr.scores, go.scores)):
        assert close(so, sr), step
        if not torch.equal(gr.sequences[:, 77 + step], go.sequences[:, 77 + step]):
            break


def test_mistral_sliding_window_and_padding():
    import torch

    transformers = pytest.importorskip("transformers")
    cfg = transformers.MistralConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, sliding_window=64,
                                     max_position_embeddings=1024)
    ref, ours = pair(transformers.MistralForCausalLM, cfg)
    ids = torch.randint(0, 1000, (2, 300), device="cuda")
    with torch.no_grad():
        assert close(ours(ids).logits, ref(ids).logits)
        mask = torch.ones_like(ids)
        mask[0, :10] = 0  # left padding
        real = mask.bool()
        assert close(ours(ids, attention_mask=mask).logits[real], ref(ids, attention_mask=mask).logits[real])


@pytest.mark.parametrize("side", ["left", "right"])
def test_llama_padded_batch_logits_and_gradients(side):
    import torch
    from transformers import LlamaForCausalLM

    ref, ours = pair(LlamaForCausalLM, llama_config())
    ids = torch.randint(0, 1000, (3, 200), device="cuda")
    mask = torch.ones_like(ids)
    for row, n in ((0, 37), (2, 150)):
        if side == "left":
            mask[row, :n] = 0
        else:
            mask[row, -n:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    out_r = ref(ids, attention_mask=mask, labels=labels)
    out_o = ours(ids, attention_mask=mask, labels=labels)
    real = mask.bool()
    assert close(out_o.logits[real], out_r.logits[real])
    assert abs(float(out_o.loss) - float(out_r.loss)) <= 1e-2 * float(out_r.loss)
    assert_same_step(ref, ours, out_r, out_o)


def test_llama_generation_left_padded():
    import torch
    from transformers import LlamaForCausalLM

    ref, ours = pair(LlamaForCausalLM, llama_config())
    ids = torch.randint(0, 1000, (2, 60), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :23] = 0
    kw = dict(max_new_tokens=5, do_sample=False, output_scores=True, return_dict_in_generate=True,
              attention_mask=mask, pad_token_id=0)
    with torch.no_grad():
        gr = ref.generate(ids, **kw)
        go = ours.generate(ids, **kw)
    for step, (sr, so) in enumerate(zip(gr.scores, go.scores)):
        assert close(so, sr), step
        if not torch.equal(gr.sequences[:, 60 + step], go.sequences[:, 60 + step]):
            break


@pytest.mark.parametrize("window,softcap", [(None, None), (64, None), (None, 30.0)])
def test_left_padded_step_and_hole_mask_against_reference(window, softcap):
    """The attention function on one generation step with a 2-D mask: left padding takes the KV-cache kernel with
    each row's padding count (a row of padding only: zeros), a mask with a hole takes the packed path; both against
    float64 attention over each row's real keys, within 2x torch's own bf16 error (conftest's rule)."""
    import types

    import numpy as np
    import torch

    import cuflash.integrations.transformers as integ
    from cuflash import reference
    from conftest import assert_close_to_ref, to_np, torch_attention_lowp

    b, h, hk, d, sk = 4, 8, 2, 128, 333
    module = types.SimpleNamespace(is_causal=True)
    scale = d ** -0.5
    q = torch.randn(b, h, 1, d, device="cuda").bfloat16()
    k, v = (torch.randn(b, hk, sk, d, device="cuda").bfloat16() for _ in range(2))
    left = torch.ones(b, sk, dtype=torch.long, device="cuda")
    for row, n in ((1, 37), (2, 250), (3, sk)):
        left[row, :n] = 0
    hole = left.clone()
    hole[0, 100:120] = 0
    kw = dict(scaling=scale, sliding_window=window, softcap=softcap)
    for mask in (left, hole):
        out, _ = integ.cuflash_attention_forward(module, q, k, v, mask, **kw)
        assert out.shape == (b, 1, h, d)
        m = mask.bool().cpu().numpy()
        win = (window - 1, 0) if window else (-1, -1)
        for r in range(b):
            keys = np.flatnonzero(m[r])
            if keys.size == 0:
                assert not out[r].float().abs().any(), "a row of padding only gives zeros"
                continue
            idx = torch.from_numpy(keys).cuda()
            qr, kr, vr = (x[r:r + 1].transpose(1, 2) for x in (q, k[:, :, idx], v[:, :, idx]))
            ref = reference.attention_forward(to_np(qr), to_np(kr), to_np(vr), scale, True, win,
                                              float(softcap or 0.0))[0]
            lowp = torch_attention_lowp(qr, kr, vr, scale, True, win, float(softcap or 0.0))
            assert_close_to_ref(f"row {r}", out[r:r + 1], lowp, ref)
