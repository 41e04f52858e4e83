"""Diagnostics: tools run by hand, not benchmark suites (none writes results.json).

GPU:  bwd_timing_check (one backward timed four ways + torch.profiler), flake_check (one accuracy check
      repeated N times), ncu_fwd / ncu_bwd (one call per provider for Nsight Compute), ncu_fwd90 (the Hopper
      forward with explicit tiles, e.g. the persistent form against the one-tile kernel), ncu_source.sh
      (per-SASS-instruction stall samples of one launch as CSV), decode_probe (the decode combine and split
      count: a correctness check, then the latency-bound decoding cases in graph replay next to SDPA cuDNN / FLASH).
CPU:  host_overhead (cuflash's per-call Python cost with torch and the driver stubbed), rounding_emulation
      (float64 emulation of the backward's roundings), sass_dump (SASS of package kernels, opcode counts).

Run each as `python -m bench.diag.NAME` (see its docstring)."""
