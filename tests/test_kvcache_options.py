"""GPU: flash_attn_with_kvcache's cache indirections against the float64 reference (flash-attn's semantics):

* block_table: paged caches k_cache [num_pages, page_size, nheads_k, d] at page sizes 16, 32, 48 and 256 (pages in
  a random order, more pages than the table uses), against the reference on the gathered keys and bitwise against
  the same keys laid out contiguously;
* cache_batch_idx: each batch element reads (and appends to) the cache row it names;
* cache_leftpad: the keys before it are unseen (causal diagonal and ALiBi distances count from it);
* rotary_cos / rotary_sin: q and the appended keys rotated (interleaved and half-split, rotary_dim below and equal
  to the head dim), the appended keys at positions cache_seqlens + i, the queries there too when causal or local
  and all at cache_seqlens otherwise; the cache rows written are checked against the rotation (one rounding);
* the score options with them; the append with them; CUDA-graph capture of a paged, rotary decode step replayed
  after the lengths and the block table changed.

The reference attends over the cache as the call left it (the append is checked separately, row by row)."""
import numpy as np
import pytest

import cuflash
from cuflash import reference
from conftest import assert_close_to_ref, to_np, torch_attention_lowp
from test_score_mods import make_alibi

pytestmark = pytest.mark.gpu

_ULP_BITS = {"float16": 10, "bfloat16": 7}


def rotate(x, cos, sin, pos, interleaved):
    """x [n, ..., d] rotated (float64) at positions pos [n] by the tables cos/sin [seqlen_ro, rd / 2]."""
    x = np.array(x, dtype=np.float64)
    rd = 2 * cos.shape[1]
    c = cos[pos].reshape((len(pos),) + (1,) * (x.ndim - 2) + (rd // 2,))
    s = sin[pos].reshape(c.shape)
    if interleaved:
        x1, x2 = x[..., 0:rd:2].copy(), x[..., 1:rd:2].copy()
        x[..., 0:rd:2], x[..., 1:rd:2] = x1 * c - x2 * s, x2 * c + x1 * s
    else:
        x1, x2 = x[..., :rd // 2].copy(), x[..., rd // 2:rd].copy()
        x[..., :rd // 2], x[..., rd // 2:rd] = x1 * c - x2 * s, x2 * c + x1 * s
    return x


def rotary_tables(seqlen_ro, rd, dtype, base=10000.0):
    import torch

    inv = 1.0 / base ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    ang = torch.arange(seqlen_ro, dtype=torch.float64)[:, None] * inv[None, :]
    dt = getattr(torch, dtype)
    return torch.cos(ang).to(dt).cuda(), torch.sin(ang).to(dt).cuda()


class Case:
    """A KV-cache call with its inputs kept before the call (caches cloned), and its reference."""

    def __init__(self, b=3, sq=1, h=8, hk=2, d=128, cap=512, seqlens=(300, 0, 511), s_new=0, dtype="float16",
                 page_size=None, batch_idx=False, leftpad=None, rotary=None, causal=False, window=(-1, -1),
                 softcap=0.0, alibi=None, seed=0, odd_rows=False):
        import torch

        g = torch.Generator(device="cuda").manual_seed(seed)
        dt = getattr(torch, dtype)
        self.b, self.sq, self.h, self.hk, self.d, self.cap, self.dtype = b, sq, h, hk, d, cap, dtype
        self.seqlens = list(seqlens)[:b]
        self.s_new, self.causal, self.window, self.softcap = s_new, causal, window, softcap

        def rnd(*shape):  # odd_rows: q, the caches and the new keys as views of rows d + 3 elements apart at a
            x = torch.randn(*shape, device="cuda", generator=g).to(dt)  # 2-byte offset (the UA kernels)
            if not odd_rows:
                return x
            big = torch.empty(x.numel() // d * (d + 3) + 1, device="cuda", dtype=dt)
            y = big[1:].view(*shape[:-1], d + 3)[..., :d]
            y.copy_(x)
            return y

        self.q = rnd(b, sq, h, d) * (3.0 if softcap else 1.0)
        self.page_size = page_size
        if page_size:  # pages in a random order, two more than the table uses
            per_seq = -(-cap // page_size)
            self.cap = per_seq * page_size
            n_pages = b * per_seq + 2
            self.kc, self.vc = rnd(n_pages, page_size, hk, d), rnd(n_pages, page_size, hk, d)
            perm = torch.randperm(n_pages, device="cuda", generator=g)[:b * per_seq]
            self.block_table = perm.reshape(b, per_seq).to(torch.int32)
        else:
            rows = b + 2 if batch_idx else b
            self.kc, self.vc = rnd(rows, cap, hk, d), rnd(rows, cap, hk, d)
            self.block_table = None
        self.batch_idx = (torch.randperm(b + 2, device="cuda", generator=g)[:b].to(torch.int32) if batch_idx
                          else None)
        self.leftpad = None if leftpad is None else torch.tensor(list(leftpad)[:b], dtype=torch.int32, device="cuda")
        self.cache_seqlens = torch.tensor(self.seqlens, dtype=torch.int32, device="cuda")
        self.k_new = rnd(b, s_new, hk, d) if s_new else None
        self.v_new = rnd(b, s_new, hk, d) if s_new else None
        self.rotary = rotary
        self.cos = self.sin = None
        if rotary:
            rd, interleaved = rotary
            self.cos, self.sin = rotary_tables(self.cap, rd, dtype)
        self.alibi = make_alibi(alibi, b, h)
        self.kc0, self.vc0 = self.kc.clone(), self.vc.clone()

    def kwargs(self):
        return dict(rotary_cos=self.cos, rotary_sin=self.sin, cache_seqlens=self.cache_seqlens,
                    cache_batch_idx=self.batch_idx, cache_leftpad=self.leftpad, block_table=self.block_table,
                    causal=self.causal, window_size=self.window, softcap=self.softcap,
                    rotary_interleaved=self.rotary[1] if self.rotary else True, alibi_slopes=self.alibi)

    def run(self, num_splits=0):
        return cuflash.flash_attn_with_kvcache(self.q, self.kc, self.vc, self.k_new, self.v_new, num_splits=num_splits,
                                               return_softmax_lse=True, **self.kwargs())

    # ---------------------------------------------------------------------------------- reference side
    def logical(self, cache, i):
        """Element i's cache as [cap, hk, d] (the pages of its block-table row, or its cache row)."""
        if self.block_table is not None:
            pages = self.block_table[i].long()
            return cache[pages].reshape(-1, self.hk, self.d)
        row = int(self.batch_idx[i]) if self.batch_idx is not None else i
        return cache[row]

    def expected_append(self):
        """The caches as the append must leave them: (k, v, the rows written), the rotated keys rounded once (fp32
        rotation)."""
        import torch

        k, v = self.kc0.clone(), self.vc0.clone()
        touched = torch.zeros(k.shape[:2], dtype=torch.bool, device=k.device)
        if not self.s_new:
            return k, v, touched
        for i, n in enumerate(self.seqlens):
            rows = [n + j for j in range(self.s_new) if n + j < self.cap]
            if not rows:
                continue
            kn = self.k_new[i, :len(rows)].float()
            if self.rotary:
                c, s = self.cos.float(), self.sin.float()
                kn = torch.from_numpy(rotate(kn.cpu().numpy(), c.cpu().numpy(), s.cpu().numpy(),
                                             np.array(rows), self.rotary[1])).float().cuda()
            for j, r in enumerate(rows):
                if self.block_table is not None:
                    page, off = int(self.block_table[i, r // self.page_size]), r % self.page_size
                    k[page, off], v[page, off] = kn[j].to(k.dtype), self.v_new[i, j]
                    touched[page, off] = True
                else:
                    row = int(self.batch_idx[i]) if self.batch_idx is not None else i
                    k[row, r], v[row, r] = kn[j].to(k.dtype), self.v_new[i, j]
                    touched[row, r] = True
        return k, v, touched

    def check_append(self):
        import torch

        ek, ev, touched = self.expected_append()
        assert torch.equal(self.vc, ev), "v_cache: the appended values land unchanged, nothing else changes"
        assert torch.equal(self.kc[~touched], ek[~touched]), "k_cache: rows not appended to must not change"
        if not self.rotary:
            assert torch.equal(self.kc, ek), "k_cache: the appended keys land unchanged"
            return
        got, want = self.kc[touched].double(), ek[touched].double()
        one_rounding = want.abs().clamp_min(2.0 ** -14) * 2.0 ** -_ULP_BITS[self.dtype]
        diff = (got - want).abs()
        assert bool((diff <= one_rounding).all()), f"k_cache: rotated keys off by more than one rounding: {diff.max()}"

    def q_rotated(self, i):
        """(float64 rotated q of element i [1, sq, h, d], the same rounded to the dtype as the kernel rounds it)."""
        import torch

        qn = to_np(self.q[i:i + 1])
        if not self.rotary:
            return qn, self.q[i:i + 1]
        per_row = self.causal or tuple(self.window) != (-1, -1)
        pos = np.minimum(self.seqlens[i] + (np.arange(self.sq) if per_row else np.zeros(self.sq, int)), self.cap - 1)
        cos, sin = to_np(self.cos), to_np(self.sin)
        q64 = rotate(qn[0], cos, sin, pos, self.rotary[1])[None]
        q32 = rotate(self.q[i].float().cpu().numpy(), self.cos.float().cpu().numpy(), self.sin.float().cpu().numpy(),
                     pos, self.rotary[1])
        return q64, torch.from_numpy(q32.astype(np.float32)).cuda().to(self.q.dtype)[None]

    def check(self, out, lse, what=""):
        import torch

        assert not torch.isnan(out).any()
        for i, n in enumerate(self.seqlens):
            lp = int(self.leftpad[i]) if self.leftpad is not None else 0
            end = min(n + self.s_new, self.cap)
            kl, vl = self.logical(self.kc, i), self.logical(self.vc, i)
            ks, vs = kl[lp:end][None], vl[lp:end][None]
            q64, qlow = self.q_rotated(i)
            al = None if self.alibi is None else (self.alibi if self.alibi.dim() == 1 else self.alibi[i:i + 1])
            if end - lp <= 0:
                assert (out[i] == 0).all() and torch.isneginf(lse[i]).all(), f"{what}: element {i} sees no key"
                continue
            ref_o, ref_lse = reference.attention_forward(q64, to_np(ks), to_np(vs), self.d ** -0.5, self.causal,
                                                         self.window, self.softcap,
                                                         None if al is None else al.double().cpu().numpy())
            low = torch_attention_lowp(qlow, ks, vs, self.d ** -0.5, self.causal, self.window, self.softcap, al)
            assert_close_to_ref(f"{what} element {i}", out[i:i + 1], low, ref_o)
            if self.rotary:  # the LSE of the rotated q as the kernel holds it (rounded once to the dtype)
                _, ref_lse = reference.attention_forward(to_np(qlow), to_np(ks), to_np(vs), self.d ** -0.5,
                                                         self.causal, self.window, self.softcap,
                                                         None if al is None else al.double().cpu().numpy())
            got = to_np(lse[i:i + 1])
            fin = np.isfinite(ref_lse)
            assert np.array_equal(np.isneginf(got), np.isneginf(ref_lse))
            assert np.allclose(got[fin], ref_lse[fin], atol=2e-4, rtol=0)


# ------------------------------------------------------------------------------------------- paged
@pytest.mark.parametrize("page_size", [16, 32, 48, 256])
@pytest.mark.parametrize("d", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("h,hk,sq", [(8, 2, 1), (4, 4, 3)])
def test_paged_against_reference_and_contiguous(page_size, d, h, hk, sq):
    import torch

    c = Case(d=d, h=h, hk=hk, sq=sq, page_size=page_size, cap=700, seqlens=(650, 0, 17), causal=sq > 1, seed=d)
    out, lse = c.run()
    c.check(out, lse, f"paged {page_size}")
    # the same keys laid out contiguously, the same tile (a paged plan takes DECODE_WIDE_TILES' where its head dim
    # has one) and split count: the same bits
    from cuflash import _configs
    from cuflash.decode import plan_for, run_plan

    kc = torch.stack([c.logical(c.kc, i) for i in range(c.b)])
    vc = torch.stack([c.logical(c.vc, i) for i in range(c.b)])
    tile = _configs.DECODE_WIDE_TILES.get(d, _configs.decode_tile(d))
    for ns in (1, 5):
        o_p, l_p = c.run(num_splits=ns)
        plan = plan_for(c.q, kc, vc, cache_seqlens=c.cache_seqlens, causal=c.causal, num_splits=ns, tile=tile)
        o_c, l_c = run_plan(plan, c.q, kc, vc, cache_seqlens=c.cache_seqlens, return_softmax_lse=True)
        assert torch.equal(o_p, o_c) and torch.equal(l_p, l_c), f"paged vs contiguous, {ns} splits"


@pytest.mark.parametrize("page_size", [16, 256])
@pytest.mark.parametrize("s_new,causal", [(1, False), (4, True)])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_paged_append(page_size, s_new, causal, dtype):
    """New keys written into the pages (crossing a page boundary, and past the capacity: dropped)."""
    cap = 512
    c = Case(page_size=page_size, cap=cap, seqlens=(page_size - 2, 0, cap - 2), s_new=s_new, causal=causal,
             dtype=dtype, sq=s_new, h=8, hk=2)
    out, lse = c.run()
    c.check_append()
    c.check(out, lse, "paged append")


@pytest.mark.parametrize("opt", [(True, (64, -1), 0.0, None), (False, (-1, -1), 20.0, "bh"),
                                 (True, (33, -1), 15.0, "h")], ids=["causal-window", "softcap-alibi", "all"])
@pytest.mark.parametrize("paged", [False, True])
def test_indirections_with_score_options(opt, paged):
    causal, window, cap, alibi = opt
    c = Case(sq=4, h=4, hk=4, page_size=32 if paged else None, batch_idx=not paged,
             leftpad=None if paged else (100, 0, 7), seqlens=(400, 0, 300), s_new=2, causal=causal, window=window,
             softcap=cap, alibi=alibi, rotary=(64, False))
    out, lse = c.run()
    c.check_append()
    c.check(out, lse, f"options {opt}")


# --------------------------------------------------------------------------------- batch index, left padding
@pytest.mark.parametrize("num_splits", [0, 1, 3])
@pytest.mark.parametrize("h,hk,sq,causal", [(8, 2, 1, False), (8, 8, 5, True), (8, 1, 1, False)])
def test_batch_idx_and_leftpad(num_splits, h, hk, sq, causal):
    c = Case(h=h, hk=hk, sq=sq, causal=causal, batch_idx=True, leftpad=(250, 0, 511), seqlens=(300, 0, 511),
             s_new=sq if causal else 0)
    out, lse = c.run(num_splits)
    c.check_append()
    c.check(out, lse, "batch_idx + leftpad")  # element 2: leftpad == seqlens, no key before the append


@pytest.mark.parametrize("leftpad", [(0, 0, 0), (1, 0, 16), (200, 0, 300)])
def test_leftpad_alone(leftpad):
    c = Case(leftpad=leftpad, seqlens=(300, 0, 511), sq=2, h=4, hk=2, causal=True)
    out, lse = c.run()
    c.check(out, lse, f"leftpad {leftpad}")


# ------------------------------------------------------------------------------------------------ rotary
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("d,rd", [(64, 64), (128, 64), (128, 128), (96, 32), (256, 128)])
@pytest.mark.parametrize("sq,causal,window", [(1, False, (-1, -1)), (3, False, (-1, -1)), (3, True, (-1, -1)),
                                              (4, False, (100, 0))])
def test_rotary(interleaved, d, rd, sq, causal, window):
    c = Case(d=d, sq=sq, s_new=sq, causal=causal, window=window, rotary=(rd, interleaved), seqlens=(300, 0, 508),
             h=8, hk=2, seed=rd + sq)
    out, lse = c.run()
    c.check_append()
    c.check(out, lse, f"rotary d{d} rd{rd}")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("h,hk", [(32, 8), (16, 1)])
def test_rotary_gqa_paged_batch(dtype, h, hk):
    """The serving step: GQA decode with a rotary append into a paged cache; and into rows picked by index."""
    for kw in (dict(page_size=16), dict(batch_idx=True, leftpad=(3, 0, 100))):
        c = Case(h=h, hk=hk, s_new=1, rotary=(128, False), dtype=dtype, seqlens=(200, 0, 511), **kw)
        out, lse = c.run()
        c.check_append()
        c.check(out, lse, f"rotary {kw}")


def test_cupy_paged_rotary():
    import cupy
    import torch

    c = Case(page_size=32, s_new=1, rotary=(64, True), seqlens=(100, 0, 200))
    args = [cupy.from_dlpack(x) if isinstance(x, torch.Tensor) else x
            for x in (c.q, c.kc, c.vc, c.k_new, c.v_new)]
    kw = {k: cupy.from_dlpack(x) if isinstance(x, torch.Tensor) else x for k, x in c.kwargs().items()}
    out, lse = cuflash.flash_attn_with_kvcache(*args, return_softmax_lse=True, **kw)
    assert isinstance(out, cupy.ndarray)
    torch.cuda.synchronize()
    c.check_append()
    c.check(torch.from_dlpack(out), torch.from_dlpack(lse), "cupy")


# ------------------------------------------------------------------------------------------ graph capture
@pytest.mark.parametrize("d,rd", [(128, 128), (59, 32)])
def test_cuda_graph_paged_rotary_step(d, rd):
    """One captured decode step (append + attend, paged, rotary, GQA) replayed after cache_seqlens and the block
    table changed in place; at head dim 59 the UA forms of the append and the decode kernel."""
    import torch

    c = Case(d=d, page_size=16, s_new=1, rotary=(rd, False), seqlens=(100, 0, 300), h=8, hk=2)
    kw = c.kwargs()
    out_buf = {}

    def step():
        out_buf["o"], out_buf["l"] = cuflash.flash_attn_with_kvcache(c.q, c.kc, c.vc, c.k_new, c.v_new,
                                                                     return_softmax_lse=True, **kw)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up: plans and kernels ready before capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    c.kc.copy_(c.kc0)
    c.vc.copy_(c.vc0)
    with torch.cuda.graph(g):
        step()
    for seqlens, seed in (((5, 300, 31), 1), ((511, 16, 0), 2)):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        perm = torch.randperm(c.kc.shape[0], device="cuda", generator=gen)[:c.block_table.numel()]
        c.block_table.copy_(perm.reshape(c.block_table.shape).to(torch.int32))
        c.cache_seqlens.copy_(torch.tensor(seqlens, dtype=torch.int32))
        c.seqlens = list(seqlens)
        c.q.copy_(torch.randn(c.q.shape, device="cuda", generator=gen).to(c.q.dtype))
        c.kc.copy_(c.kc0)
        c.vc.copy_(c.vc0)
        g.replay()
        torch.cuda.synchronize()
        c.check_append()
        c.check(out_buf["o"], out_buf["l"], f"replay {seqlens}")


def test_plan_memo_with_indirections():
    """The same call twice reuses its plan; another block table of the same shape gets its pointer per call (not
    the memoized one)."""
    import torch

    from cuflash import decode

    c = Case(page_size=32, seqlens=(100, 50, 200))
    out, lse = c.run()
    n = len(decode._PLANS)
    c.block_table = torch.flip(c.block_table, dims=[1]).contiguous()
    out, lse = c.run()
    assert len(decode._PLANS) == n
    c.check(out, lse, "second block table")


# ------------------------------------------------------------------ rows that are not 16-byte units (the UA kernels)
@pytest.mark.parametrize("d,rd,dtype", [(59, 48, "float16"), (111, 96, "bfloat16"), (3, 0, "float16"),
                                        (200, 128, "float16")])
@pytest.mark.parametrize("layout", ["paged16", "paged48", "batch_idx"])
def test_ua_indirections(d, rd, dtype, layout):
    """flash_attn_with_kvcache at head dims that are not multiples of 8 (the decode kernel's UA form): a speculative
    causal step appending 3 rotated keys (interleaved at odd head dims, half-split at even ones) into a paged cache or
    into rows picked by cache_batch_idx behind cache_leftpad; the automatic split count, one split (O written by the
    kernel), 3 splits (the rows combine) and 20 (the block combine)."""
    kw = dict(paged16=dict(page_size=16), paged48=dict(page_size=48),
              batch_idx=dict(batch_idx=True, leftpad=(7, 0, 40)))[layout]
    c = Case(d=d, sq=3, h=4, hk=2, s_new=3, causal=True, rotary=(rd, d % 2 == 1) if rd else None, dtype=dtype,
             seqlens=(300, 0, 508), seed=d, **kw)
    for ns in (0, 1, 3, 20):
        out, lse = c.run(ns)
        c.check_append()
        c.check(out, lse, f"UA d{d} {layout} {ns} splits")


@pytest.mark.parametrize("opt", [(True, (64, -1), 0.0, None), (False, (-1, -1), 20.0, "bh"),
                                 (False, (33, 2), 15.0, "h")], ids=["causal-window", "softcap-alibi", "all"])
@pytest.mark.parametrize("paged", [False, True])
def test_ua_indirections_with_score_options(opt, paged):
    causal, window, cap, alibi = opt
    c = Case(d=59, sq=4, h=4, hk=4, page_size=32 if paged else None, batch_idx=not paged,
             leftpad=None if paged else (100, 0, 7), seqlens=(400, 0, 300), s_new=2, causal=causal, window=window,
             softcap=cap, alibi=alibi, rotary=(32, False))
    out, lse = c.run()
    c.check_append()
    c.check(out, lse, f"UA options {opt}")


@pytest.mark.parametrize("d,rd", [(64, 64), (128, 32)])
@pytest.mark.parametrize("h,hk,sq", [(32, 8, 1), (8, 8, 3)])
def test_ua_odd_rows_aligned_headdim(d, rd, h, hk, sq):
    """Head dims 64 and 128 whose rows are 2-byte aligned views (rows d + 3 apart, one element into the buffer): the
    UA form by the strides alone (no GQA fold), paged and by index, a rotated append."""
    for kw in (dict(page_size=16), dict(batch_idx=True, leftpad=(3, 0, 100))):
        c = Case(d=d, h=h, hk=hk, sq=sq, s_new=sq, causal=sq > 1, rotary=(rd, sq == 1), seqlens=(200, 0, 511),
                 odd_rows=True, seed=d + sq, **kw)
        assert c.q.data_ptr() % 16 and c.kc.stride(-2) % 8
        out, lse = c.run()
        c.check_append()
        c.check(out, lse, f"odd rows d{d} {kw}")

