"""torch.compile and Hugging Face Transformers with cuflash (suites compile_block and hf_llama).

compile_block: one pre-norm transformer block (RMSNorm, fused QKV projection, causal GQA attention, output
projection, SwiGLU MLP; hidden 2048, 16 query / 4 KV heads of 128, bf16, batch x seqlen = 16k tokens), a training
step's forward + backward, with cuflash's attention and with torch SDPA's (the default backend choice), each eager
and under torch.compile(fullgraph=True), timed in turn, medians of `rounds` rounds. Records: mode "step", the
block's time in ms (no attention TFLOP/s: the step is mostly matrix products), `compiled` and `ratio_to_sdpa` (SDPA's
time of the same mode / cuflash's: > 1 faster).

hf_llama: a randomly initialised Llama (8 layers, hidden 2048, 16 / 4 heads, bf16, 4 x 2048 tokens) with
attn_implementation="cufa" (cuflash.integrations.transformers) and "sdpa": a training step (forward with labels +
backward), the same step on a padded batch (three rows left-padded: cuflash runs it as packed sequences, SDPA with
its padding mask), and a greedy generation loop (prefill 512 tokens, 64 new ones: ms per new token), timed in
turn."""
from __future__ import annotations

import gc

from .harness import record, time_rounds

HIDDEN, HEADS, KV_HEADS, HEADDIM, TOKENS = 2048, 16, 4, 128, 16384


def _block(attn, dtype):
    """The block as a function of (x, params): attn(q, k, v) takes [b, s, h, d] views, returns [b, s, h, d]."""
    import torch
    import torch.nn.functional as F

    def rms(x, w):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype) * w

    def block(x, wn1, wqkv, wo, wn2, w1, w2, w3):
        b, s, _ = x.shape
        h = rms(x, wn1)
        qkv = h @ wqkv
        q, k, v = qkv.split((HEADS * HEADDIM, KV_HEADS * HEADDIM, KV_HEADS * HEADDIM), dim=-1)
        a = attn(q.view(b, s, HEADS, HEADDIM), k.view(b, s, KV_HEADS, HEADDIM), v.view(b, s, KV_HEADS, HEADDIM))
        x = x + a.reshape(b, s, HEADS * HEADDIM) @ wo
        h = rms(x, wn2)
        return x + (F.silu(h @ w1) * (h @ w3)) @ w2

    return block


def _params(dtype):
    import torch

    def p(*shape, scale=0.02):
        return (torch.randn(*shape, device="cuda", dtype=dtype) * scale).requires_grad_()

    qkv = (HEADS + 2 * KV_HEADS) * HEADDIM
    return [p(HIDDEN, scale=1.0), p(HIDDEN, qkv), p(HEADS * HEADDIM, HIDDEN), p(HIDDEN, scale=1.0),
            p(HIDDEN, 4 * HIDDEN), p(4 * HIDDEN, HIDDEN), p(HIDDEN, 4 * HIDDEN)]


def compile_block(dtypes=("bfloat16",), seqlens=(2048, 8192), rounds=3):
    import torch
    import torch.nn.functional as F

    import cuflash

    def cuflash_attn(q, k, v):
        return cuflash.flash_attn_func(q, k, v, causal=True)

    def sdpa_attn(q, k, v):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                              enable_gqa=True).transpose(1, 2)

    recs = []
    for dtype in dtypes:
        dt = getattr(torch, dtype)
        for s in seqlens:
            b = max(1, TOKENS // s)
            params = _params(dt)
            x = torch.randn(b, s, HIDDEN, device="cuda", dtype=dt, requires_grad=True)
            dy = torch.randn_like(x)
            fns = {}
            for prov, attn in (("cuflash", cuflash_attn), ("sdpa", sdpa_attn)):
                eager = _block(attn, dt)
                torch._dynamo.reset()
                compiled = torch.compile(_block(attn, dt), fullgraph=True)
                for mode, fn in (("eager", eager), ("compiled", compiled)):
                    def step(fn=fn):
                        for t in [x, *params]:
                            t.grad = None
                        fn(x, *params).backward(dy)

                    step()  # compile and warm up outside the timing
                    fns[f"{prov}/{mode}"] = step
            res = time_rounds(fns, rounds)
            for key, (ms, per) in res.items():
                prov, mode = key.split("/")
                base = res.get(f"sdpa/{mode}", (None,))[0]
                recs.append(record(prov, f"block-{mode}", "step", dtype, b, HEADS, s, s, HEADDIM, True, ms,
                                   backend="sm90+sm80" if prov == "cuflash" else None, rounds=rounds, round_ms=per,
                                   compiled=mode == "compiled", kv_heads=KV_HEADS,
                                   ratio_to_sdpa=(base / ms) if prov == "cuflash" and base and ms else None))
            print("compile_block", dtype, s, " ".join(f"{k}={v[0]:.3f}ms" if v[0] else f"{k}=n/a"
                                                      for k, v in res.items()), flush=True)
            gc.collect()
    return recs


def hf_llama(batch=4, seqlen=2048, prefill=512, new_tokens=64, rounds=3):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import cuflash.integrations.transformers  # noqa: F401  (registers "cufa")

    cfg = LlamaConfig(vocab_size=32000, hidden_size=HIDDEN, intermediate_size=5632, num_hidden_layers=8,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=4096)
    torch.manual_seed(0)
    models = {"sdpa": LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").to("cuda", torch.bfloat16)}
    models["cufa"] = LlamaForCausalLM._from_config(cfg, attn_implementation="cufa").to("cuda", torch.bfloat16)
    models["cufa"].load_state_dict(models["sdpa"].state_dict())
    ids = torch.randint(0, cfg.vocab_size, (batch, seqlen), device="cuda")
    prompt = ids[:, :prefill]

    def train_step(m):
        def run():
            m.zero_grad(set_to_none=True)
            m(ids, labels=ids).loss.backward()
        return run

    pad_mask = torch.ones_like(ids)  # a padded batch: rows 1-3 left-padded by 300, 700 and 1500 tokens
    for row, n in ((1, 300), (2, 700), (3, 1500)):
        pad_mask[row, :n] = 0
    pad_labels = ids.masked_fill(pad_mask == 0, -100)

    def train_step_padded(m):
        def run():
            m.zero_grad(set_to_none=True)
            m(ids, attention_mask=pad_mask, labels=pad_labels).loss.backward()
        return run

    def generate(m):
        def run():
            with torch.no_grad():
                m.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False)
        return run

    recs = []
    for what, make, tokens in (("train_step", train_step, seqlen), ("train_step_padded", train_step_padded, seqlen),
                               ("generate", generate, new_tokens)):
        fns = {name: make(m) for name, m in models.items()}
        for fn in fns.values():
            fn()  # warm up
        res = time_rounds(fns, rounds)
        base = res["sdpa"][0]
        for name, (ms, per) in res.items():
            prov = "cuflash" if name == "cufa" else "sdpa"
            per_token = ms / tokens if what == "generate" and ms else None
            train = what.startswith("train_step")
            recs.append(record(prov, f"hf-llama-{what}", "step", "bfloat16", batch, HEADS, seqlen if train else
                               prefill, seqlen if train else prefill + new_tokens,
                               HEADDIM, True, ms, backend="sm90+sm80" if prov == "cuflash" else None, rounds=rounds,
                               round_ms=per,
                               attn_implementation=name, ms_per_token=per_token,
                               ratio_to_sdpa=(base / ms) if prov == "cuflash" and base and ms else None))
        print("hf_llama", what, " ".join(f"{k}={v[0]:.3f}ms" if v[0] else f"{k}=n/a" for k, v in res.items()),
              flush=True)
    return recs
