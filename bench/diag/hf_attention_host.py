"""Diagnostic (GPU): the Hugging Face attention functions of one greedy generation, alone, on real torch --
cuflash's (cuflash.integrations.transformers, "cufa") and transformers' own "sdpa" -- over the decode steps of the
hf_llama model (8 layers, batch 4, 16 / 4 heads of 128, bf16, keys 513..576: each step's keys and values new
[b, hk, keys, d] arrays, as transformers' cache makes them), with and without a left-padded mask.

    PYTHONPATH=. python3 -m bench.diag.hf_attention_host [--rounds 5]

Per call: host microseconds (the loop's wall time with the device work queued behind it: what the Python path
costs; the device is idle-bound here) and the GPU microseconds of the same loop (CUDA events), medians of rounds
taken in turn; plus, for cufa, the plans made (cuflash._fwd._make_plan) and torch.nonzero calls (host syncs) per
step. A correctness line first: cufa's decode outputs bitwise equal to a fresh plan's (memos cleared) and within
bf16 agreement of sdpa's.
"""
from __future__ import annotations

import argparse
import statistics
import time


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    import cuflash.integrations.transformers as integ
    from cuflash import _fwd

    b, h, hk, d, layers, prefill, steps = 4, 16, 4, 128, 8, 512, 64

    class Mod(torch.nn.Module):
        is_causal = True
        num_key_value_groups = h // hk

    mod = Mod().eval()
    g = torch.Generator(device="cuda").manual_seed(0)
    pad = torch.ones((b, prefill + steps), dtype=torch.bool, device="cuda")
    pad[1, :100], pad[3, :300] = False, False

    def arrays():
        out = []
        for t in range(steps):
            sk = prefill + 1 + t
            q = torch.randn((b, 1, h, d), device="cuda", generator=g).bfloat16().transpose(1, 2)
            kv = [tuple(torch.randn((b, hk, sk, d), device="cuda", generator=g).bfloat16() for _ in range(2))
                  for _ in range(layers)]
            m = pad[:, :sk].clone()  # cufa takes the 2-D padding mask, sdpa a broadcastable 4-D one
            out.append((q, kv, {"cufa": m, "sdpa": m[:, None, None, :]}))
        return out

    data = arrays()
    counts = dict(plans=0, nonzero=0)
    real_make, real_nonzero = _fwd._make_plan, torch.nonzero

    def make(*a, **kw):
        counts["plans"] += 1
        return real_make(*a, **kw)

    def nonzero(*a, **kw):
        counts["nonzero"] += 1
        return real_nonzero(*a, **kw)

    _fwd._make_plan, integ.torch.nonzero = make, nonzero
    fns = {"cufa": integ.cuflash_attention_forward, "sdpa": sdpa_attention_forward}

    def run(name, masked):
        fn, outs = fns[name], []
        for q, kv, m in data:
            for k, v in kv:
                outs.append(fn(mod, q, k, v, m[name] if masked else None, dropout=0.0, scaling=d ** -0.5)[0])
        return outs

    # correctness: cufa's steps against a fresh plan per call, and against sdpa
    with torch.no_grad():
        ours = run("cufa", False)
        q, kv, _ = data[5]
        _fwd._PLANS.clear(), _fwd._KV_PLANS.clear()
        fresh = integ.cuflash_attention_forward(mod, q, kv[0][0], kv[0][1], None, scaling=d ** -0.5)[0]
        ref = sdpa_attention_forward(mod, q, kv[0][0], kv[0][1], None, dropout=0.0, scaling=d ** -0.5,
                                     is_causal=False)[0]
        bitwise = torch.equal(ours[5 * layers], fresh)
        err = float((ours[5 * layers].float() - ref.float()).abs().max())
        print(f"correctness: cufa step == fresh plan bitwise: {bitwise}; max |cufa - sdpa| = {err:.3e}")
        rows = []
        for masked in (False, True):
            per = {name: ([], []) for name in fns}
            for _ in range(args.rounds):
                for name in fns:
                    run(name, masked)  # warm
                    c0 = dict(counts)
                    torch.cuda.synchronize()
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    t0 = time.perf_counter()
                    s.record()
                    run(name, masked)
                    e.record()
                    host = time.perf_counter() - t0
                    torch.cuda.synchronize()
                    n = steps * layers
                    per[name][0].append(host / n * 1e6)
                    per[name][1].append(s.elapsed_time(e) / n * 1e3)
                    if name == "cufa":
                        made = ((counts["plans"] - c0["plans"]) / steps, (counts["nonzero"] - c0["nonzero"]) / steps)
            for name in fns:
                extra = f"plans/step {made[0]:.2f}  nonzero/step {made[1]:.2f}" if name == "cufa" else ""
                rows.append((("padded " if masked else "no mask ") + name, statistics.median(per[name][0]),
                             statistics.median(per[name][1]), extra))
    print(f"{'decode step (8 layers, b4 h16/4 d128)':40s} {'host us/call':>13s} {'GPU us/call':>12s}")
    for name, host, gpu, extra in rows:
        print(f"{name:40s} {host:13.1f} {gpu:12.1f}  {extra}")


if __name__ == "__main__":
    main()
