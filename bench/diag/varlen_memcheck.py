"""Diagnostic (GPU): the packed-sequence kernels under compute-sanitizer. Sequences of length 0 and 1 next to
ragged ones, forward (both backends) and backward (every dQ strategy), causal and not, with the score modifiers and
dropout; every out-of-bounds access or uninitialised read is the sanitizer's error. Prints one line per case and
checks that no output is NaN.

    compute-sanitizer --tool memcheck --error-exitcode 1 python -m bench.diag.varlen_memcheck
    compute-sanitizer --tool initcheck --error-exitcode 1 python -m bench.diag.varlen_memcheck
"""
from __future__ import annotations

import sys


def main(argv):
    import torch

    import cuflash

    cases = [((0, 5, 0, 1, 130, 0), (3, 0, 0, 1, 77, 200)), ((0,), (0,)), ((1, 0), (0, 1)), ((64, 0, 129), (0, 64, 1))]
    dev = torch.device("cuda")
    n = 0
    for lens_q, lens_k in cases:
        cq = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32, device=dev)
        ck = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32, device=dev)
        for d in (64, 128):
            for causal, opts in ((False, {}), (True, {}), (False, dict(window_size=(16, 4), softcap=5.0)),
                                 (True, dict(dropout_p=0.2))):
                for backend in ("sm80", "auto"):
                    for dq in ("atomic", "seqpar", "loop"):
                        if backend == "auto" and dq != "atomic":
                            continue
                        q = torch.randn(sum(lens_q), 4, d, device=dev, dtype=torch.float16, requires_grad=True)
                        k = torch.randn(sum(lens_k), 2, d, device=dev, dtype=torch.float16, requires_grad=True)
                        v = torch.randn(sum(lens_k), 2, d, device=dev, dtype=torch.float16, requires_grad=True)
                        be = "sm80" if opts.get("dropout_p") else backend
                        out = cuflash.flash_attn_varlen_func(q, k, v, cq, ck, max(lens_q), max(lens_k), causal=causal,
                                                             dq_strategy=dq, backend=be, **opts)
                        out.backward(torch.randn_like(out))
                        torch.cuda.synchronize()
                        bad = [name for name, x in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad))
                               if torch.isnan(x).any()]
                        print(f"lens_q={lens_q} lens_k={lens_k} d={d} causal={causal} opts={opts} backend={be} "
                              f"dq={dq}: {'NaN in ' + ','.join(bad) if bad else 'ok'}", flush=True)
                        n += 1
                        if bad:
                            return 1
    print(f"varlen_memcheck: {n} cases, no NaN")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
