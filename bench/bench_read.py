"""Read-only streaming kernels (cuda_src/micro/read_sweep.cu): the points of the read-bandwidth sweep
(bench/diag/hbm_read_sweep.py) and the kernel candidates of the harness' read probe (harness.measure_ceilings).

A point is one kernel (load kind, depth, hint), a launch shape (threads per block, blocks per SM: the dynamic
shared memory is padded so that no more fit) and a layout of the work over the buffer (read_sweep.cu's ReadWalk).
`prepare(point, buffers)` resolves it on the GPU into a `Prepared`: the launch, the bytes it reads and the words
it must sum to. Nothing here imports torch or CuPy at module level."""
from __future__ import annotations

from dataclasses import dataclass, field

from cuflash._configs import SM90_SMEM_PER_BLOCK, SM90_SMEM_PER_SM, SM90_SMEM_RESERVED
from cuflash._launch import KernelSpec

FILE = "micro/read_sweep.cu"
ROW_BYTES = 256  # one row of the heads layouts: head dim 128 x 16 bits
LAYOUTS = {"flat_grid": 0, "flat_chunk": 1, "heads_seq": 2, "heads_interleaved": 3}
HINTS = {"plain": 0, "nc": 1, "l2_128": 2, "l2_256": 3}
KINDS = ("ldg", "cp_async", "bulk")
BULK_MAX_STAGES = 16  # read_sweep.cu READ_BULK_MAX_STAGES
BULK_BARRIER_BYTES = 128
LDG_MAX_THREADS = 512  # read_ldg_kernel's __launch_bounds__
SMEM_PER_SM = SM90_SMEM_PER_SM  # H100 / H200 (the sweep's target); the occupancy API has the last word
SMEM_RESERVED = SM90_SMEM_RESERVED  # per block
SMEM_STATIC = 128  # read_sweep.cu's warp sums
# the most dynamic shared memory a block may ask for: the opt-in limit (227 KB) counts the static bytes too
SMEM_MAX_BLOCK = SM90_SMEM_PER_BLOCK - SMEM_STATIC
CP_ASYNC_U = 8  # 16-byte chunks per thread per ring stage
# ReadSweepParams: k, v, out, then 10 int64 fields, in read_sweep.cu's order
PARAM_FORMAT = "=QQQ" + "q" * 10


@dataclass(frozen=True)
class Heads:
    """The decode layout: `batch` x `kv_heads` heads, each a K and a V region of `rows` rows of 256 bytes;
    `cache`: "bshd" (flash-attn's [b, s, hk, d]: rows hk x 256 bytes apart) or "bhsd" (head-contiguous)."""

    batch: int = 8
    kv_heads: int = 32
    rows: int = 16384
    cache: str = "bshd"

    @property
    def region_bytes(self) -> int:
        return self.batch * self.kv_heads * self.rows * ROW_BYTES

    def strides(self) -> tuple:
        """(batch stride, head stride, row stride) in bytes."""
        if self.cache == "bshd":
            return self.rows * self.kv_heads * ROW_BYTES, ROW_BYTES, self.kv_heads * ROW_BYTES
        return self.kv_heads * self.rows * ROW_BYTES, self.rows * ROW_BYTES, ROW_BYTES


@dataclass(frozen=True)
class Point:
    """One sweep point. depth: ldg U (16-byte loads per thread per tile), cp_async STAGES (ring of U = 8 chunks per
    thread per stage), bulk stages; bulk_kb: bytes per bulk copy (one tile). layout: LAYOUTS; splits / order /
    heads for the heads layouts (order "head": the decode kernel's block order, head-major; "split": split-major)."""

    name: str
    kind: str
    depth: int
    threads: int = 256
    blocks_per_sm: int = 1
    layout: str = "flat_grid"
    hint: str = "nc"
    bulk_kb: int = 0
    splits: int = 1
    order: str = "head"
    heads: Heads = field(default_factory=Heads)
    note: str = ""

    @property
    def tile_bytes(self) -> int:
        if self.kind == "bulk":
            return self.bulk_kb * 1024
        return self.threads * 16 * (self.depth if self.kind == "ldg" else CP_ASYNC_U)

    @property
    def ring_bytes(self) -> int:
        """Dynamic shared memory the kernel itself needs."""
        if self.kind == "ldg":
            return 0
        if self.kind == "cp_async":
            return self.depth * self.tile_bytes
        return BULK_BARRIER_BYTES + self.depth * self.tile_bytes

    @property
    def block_in_flight(self) -> int:
        """Bytes one block has in flight while it waits (ldg: its U loads; the rings: every stage)."""
        return self.tile_bytes if self.kind == "ldg" else self.depth * self.tile_bytes

    @property
    def is_heads(self) -> bool:
        return self.layout.startswith("heads")

    def spec(self) -> KernelSpec:
        smem = launch_smem(self)
        if self.kind == "ldg":
            return KernelSpec(FILE, f"cuflash::read_ldg_kernel<{self.depth}, {HINTS[self.hint]}>", self.threads, smem)
        if self.kind == "cp_async":  # cp.async has no .nc: "nc" is the plain copy (one compiled kernel)
            hint = HINTS["plain"] if self.hint == "nc" else HINTS[self.hint]
            return KernelSpec(FILE, f"cuflash::read_cp_async_kernel<{self.depth}, {CP_ASYNC_U}, {hint}>",
                              self.threads, smem)
        return KernelSpec(FILE, "cuflash::read_bulk_kernel", self.threads, smem, min_arch=90)

    def problems(self) -> list:
        """Why this point cannot be launched as described (empty: well-formed)."""
        bad = []
        if self.kind not in KINDS:
            bad.append(f"kind {self.kind}")
        if self.layout not in LAYOUTS:
            bad.append(f"layout {self.layout}")
        if self.hint not in HINTS:
            bad.append(f"hint {self.hint}")
        if self.threads % 32 or not 32 <= self.threads <= 1024:
            bad.append(f"threads {self.threads}")
        if self.kind == "ldg" and self.threads > LDG_MAX_THREADS:
            bad.append("ldg: more threads than its __launch_bounds__")
        if self.kind == "cp_async" and self.depth < 2:
            bad.append("cp_async: a ring needs 2 stages")
        if self.kind == "bulk":
            if not 1 <= self.depth <= BULK_MAX_STAGES:
                bad.append(f"bulk stages {self.depth}")
            if self.bulk_kb <= 0 or self.tile_bytes >= 1 << 20:  # the mbarrier's transaction count
                bad.append(f"bulk copy of {self.bulk_kb} KB")
            if self.is_heads and self.heads.cache != "bhsd":
                bad.append("bulk: contiguous tiles only (bhsd heads or flat layouts)")
            if self.hint != "nc":
                bad.append("bulk: no load hint")
        if self.tile_bytes % ROW_BYTES:
            bad.append("tiles of whole 256-byte rows")
        if launch_smem(self) > SMEM_MAX_BLOCK or self.ring_bytes > SMEM_MAX_BLOCK:
            bad.append("shared memory")
        if self.is_heads:
            rows_per_split, rem = divmod(self.heads.rows, self.splits)
            if rem or rows_per_split * ROW_BYTES % self.tile_bytes:
                bad.append("heads: a split must hold whole tiles")
        if self.order not in ("head", "split"):
            bad.append(f"order {self.order}")
        return bad


def launch_smem(p: Point) -> int:
    """Dynamic shared memory of a launch: the ring, padded so that at most blocks_per_sm blocks fit an SM (the
    kernels' 128 bytes of static shared memory and the 1 KB the driver reserves per block counted)."""
    cap = (SMEM_PER_SM // p.blocks_per_sm - SMEM_RESERVED - 256) // 128 * 128
    return max(p.ring_bytes, min(cap, SMEM_MAX_BLOCK))


# The harness' read probe (measure_ceilings): one candidate per load kind, 128 KB in flight per SM, the flat
# grid-stride layout (the sweep's prediction for the fastest pattern of each kind; the best of them is the probe).
PROBE_POINTS = (
    Point("probe ldg", "ldg", 8, threads=256, blocks_per_sm=4),
    Point("probe cp.async", "cp_async", 4, threads=256, blocks_per_sm=1),
    Point("probe bulk", "bulk", 4, threads=128, blocks_per_sm=1, bulk_kb=32),
)


@dataclass
class Prepared:
    """A point resolved on the GPU: launch() reads `bytes_read` bytes; the sum (mod 2^32) of out[:grid] must equal
    the sum of the 32-bit words of `check_range` (byte offsets into the buffer)."""

    point: Point
    grid: int
    resident: int  # blocks per SM the occupancy API allows at this launch's shared memory
    sms: int
    bytes_read: int
    check_range: tuple
    launch: object

    @property
    def in_flight_per_sm(self) -> int:
        return self.point.block_in_flight * min(self.resident, -(-self.grid // self.sms))

    @property
    def waves(self) -> float:
        return self.grid / (self.resident * self.sms)


def _steps_grid(p: Point, sms: int, resident: int, flat_bytes: int):
    """(grid, steps per block, bytes read, checked byte range)."""
    if p.is_heads:
        h = p.heads
        per_region = h.rows // p.splits * ROW_BYTES // p.tile_bytes
        grid = h.batch * h.kv_heads * p.splits
        return grid, 2 * per_region, 2 * h.region_bytes, (0, 2 * h.region_bytes)
    grid = sms * resident
    steps = flat_bytes // p.tile_bytes // grid
    if steps < 1:
        raise ValueError(f"{p.name}: buffer too small for the grid")
    n = steps * grid * p.tile_bytes
    return grid, steps, n, (0, n)


def prepare(p: Point, base_ptr: int, flat_bytes: int, out_ptr: int, device: int = 0, stream: int = 0) -> Prepared:
    """Compile (or load) the point's kernel and bind a launch over the buffer at base_ptr: the flat layouts read its
    first flat_bytes; the heads layouts read K = [0, region) and V = [region, 2 region) (flat_bytes >= 2 region)."""
    import struct

    from cupy.cuda import driver

    from cuflash._launch import _scratch, get_launcher

    bad = p.problems()
    if bad:
        raise ValueError(f"{p.name}: {'; '.join(bad)}")
    if p.is_heads and 2 * p.heads.region_bytes > flat_bytes:
        raise ValueError(f"{p.name}: the heads layout needs {2 * p.heads.region_bytes} bytes")
    spec = p.spec()
    lau = get_launcher(spec, device)
    if spec.smem > 48 * 1024:
        lau.raw.max_dynamic_shared_size_bytes = SMEM_MAX_BLOCK  # one function, several paddings: allow the most
    resident = int(driver.occupancyMaxActiveBlocksPerMultiprocessor(lau.ptr, p.threads, spec.smem))
    if resident < 1:
        raise RuntimeError(f"{p.name}: no block fits an SM")
    sms = _sm_count(device)
    grid, steps, nbytes, rng = _steps_grid(p, sms, resident, flat_bytes)
    h = p.heads
    bs, hs, rs = h.strides() if p.is_heads else (0, 0, ROW_BYTES)
    values = (base_ptr, base_ptr + (h.region_bytes if p.is_heads else 0), out_ptr, LAYOUTS[p.layout], steps,
              p.tile_bytes, p.splits, h.kv_heads, bs, hs, rs, int(p.order == "split"), p.depth)
    fmt = struct.Struct(PARAM_FORMAT)

    def launch():  # the ReadSweepParams struct by value: argv[0] points at it (cuflash._launch._scratch)
        buf, argv_addr, _ = _scratch()
        fmt.pack_into(buf, 0, *values)
        driver.launchKernel(lau.ptr, grid, 1, 1, p.threads, 1, 1, spec.smem, stream, argv_addr, 0)

    return Prepared(p, grid, resident, sms, nbytes, rng, launch)


def _sm_count(device: int) -> int:
    import torch

    return torch.cuda.get_device_properties(device).multi_processor_count


def words_sum(buf_i32, lo: int, hi: int) -> int:
    """Sum (mod 2^32) of the 32-bit words of bytes [lo, hi) of a torch int32 view of the buffer."""
    return int(buf_i32[lo // 4: hi // 4].sum().item()) % (1 << 32)


def block_sums_total(out_i32, grid: int) -> int:
    """Sum (mod 2^32) of the kernel's per-block sums (out as a torch int32 tensor)."""
    return int(out_i32[:grid].to(dtype=__import__("torch").int64).sum().item()) % (1 << 32)
