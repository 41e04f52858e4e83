"""Decoding benchmarks: q_len 1, 32 query heads, head dim 128, fp16, batch 1..64, cache 1k..128k, with
32, 8 and 1 KV heads. Time, K/V bytes read, the bandwidth floor (bytes / copy bandwidth measured in this
run), cuflash split-KV (heuristic splits) and unsplit, and SDPA FLASH / CUDNN / EFFICIENT (GQA expanded
to full heads for them, outside the timing)."""
from __future__ import annotations

import gc

from .harness import SDPA_PROVIDERS, host_us_per_call, measure_ceilings, record, sdpa, time_ms

MAX_KV_BYTES = 24 * 2 ** 30


def decode(batches=(1, 8, 64), cache_lens=(1024, 4096, 16384, 32768, 131072), kv_heads=(32, 8, 1), h=32, d=128):
    import torch

    import cuflash
    from cuflash._configs import DECODE_TILES, fwd_smem_bytes
    from cuflash.decode import decode_slots, num_splits_heuristic

    bw = measure_ceilings()[0]["tb_per_s"] * 1e12
    recs = []
    for hk in kv_heads:
        for b in batches:
            for s in cache_lens:
                kv_bytes = 2 * b * s * hk * d * 2
                if kv_bytes > MAX_KV_BYTES:
                    continue
                kc = torch.randn(b, s, hk, d, device="cuda", dtype=torch.float16)
                vc = torch.randn(b, s, hk, d, device="cuda", dtype=torch.float16)
                q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.float16)
                seqlens = torch.full((b,), s, dtype=torch.int32, device="cuda")
                floor_us = kv_bytes / bw * 1e6
                rows = h // hk if h > hk else 1
                auto = num_splits_heuristic(b * (hk if h > hk else h), decode_slots(0, fwd_smem_bytes(d, DECODE_TILES[d])),
                                            -(-s // DECODE_TILES[d].block_n))
                common = dict(heads_k=hk, kv_bytes=kv_bytes, floor_us=floor_us)
                for name, ns in (("split", 0), ("unsplit", 1)):
                    ms = time_ms(lambda: cuflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, num_splits=ns))
                    recs.append(record("cuflash", f"decode-{name}", "decode", "float16", b, h, 1, s, d, False, ms,
                                       us=ms * 1e3, num_splits=auto if ns == 0 else 1, bw_fraction=floor_us / (ms * 1e3),
                                       **common))
                qt = q.transpose(1, 2)
                expand = kv_bytes * (h // hk) <= MAX_KV_BYTES  # SDPA needs GQA expanded to full heads
                if expand:
                    kt = kc.transpose(1, 2).repeat_interleave(h // hk, 1) if h > hk else kc.transpose(1, 2)
                    vt = vc.transpose(1, 2).repeat_interleave(h // hk, 1) if h > hk else vc.transpose(1, 2)
                    kt, vt = kt.contiguous(), vt.contiguous()
                else:
                    kt = vt = None
                for prov in SDPA_PROVIDERS:
                    fn = sdpa(prov)
                    try:
                        ms = time_ms(lambda: fn(qt, kt, vt)) if expand else None
                    except RuntimeError as e:
                        ms = None
                        print(f"sdpa {prov} decode failed: {e}")
                    recs.append(record(prov, "sdpa", "decode", "float16", b, h, 1, s, d, False, ms,
                                       us=ms * 1e3 if ms else None, num_splits=None,
                                       bw_fraction=floor_us / (ms * 1e3) if ms else None, **common))
                r = recs[-5:]
                print(f"decode hk={hk} b={b} s={s} floor={floor_us:.0f}us: " + " ".join(
                    f"{x['algo'] if x['provider'] == 'cuflash' else x['provider']}={x['us'] or 0:.0f}" for x in r))
                del kc, vc, q, kt, vt
                gc.collect()
                torch.cuda.empty_cache()
    # host overhead of a small step, a loop of calls from Python
    kc = torch.randn(1, 4096, 8, d, device="cuda", dtype=torch.float16)
    vc = torch.randn_like(kc)
    q = torch.randn(1, 1, 8, d, device="cuda", dtype=torch.float16)
    seqlens = torch.full((1,), 4096, dtype=torch.int32, device="cuda")
    us = host_us_per_call(lambda: cuflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens))
    recs.append(record("cuflash", "decode-split", "decode_latency", "float16", 1, 8, 1, 4096, d, False, us / 1e3,
                       us=us, heads_k=8))
    qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous()
    fn = sdpa("flash")
    us = host_us_per_call(lambda: fn(qt, kt, vt))
    recs.append(record("flash", "sdpa", "decode_latency", "float16", 1, 8, 1, 4096, d, False, us / 1e3, us=us,
                       heads_k=8))
    print(f"decode per-call latency (1, 8 heads, 4k): cuflash={recs[-2]['us']:.1f}us flash={recs[-1]['us']:.1f}us")
    return recs





def _sweep_tiles():
    from cuflash._configs import FwdTile

    return [FwdTile(64, 64, 4), FwdTile(128, 128, 8), FwdTile(64, 32, 4)]


def sweep_specs():
    from cuflash._configs import fwd_spec

    return [fwd_spec("float16", 128, False, True, t) for t in _sweep_tiles()]


def decode_sweep(cases=((32, 1, 32768), (32, 1, 131072), (32, 8, 32768), (8, 8, 131072), (8, 1, 32768),
                        (1, 32, 131072)), h=32, d=128):
    """Split-KV tile and split-count sweep on representative decoding cases (head dim 128, fp16)."""
    import torch

    from cuflash import flash
    from cuflash._validate import check_qkv
    from cuflash._configs import fwd_smem_bytes
    from cuflash.decode import decode_slots, num_splits_heuristic

    bw = measure_ceilings()[0]["tb_per_s"] * 1e12
    recs = []
    for hk, b, s in cases:
        kc = torch.randn(b, s, hk, d, device="cuda", dtype=torch.float16)
        vc = torch.randn_like(kc)
        q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.float16)
        seqlens = torch.full((b,), s, dtype=torch.int32, device="cuda")
        qa, ka, va = check_qkv(q, kc, vc)
        kv_bytes = 2 * b * s * hk * d * 2
        floor_us = kv_bytes / bw * 1e6
        for t in _sweep_tiles():
            base = num_splits_heuristic(b * (hk if h > hk else h) * -(-(h // hk if h > hk else 1) // t.block_m),
                                        decode_slots(0, fwd_smem_bytes(d, t)), -(-s // t.block_n))
            for mult in (1, 2, 4):
                ns = min(128, base * mult)
                ms = time_ms(lambda: flash.forward(qa, ka, va, None, False, tile=t, seqlens_k_ptr=seqlens.data_ptr(),
                                                   num_splits=ns))
                recs.append(record("cuflash", f"decode-tile-{t.block_m}x{t.block_n}x{t.nwarps}w", "decode", "float16",
                                   b, h, 1, s, d, False, ms, us=ms * 1e3, num_splits=ns, heads_k=hk, kv_bytes=kv_bytes,
                                   floor_us=floor_us, bw_fraction=floor_us / (ms * 1e3)))
        print(f"decode sweep hk={hk} b={b} s={s} floor={floor_us:.0f}: " + " ".join(
            f"{r['algo'][12:]}/{r['num_splits']}={r['us']:.0f}" for r in recs[-9:]))
        del kc, vc, q
        torch.cuda.empty_cache()
    return recs
