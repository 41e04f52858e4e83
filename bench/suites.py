"""The benchmark suites of `python -m bench`: name -> what it measures, the function that runs it, its default
arguments, and a rough time on one H200 (minutes, from the record counts and timings of bench/results).

A suite is a function returning a list of records (bench.harness.record); its records are filed under the
suite's name (field `section`). Options given on the command line (--seqlens, --dtypes, --headdims, --rounds,
...) are passed to the suites whose function takes them. Nothing is imported until a suite runs, so listing
them needs neither torch nor a GPU."""
from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Suite:
    name: str
    module: str  # under bench/
    func: str
    minutes: float  # rough, one H200
    doc: str
    defaults: dict = field(default_factory=dict)

    def resolve(self):
        return getattr(importlib.import_module(f"bench.{self.module}"), self.func)

    def run(self, **options):
        """Call the suite with its defaults, overridden by the `options` its function accepts (None: not given)."""
        fn = self.resolve()
        params = inspect.signature(fn).parameters
        kw = dict(self.defaults)
        kw.update({k: v for k, v in options.items() if v is not None and k in params})
        return fn(**kw)

    def accepts(self):
        try:
            return [p for p in inspect.signature(self.resolve()).parameters]
        except Exception:  # noqa: BLE001 - a module that does not import here (no GPU libraries)
            return []


GRID = (1024, 2048, 4096, 8192, 16384)
# suite bwd90's grid and providers (bwd90_queued times the same with each call queued behind a spin kernel)
BWD90 = dict(seqlens=(2048, 4096, 8192, 16384), headdims=(64, 128, 256), strategies=("atomic", "ordered"), rounds=3,
             providers=("flash", "cudnn"), backends=("sm90", "sm80"), strategies_dtypes=("float16", "bfloat16"))

SUITES = {s.name: s for s in (
    Suite("ceilings", "harness", "measure_ceilings", 0.1,
          "copy bandwidth and cuBLAS bf16 matmul rate of this run (the references of decode and micro)"),
    Suite("latency", "bench_fwd", "small_latency", 0.2,
          "per-call time of a loop of forward calls from Python: batch 1, 8 heads, 128 tokens, hdim 64"),
    Suite("fwd", "bench_fwd", "fa2_grid", 3.5,
          "forward on the FlashAttention-2 grid (batch x seqlen = 16k, hidden 2048, hdim 64/128, causal or not, "
          "fp16/bf16), cuflash, SDPA FLASH and cuDNN timed in turn, medians of 3 rounds",
          dict(seqlens=GRID, naive=(), rounds=3, providers=("flash", "cudnn"))),
    Suite("fwd90", "bench_fwd", "hopper_grid", 5.0,
          "the Hopper forward (backend sm90) next to the mma.sync forward (sm80), SDPA FLASH and cuDNN, timed in "
          "turn, medians of 3 rounds: FA2 grid 512-16k at hdim 64/128/256 fp16/bf16, 1 x 64k, GQA 64/8 at 8k (about "
          "a minute per dtype at head dim 64 or 128, 20 s at 256: --dtypes float16 --headdims 64,128)"),
    Suite("fwd90_queued", "bench_fwd", "hopper_grid", 3.0,
          "suite fwd90 with every call queued behind a ~3 ms spin kernel (the start event after it): the forwards' "
          "GPU time, without the host time a lone call spends before its kernel starts (cuflash's and SDPA's alike), "
          "FA2 grid from 1k and the extra points (--headdims 64,128 by default)",
          dict(headdims=(64, 128), seqlens=(1024, 2048, 4096, 8192, 16384), queued=True)),
    Suite("fwd90_extra", "bench_fwd", "hopper_grid", 3.0,
          "suite fwd90's points outside the FA2 grid alone: batch 1 x 64k at hdim 64/128 and GQA 64/8 heads at 8k "
          "(hdim 128), fp16/bf16, the same four providers timed in turn, medians of 3 rounds (README's table takes "
          "them with `python -m bench merge OUT old.json new.json:fwd90_extra=fwd90`)",
          dict(seqlens=())),
    Suite("scores", "bench_scores", "scores", 2.0,
          "the score modifiers (sliding window 4096, soft-cap 50, ALiBi, all three) next to the plain causal "
          "kernels, forward and backward (sm90, sm80), fp16 hdim 64/128 at 4k-16k, SDPA FLASH / cuDNN on the plain "
          "causal problem, timed in turn, medians of 3 rounds"),
    Suite("scores_queued", "bench_scores", "scores", 2.0,
          "suite scores with every call queued behind a ~3 ms spin kernel (the start event after it): each "
          "modifier's GPU time next to the plain kernel's, without the host time a lone call spends before its "
          "kernel starts",
          dict(queued=True)),
    Suite("dropout", "bench_parity", "dropout", 1.5,
          "attention dropout (p 0.1) next to the same call without it, forward and forward + backward, fp16 hdim "
          "64/128 at 2k/8k, causal or not, SDPA FLASH / cuDNN with the same dropout, timed in turn, 3 rounds"),
    Suite("headdims", "bench_parity", "headdims", 1.0,
          "head dims that are not compiled (80, 160, 192, 224, 384: zero-padded on the next kernel) next to the "
          "compiled ones (and the forward-only 512) and SDPA FLASH / cuDNN at the same head dim, forward and forward "
          "+ backward, fp16 4k, 3 rounds"),
    Suite("varlen", "bench_parity", "varlen", 1.5,
          "packed sequences (flash_attn_varlen_func) of three length mixtures against the padded batch they make, "
          "run by cuflash's fixed-length kernels and SDPA FLASH / cuDNN; forward and forward + backward, fp16 hdim "
          "128, 16 heads, causal or not, TFLOP/s of the real tokens, timed in turn, 3 rounds"),
    Suite("compile_block", "bench_integrations", "compile_block", 2.0,
          "a transformer block's training step (RMSNorm, QKV, causal GQA 16/4 x 128, MLP; bf16, 16k tokens) with "
          "cuflash's attention and SDPA's, eager and under torch.compile(fullgraph=True), timed in turn, 3 rounds"),
    Suite("hf_llama", "bench_integrations", "hf_llama", 2.0,
          "a random 8-layer Llama (hidden 2048, 16/4 heads, bf16) with attn_implementation 'cufa' and 'sdpa': "
          "training step on 4 x 2048 tokens (also with three rows left-padded), greedy generation of 64 tokens after 512, "
          "timed in turn, 3 rounds"),
    Suite("fwd_single", "bench_fwd", "fa2_grid", 2.0,
          "the forward grid from 512, one call per timing, with SDPA EFFICIENT and the naive baseline (fp16)"),
    Suite("grid_order", "bench_fwd", "grid_order", 0.3, "forward grid order: Q tile in grid x vs (batch, head) in grid x"),
    Suite("layout", "bench_fwd", "layout", 0.5,
          "forward of cuflash and SDPA FLASH on [b, s, h, d]- and [b, h, s, d]-contiguous data"),
    Suite("memory", "bench_fwd", "peak_memory", 0.3, "peak device memory of one forward, seqlen 1k-64k"),
    Suite("fwd_tiles", "bench_fwd", "tile_sweep", 0.5, "every candidate forward tile next to SDPA FLASH (fp16)"),
    Suite("fwd_interleaved", "bench_fwd", "interleaved", 1.5,
          "the forward points nearest 1.0x FLASH: configured tile, load positions and FLASH timed in turn, 8 rounds"),
    Suite("bwd", "bench_bwd", "bwd", 5.0,
          "backward through autograd on the FlashAttention-2 grid from 2k (default dQ strategy), cuflash, FLASH "
          "and cuDNN timed in turn, medians of 3 rounds",
          dict(seqlens=(2048, 4096, 8192, 16384), strategies=("atomic",), rounds=3, providers=("flash", "cudnn"))),
    Suite("bwd90", "bench_bwd", "bwd", 9.0,
          "backward through autograd on the FlashAttention-2 grid from 2k, head dims 64, 128 and 256: the Hopper "
          "backward (default dQ strategy and the deterministic 'ordered' where it runs: at 256 where turned on), the "
          "mma.sync backward, FLASH and cuDNN timed in turn, medians of 3 rounds",
          BWD90),
    Suite("bwd90_queued", "bench_bwd", "bwd", 9.0,
          "suite bwd90 with every call queued behind a ~3 ms spin kernel (the start event after it): the backwards' "
          "GPU time through autograd, without the host hand-off a lone call exposes, as in a training step",
          dict(BWD90, queued=True)),
    Suite("bwd90_extra", "bench_bwd", "bwd", 3.0,
          "suite bwd90_queued's providers and strategies at the Hopper forward grid's extra points alone: batch 1 x "
          "64k at head dims 64 and 128, GQA 64 query / 8 KV heads at 8k (head dim 128), fp16/bf16, causal or not, "
          "every call queued behind a spin kernel, one round (the 64k points take seconds per round)",
          dict(BWD90, queued=True, seqlens=(), extra=True, headdims=(64, 128), rounds=1)),
    Suite("bwd_strategies", "bench_bwd", "bwd", 2.0,
          "backward through autograd, every dQ strategy (atomic, seqpar, loop up to 2k) next to SDPA "
          "FLASH / cuDNN / EFFICIENT, one call per timing", dict(seqlens=(1024, 4096, 16384))),
    Suite("bwd_loop", "bench_bwd", "bwd_loop", 1.0,
          "backward, 10 back-to-back autograd calls per timing (host latency overlapped), next to FLASH"),
    Suite("bwd_partition", "bench_bwd", "bwd_partition", 0.5,
          "the backward warp partitions (kv, q, 2d), each with its configured tile"),
    Suite("bwd_tiles", "bench_bwd", "bwd_tile_sweep", 1.0,
          "candidate backward tiles (called directly) next to SDPA FLASH's backward (options: --dtypes "
          "--rounds --headdims --seqlens)"),
    Suite("dq_memory", "bench_bwd", "dq_memory", 0.2, "extra device memory of each dQ strategy: formula and measured"),
    Suite("decode", "bench_decode", "decode", 6.5,
          "decoding steps (q_len 1, 32 heads, hdim 128, fp16, batch 1-64, cache 1k-128k, 32/8/1 KV heads): "
          "event and CUDA-graph time, bandwidth floor, cuflash kernels and SDPA backends timed in turn, medians of "
          "3 rounds"),
    Suite("decode_sweep", "bench_decode", "decode_sweep", 1.0, "decode-kernel tile and split-count sweep"),
    Suite("decode_big_gqa", "bench_decode", "decode_big_gqa", 0.4,
          "the large GQA/MQA decoding cases with SDPA FLASH's native GQA, timed in turn, medians of 3 rounds"),
    Suite("decode_paged", "bench_decode", "decode_paged", 0.8,
          "paged KV caches (page sizes 16 and 256, pages in a random order) against contiguous ones, and the "
          "rotary append step, timed in turn, medians of 3 rounds"),
    Suite("cp", "bench_cp", "cp", 6.0,
          "context parallelism (cuflash.distributed ring attention, zigzag) under torchrun on 2, 4, 8 GPUs (as many as "
          "are visible; NCCL, NVLink multicast off): time per step forward and forward + backward at 128k-1M, causal "
          "or not, hdim 128 bf16, next to the same loop without communication and one GPU on the whole sequence "
          "(overlap, scaling efficiency); with one GPU only the one-GPU baseline and the simulation overhead"),
    Suite("micro", "bench_micro", "micro", 1.5, "instruction-level microbenchmarks (cuda_src/micro/micro.cu)"),
    Suite("micro90", "bench_micro_sm90", "micro90", 0.3,
          "Hopper instruction microbenchmarks (cuda_src/micro/micro_sm90.cu, sm_90a): wgmma ss/rs, TMA, mbarrier"),
    Suite("ladder", "bench_v1", "v1_ladder", 2.0,
          "the V1 -> V2 ladder: time, error against float64 and counted traffic of every rung"),
    Suite("traffic", "bench_traffic", "traffic", 2.0,
          "measured (Nsight Compute) vs counted device-memory traffic of the ladder's rungs"),
)}

# `python -m bench all` without --suites: the forward headline (Hopper and mma.sync kernels next to SDPA), latency
# and the Hopper microbenchmarks, about 5.6 minutes; with the precompile and the GPU tests (about 10 minutes on one
# H200) that is more than one 10-minute command: `--test-part 1/2` and `2/2` split the tests over two runs, and
# `--time-limit 9.5` starts only the suites that fit (or name --tests, --suites, --seqlens, --headdims);
# the backward (suite bwd, about 5 minutes) and decoding (decode) are runs of their own
DEFAULT_ALL = ("ceilings", "fwd90", "latency", "micro90")


def resolve_list(text: str | None) -> list[str]:
    """'fwd,bwd' -> ['fwd', 'bwd']; 'default' -> DEFAULT_ALL; 'every' -> all suites; 'none' -> []."""
    if text in (None, "", "default"):
        return list(DEFAULT_ALL)
    if text == "none":
        return []
    if text == "every":
        return list(SUITES)
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SUITES]
    if unknown:
        raise SystemExit(f"unknown suite(s) {unknown}; known: {', '.join(SUITES)}")
    return names


def listing() -> str:
    lines = [f"{'suite':16s} {'~min':>5s}  what"]
    for s in SUITES.values():
        lines.append(f"{s.name:16s} {s.minutes:5.1f}  {s.doc}")
    return "\n".join(lines)
