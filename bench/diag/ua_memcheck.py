"""Diagnostic (GPU, under compute-sanitizer): the UA kernels (rows that are not 16-byte units: odd head dims, odd
strides) on small ragged shapes, every access of each array checked against its allocation. Run with the caching
allocator off, so that every tensor is its own allocation and a read or write past a row's end at the last row is
an error:

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck python -m bench.diag.ua_memcheck

Forward and backward (autograd) at head dims 3 and 59, causal and not, seqlen_q != seqlen_k, GQA; a view with
67-element rows; the packed (varlen) forward and backward with an empty sequence; the KV-cache append; the decode
kernel's UA form (paged with a rotated append, by index behind a left padding; 1, 3 and 20 splits); paged K/V of packed
sequences. Each result is
checked against the float64 reference loosely (the tests hold the error rule); the sanitizer's summary is the point.
"""
from __future__ import annotations


def main():
    import numpy as np
    import torch

    import cuflash
    from cuflash import reference

    def close(name, got, ref, tol=3e-2):
        err = float(np.abs(got.detach().double().cpu().numpy() - ref).max())
        print(f"{'ok ' if err <= tol else 'BAD'} {name}: max error {err:.2e}", flush=True)

    torch.manual_seed(0)
    for d in (3, 59):
        for causal in (False, True):
            q = torch.randn(2, 37, 4, d, device="cuda", dtype=torch.float16, requires_grad=True)
            k = torch.randn(2, 45, 2, d, device="cuda", dtype=torch.float16, requires_grad=True)
            v = torch.randn(2, 45, 2, d, device="cuda", dtype=torch.float16, requires_grad=True)
            out = cuflash.flash_attn_func(q, k, v, causal=causal)
            dout = torch.randn_like(out)
            out.backward(dout)
            np_ = [x.detach().double().cpu().numpy() for x in (q, k, v, dout)]
            ref_o, _ = reference.attention_forward(*np_[:3], None, causal)
            close(f"d{d} causal={causal} out", out, ref_o)
            for name, g, r in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad),
                                  reference.attention_backward(np_[3], *np_[:3], None, causal)):
                close(f"d{d} causal={causal} {name}", g, r, 5e-2)
    base = torch.randn(2, 40, 2, 67, device="cuda", dtype=torch.float16)
    x = base[..., :64]  # rows of 67 elements
    out = cuflash.flash_attn_func(x, x, x, causal=True)
    xn = x.double().cpu().numpy()
    close("d64 rows of 67 out", out, reference.attention_forward(xn, xn, xn, None, True)[0])
    lens = (0, 33, 1, 70)
    cu = torch.tensor(np.cumsum((0,) + lens), dtype=torch.int32, device="cuda")
    qv, kv, vv = (torch.randn(sum(lens), 2, 59, device="cuda", dtype=torch.float16, requires_grad=True)
                  for _ in range(3))
    ov = cuflash.flash_attn_varlen_func(qv, kv, vv, cu, cu, max(lens), max(lens), causal=True)
    ov.backward(torch.randn_like(ov))
    print(f"varlen d59: out finite {bool(torch.isfinite(ov).all())}, grads finite "
          f"{all(bool(torch.isfinite(t.grad).all()) for t in (qv, kv, vv))}", flush=True)
    kc = torch.randn(2, 64, 2, 59, device="cuda", dtype=torch.float16)
    vc = torch.randn(2, 64, 2, 59, device="cuda", dtype=torch.float16)
    kn, vn = (torch.randn(2, 3, 2, 59, device="cuda", dtype=torch.float16) for _ in range(2))
    qd = torch.randn(2, 3, 4, 59, device="cuda", dtype=torch.float16)
    sl = torch.tensor([10, 61], dtype=torch.int32, device="cuda")
    od = cuflash.flash_attn_with_kvcache(qd, kc, vc, kn, vn, cache_seqlens=sl, causal=True)
    ok = torch.equal(kc[0, 10:13], kn[0]) and torch.equal(kc[1, 61:64], kn[1])
    print(f"kvcache append d59: appended rows exact {ok}, out finite {bool(torch.isfinite(od).all())}", flush=True)
    # the decode kernel's UA form: a paged cache (pages in their own allocation, the last page's last row at its end)
    # with a rotated append, then rows by index behind a left padding; one split, the rows combine, the block combine
    kp, vp = (torch.randn(5, 16, 2, 59, device="cuda", dtype=torch.float16) for _ in range(2))
    bt = torch.tensor([[4, 0], [2, 3]], dtype=torch.int32, device="cuda")
    cos, sin = (torch.rand(32, 16, device="cuda", dtype=torch.float16) for _ in range(2))
    sl2 = torch.tensor([7, 29], dtype=torch.int32, device="cuda")
    ki, vi = (torch.randn(3, 40, 2, 59, device="cuda", dtype=torch.float16) for _ in range(2))
    bi = torch.tensor([2, 0], dtype=torch.int32, device="cuda")
    lp = torch.tensor([5, 0], dtype=torch.int32, device="cuda")
    for ns in (1, 3, 20):
        op, lse = cuflash.flash_attn_with_kvcache(qd, kp, vp, kn, vn, cos, sin, sl2, block_table=bt, causal=True,
                                                  num_splits=ns, return_softmax_lse=True)
        oi = cuflash.flash_attn_with_kvcache(qd[:, :1], ki, vi, cache_seqlens=sl2, cache_batch_idx=bi,
                                             cache_leftpad=lp, num_splits=ns)
        print(f"kvcache d59 UA decode, {ns} splits: paged rotary out finite {bool(torch.isfinite(op).all())}, lse "
              f"finite {bool(torch.isfinite(lse).all())}; by index out finite {bool(torch.isfinite(oi).all())}",
              flush=True)
    # paged K/V of packed sequences at head dim 59 (the gather's UA form)
    lk = (0, 33, 1)
    ck = torch.tensor(np.cumsum((0,) + lk), dtype=torch.int32, device="cuda")
    cq = torch.tensor(np.cumsum((0, 2, 5, 1)), dtype=torch.int32, device="cuda")
    qg = torch.randn(8, 4, 59, device="cuda", dtype=torch.float16)
    btv = torch.tensor([[1, 1, 1], [0, 3, 2], [4, 4, 4]], dtype=torch.int32, device="cuda")
    og = cuflash.flash_attn_varlen_func(qg, kp, vp, cq, ck, 5, 33, block_table=btv)
    print(f"paged varlen d59: out finite {bool(torch.isfinite(og).all())}", flush=True)
    torch.cuda.synchronize()
    print("done", flush=True)


if __name__ == "__main__":
    main()
