"""The counters of the Hopper forward's dynamic tile walk: which pair a launch uses (cuda_src/flash_fwd_sm90.cu,
Sm90FwdWalk).

The persistent form can hand its Q tiles out from a pair of counters in device memory (`sm90_walk_counters`, a
global of the kernel's module: zero when the module loads, and every launch leaves its pair zero again, so no memset
is launched). Two launches that may run at the same time must not share a pair. Launches on one stream never
overlap (the forward is not launched with Programmatic Dependent Launch), so each (device, stream) keeps one slot. A
launch captured into a CUDA graph takes a slot of its own for good: the graph may be replayed on any stream, while
eager launches run on the stream it was captured on (CUDA orders the replays of one graph). When the slots run out,
a launch walks its tiles in fixed waves (`slot` returns -1): the same tiles in the same order, dealt out without the
counter. A stream destroyed while such a launch is still queued on it and a new stream created at the same handle
would share its slot; CUDA reuses handles, so that is possible in principle and not guarded against.
"""
from __future__ import annotations

import struct
import threading

from ._params import FWD_PARAMS

SLOTS = 8192  # SM90_WALK_SLOTS in cuda_src/flash_fwd_sm90.cu
DYNAMIC = -2  # launch_setup's walk_slot for a launch whose slot is taken per call (the kernel reads < 0 as fixed)
SLOT_OFFSET = FWD_PARAMS.offsets()["walk_slot"][0]  # the field's byte offset in a packed FwdParams
put_slot = struct.Struct("<q").pack_into  # put_slot(buffer, SLOT_OFFSET, slot)

_lock = threading.Lock()
_stream_slots: dict = {}  # (device, raw stream) -> slot
_taken = [0]  # slots handed out


def _new_slot() -> int:
    with _lock:
        s = _taken[0]
        if s >= SLOTS:
            return -1
        _taken[0] = s + 1
        return s


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


def slot(device: int, stream: int) -> int:
    """The counter slot of a dynamic-walk launch on (device, stream): the stream's own, or, while the stream is being
    captured, a new one kept for good; -1 when none is left (the launch then walks in fixed waves)."""
    if capturing(stream):
        return _new_slot()
    key = (device, stream)
    s = _stream_slots.get(key)
    if s is None:
        s = _stream_slots[key] = _new_slot()
    return s

