"""GPU: packed sequences (flash_attn_varlen_func and its packed forms) against per-sequence calls of the float64
reference: outputs within 2x and gradients within 3x of torch's own attention in the same dtype on the same
sequences (conftest.py's rule); lengths including 0 and 1, seqlen_q != seqlen_k, sequences whose rows see no key,
every head dim (padded ones and the forward-only 512), fp16/bf16, GQA/MQA, causal, window, soft-cap, ALiBi,
dropout (the kernels' own Philox mask, per sequence), every dQ strategy, both forward backends; max_seqlen as
0-dim tensors; the CuPy path; CUDA-graph capture with changing lengths; input validation."""
import numpy as np
import pytest

import cuflash
from cuflash import _dropout, reference
from conftest import assert_close_to_ref, to_np, torch_attention_lowp

pytestmark = pytest.mark.gpu

LENS_Q = (37, 0, 1, 130, 64, 5, 200)
LENS_K = (53, 17, 1, 130, 0, 200, 77)


def cu_of(lens):
    import torch

    return torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device="cuda")


def packed_inputs(lens_q, lens_k, h, hk, d, dtype, requires_grad=True):
    import torch

    dt = getattr(torch, dtype)
    q = torch.randn(sum(lens_q), h, d, device="cuda").to(dt)
    k = torch.randn(sum(lens_k), hk, d, device="cuda").to(dt)
    v = torch.randn(sum(lens_k), hk, d, device="cuda").to(dt)
    for x in (q, k, v):
        x.requires_grad_(requires_grad)
    return q, k, v


def keep_of(seq, h, head, sq, sk, p, state):
    """The kernels' keep mask of (sequence seq, head): the counter of (seq * nheads + head) at local positions."""
    return _dropout.random16_reference(seq * h + head, sq, sk, *state) < _dropout.keep_threshold(p)


def per_sequence(q, k, v, dout, lens_q, lens_k, scale, causal, window, softcap, alibi, drop, grads=True):
    """(out, dq, dk, dv) of the float64 reference and of torch's low-precision attention, sequence by sequence,
    packed like cuflash's. drop: (p, (seed, offset)) or None."""
    import torch

    h, hk = q.shape[1], k.shape[1]
    cq, ck = np.concatenate([[0], np.cumsum(lens_q)]), np.concatenate([[0], np.cumsum(lens_k)])
    ref = {n: [] for n in ("o", "dq", "dk", "dv")}
    low = {n: [] for n in ("o", "dq", "dk", "dv")}
    for b, (sq, sk) in enumerate(zip(lens_q, lens_k)):
        qs, ks, vs = (x[c[b]:c[b + 1]].detach()[None] for x, c in ((q, cq), (k, ck), (v, ck)))
        ds = dout[cq[b]:cq[b + 1]][None]
        slopes = None
        if alibi is not None:
            slopes = alibi[b] if alibi.dim() == 2 else alibi
        if sk == 0 or sq == 0:  # nothing seen: zeros (the rule of rows that see no key)
            for store in (ref, low):
                store["o"].append(np.zeros((sq, h, q.shape[2])))
                store["dq"].append(np.zeros((sq, h, q.shape[2])))
                store["dk"].append(np.zeros((sk, hk, q.shape[2])))
                store["dv"].append(np.zeros((sk, hk, q.shape[2])))
            continue
        mask = None
        if drop is not None:
            mask = np.stack([keep_of(b, h, hh, sq, sk, drop[0], drop[1]) for hh in range(h)])[None]
        args = dict(softmax_scale=scale, causal=causal, window_size=window, softcap=softcap,
                    alibi_slopes=None if slopes is None else slopes.double().cpu().numpy(),
                    dropout_mask=mask, dropout_p=drop[0] if drop else 0.0)
        o_ref, _ = reference.attention_forward(to_np(qs), to_np(ks), to_np(vs), **args)
        ref["o"].append(o_ref[0])
        ql, kl, vl = (x.clone().requires_grad_(True) for x in (qs, ks, vs))
        tdrop = None if mask is None else (torch.from_numpy(mask).to("cuda"), drop[0])
        ol = torch_attention_lowp(ql, kl, vl, scale, causal, window, softcap, slopes, tdrop)
        low["o"].append(to_np(ol)[0])
        if grads:
            dq_r, dk_r, dv_r = reference.attention_backward(to_np(ds), to_np(qs), to_np(ks), to_np(vs), **args)
            for n, x in zip(("dq", "dk", "dv"), (dq_r, dk_r, dv_r)):
                ref[n].append(x[0])
            gq, gk, gv = torch.autograd.grad(ol, (ql, kl, vl), ds)
            for n, x in zip(("dq", "dk", "dv"), (gq, gk, gv)):
                low[n].append(to_np(x)[0])
    cat = lambda lst: np.concatenate(lst, axis=0)  # noqa: E731
    return {n: cat(x) for n, x in ref.items() if x}, {n: cat(x) for n, x in low.items() if x}


def check(q, k, v, lens_q, lens_k, *, causal=False, window=(-1, -1), softcap=0.0, alibi=None, dropout_p=0.0,
          backend="auto", dq_strategy=None, deterministic=False, max_as_tensor=False, grads=True, scale=None):
    import torch


    d = q.shape[2]
    scale = scale or d ** -0.5
    cq, ck = cu_of(lens_q), cu_of(lens_k)
    mq, mk = max(lens_q), max(lens_k)
    if max_as_tensor:
        mq, mk = torch.tensor(mq, dtype=torch.int32, device="cuda"), torch.tensor(mk, dtype=torch.int32, device="cuda")
    state = None
    if dropout_p:
        w = torch.cuda.default_generators[torch.cuda.current_device()].get_state().view(torch.int64)
        state = (int(w[0]) & ((1 << 64) - 1), int(w[1]))
    res = cuflash.flash_attn_varlen_func(q, k, v, cq, ck, mq, mk, dropout_p, scale, causal, window, softcap, alibi,
                                         deterministic, not dropout_p, dq_strategy=dq_strategy, backend=backend)
    out, lse = (res, None) if dropout_p else res[:2]
    assert out.shape == q.shape
    dout = torch.randn_like(out)
    ref, low = per_sequence(q, k, v, dout, lens_q, lens_k, scale, causal, window, softcap, alibi,
                            (dropout_p, state) if dropout_p else None, grads)

    def close(name, ours, factor):  # conftest's rule; torch's error from its per-sequence float64 copy
        assert_close_to_ref(name, ours, low[name], ref[name], factor)

    close("o", out, 2.0)
    if lse is not None:  # [h, total_q]; -inf for rows that see no key
        assert lse.shape == (q.shape[1], q.shape[0])
        assert not torch.isnan(lse).any()
    if grads:
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
        for n, x in (("dq", dq), ("dk", dk), ("dv", dv)):
            close(n, x, 3.0)
    return out


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [32, 64, 96, 128, 256, 40, 136])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_backward(d, dtype, causal):
    q, k, v = packed_inputs(LENS_Q, LENS_K, 4, 2, d, dtype)
    check(q, k, v, LENS_Q, LENS_K, causal=causal)


@pytest.mark.parametrize("backend", ["sm80", "auto"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_backends(d, backend, causal):
    """The Hopper forward (auto on sm_90) and the mma.sync forward on the same packed inputs, MQA."""
    q, k, v = packed_inputs(LENS_Q, LENS_K, 4, 1, d, "bfloat16", requires_grad=False)
    check(q, k, v, LENS_Q, LENS_K, causal=causal, backend=backend, grads=False)


@pytest.mark.parametrize("causal", [False, True])
def test_headdim_512_forward(causal):
    q, k, v = packed_inputs(LENS_Q, LENS_K, 2, 2, 512, "float16", requires_grad=False)
    check(q, k, v, LENS_Q, LENS_K, causal=causal, grads=False)


@pytest.mark.parametrize("opt", ["window", "causal_window", "softcap", "alibi", "alibi_batch", "all"])
@pytest.mark.parametrize("d", [64, 128])
def test_score_modifiers(opt, d):
    import torch

    q, k, v = packed_inputs(LENS_Q, LENS_K, 4, 2, d, "float16")
    b = len(LENS_Q)
    kw = dict(window=dict(window=(20, 7)), causal_window=dict(window=(33, -1), causal=True),
              softcap=dict(softcap=3.0),
              alibi=dict(alibi=torch.rand(4, device="cuda", dtype=torch.float32) * 0.3),
              alibi_batch=dict(alibi=torch.rand(b, 4, device="cuda", dtype=torch.float32) * 0.3),
              all=dict(window=(40, 5), softcap=4.0, alibi=torch.rand(4, device="cuda", dtype=torch.float32) * 0.2),
              )[opt]
    check(q, k, v, LENS_Q, LENS_K, **kw)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("opt", ["plain", "causal", "alibi"])
def test_dropout(d, opt):
    import torch

    q, k, v = packed_inputs(LENS_Q, LENS_K, 4, 2, d, "bfloat16")
    kw = dict(plain={}, causal=dict(causal=True), alibi=dict(alibi=torch.rand(4, device="cuda") * 0.3))[opt]
    check(q, k, v, LENS_Q, LENS_K, dropout_p=0.17, **kw)


@pytest.mark.parametrize("opt", ["plain", "causal", "window-softcap-alibi", "max-as-tensor"])
def test_dropout_probs(opt):
    """return_attn_probs with dropout on packed sequences: S_dmask float32 [batch, nheads, max_seqlen_q,
    max_seqlen_k], each sequence's probabilities at its local positions (the mask bottom-right aligned per
    sequence; magnitudes against the float64 softmax), negative exactly where the kernels' keep mask of (sequence
    b nheads + head, local i, local j) drops (keep_of, which test_dropout's gradients tie to the kernels), zeros
    past each sequence; empty sequences all zeros; the LSE and the output as without it."""
    import torch

    h, hk, d, p = 4, 2, 64, 0.17
    q, k, v = packed_inputs(LENS_Q, LENS_K, h, hk, d, "float16", requires_grad=opt == "causal")
    scale = d ** -0.5
    kw = dict(plain={}, causal=dict(causal=True), **{"max-as-tensor": {}},
              **{"window-softcap-alibi": dict(window_size=(40, 3), softcap=3.0,
                                              alibi_slopes=torch.rand(len(LENS_Q), h, device="cuda") * 0.3)})[opt]
    mq, mk = max(LENS_Q) + 3, max(LENS_K)
    if opt == "max-as-tensor":
        mq, mk = torch.tensor(mq, dtype=torch.int32, device="cuda"), torch.tensor(mk, dtype=torch.int32, device="cuda")
    w = torch.cuda.default_generators[torch.cuda.current_device()].get_state().view(torch.int64)
    state = (int(w[0]) & ((1 << 64) - 1), int(w[1]))
    out, lse, probs = cuflash.flash_attn_varlen_func(q, k, v, cu_of(LENS_Q), cu_of(LENS_K), mq, mk, p,
                                                     return_attn_probs=True, **kw)
    assert probs.dtype == torch.float32 and probs.shape == (len(LENS_Q), h, max(LENS_Q) + 3, max(LENS_K))
    assert lse.shape == (h, sum(LENS_Q)) and not torch.isnan(probs).any()
    got = probs.cpu().numpy()
    cq, ck = np.concatenate([[0], np.cumsum(LENS_Q)]), np.concatenate([[0], np.cumsum(LENS_K)])
    alibi = kw.get("alibi_slopes")
    for b, (sq, sk) in enumerate(zip(LENS_Q, LENS_K)):
        seq = got[b]
        assert not seq[:, sq:].any() and not seq[:, :, sk:].any(), "zeros past the sequence"
        if sq == 0 or sk == 0:
            continue
        an = None if alibi is None else alibi[b].double().cpu().numpy()
        s, _ = reference._scores(reference._bhsd(to_np(q[cq[b]:cq[b + 1]])[None]),
                                 np.repeat(reference._bhsd(to_np(k[ck[b]:ck[b + 1]])[None]), h // hk, 1), scale,
                                 kw.get("causal", False), kw.get("window_size", (-1, -1)), kw.get("softcap", 0.0), an)
        m = s.max(-1, keepdims=True)
        lse_ref = np.where(np.isfinite(m), m + np.log(np.exp(s - np.where(np.isfinite(m), m, 0)).sum(-1,
                                                                                                      keepdims=True)),
                           -np.inf)[0]
        ref_p = np.nan_to_num(np.exp(s[0] - lse_ref))
        mine = seq[:, :sq, :sk]
        assert np.abs(np.abs(mine) - ref_p).max() < 2e-3, (b, np.abs(np.abs(mine) - ref_p).max())
        keep = np.stack([keep_of(b, h, hh, sq, sk, p, state) for hh in range(h)])
        nz = mine != 0
        assert np.array_equal((~np.signbit(mine)) & nz, keep & nz), f"sequence {b}: negative exactly where dropped"
        assert nz.any()
    if opt == "causal":  # the backward of the same call drops what S_dmask marks (the gradient rule of check())
        dout = torch.randn_like(out)
        ref, low = per_sequence(q, k, v, dout, LENS_Q, LENS_K, scale, True, (-1, -1), 0.0, None, (p, state))
        for n, x in zip(("dq", "dk", "dv"), torch.autograd.grad(out, (q, k, v), dout)):
            assert_close_to_ref(n, x, low[n], ref[n], 3.0)


def test_dropout_probs_refuse_a_short_max_seqlen():
    """S_dmask is laid out by max_seqlen: one shorter than a sequence is a ValueError before any launch (the
    generator not advanced)."""
    import torch

    q, k, v = packed_inputs(LENS_Q, LENS_K, 2, 2, 64, "float16", requires_grad=False)
    before = torch.cuda.get_rng_state()
    with pytest.raises(ValueError, match="max_seqlen_q"):
        cuflash.flash_attn_varlen_func(q, k, v, cu_of(LENS_Q), cu_of(LENS_K), 100, max(LENS_K), 0.1,
                                       return_attn_probs=True)
    assert torch.equal(torch.cuda.get_rng_state(), before)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("strategy", [("atomic", False, False), ("seqpar", True, False), ("loop", True, False),
                                      (None, True, True), (None, False, True)])
def test_dq_strategies(d, strategy):
    """Every dQ strategy; deterministic with 0-dim max_seqlen tensors picks 'loop' (seqpar needs an int)."""
    dq_strategy, deterministic, as_tensor = strategy
    q, k, v = packed_inputs(LENS_Q, LENS_K, 4, 4, d, "float16")
    check(q, k, v, LENS_Q, LENS_K, causal=True, dq_strategy=dq_strategy, deterministic=deterministic,
          max_as_tensor=as_tensor)


def test_deterministic_bitwise():
    import torch

    q, k, v = packed_inputs(LENS_Q, LENS_K, 4, 2, 64, "float16")
    cq, ck = cu_of(LENS_Q), cu_of(LENS_K)
    dout = torch.randn_like(q)
    res = []
    for _ in range(2):
        out = cuflash.flash_attn_varlen_func(q, k, v, cq, ck, 200, 200, causal=True, deterministic=True)
        res.append(torch.autograd.grad(out, (q, k, v), dout))
    for a, b in zip(*res):
        assert torch.equal(a, b)


def test_long_and_short_mixture():
    """A 4k sequence among short ones (tiles of one sequence spread over many blocks), causal, GQA."""
    lens = (4096, 3, 0, 777, 1, 129)
    q, k, v = packed_inputs(lens, lens, 8, 2, 128, "bfloat16")
    check(q, k, v, lens, lens, causal=True)


def test_packed_forms_and_cupy():
    import cupy
    import torch

    lens = (50, 0, 77, 1)
    cq = cu_of(lens)
    qkv = torch.randn(sum(lens), 3, 4, 64, device="cuda", dtype=torch.float16, requires_grad=True)
    out = cuflash.flash_attn_varlen_qkvpacked_func(qkv, cq, max(lens), causal=True)
    q, k, v = (qkv[:, i] for i in range(3))
    ref = cuflash.flash_attn_varlen_func(q, k, v, cq, cq, max(lens), max(lens), causal=True)
    assert torch.equal(out, ref)
    out.sum().backward()
    assert qkv.grad is not None and not torch.isnan(qkv.grad).any()
    kv = torch.stack([k, v], dim=1).detach()
    out2 = cuflash.flash_attn_varlen_kvpacked_func(q.detach(), kv, cq, cq, max(lens), max(lens), causal=True)
    assert torch.equal(out2, ref.detach())
    # CuPy: forward with the LSE, then flash_attn_varlen_backward; the same numbers as torch's autograd
    qc, kc, vc = (cupy.from_dlpack(x.detach().contiguous()) for x in (q, k, v))
    cuc = cupy.from_dlpack(cq)
    oc, lc, _ = cuflash.flash_attn_varlen_func(qc, kc, vc, cuc, cuc, max(lens), max(lens), causal=True,
                                               return_attn_probs=True)
    assert isinstance(oc, cupy.ndarray) and lc.shape == (4, sum(lens))
    np.testing.assert_array_equal(cupy.asnumpy(oc), ref.detach().cpu().numpy())
    qg, kg, vg = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    o_t = cuflash.flash_attn_varlen_func(qg, kg, vg, cq, cq, max(lens), max(lens), causal=True, deterministic=True)
    g = torch.randn_like(o_t)
    tq, tk, tv = torch.autograd.grad(o_t, (qg, kg, vg), g)
    dq, dk, dv = cuflash.flash_attn_varlen_backward(cupy.from_dlpack(g), qc, kc, vc, oc, lc, cuc, cuc, max(lens),
                                                    max(lens), causal=True, deterministic=True)
    for a, b in ((dq, tq), (dk, tk), (dv, tv)):
        np.testing.assert_array_equal(cupy.asnumpy(a), b.cpu().numpy())


def test_graph_capture_changing_lengths():
    """A forward + backward captured once replays with new cu_seqlens (same totals): no host read of the lengths."""
    import torch

    total = 300
    q, k, v = packed_inputs((total,), (total,), 4, 2, 64, "float16", requires_grad=False)
    # max_seqlen as a device array (never read) and as an int bound (on sm90 at head dim 64 the int selects the
    # short-keys tile, the array the configured one): the eager reference takes the same form, so the same kernel
    for mq in (torch.tensor(150, dtype=torch.int32, device="cuda"), 300):
        cq = cu_of((100, 150, 50))
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            for _ in range(2):  # warm-up (compiles, allocates)
                cuflash.flash_attn_varlen_func(q, k, v, cq, cq, mq, mq, causal=True)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = cuflash.flash_attn_varlen_func(q, k, v, cq, cq, mq, mq, causal=True)
        for lens in ((100, 150, 50), (1, 298, 1), (0, 300, 0), (299, 0, 1)):
            cq.copy_(cu_of(lens))
            g.replay()
            torch.cuda.synchronize()
            ref = cuflash.flash_attn_varlen_func(q, k, v, cu_of(lens), cu_of(lens), mq, mq, causal=True)
            assert torch.equal(out, ref), (lens, mq)


def test_rows_that_see_no_key_are_zero():
    import torch

    lens_q, lens_k = (5, 70, 3), (0, 0, 9)
    q, k, v = packed_inputs(lens_q, lens_k, 2, 2, 64, "float16", requires_grad=False)
    out, lse, _ = cuflash.flash_attn_varlen_func(q, k, v, cu_of(lens_q), cu_of(lens_k), 70, 9, causal=True,
                                                 return_attn_probs=True)
    assert torch.equal(out[:75], torch.zeros_like(out[:75]))
    assert torch.isinf(lse[:, :75]).all() and (lse[:, :75] < 0).all()
    assert not torch.isnan(out).any()


def test_validation():
    import torch

    q, k, v = packed_inputs((10, 20), (10, 20), 4, 2, 64, "float16", requires_grad=False)
    cq = cu_of((10, 20))
    f = cuflash.flash_attn_varlen_func
    with pytest.raises(TypeError, match="cu_seqlens_q must be int32"):
        f(q, k, v, cq.long(), cq, 20, 20)
    with pytest.raises(ValueError, match="cu_seqlens_q and cu_seqlens_k must have the same length"):
        f(q, k, v, cq, cu_of((10, 10, 10)), 20, 20)
    with pytest.raises(ValueError, match="q must have 3 dimensions"):
        f(q[None], k, v, cq, cq, 20, 20)
    with pytest.raises(TypeError, match="max_seqlen_q must be an int"):
        f(q, k, v, cq, cq, 20.0, 20)
    with pytest.raises(ValueError, match="k must have 4 dimensions"):
        f(q, k, v, cq, cq, 20, 20, block_table=torch.zeros(2, 1, dtype=torch.int32, device="cuda"))
    with pytest.raises(ValueError, match="seqpar"):
        qg = q.clone().requires_grad_(True)
        out = f(qg, k, v, cq, cq, torch.tensor(20, device="cuda"), torch.tensor(20, device="cuda"),
                dq_strategy="seqpar")
        out.sum().backward()
    with pytest.raises(ValueError, match="alibi_slopes must have shape"):
        f(q, k, v, cq, cq, 20, 20, alibi_slopes=torch.ones(3, 4, device="cuda"))


def paged_of(k, v, lens_k, page_size, extra_pages=3, seed=0):
    """Packed k, v laid out in pages (flash-attn's paged layout): (k_pages, v_pages [num_pages, page_size, hk, d],
    block_table int32 [batch, max_pages]); pages in a random order, the unused ones and the tails filled with noise."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    per = [-(-n // page_size) for n in lens_k]
    max_pages = max(1, max(per))
    n_pages = sum(per) + extra_pages
    kp = torch.randn(n_pages, page_size, *k.shape[1:], device="cuda", generator=g).to(k.dtype)
    vp = torch.randn(n_pages, page_size, *v.shape[1:], device="cuda", generator=g).to(v.dtype)
    order = torch.randperm(n_pages, device="cuda", generator=g).tolist()
    bt = torch.full((len(lens_k), max_pages), n_pages - 1, dtype=torch.int32)  # unused entries: any valid page
    start, nxt = 0, 0
    for b, n in enumerate(lens_k):
        for j in range(per[b]):
            page = order[nxt]
            nxt += 1
            bt[b, j] = page
            rows = min(page_size, n - j * page_size)
            kp[page, :rows] = k[start + j * page_size:start + j * page_size + rows]
            vp[page, :rows] = v[start + j * page_size:start + j * page_size + rows]
        start += n
    return kp, vp, bt.cuda()


def _odd_rows(x, pad=3, offset=1):
    """A copy of x [..., d] as a view whose rows are d + pad elements apart, `offset` elements into its buffer: every
    stride and the base address 2-byte aligned only."""
    import torch

    d = x.shape[-1]
    big = torch.empty(x.numel() // d * (d + pad) + offset, device=x.device, dtype=x.dtype)
    y = big[offset:].view(*x.shape[:-1], d + pad)[..., :d]
    y.copy_(x)
    assert y.data_ptr() % 16 and y.stride(-2) % 8
    return y


@pytest.mark.parametrize("page_size", [16, 48, 256])
@pytest.mark.parametrize("backend", ["auto", "sm80"])
@pytest.mark.parametrize("d,causal", [(64, True), (128, False), (128, True), (256, True), (59, True), (111, False)])
def test_paged_kv_equals_contiguous(page_size, backend, d, causal):
    """block_table: the same keys in pages give the same bits as the packed call (and that one is checked against
    the reference above); GQA, empty sequences, sequences shorter than a page and spanning many. Head dims 59 and 111
    (rows that are not 16-byte units): the gather's UA form, then the UA kernels on both sides; at head dim 64 with
    page size 48 the pages are views of rows 67 elements long at a 2-byte offset (the gather's UA form, 16-byte
    packed rows after it)."""
    import torch

    q, k, v = packed_inputs(LENS_Q, LENS_K, 4, 2, d, "float16", requires_grad=False)
    kp, vp, bt = paged_of(k, v, LENS_K, page_size)
    if d == 64 and page_size == 48:
        kp, vp = (_odd_rows(x) for x in (kp, vp))
    cq, ck = cu_of(LENS_Q), cu_of(LENS_K)
    ref_o, ref_lse, _ = cuflash.flash_attn_varlen_func(q, k, v, cq, ck, max(LENS_Q), max(LENS_K), causal=causal,
                                                       return_attn_probs=True, backend=backend)
    out, lse, _ = cuflash.flash_attn_varlen_func(q, kp, vp, cq, ck, max(LENS_Q), max(LENS_K), causal=causal,
                                                 return_attn_probs=True, backend=backend, block_table=bt)
    assert torch.equal(out, ref_o) and torch.equal(lse, ref_lse)


@pytest.mark.parametrize("opts", [dict(window_size=(40, 0), softcap=20.0), dict(alibi="bh", causal=True),
                                  dict(dropout_p=0.2)], ids=["window-softcap", "alibi", "dropout"])
def test_paged_kv_with_options(opts):
    """The score options and dropout on paged K/V against the reference, per sequence (MQA, bf16, page size 32)."""
    import torch

    from test_score_mods import make_alibi

    opts = dict(opts)
    alibi = make_alibi(opts.pop("alibi", None), len(LENS_Q), 4)
    dropout_p = opts.pop("dropout_p", 0.0)
    q, k, v = packed_inputs(LENS_Q, LENS_K, 4, 1, 64, "bfloat16", requires_grad=False)
    kp, vp, bt = paged_of(k, v, LENS_K, 32)
    cq, ck = cu_of(LENS_Q), cu_of(LENS_K)
    gen = torch.cuda.default_generators[torch.cuda.current_device()]
    saved = gen.get_state()
    contiguous = cuflash.flash_attn_varlen_func(q, k, v, cq, ck, 200, 200, dropout_p, alibi_slopes=alibi, **opts)
    gen.set_state(saved)  # the same dropout draw
    paged = cuflash.flash_attn_varlen_func(q, kp, vp, cq, ck, 200, 200, dropout_p, alibi_slopes=alibi,
                                           block_table=bt, **opts)
    assert torch.equal(paged, contiguous)
    if not dropout_p:
        check(q, k, v, LENS_Q, LENS_K, alibi=alibi, grads=False, causal=opts.get("causal", False),
              window=opts.get("window_size", (-1, -1)), softcap=opts.get("softcap", 0.0))


def test_paged_kv_refuses_autograd_and_bad_pages():
    import torch

    q, k, v = packed_inputs(LENS_Q, LENS_K, 4, 2, 64, "float16", requires_grad=False)
    kp, vp, bt = paged_of(k, v, LENS_K, 16)
    cq, ck = cu_of(LENS_Q), cu_of(LENS_K)
    with pytest.raises(NotImplementedError, match="block_table with autograd"):
        cuflash.flash_attn_varlen_func(q.clone().requires_grad_(True), kp, vp, cq, ck, 200, 200, block_table=bt)
    with pytest.raises(ValueError, match="multiple of 16"):
        cuflash.flash_attn_varlen_func(q, kp[:, :8].contiguous(), vp[:, :8].contiguous(), cq, ck, 200, 200,
                                       block_table=bt)
    with pytest.raises(ValueError, match="block_table must have shape"):
        cuflash.flash_attn_varlen_func(q, kp, vp, cq, ck, 200, 200, block_table=bt[:3])
    # a CUDA graph of the paged call, replayed after the table was rewritten in place (pages moved)
    out = {}
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out["o"] = cuflash.flash_attn_varlen_func(q, kp, vp, cq, ck, 200, 200, block_table=bt)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out["o"] = cuflash.flash_attn_varlen_func(q, kp, vp, cq, ck, 200, 200, block_table=bt)
    kp2, vp2, bt2 = paged_of(k, v, LENS_K, 16, seed=5)
    kp.copy_(kp2)
    vp.copy_(vp2)
    bt.copy_(bt2)
    g.replay()
    torch.cuda.synchronize()
    ref = cuflash.flash_attn_varlen_func(q, k, v, cq, ck, 200, 200)
    assert torch.equal(out["o"], ref)
