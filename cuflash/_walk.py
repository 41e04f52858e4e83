"""The counters of the Hopper forward's dynamic tile walk: which pair a launch uses (cuda_src/flash_fwd_sm90.cu,
Sm90FwdWalk); and the workspace of its stream-K walk (Sm90FwdStreamK).

The persistent form can hand its Q tiles out from a pair of counters in device memory (`sm90_walk_counters`, a
global of the kernel's module: zero when the module loads, and every launch leaves its pair zero again, so no memset
is launched). Two launches that may run at the same time must not share a pair. Launches on one stream never
overlap (the forward is not launched with Programmatic Dependent Launch), so each (device, stream) keeps one slot. A
launch captured into a CUDA graph takes a slot of its own for good: the graph may be replayed on any stream, while
eager launches run on the stream it was captured on (CUDA orders the replays of one graph). When the slots run out,
a launch walks its tiles in fixed waves (`slot` returns -1): the same tiles in the same order, dealt out without the
counter. A stream destroyed while such a launch is still queued on it and a new stream created at the same handle
would share its slot; CUDA reuses handles, so that is possible in principle and not guarded against. The per-thread
default stream has one handle for every thread's own stream: its launches are keyed by the thread as well.

Stream-K's workspace (`sk_workspace`): a flag per (block, consumer warpgroup) and each one's partial state (the
Hopper backward's stream-K: a flag per block and its partial dK, dV; `bwd_sk_bytes`). Every
launch leaves the flags zero, so a (device, stream) keeps one workspace, zeroed once, stream-ordered, when it is made
(or outgrown: the old one is kept, as launches queued before may still use it). A launch captured into a CUDA graph
takes no stream-K (the kernel walks in fixed waves; `sk_workspace` returns 0): a workspace of its own for each
captured launch, kept for good, would cost the graph's lifetime in memory.
"""
from __future__ import annotations

import struct
import threading

from ._configs import SM90_SK_MAX_GRID
from ._params import FWD_PARAMS

SLOTS = 8192  # SM90_WALK_SLOTS in cuda_src/flash_fwd_sm90.cu
DYNAMIC = -2  # launch_setup's walk_slot for a launch whose slot is taken per call (the kernel reads < 0 as fixed)
STREAM_K = -3  # launch_setup's walk_slot for a stream-K launch: fixed waves, o_accum the workspace put in per call
SK_FLAG_BYTES = 4 * 4 * SM90_SK_MAX_GRID  # SM90_SK_FLAGS ints in cuda_src/flash_fwd_sm90.cu: 4 per block
PER_THREAD_STREAM = 2  # cudaStreamPerThread
SLOT_OFFSET = FWD_PARAMS.offsets()["walk_slot"][0]  # the field's byte offset in a packed FwdParams
put_slot = struct.Struct("<q").pack_into  # put_slot(buffer, SLOT_OFFSET, slot)
O_ACCUM_OFFSET = FWD_PARAMS.offsets()["o_accum"][0]  # stream-K's workspace pointer
put_ptr = struct.Struct("<Q").pack_into  # put_ptr(buffer, O_ACCUM_OFFSET, address)

_lock = threading.Lock()


def _stream_key(device: int, stream: int) -> tuple:
    """What tells launches that may overlap apart: (device, stream), and the thread on the per-thread stream."""
    return (device, stream, threading.get_ident()) if stream == PER_THREAD_STREAM else (device, stream)


_runtime = []  # cupy.cuda.runtime, imported at the first call (every dynamic-walk launch asks)


def capturing(stream: int) -> bool:
    """Whether `stream` (a raw handle) is being captured into a CUDA graph."""
    if not _runtime:
        from cupy.cuda import runtime

        _runtime.append(runtime)
    runtime = _runtime[0]
    try:
        return runtime.streamIsCapturing(stream) != runtime.streamCaptureStatusNone
    except runtime.CUDARuntimeError:  # the legacy stream queried while another stream captures: no launch is valid
        return False


class SlotPool:
    """`size` slots of a module's counters, handed out by `slot`."""

    def __init__(self, size: int):
        self.size = size
        self.taken = 0  # slots handed out
        self.streams: dict = {}  # _stream_key -> slot

    def new(self) -> int:
        with _lock:
            s = self.taken
            if s >= self.size:
                return -1
            self.taken = s + 1
            return s

    def slot(self, device: int, stream: int) -> int:
        """The slot of a launch on (device, stream): the stream's own, or, while the stream is being captured, a new
        one kept for good; -1 when none is left."""
        if capturing(stream):
            return self.new()
        key = _stream_key(device, stream)
        s = self.streams.get(key)
        if s is None:
            s = self.streams[key] = self.new()
        return s


FWD_SLOTS = SlotPool(SLOTS)  # the Hopper forward's dynamic walk (-1: the launch walks in fixed waves)
slot = FWD_SLOTS.slot


def bwd_sk_bytes(grid: int, headdim: int, split: bool = False) -> int:
    """The Hopper backward's stream-K workspace at a grid of `grid` blocks and a kernel head dim (cuda_src/
    flash_bwd_sm90.cu, Sm90BwdStreamK): the flags (one int per block, in the forward's SK_FLAG_BYTES), then per block
    256 consumer threads' partial dK and dV, 2 x DP / 8 float4 (the column-split kernel's, `split`: 2 x DP / 16)."""
    dp = -(-headdim // 64) * 64
    return SK_FLAG_BYTES + grid * 2 * (dp // (16 if split else 8)) * 256 * 16


def sk_bytes(grid: int, nwg: int, headdim: int) -> int:
    """Stream-K's workspace at a grid of `grid` blocks of `nwg` consumer warpgroups and a kernel head dim: the flags,
    then per (block, warpgroup) 128 threads' (DP / 8 + 1) float4 (DP: the head dim in whole 64-column chunks)."""
    dp = -(-headdim // 64) * 64
    return SK_FLAG_BYTES + grid * nwg * (dp // 8 + 1) * 128 * 16


_workspaces: dict = {}  # _stream_key -> (pointer, bytes, cupy memory)
_outgrown: list = []  # workspaces replaced by larger ones (kept: launches queued before may use them)


def sk_workspace(device: int, stream: int, nbytes: int) -> int:
    """The stream-K workspace of a launch on (device, stream) needing `nbytes`: its address, or 0 while the stream
    is being captured (the launch then walks in fixed waves)."""
    if capturing(stream):
        return 0
    key = _stream_key(device, stream)
    ws = _workspaces.get(key)
    if ws is None or ws[1] < nbytes:
        mem = _alloc_zeroed_flags(device, stream, nbytes)
        with _lock:
            if ws is not None:
                _outgrown.append(ws)
            ws = _workspaces[key] = (mem.ptr, nbytes, mem)
    return ws[0]


def _alloc_zeroed_flags(device: int, stream: int, nbytes: int):
    """nbytes of device memory (CuPy's pool) whose flags are zeroed on `stream`, ahead of the launch that uses them."""
    import cupy
    from cupy.cuda import runtime

    with cupy.cuda.Device(device):
        mem = cupy.cuda.alloc(nbytes)
        runtime.memsetAsync(mem.ptr, 0, SK_FLAG_BYTES, stream)
    return mem
