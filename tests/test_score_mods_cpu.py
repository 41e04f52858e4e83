"""CPU: the score modifiers' host side -- flash-attn's window_size / softcap / alibi_slopes turned into the kernels'
mask mode and parameter fields (cuflash/_mods.py), the kernels every mode compiles to, and the launches of
flash_attn_func, autograd-free backward and flash_attn_with_kvcache with the GPU stood in (their kernel names and
parameter blocks)."""
import math
import struct

import pytest

from cuflash import _configs, _mods
from conftest import run_with_stand_ins

LOG2E = math.log2(math.e)


class _View:
    def __init__(self, shape, strides, ptr=4096):
        self.shape, self.strides, self.ptr = shape, strides, ptr


@pytest.mark.parametrize("causal,window,kcausal,mod,wl,wr", [
    (False, (-1, -1), False, 0, 0, 0),   # plain
    (True, (-1, -1), True, 0, 0, 0),     # causal
    (False, (-1, 0), True, 0, 0, 0),     # the band that is exactly causal runs the causal kernels
    (True, (7, 3), False, 1, 7, 0),      # causal folds right = 0
    (False, (5, -1), False, 1, 5, 100),  # unbounded right -> seqlen_q (no key past it)
    (False, (-1, 9), False, 1, 300, 9),  # unbounded left -> seqlen_k
    (False, (0, 0), False, 1, 0, 0),
    (False, (10**6, 10**6), False, 1, 300, 100),  # wider than the sequences: clamped, same band
])
def test_resolve_window(causal, window, kcausal, mod, wl, wr):
    m = _mods.resolve(causal, window, 0.0, None, 100, 300, 0.125)
    assert (m.causal, m.mod) == (kcausal, mod)
    assert m.fields["scale_log2"] == pytest.approx(0.125 * LOG2E)
    if mod:
        assert (m.fields["window_left"], m.fields["window_right"]) == (wl, wr)
        assert m.fields["softcap_pre"] == 0.0 and m.fields["alibi_slopes"] == 0 and m.fields["alibi_mul"] == 0.0


def test_resolve_softcap_and_alibi():
    al = _View((2, 8), (8, 1), ptr=0xABC0)
    m = _mods.resolve(True, (-1, -1), 30.0, al, 64, 64, 0.125)
    assert (m.causal, m.mod) == (False, 1)  # causal becomes the band [.., i + off]
    f = m.fields
    assert (f["window_left"], f["window_right"]) == (64, 0)
    assert f["softcap_pre"] == pytest.approx(0.125 / 30.0) and f["scale_log2"] == pytest.approx(30.0 * LOG2E)
    assert f["alibi_slopes"] == 0xABC0 and f["alibi_batch_stride"] == 8 and f["alibi_mul"] == pytest.approx(1 / 30)
    assert _mods.has_softcap(m)
    m = _mods.resolve(False, (-1, -1), 0.0, _View((8,), (1,)), 64, 64, 0.25)
    assert m.mod == 1 and m.fields["alibi_batch_stride"] == 0 and m.fields["alibi_mul"] == pytest.approx(4.0)
    assert not _mods.has_softcap(m) and not _mods.has_softcap(None)
    assert (m.fields["window_left"], m.fields["window_right"]) == (64, 64)  # no band: bounds no key reaches


def test_memo_key():
    assert _mods.memo_key(False, (-1, -1), 0.0, None) == ()
    assert _mods.memo_key(True, (4, 5), 2.0, None) == ((4, 0), 2.0, None)
    assert _mods.memo_key(False, (4, 5), 0, object()) is None  # slopes of no known kind: validated every call


def test_every_mode_compiles_for_every_masked_kernel():
    """Each masked kernel family (V2 forward, split-KV, decode, backward, dQ convert, the sm_90a forward) has its
    MOD_SCORE twin in all_specs (non-causal only: a causal band is right = 0), so CI compiles every one."""
    names = {s.name for s in _configs.all_specs()}
    for dt in _configs.DTYPES:
        for d in _configs.HEADDIMS:
            for split in (False, True):
                assert _configs.fwd_spec(dt, d, False, split, mod=1).name in names
            assert _configs.decode_spec(dt, d, False, 1, mod=1).name in names
            for part in _configs.BWD_PARTITIONS:
                if d in _configs.bwd_tiles(part):
                    spec = _configs.bwd_spec(dt, d, False, warp_partition=part, mod=1)
                    assert (spec.name in names) == ((part, d) not in _configs.BWD_SCORE_UNSUPPORTED)
        for d in _configs.SM90_HEADDIMS:
            assert _configs.sm90_fwd_spec(dt, d, False, mod=1).name in names
    with pytest.raises(ValueError, match="mod"):
        _configs.fwd_spec("float16", 64, True, False, mod=1)
    with pytest.raises(ValueError, match="mod"):
        _configs.bwd_spec("float16", 64, False, mod=2)


_BODY = r"""
from cuflash._params import FWD_PARAMS, BWD_PARAMS
q, k, v = T((2, 100, 8, 64), torch.float16), T((2, 300, 4, 64), torch.float16), T((2, 300, 4, 64), torch.float16)
al = T((2, 8), torch.float32)
def fields(rec, block):
    return block.unpack(bytes.fromhex(rec[2])[:block.size])
out = {}
for backend in ("sm80", "sm90"):
    recs, _ = launches(lambda: cuflash.flash_attn_func(q, k, v, causal=True, window_size=(16, 3), softcap=30.0,
                                                       alibi_slopes=al, backend=backend))
    out[backend] = [recs[-1][0], fields(recs[-1], FWD_PARAMS)]
recs, _ = launches(lambda: cuflash.flash_attn_func(q, k, v, window_size=(-1, 0)))
out["causal_band"] = recs[-1][0]
recs, _ = launches(lambda: cuflash.flash_attn_func(q, k, v, window_size=(8, 8), backend="sm80"))
out["window_only"] = [recs[-1][0], fields(recs[-1], FWD_PARAMS)]
# the mma.sync forward's capped-max form: soft-capped fixed-length calls at each head dim, a packed one, ALiBi alone
for d in (64, 96, 128, 256, 200):
    qd, kd = T((2, 100, 8, d), torch.float16), T((2, 300, 4, d), torch.float16)
    recs, _ = launches(lambda: cuflash.flash_attn_func(qd, kd, kd, softcap=30.0, backend="sm80"))
    out[f"cap {d}"] = recs[-1][0]
recs, _ = launches(lambda: cuflash.flash_attn_func(q, k, v, alibi_slopes=al, backend="sm80"))
out["alibi_only"] = recs[-1][0]
qp, kp = T((200, 8, 64), torch.float16), T((600, 4, 64), torch.float16)
cu_q, cu_k = T((3,), torch.int32), T((3,), torch.int32)
recs, _ = launches(lambda: cuflash.flash_attn_varlen_func(qp, kp, kp, cu_q, cu_k, 100, 300, softcap=30.0,
                                                          backend="sm80"))
out["cap packed"] = recs[-1][0]
do = T((2, 100, 8, 64), torch.float16)
o = T((2, 100, 8, 64), torch.float16)
lse = T((2, 8, 100), torch.float32)
recs, _ = launches(lambda: cuflash.flash_attn_backward(do, q, k, v, o, lse, causal=True, window_size=(16, 3),
                                                       softcap=30.0, alibi_slopes=al))
out["bwd"] = [[r[0] for r in recs], fields(recs[1], BWD_PARAMS)]
recs, _ = launches(lambda: cuflash.flash_attn_backward(do, q, k, v, o, lse, causal=True, window_size=(16, 3),
                                                       softcap=30.0, alibi_slopes=al, backend="sm80"))
out["bwd_sm80"] = [[r[0] for r in recs], fields(recs[1], BWD_PARAMS)]
kc, vc = T((2, 500, 4, 64), torch.float16), T((2, 500, 4, 64), torch.float16)
q1 = T((2, 1, 8, 64), torch.float16)
recs, _ = launches(lambda: cuflash.flash_attn_with_kvcache(q1, kc, vc, cache_seqlens=T((2,), torch.int32),
                                                           window_size=(100, -1), alibi_slopes=T((8,), torch.float32)))
out["decode"] = [recs[0][0], fields(recs[0], FWD_PARAMS)]
res.update(out)
res["errors"] = [err(lambda: cuflash.flash_attn_func(q, k, v, alibi_slopes=T((8, 2), torch.float32))),
                 err(lambda: cuflash.flash_attn_func(q, k, v, alibi_slopes=T((8,), torch.float32, (2,)))),
                 err(lambda: cuflash.flash_attn_with_kvcache(q1, kc, vc, softcap=-1.0)),
                 err(lambda: cuflash.flash_attn_backward(do, q, k, v, o, lse, alibi_slopes=T((3,), torch.float32)))]
"""


@pytest.fixture(scope="module")
def stood_in():
    return run_with_stand_ins(_BODY)


def test_forward_launches_the_score_kernels(stood_in):
    for backend, kernel in (("sm80", "flash_fwd_kernel<"), ("sm90", "flash_fwd_sm90_kernel<")):
        name, f = stood_in[backend]
        # MOD_SCORE (1) last, then on the mma.sync forward (head dim 64) O_SPLIT, PERSIST, SK and CAP_MAX true, on the
        # Hopper forward O_TMA, MINB, PERSIST, SK and CAP_MAX true: the soft-cap's capped-max forms
        ends = (", 1, 0, false, false, true>",) if backend == "sm80" else (", 1, true, 1, false, false, true>",)
        assert kernel in name and name.endswith(ends) and ", false, " in name, name
        assert (f["window_left"], f["window_right"]) == (16, 0)  # causal: right = 0
        assert f["softcap_pre"] == pytest.approx(64 ** -0.5 / 30.0) and f["scale_log2"] == pytest.approx(30 * LOG2E)
        assert f["alibi_slopes"] != 0 and f["alibi_batch_stride"] == 8 and f["alibi_mul"] == pytest.approx(1 / 30)
        assert f["heads_per_kv"] == 2 and f["nheads"] == 8
    assert not stood_in["causal_band"].endswith((", 1>", ", 1, true>")) and ", true, " in stood_in["causal_band"]
    name, f = stood_in["window_only"]
    assert name.endswith(", 1>") and f["softcap_pre"] == 0.0 and f["alibi_slopes"] == 0
    assert f["scale_log2"] == pytest.approx(64 ** -0.5 * LOG2E) and (f["window_left"], f["window_right"]) == (8, 8)


# (the Hopper one at head dim 64 in its CAP_ONLY form, cuflash._configs.SM90_BWD_CAP_ONLY_HEADDIMS, and, soft-capped
# with 100 keys, persistent: SM90_BWD_PERSIST_CAP_MAX_SEQLEN_K)
@pytest.mark.parametrize("which,main,tail", [("bwd", "flash_bwd_sm90_kernel<", ", 1, 0, 0, true, false, true>"),
                                             ("bwd_sm80", "flash_bwd_kernel<", ", 1>")])
def test_backward_launches_the_score_kernels(stood_in, which, main, tail):
    """The score-modifier (MOD_SCORE) backward kernels: the Hopper one by default on the compute capability 9.0
    stand-in, the mma.sync one with backend="sm80"; the convert kernel of the same mode, the modifier fields."""
    names, f = stood_in[which]
    assert main in names[1] and names[1].endswith(tail)
    assert "flash_bwd_convert_dq_kernel<" in names[2] and names[2].endswith(", 1>")
    assert (f["window_left"], f["window_right"]) == (16, 0) and f["scale_log2"] == pytest.approx(30 * LOG2E)
    assert f["softmax_scale"] == pytest.approx(64 ** -0.5) and f["alibi_slopes"] != 0


def test_decode_launches_unfolded_score_kernel(stood_in):
    name, f = stood_in["decode"]
    assert "flash_decode_kernel<" in name and name.endswith((", 1>", ", 1, false, true>"))  # MOD 1 (swizzled ring)
    assert f["seqlen_q"] == 1 and f["nheads"] == 8 and f["heads_per_kv"] == 2  # GQA heads not folded into rows
    assert (f["window_left"], f["window_right"]) == (100, 1) and f["alibi_batch_stride"] == 0


def test_bad_modifier_values_raise_before_launch(stood_in):
    e = stood_in["errors"]
    assert e[0][0] == "ValueError" and "alibi_slopes" in e[0][1]
    assert e[1][0] == "ValueError" and "contiguous" in e[1][1]
    assert e[2][0] == "ValueError" and "softcap" in e[2][1]
    assert e[3][0] == "ValueError" and "alibi_slopes" in e[3][1]


def test_params_pack_modifier_fields():
    from cuflash._params import FWD_PARAMS

    raw = FWD_PARAMS.pack(0, window_left=3, window_right=9, softcap_pre=0.5, alibi_mul=2.0, alibi_batch_stride=8)
    off = FWD_PARAMS.offsets()
    assert struct.unpack_from("<q", raw, off["window_left"][0])[0] == 3
    assert struct.unpack_from("<f", raw, off["alibi_mul"][0])[0] == 2.0


def test_mod_values_match_the_kernels():
    """The MOD template values the host names kernels with are the ones cuda_src/attn/mask.cuh defines."""
    import re

    from cuflash._loader import source_dir

    src = (source_dir() / "attn" / "mask.cuh").read_text()
    m = re.search(r"enum\s*:\s*int\s*\{([^}]*)\}", src)
    assert m, "mask.cuh: the MOD enum not found"
    values = {k: int(v) for k, v in re.findall(r"(MOD_\w+)\s*=\s*(\d+)", m.group(1))}
    assert values == {"MOD_NONE": _configs.MOD_NONE, "MOD_SCORE": _configs.MOD_SCORE,
                      "MOD_DROPOUT": _configs.MOD_DROPOUT, "MOD_SCORE_DROPOUT": _configs.MOD_SCORE_DROPOUT}
    assert (_mods.MOD_NONE, _mods.MOD_SCORE, _mods.MOD_SCORE_DROPOUT) == (0, 1, 3)


def test_mma_sync_capped_max_form_taken(stood_in):
    """Soft-capped fixed-length calls on the mma.sync forward take the capped-max form at FWD_CAP_MAX_HEADDIMS (head
    dim 200 runs the 256 kernel: not there), with its tile; calls without the soft-cap and packed sequences keep the
    modifier kernel."""
    for d in (64, 96, 128, 256, 200):
        kd = _configs.kernel_headdim(d, _configs.FWD_HEADDIMS)
        on = kd in _configs.FWD_CAP_MAX_HEADDIMS
        tile = _configs.fwd_cap_max_tile(kd) if on else _configs.fwd_tile(kd, False, _configs.MOD_SCORE)
        assert stood_in[f"cap {d}"] == _configs.fwd_spec("float16", kd, False, False, tile,
                                                         mod=_configs.MOD_SCORE).name, d
    assert set(_configs.FWD_CAP_MAX_HEADDIMS) == {64, 96, 128}
    assert stood_in["alibi_only"] == _configs.fwd_spec("float16", 64, False, False, mod=_configs.MOD_SCORE).name
    assert stood_in["cap packed"] == _configs.fwd_spec("float16", 64, False, False, mod=_configs.MOD_SCORE,
                                                       varlen=True).name


def test_mma_sync_capped_max_variant_specs():
    """The mma.sync forward's capped-max form (FwdTile.cap_max, flash_fwd.cu CAP_MAX): a variant of the fixed-length
    modifier kernel at every head dim (at 128 on 32-key tiles), named with every trailing template argument up to
    CAP_MAX, among the configurations CI compiles; no configured tile is it (the host picks it: fwd_cap_max_tile), and
    it is refused on a kernel without
    the modifiers, with dropout, split-KV, packed sequences or the UA form."""
    from dataclasses import replace

    every = set(_configs.all_specs())
    specs = _configs.fwd_cap_max_specs()
    dims = (*_configs.HEADDIMS, *(d for d in _configs.FWD_HEADDIMS if d not in _configs.HEADDIMS))
    assert len(specs) == len(_configs.DTYPES) * len(dims) and set(specs) <= every
    for d in dims:
        t = _configs.fwd_cap_max_tile(d)
        assert t.cap_max and t.block_n == (32 if d == 128 else _configs.fwd_tile(d, False, _configs.MOD_SCORE).block_n)
        assert not _configs.fwd_tile(d, False, _configs.MOD_SCORE).cap_max
        spec = _configs.fwd_spec("float16", d, False, False, t, mod=_configs.MOD_SCORE)
        assert spec.name.endswith(", 1, %d, false, false, true>" % (d // t.o_split if t.o_split > 1 else 0))
        for kw in (dict(mod=0), dict(mod=_configs.MOD_SCORE_DROPOUT), dict(mod=_configs.MOD_SCORE, varlen=True),
                   dict(mod=_configs.MOD_SCORE, ua=True)):
            with pytest.raises(ValueError):
                _configs.fwd_spec("float16", d, False, False, t, **kw)
        if d in _configs.DECODE_TILES:
            with pytest.raises(ValueError):
                _configs.fwd_spec("float16", d, False, True, replace(_configs.split_tile(d), cap_max=True),
                                  mod=_configs.MOD_SCORE)
    fwd = [s for s in every if s.name.startswith("cuflash::flash_fwd_kernel<")]
    for s in fwd:  # CAP_MAX is the 16th template argument: only the variants spell it out
        assert (len(s.name[s.name.index("<") + 1:-1].split(", ")) == 16) == (s in specs), s.name
