"""Diagnostic (GPU): where a single backward call through autograd spends the time that back-to-back calls hide.

For each shape (FlashAttention-2 grid: batch x seqlen = 16k, hidden 2048) and provider -- cuflash through autograd,
cuflash's `flash_attn_backward` (no autograd), SDPA CUDNN and SDPA FLASH through autograd -- timed two ways, in turn,
medians of rounds:

* single: one call between two CUDA events, the GPU idle before it (what suite `bwd90` times with --calls 1);
* queued: the same call queued behind a ~3 ms spin kernel (`torch.cuda._sleep`), the start event recorded after the
  spin, so the host's work before the first kernel lies under the spin: the call's GPU time alone (what suite
  `bwd90_queued` times: bench.harness.time_queued_ms);
* exposed = single - queued: the host latency the GPU waits for.

Then torch.profiler (CPU + CUDA) over a few single calls per provider: from the start of the call on the host to its
first kernel launch (host), and to that kernel's start on the GPU.

    python -m bench.diag.bwd_handoff [--rounds 5] [--shapes d128:2048,d128:4096n,...]

A shape is `d<headdim>:<seqlen>` with an `n` suffix for non-causal (default causal).
"""
from __future__ import annotations

import argparse
import statistics
import sys


def _parse_shape(s):
    d, n = s.split(":")
    causal = not n.endswith("n")
    return int(d.lstrip("d")), int(n.rstrip("n")), causal


def _providers(torch, d, s, causal, dt):
    import cuflash

    from ..bench_bwd import _grad_fn, _inputs, _sdpa_inputs
    from ..harness import sdpa

    h, b = 2048 // d, 16384 // s
    q, k, v, dout = _inputs(b, s, h, d, dt)
    out = cuflash.flash_attn_func(q, k, v, causal=causal)
    with torch.no_grad():
        o2, lse, _ = cuflash.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    fns = {"cuflash autograd": _grad_fn(out, (q, k, v), dout),
           "cuflash flash_attn_backward": lambda: cuflash.flash_attn_backward(dout, qd, kd, vd, o2, lse,
                                                                             causal=causal)}
    qt, kt, vt, dt_ = _sdpa_inputs(q, k, v, dout)
    for name in ("cudnn", "flash"):
        try:
            o = sdpa(name)(qt, kt, vt, causal)
            fns[f"SDPA {name.upper()} autograd"] = _grad_fn(o, (qt, kt, vt), dt_)
        except RuntimeError as err:
            print(f"SDPA {name} refused: {err}")
    return fns


def first_times(events, n):
    """(median host us from the mark `bwd{i}` to the backward's first kernel launch, median us from the mark to its
    first GPU kernel) over marks 0..n-1; events: (name, start us, on the GPU) in any order, a mark's window ending at
    the next mark. None where no window had one."""
    marks = {name: t for name, t, gpu in events if not gpu and name.startswith("bwd")}
    launch, first = [], []
    for i in range(n):
        t0 = marks.get(f"bwd{i}")
        if t0 is None:
            continue
        t1 = marks.get(f"bwd{i + 1}", float("inf"))
        inside = [(name, t, gpu) for name, t, gpu in events if t0 <= t < t1]
        host = [t for name, t, gpu in inside if not gpu and "LaunchKernel" in name]
        dev = [t for name, t, gpu in inside if gpu and "Memset" not in name and "Memcpy" not in name]
        if host:
            launch.append(min(host) - t0)
        if dev:
            first.append(min(dev) - t0)
    return (statistics.median(launch) if launch else None, statistics.median(first) if first else None)


def _profile(torch, fns, n=5):
    """{provider: first_times of n backwards under torch.profiler (CPU and CUDA activities), each alone}."""
    from torch.profiler import ProfilerActivity, profile, record_function

    res = {}
    for name, fn in fns.items():
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for i in range(n):
                torch.cuda.synchronize()
                with record_function(f"bwd{i}"):
                    fn()
                torch.cuda.synchronize()
        res[name] = first_times([(x.name, x.time_range.start, x.device_type.name == "CUDA") for x in prof.events()], n)
    return res


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--rep", type=int, default=10)
    p.add_argument("--shapes", default="d128:2048,d128:2048n,d128:4096n,d64:2048,d128:8192n")
    p.add_argument("--dtype", default="float16")
    a = p.parse_args(argv)
    import torch

    from ..harness import event_median_ms, spin_cycles, time_queued_ms

    dt = getattr(torch, a.dtype)
    cycles = spin_cycles(3.0)

    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {a.dtype}, {a.rounds} rounds of {a.rep}; "
          f"spin {cycles} cycles (~3 ms)")
    for shape in a.shapes.split(","):
        d, s, causal = _parse_shape(shape)
        fns = _providers(torch, d, s, causal, dt)
        for fn in fns.values():  # warm-up (plans, cuDNN graphs)
            for _ in range(3):
                fn()
        torch.cuda.synchronize()
        single = {n: [] for n in fns}
        queued = {n: [] for n in fns}
        for _ in range(a.rounds):
            for n, fn in fns.items():
                single[n].append(event_median_ms(fn, a.rep, before=torch.cuda.synchronize))
                queued[n].append(time_queued_ms(fn, warmup=1, rep=a.rep))
        prof = _profile(torch, fns)
        print(f"\n## d{d} seqlen {s} {'causal' if causal else 'non-causal'} (batch {16384 // s}, heads {2048 // d})")
        print("| provider | single ms | queued ms | exposed ms | host us to first launch | us to first kernel |")
        print("|---|---|---|---|---|---|")
        for n in fns:
            sm, dm = statistics.median(single[n]), statistics.median(queued[n])
            hl, fk = prof[n]
            fmt = lambda x: "-" if x is None else f"{x:.0f}"  # noqa: E731
            print(f"| {n} | {sm:.3f} | {dm:.3f} | {sm - dm:.3f} | {fmt(hl)} | {fmt(fk)} |", flush=True)
        del fns
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:])
