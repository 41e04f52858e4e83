"""CPU: the packed-sequence path's launches (the GPU replaced by bench's host_overhead stand-ins in a subprocess):
the VARLEN kernels, a grid over every sequence's tiles sized from the totals alone (no max_seqlen, no read of the
lengths), batch strides 0, the cu_seqlens pointers in the parameter block, flash-attn's [h, total_q] LSE, the
backward's padded row buffers; the host's tile rule against a Python model of the kernels' varlen_tile; input
validation by name before any launch. GPU tests: tests/test_varlen.py."""
import numpy as np
import pytest

from cuflash import _configs
from cuflash._varlen import BWD_ROW_PAD
from conftest import run_with_stand_ins

_BODY = r"""
from cuflash._params import FWD_PARAMS, BWD_PARAMS
def fields(rec, block):
    return block.unpack(bytes.fromhex(rec[2])[:block.size])
lens_q, lens_k = (37, 0, 1, 130), (53, 17, 1, 0)
tq, tk = sum(lens_q), sum(lens_k)
q, k, v = T((tq, 8, 64), torch.float16), T((tk, 2, 64), torch.float16), T((tk, 2, 64), torch.float16)
cq, ck = T((5,), torch.int32), T((5,), torch.int32)
out = {}
for backend in ("sm80", "sm90"):
    recs, o = launches(lambda: cuflash.flash_attn_varlen_func(q, k, v, cq, ck, 130, 53, causal=True, backend=backend,
                                                              return_attn_probs=True))
    out[backend] = [recs[-1][0], list(recs[-1][1]), fields(recs[-1], FWD_PARAMS), list(o[0].shape), list(o[1].shape)]
mq = T((), torch.int32)
recs, _ = launches(lambda: cuflash.flash_attn_varlen_func(q, k, v, cq, ck, mq, mq, window_size=(5, 2), backend="sm80"))
out["tensor_max"] = [recs[-1][0], list(recs[-1][1])]
do, o3, lse = T((tq, 8, 64), torch.float16), T((tq, 8, 64), torch.float16), T((8, tq), torch.float32)
for strat in ("atomic", "loop"):  # (seqpar reads the free memory: the GPU tests)
    recs, g = launches(lambda: cuflash.flash_attn_varlen_backward(do, q, k, v, o3, lse, cq, ck, 130, 53, causal=True,
                                                                  dq_strategy=strat))
    out["bwd_" + strat] = [[r[0] for r in recs], [list(r[1]) for r in recs], fields(recs[1], BWD_PARAMS),
                           [list(x.shape) for x in g]]
# paged K/V: 12 pages of 16 keys, 3 per sequence -> gathered into 4 x 3 x 16 packed rows, then the packed forward
from cuflash._params import GATHER_ARGS
kp, vp, bt = T((12, 16, 2, 64), torch.float16), T((12, 16, 2, 64), torch.float16), T((4, 3), torch.int32)
recs, o = launches(lambda: cuflash.flash_attn_varlen_func(q, kp, vp, cq, ck, 130, 53, block_table=bt, backend="sm80"))
out["paged"] = [[r[0] for r in recs], [list(r[1]) for r in recs], GATHER_ARGS.unpack(bytes.fromhex(recs[0][2])),
                fields(recs[1], FWD_PARAMS), kp.data_ptr(), bt.data_ptr(), ck.data_ptr()]
res.update(out)
res["errors"] = {
    "rank": err(lambda: cuflash.flash_attn_varlen_func(T((2, 10, 8, 64), torch.float16), k, v, cq, ck, 1, 1)),
    "cu_dtype": err(lambda: cuflash.flash_attn_varlen_func(q, k, v, T((5,), torch.float32), ck, 1, 1)),
    "cu_len": err(lambda: cuflash.flash_attn_varlen_func(q, k, v, cq, T((4,), torch.int32), 1, 1)),
    "cu_rank": err(lambda: cuflash.flash_attn_varlen_func(q, k, v, T((5, 1), torch.int32), ck, 1, 1)),
    "max": err(lambda: cuflash.flash_attn_varlen_func(q, k, v, cq, ck, 1.5, 1)),
    "max_neg": err(lambda: cuflash.flash_attn_varlen_func(q, k, v, cq, ck, -1, 1)),
    "pages": err(lambda: cuflash.flash_attn_varlen_func(q, k, v, cq, ck, 1, 1, block_table=T((4, 2), torch.int32))),
    "page_size": err(lambda: cuflash.flash_attn_varlen_func(q, T((12, 24, 2, 64), torch.float16),
                                                            T((12, 24, 2, 64), torch.float16), cq, ck, 1, 1,
                                                            block_table=T((4, 2), torch.int32))),
    "bt_batch": err(lambda: cuflash.flash_attn_varlen_func(q, kp, vp, cq, ck, 1, 1, block_table=T((3, 2), torch.int32))),
    "bt_dtype": err(lambda: cuflash.flash_attn_varlen_func(q, kp, vp, cq, ck, 1, 1,
                                                           block_table=T((4, 2), torch.float32))),
    "heads": err(lambda: cuflash.flash_attn_varlen_func(q, T((tk, 3, 64), torch.float16), T((tk, 3, 64),
                                                        torch.float16), cq, ck, 1, 1)),
    "seqpar_tensor": err(lambda: cuflash.flash_attn_varlen_backward(do, q, k, v, o3, lse, cq, ck, mq, mq,
                                                                     dq_strategy="seqpar")),
    "lse_shape": err(lambda: cuflash.flash_attn_varlen_backward(do, q, k, v, o3, T((4, 8, 42), torch.float32), cq,
                                                                 ck, 1, 1)),
}
ho.LAUNCHES.clear()
"""


@pytest.fixture(scope="module")
def host():
    return run_with_stand_ins(_BODY)


TQ, TK, B = 168, 71, 4


@pytest.mark.parametrize("backend", ["sm80", "sm90"])
def test_forward_launch(host, backend):
    name, grid, f, out_shape, lse_shape = host[backend]
    kernel = "flash_fwd_kernel<" if backend == "sm80" else "flash_fwd_sm90_kernel<"
    assert kernel in name, name
    if backend == "sm80":
        assert name.endswith(", true>"), name  # VARLEN
    block_m = (int(name.split(", ")[2]) if backend == "sm80" else _configs.sm90_fwd_tile(64, True, 53).block_m)
    assert grid == [TQ // block_m + B, 8, 1]  # every sequence's tiles, from the totals
    assert f["batch"] == B and f["seqlen_q"] == TQ and f["seqlen_k"] == TK and f["grid_order"] == 0
    assert f["cu_seqlens_q"] != 0 and f["cu_seqlens_k"] != 0 and f["cu_seqlens_q"] != f["cu_seqlens_k"]
    for t in ("q", "k", "v", "o"):
        assert f[f"{t}_batch_stride"] == 0
    assert f["q_row_stride"] == 8 * 64 and f["k_row_stride"] == 2 * 64 and f["heads_per_kv"] == 4
    assert out_shape == [TQ, 8, 64] and lse_shape == [8, TQ]


def test_paged_gather_then_packed_forward(host):
    names, grids, g, f, kp, bt, ck = host["paged"]
    assert names[0] == "cuflash::paged_kv_gather_kernel<__half>" and "flash_fwd_kernel<" in names[1]
    rows = 4 * 3 * 16  # room for every sequence's pages (the rows after the total zeroed)
    assert (g["k_pages"], g["block_table"], g["cu_seqlens_k"]) == (kp, bt, ck)
    assert (g["batch"], g["rows"], g["nheads_k"], g["headdim"], g["bt_stride"], g["page_size"]) == (4, rows, 2, 64, 3,
                                                                                                     16)
    assert (g["kp_ps"], g["kp_rs"], g["kp_hs"]) == (16 * 2 * 64, 2 * 64, 64)
    assert grids[0] == [-(-(2 * rows * 2 * 8) // 256), 1, 1]
    # the forward reads the gathered rows (packed, row stride nheads_k x headdim) with the same cu_seqlens_k
    assert f["k"] == g["k_out"] and f["v"] == g["v_out"] and f["cu_seqlens_k"] == ck
    assert f["seqlen_k"] == rows and f["k_row_stride"] == 2 * 64 and f["k_batch_stride"] == 0


def test_tensor_max_seqlen_is_not_read(host):
    name, grid = host["tensor_max"]
    assert name.endswith(", true>") and grid[0] == TQ // int(name.split(", ")[2]) + B


@pytest.mark.parametrize("strategy", ["atomic", "loop"])
def test_backward_launches(host, strategy):
    names, grids, f, shapes = host["bwd_" + strategy]
    assert "preprocess" in names[0] and "flash_bwd_kernel<" in names[1] and "convert" in names[2]
    assert names[1].endswith(", true>"), names[1]
    block_n = int(names[1].split(", ")[3])
    sq_pad = BWD_ROW_PAD * (TQ // BWD_ROW_PAD + B)
    assert f["seqlen_q_pad"] == sq_pad and f["batch"] == B and f["seqlen_q"] == TQ and f["seqlen_k"] == TK
    for t in ("q", "k", "v", "o", "do", "dq", "dk", "dv"):
        assert f[f"{t}_batch_stride"] == 0
    assert f["cu_seqlens_q"] != 0 and f["cu_seqlens_k"] != 0
    if strategy == "loop":
        assert grids[1] == [1, 2, B]
    else:
        assert grids[1] == [TK // block_n + B, 2, 1]
    assert f["num_dq_splits"] == 1
    assert shapes == [[TQ, 8, 64], [TK, 2, 64], [TK, 2, 64]]


@pytest.mark.parametrize("tag,exc,words", [
    ("rank", "ValueError", ["q", "3 dimensions"]), ("cu_dtype", "TypeError", ["cu_seqlens_q", "int32", "float32"]),
    ("cu_len", "ValueError", ["same length"]), ("cu_rank", "ValueError", ["cu_seqlens_q", "1 dimensions"]),
    ("max", "TypeError", ["max_seqlen_q"]), ("max_neg", "ValueError", ["max_seqlen_q"]),
    ("pages", "ValueError", ["k must have 4 dimensions", "block_table"]),
    ("page_size", "ValueError", ["page size", "multiple of 16"]), ("bt_batch", "ValueError", ["block_table", "(4,"]),
    ("bt_dtype", "TypeError", ["block_table must be int32"]),
    ("heads", "ValueError", ["heads"]), ("seqpar_tensor", "ValueError", ["seqpar", "max_seqlen_k"]),
    ("lse_shape", "ValueError", ["softmax_lse"])])
def test_errors_name_the_argument(host, tag, exc, words):
    got, msg = host["errors"][tag]
    assert got == exc, (tag, got, msg)
    for w in words:
        assert w in msg, (tag, msg)


def _varlen_tile(cu, t, rows):
    """Python model of cuda_src/attn/seqlen.cuh varlen_tile: the last b with cu[b] // rows + b <= t."""
    b = max(i for i in range(len(cu) - 1) if cu[i] // rows + i <= t)
    return b, t - (cu[b] // rows + b)


@pytest.mark.parametrize("rows", [64, 128])
def test_tile_layout_covers_every_tile_once(rows):
    """The grid of total // rows + batch tiles holds each sequence's ceil(len / rows) tiles exactly once, at most one
    spare per sequence, for random lengths with zeros and ones."""
    rng = np.random.default_rng(7)
    for _ in range(200):
        lens = rng.choice([0, 1, 2, 63, 64, 65, 127, 128, 129, 300, 1000], size=rng.integers(1, 12))
        cu = np.concatenate([[0], np.cumsum(lens)]).tolist()
        seen = {}
        grid = cu[-1] // rows + len(lens)
        for t in range(grid):
            b, m = _varlen_tile(cu, t, rows)
            if m * rows < lens[b]:
                assert (b, m) not in seen
                seen[(b, m)] = t
        assert len(seen) == sum(-(-int(n) // rows) for n in lens)
        # the padded rows of the backward: every sequence's rows fit before the next one's start
        starts = [BWD_ROW_PAD * (cu[b] // BWD_ROW_PAD + b) for b in range(len(cu))]
        for b, n in enumerate(lens):
            assert starts[b] + -(-int(n) // BWD_ROW_PAD) * BWD_ROW_PAD <= starts[b + 1]
        assert starts[-1] == BWD_ROW_PAD * (cu[-1] // BWD_ROW_PAD + len(lens))


def test_every_varlen_kernel_is_compiled():
    names = {s.name for s in _configs.all_specs()}
    for s in _configs.varlen_specs():
        assert s.name in names and s.name.endswith(", true>")
    for dt in _configs.DTYPES:
        for d in _configs.FWD_HEADDIMS:
            assert _configs.fwd_spec(dt, d, True, False, varlen=True).name in names
    with pytest.raises(ValueError, match="varlen"):
        _configs.fwd_spec("float16", 64, False, True, varlen=True)


def test_bwd_row_pad_matches_the_kernels():
    import re
    from pathlib import Path

    src = (Path(__file__).resolve().parent.parent / "cuda_src" / "attn" / "bwd.cuh").read_text()
    assert int(re.search(r"constexpr int BWD_ROW_PAD = (\d+);", src).group(1)) == BWD_ROW_PAD

