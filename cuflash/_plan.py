"""The host plan shared by every kernel family (V2 forward, V2 backward, decode, V1).

A plan holds everything a launch needs that depends only on a call's memo key (dtypes, shapes, strides,
devices, options): the output shapes, one parameter block with every field but the per-call pointers
already bound by name (cuflash._params.ParamBlock.bind), and the kernels to launch with that block. It is
made once, after validation; a call whose arrays match the key then only

1. allocates the outputs (an `allocator`: one torch.empty / cupy.empty each, NaN-filled under _interop.POISON),
2. packs the block with the call's pointers and launches every kernel (`launch`: one Struct.pack_into and
   one cuLaunchKernel per kernel, on the plan's device; a kernel added with pdl=True, one that waits for the
   kernel before it with griddepcontrol.wait, goes through cuLaunchKernelEx with Programmatic Dependent Launch
   where cuflash._launch.pdl_supported says so: its launch config built once, cuflash._launch.ProgrammaticLaunch).

Memoization: each family keeps a dict of plans keyed by `_interop.desc` parts and scalar options (built
inline on the hot path); `remember` is the shared bounded put.
"""
from __future__ import annotations

import sys

from . import _interop
from ._interop import TORCH, ctx_current_fn, ensure_context, get_device_fn, launch_fn
from ._launch import ProgrammaticLaunch, _scratch, _tls, pdl_supported
from ._params import ParamBlock

FLOAT32 = "float32"


class HostPlan:
    """Base of the memoized host plans.

    Made from a validated view of the plan's first input (`like`: kind, device, dtype of the outputs):

    * `spec(shape, float32=False)` -> an output spec for `allocator` (the inputs' dtype, or float32);
    * `bind(block, dynamic, **constants)` fixes the parameter block: `dynamic` names its leading per-call fields;
    * `add_launch(launcher, grid, pdl=False)` appends a kernel launched with the block (in order); pdl=True: a
      kernel that may start before the one ahead of it drains (it waits for it on the device), launched with PDL
      where supported -- `pdl` then says the plan does;
    * `allocator(*specs)` -> a function of no arguments that allocates those outputs;
    * per call: that allocator() -> (arrays, pointers, stream); `launch(stream, *dynamic_values)` (or
      `launch_after(first, first_values, stream, *dynamic_values)`: another plan's kernels first).
    """

    __slots__ = ("kind", "device", "tdevice", "odtype", "params", "pack", "rest", "launches", "pdl", "_driver")

    def __init__(self, like: _interop.Arr):
        self.kind, self.device = like.kind, like.device
        self.odtype = like.obj.dtype
        self.tdevice = like.obj.device if like.kind == TORCH else None
        self.launches = ()
        self.pdl = False  # some kernel is launched with Programmatic Dependent Launch
        self.params = self.pack = self.rest = None
        # cuLaunchKernel, cudaGetDevice and cuCtxGetCurrent, looked up once (what _interop.launch_fn, get_device and
        # ensure_context call)
        self._driver = (launch_fn(), get_device_fn(), ctx_current_fn())

    # ------------------------------------------------------------------------------ made once per key
    def spec(self, shape, float32: bool = False) -> tuple:
        """(shape, dtype) of one output for `allocator`: the inputs' dtype, or float32 (in the plan's library)."""
        if not float32:
            return tuple(shape), self.odtype
        return tuple(shape), (sys.modules["torch"].float32 if self.kind == TORCH else FLOAT32)

    def bind(self, block: ParamBlock, dynamic, **constants) -> None:
        """The plan's parameter block: `constants` by field name; `dynamic` (the block's leading fields) per call."""
        self.params = block.bind(dynamic, **constants)
        self.pack, self.rest = self.params.struct.pack_into, self.params.rest

    def add_launch(self, launcher, grid, pdl: bool = False) -> None:
        """Launch `launcher` (cuflash._launch.Launcher) over `grid` (x, y, z) with the plan's block, after the others;
        pdl=True: with Programmatic Dependent Launch where supported (the kernel must wait for its predecessor's
        writes with griddepcontrol.wait, and that predecessor must be the plan's own kernel)."""
        gx, gy, gz = grid
        ex = None
        if pdl and pdl_supported(self.device):
            ex = ProgrammaticLaunch(launcher.ptr, grid, launcher.threads, launcher.smem)
            self.pdl = True
        self.launches += ((launcher.ptr, gx, gy, gz, launcher.threads, launcher.smem, ex),)

    def allocator(self, *specs):
        """A function of no arguments that allocates one array per spec (from `spec`) on the plan's device and
        returns (arrays, pointers, the caller's current raw stream) -- NaN-filled under _interop.POISON."""
        return _allocator_factory(self.kind, len(specs))(self, *(x for spec in specs for x in spec))

    # ------------------------------------------------------------------------------------- per call
    def launch(self, stream: int, *dynamic) -> None:
        """Pack the block (the dynamic fields' values in `bind` order) and launch every kernel on `stream`."""
        # one block for all kernels (the driver copies it during each launch call), in this thread's buffer
        buf, argv, _ = getattr(_tls, "s", None) or _scratch()
        self.pack(buf, 0, *dynamic, *self.rest)
        self.launch_packed(stream, argv)

    def launch_packed(self, stream: int, argv: int) -> None:
        """Launch every kernel with parameters already packed where `argv` (a void** address) points, on the
        plan's device."""
        launch, get_device, ctx_current = self._driver
        if not ctx_current():
            ensure_context()
        if get_device() == self.device:
            _launch_all(self.launches, launch, stream, argv)
        else:
            import cupy

            with cupy.cuda.Device(self.device):
                _launch_all(self.launches, launch, stream, argv)

    def launch_after(self, first: HostPlan, first_values: tuple, stream: int, *dynamic) -> None:
        """`first`'s kernels with its own block (first_values: its dynamic fields), then this plan's `launch`,
        in one device context (the decode path's KV-cache append before attending)."""
        buf, argv, _ = getattr(_tls, "s", None) or _scratch()
        launch, get_device, ctx_current = self._driver
        if not ctx_current():
            ensure_context()
        ctx = None
        if get_device() != self.device:
            import cupy

            ctx = cupy.cuda.Device(self.device)
            ctx.__enter__()
        try:
            first.pack(buf, 0, *first_values, *first.rest)
            _launch_all(first.launches, launch, stream, argv)
            self.pack(buf, 0, *dynamic, *self.rest)
            _launch_all(self.launches, launch, stream, argv)
        finally:
            if ctx is not None:
                ctx.__exit__(None, None, None)


def _launch_all(launches, launch, stream: int, argv: int) -> None:
    """Each of a plan's launches in order, with the parameters packed at `argv`: a plain launch through the
    driver (`launch`: cuLaunchKernel's arguments), or the entry's own launcher (`ex`: one with launch
    attributes, e.g. a programmatic dependent launch)."""
    for fn, gx, gy, gz, threads, smem, ex in launches:
        if ex is None:
            launch(fn, gx, gy, gz, threads, 1, 1, smem, stream, argv, 0)
        else:
            ex(stream, argv)


_ALLOCATORS: dict = {}


def _allocator_factory(kind: int, n: int):
    """The factory of `HostPlan.allocator` for n outputs of one array library: generated once per (kind, n), so
    that an allocation costs what hand-written torch.empty / cupy.empty calls cost (no loop, no spec look-up)."""
    fn = _ALLOCATORS.get((kind, n))
    if fn is not None:
        return fn
    params = ", ".join(f"s{i}, d{i}" for i in range(n))
    xs = "".join(f"x{i}, " for i in range(n))
    lines = [f"def factory(plan, {params}):", "    dev, tdev = plan.device, plan.tdevice", "    def outputs():"]
    if kind == TORCH:
        lines += ["        torch = sys.modules['torch']", "        empty = torch.empty"]
        lines += [f"        x{i} = empty(s{i}, dtype=d{i}, device=tdev)" for i in range(n)]
        lines += ["        if _interop.POISON:", f"            for x in ({xs}):", "                x.fill_(float('nan'))",
                  f"        return [{xs}], [{''.join(f'x{i}.data_ptr(), ' for i in range(n))}], "
                  "torch._C._cuda_getCurrentRawStream(dev)"]
    else:
        lines += ["        import cupy", "        with _interop.device_guard(dev):"]
        lines += [f"            x{i} = cupy.empty(s{i}, dtype=d{i})" for i in range(n)]
        lines += ["        if _interop.POISON:", f"            for x in ({xs}):", "                x.fill(float('nan'))",
                  f"        return [{xs}], [{''.join(f'x{i}.data.ptr, ' for i in range(n))}], "
                  "cupy.cuda.get_current_stream(dev).ptr"]
    lines.append("    return outputs")
    env = {"sys": sys, "_interop": _interop}
    exec("\n".join(lines), env)  # noqa: S102 - generated from the fixed template above
    fn = _ALLOCATORS[(kind, n)] = env["factory"]
    return fn


def remember(memo: dict, key, plan, max_size: int) -> None:
    """memo[key] = plan (nothing for key None), clearing the memo first when it holds max_size plans."""
    if key is not None:
        if len(memo) >= max_size:
            memo.clear()
        memo[key] = plan
