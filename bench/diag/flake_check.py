"""Diagnostic (GPU): repeat one backward accuracy check N times with fresh random inputs and count how often it
misses the error rule (python -m bench.diag.flake_check [N]). Used to tell a rare tolerance miss from a kernel bug.

The rule is the GPU tests' (tests/conftest.py, restated here so that bench/ does not import the tests): cuflash's
max abs error against the float64 reference must be at most 2x the error of torch's own attention computed in
the inputs' dtype, plus half an ulp of the output dtype at the reference's largest magnitude (at least 1e-5)."""
import sys

import numpy as np

ERR_FLOOR = 1e-5
MANTISSA_BITS = {"bfloat16": 7, "float16": 10}


def _np(x):
    return x.detach().double().cpu().numpy()


def _half_ulp(dtype: str, ref) -> float:
    m = float(np.max(np.abs(ref))) if ref.size else 0.0
    return 0.0 if m == 0.0 else 0.5 * 2.0 ** (np.floor(np.log2(m)) - MANTISSA_BITS[dtype])


def _torch_lowp(q, k, v, scale, causal):
    """torch's attention in the inputs' dtype, [b, s, h, d], bottom-right causal (the rule's yardstick)."""
    import torch

    from cuflash import reference

    g = q.shape[2] // k.shape[2]
    qh = q.transpose(1, 2)
    kh, vh = (x.transpose(1, 2).repeat_interleave(g, 1) for x in (k, v))
    s = (qh @ kh.transpose(-1, -2)) * scale
    if causal:
        mask = torch.from_numpy(reference.causal_mask(q.shape[1], k.shape[1])).to(q.device)
        s = s.masked_fill(~mask, float("-inf"))
    return (torch.softmax(s, dim=-1).nan_to_num(0.0) @ vh).transpose(1, 2)


def check_grads(b, sq, sk, h, hk, d, dtype, causal, warp_partition="auto"):
    """Raises AssertionError when dq, dk or dv misses the rule."""
    import torch

    import cuflash
    from cuflash import reference

    dt = getattr(torch, dtype)
    q = torch.randn(b, sq, h, d, device="cuda").to(dt).requires_grad_()
    k = torch.randn(b, sk, hk, d, device="cuda").to(dt).requires_grad_()
    v = torch.randn(b, sk, hk, d, device="cuda").to(dt).requires_grad_()
    scale = d ** -0.5
    out = cuflash.flash_attn_func(q, k, v, causal=causal, warp_partition=warp_partition)
    dout = torch.randn_like(out)
    ours = torch.autograd.grad(out, (q, k, v), dout)
    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    lowp = torch.autograd.grad(_torch_lowp(qq, kk, vv, scale, causal), (qq, kk, vv), dout)
    ref = reference.attention_backward(_np(dout), _np(q), _np(k), _np(v), scale, causal)
    for name, g, lp, r in zip(("dq", "dk", "dv"), ours, lowp, ref):
        e_ours = float(np.max(np.abs(_np(g) - r))) if r.size else 0.0
        e_torch = float(np.max(np.abs(_np(lp) - r))) if r.size else 0.0
        floor = max(ERR_FLOOR, _half_ulp(dtype, r))
        assert e_ours <= 2 * e_torch + floor, (
            f"{name} ({warp_partition}): max abs error {e_ours:.3e} > 2 x torch's {e_torch:.3e} + {floor:.2e}")


def main(n=40):
    cases = [("kv", 32), ("kv", 64), ("2d", 32), ("2d", 64), ("q", 32)]
    for part, d in cases:
        fails, worst = 0, ""
        for _ in range(n):
            try:
                check_grads(2, 300, 17, 2, 2, d, "float16", True, warp_partition=part)
            except AssertionError as e:
                fails += 1
                worst = str(e).splitlines()[0][:160]
        print(f"flake_check (300, 17) causal fp16 d={d} {part}: {fails}/{n} missed  {worst}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 40)
