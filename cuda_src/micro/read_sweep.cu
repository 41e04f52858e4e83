// cuda_src/micro/read_sweep.cu -- read-only streaming kernels, driven by bench/diag/hbm_read_sweep.py.
//
// Which access pattern reads device memory fastest, and what the decode kernel's pattern costs: every kernel
// reads a buffer far larger than L2 once and keeps nothing, so its time is the read bandwidth of its pattern.
// Three load kinds:
//   read_ldg_kernel<U, HINT>            U 16-byte ld.global.v4 per thread per tile into registers (HINT: plain,
//                                       .nc, .nc + L2::128B / L2::256B prefetch);
//   read_cp_async_kernel<STAGES, U, HINT>  cp.async.cg 16 B into a STAGES-deep shared-memory ring, U chunks per
//                                       thread per stage (the decode kernel's load, HINT as above);
//   read_bulk_kernel                    cp.async.bulk (non-tensor) of one contiguous tile per stage into an
//                                       mbarrier ring of p.stages stages (run time), one thread issuing.
// and one walk of the tiles (ReadWalk, run time), so that the load kind and the layout are separate axes:
//   READ_FLAT_GRID          block b reads tiles b, b + grid, b + 2 grid, ... of one flat region (the whole GPU
//                           sweeps the buffer front to back: a grid-stride reduction, what torch's x.sum does);
//   READ_FLAT_CHUNK         block b reads tiles b steps .. (b + 1) steps - 1 (each block one contiguous chunk);
//   READ_HEADS_SEQ          the decode layout: batch x kv_heads "heads", each with a K region and a V region of
//                           rows of 256 bytes (head dim 128, 16 bits) at row_stride (flash-attn's [b, s, hk, d]
//                           cache: hk x 256 bytes; a head-contiguous [b, hk, s, d] cache: 256); a block per
//                           (head, split) reads its split's rows of K, then the same rows of V;
//   READ_HEADS_INTERLEAVED  the same blocks reading K tile 0, V tile 0, K tile 1, V tile 1, ... (the decode kernel's
//                           order: each of its warp tiles is a K tile and the V tile of the same keys).
// A tile of NT threads x U chunks: chunk c = u NT + tid is 16 bytes at row c / 16, column (c % 16) x 16 of the
// tile's rows (a warp covers two 256-byte rows per load, as the decode kernel's warp_load_tile).
//
// Every kernel adds up (mod 2^32) every 32-bit word it reads -- the ring kernels read their stages back from shared
// memory, all of them, as the decode kernel's ldmatrix does -- and writes one sum per block (out[blockIdx.x]):
// nothing can be removed, and the host checks that the sums add up to the words of the bytes the layout claims to
// cover, so a walk that read a tile twice (an L2 hit counted as device-memory bandwidth) would fail.
//
// Parameters: one ReadSweepParams by value (8-byte fields, packed by the host in this order).
#include "../common/ptx.cuh"
#include "../common/sm90.cuh"

namespace cuflash {

constexpr int READ_FLAT_GRID = 0;
constexpr int READ_FLAT_CHUNK = 1;
constexpr int READ_HEADS_SEQ = 2;
constexpr int READ_HEADS_INTERLEAVED = 3;
constexpr int READ_ROW_BYTES = 256;  // one row of the heads layouts: head dim 128 x 16 bits

// Load hints (HINT) of the ldg and cp.async kernels.
constexpr int READ_PLAIN = 0;        // ld.global.v4 / cp.async.cg
constexpr int READ_NC = 1;           // ld.global.nc.L1::no_allocate (cp.async: the same as PLAIN)
constexpr int READ_L2_128B = 2;      // + .L2::128B: the L2 fetches the 128-byte line around the access
constexpr int READ_L2_256B = 3;      // + .L2::256B: the 256-byte pair of lines

struct ReadSweepParams {
  const unsigned char* k;  // region 0 (the flat layouts: the whole buffer)
  const unsigned char* v;  // region 1 (the heads layouts' V)
  uint32_t* out;           // [gridDim.x]: the sum (mod 2^32) of the 32-bit words each block read
  int64_t layout;          // READ_FLAT_GRID .. READ_HEADS_INTERLEAVED
  int64_t steps;           // tiles each block reads (heads layouts: 2 x tiles per region)
  int64_t tile_bytes;      // bytes of one tile (a multiple of 256: whole rows)
  int64_t splits;          // heads layouts: blocks per head
  int64_t kv_heads;        // heads layouts: heads per batch element
  int64_t batch_stride;    // heads layouts: bytes between batch elements
  int64_t head_stride;     // heads layouts: bytes between the heads of one batch element
  int64_t row_stride;      // bytes between 256-byte rows (the flat layouts: 256)
  int64_t split_major;     // heads layouts: block = split x heads + head (else head x splits + split, the decoder's)
  int64_t stages;          // read_bulk_kernel: ring depth (<= READ_BULK_MAX_STAGES)
};

// The tiles one block reads, in order: tile(i) is the address of row 0 of its i-th tile. Regions are walked
// `stride` bytes per tile; the heads layouts switch to V after `per_region` tiles (SEQ) or every other tile
// (INTERLEAVED); the flat layouts never reach V (per_region = steps).
struct ReadWalk {
  const unsigned char* base0;
  const unsigned char* base1;
  int64_t stride;
  int64_t per_region;
  bool interleaved;
  __device__ __forceinline__ explicit ReadWalk(const ReadSweepParams& p) {
    const int64_t b = blockIdx.x, grid = gridDim.x;
    interleaved = p.layout == READ_HEADS_INTERLEAVED;
    if (p.layout == READ_FLAT_GRID || p.layout == READ_FLAT_CHUNK) {
      const bool by_grid = p.layout == READ_FLAT_GRID;
      base0 = base1 = p.k + (by_grid ? b : b * p.steps) * p.tile_bytes;
      stride = by_grid ? grid * p.tile_bytes : p.tile_bytes;
      per_region = p.steps;
      return;
    }
    const int64_t heads = grid / p.splits;
    const int64_t head = p.split_major ? b % heads : b / p.splits;
    const int64_t split = p.split_major ? b / heads : b % p.splits;
    per_region = p.steps / 2;
    stride = p.tile_bytes / READ_ROW_BYTES * p.row_stride;
    const int64_t off = (head / p.kv_heads) * p.batch_stride + (head % p.kv_heads) * p.head_stride +
                        split * per_region * stride;
    base0 = p.k + off;
    base1 = p.v + off;
  }
  __device__ __forceinline__ const unsigned char* tile(int64_t i) const {
    if (interleaved) return ((i & 1) ? base1 : base0) + (i >> 1) * stride;
    return i < per_region ? base0 + i * stride : base1 + (i - per_region) * stride;
  }
};

// This thread's first chunk in a tile, and the step between its chunks u and u + 1 (NT / 16 rows further).
__device__ __forceinline__ int64_t read_chunk_offset(const ReadSweepParams& p) {
  return (int64_t)(threadIdx.x >> 4) * p.row_stride + (threadIdx.x & 15) * 16;
}
__device__ __forceinline__ int64_t read_chunk_step(const ReadSweepParams& p) {
  return (int64_t)(blockDim.x >> 4) * p.row_stride;
}

__device__ __forceinline__ uint32_t read_sum4(uint4 x) { return x.x + x.y + x.z + x.w; }
// out[blockIdx.x] = the block's sum (every thread calls it once, at the end).
__device__ __forceinline__ void read_block_sum(uint32_t* out, uint32_t s) {
  __shared__ uint32_t warp_sums[32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) warp_sums[warp] = s;
  __syncthreads();  // RAW: warp_sums
  if (threadIdx.x == 0) {
    uint32_t t = 0u;
    for (int w = 0; w < (int)(blockDim.x >> 5); ++w) t += warp_sums[w];
    out[blockIdx.x] = t;
  }
}

// PTX ISA 9.7.9.8 ld: ld.global{.nc}{.level::eviction_priority}{.level::cache_hint}{.level::prefetch_size}.v4.u32.
// Volatile: the U loads of a tile are issued in program order, all before the first use.
template <int HINT>
__device__ __forceinline__ uint4 read_ldg16(const void* src) {
  uint4 r;
  if constexpr (HINT == READ_PLAIN) {
    asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(src));
  } else if constexpr (HINT == READ_NC) {
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(src));
  } else if constexpr (HINT == READ_L2_128B) {
    asm volatile("ld.global.nc.L1::no_allocate.L2::128B.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(src));
  } else {
    static_assert(HINT == READ_L2_256B, "load hint");
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(src));
  }
  return r;
}

// PTX ISA 9.7.9.25.3.1 cp.async.cg.shared.global{.level::cache_hint}{.level::prefetch_size}, 16 bytes.
template <int HINT>
__device__ __forceinline__ void read_cp_async16(uint32_t dst, const void* src) {
  if constexpr (HINT == READ_PLAIN || HINT == READ_NC) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
  } else if constexpr (HINT == READ_L2_128B) {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
  } else {
    static_assert(HINT == READ_L2_256B, "load hint");
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
  }
}

// No cache-policy hint: an L2::evict_first policy (createpolicy + .L2::cache_hint) stopped the sweep with an
// illegal instruction on the H200 and was removed.

__device__ __forceinline__ uint4 read_lds16(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr)
               : "memory");
  return v;
}

// ------------------------------------------------------------------------------------------ ld.global
// U x 16 bytes per thread in flight while a tile is read, none between tiles: the bytes in flight per SM are
// U x 16 x threads per block x blocks per SM, reached through many warps (torch's reductions work this way).
// __launch_bounds__(512, 1): without it ptxas kept the kernel at 32 registers by adding each load's words right
// after it, which left 4 of U = 16 loads per thread in flight; with it all U loads are issued before the first add
// (U = 16: 83 registers). At most 512 threads per block.
template <int U, int HINT>
__global__ void __launch_bounds__(512, 1) read_ldg_kernel(const __grid_constant__ ReadSweepParams p) {
  const ReadWalk w(p);
  const int64_t off0 = read_chunk_offset(p), ustep = read_chunk_step(p);
  uint32_t sum = 0u;
#pragma unroll 1
  for (int64_t i = 0; i < p.steps; ++i) {
    const unsigned char* src = w.tile(i) + off0;
    uint4 x[U];
#pragma unroll
    for (int u = 0; u < U; ++u) x[u] = read_ldg16<HINT>(src + u * ustep);
#pragma unroll
    for (int u = 0; u < U; ++u) sum += read_sum4(x[u]);
  }
  read_block_sum(p.out, sum);
}

// ------------------------------------------------------------------------------------------ cp.async ring
// STAGES tiles of U chunks per thread, one commit group per tile. Trip j issues tile j + STAGES - 1 into the slot
// this thread read in trip j - 1, then waits for tile j (cp.async.wait_group STAGES - 1): STAGES tiles in flight
// while it waits, STAGES - 1 while it reads. A thread reads back only its own chunks: no block barrier in the
// loop (the decode kernel's per-warp rings need only __syncwarp for the same reason). Dynamic shared memory:
// STAGES x U x NT x 16 bytes (the host may reserve more, to hold fewer blocks per SM).
template <int STAGES, int U, int HINT>
__global__ void read_cp_async_kernel(const __grid_constant__ ReadSweepParams p) {
  static_assert(STAGES >= 2, "a ring");
  extern __shared__ __align__(128) unsigned char read_smem[];
  const ReadWalk w(p);
  const int NT = blockDim.x, tid = threadIdx.x;
  const int64_t off0 = read_chunk_offset(p), ustep = read_chunk_step(p);
  const uint32_t smem0 = smem_addr(read_smem) + tid * 16u;
  const uint32_t u_bytes = NT * 16u, slot_bytes = U * u_bytes;
  const int64_t steps = p.steps;
  auto issue = [&](int64_t i, int slot) {
    const unsigned char* src = w.tile(i) + off0;
    const uint32_t dst = smem0 + slot * slot_bytes;
#pragma unroll
    for (int u = 0; u < U; ++u) read_cp_async16<HINT>(dst + u * u_bytes, src + u * ustep);
  };
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < steps) issue(s, s);
    cp_async_commit();
  }
  uint32_t sum = 0u;
  int slot_w = STAGES - 1, slot_r = 0;
#pragma unroll 1
  for (int64_t j = 0; j < steps; ++j) {
    if (j + STAGES - 1 < steps) issue(j + STAGES - 1, slot_w);
    cp_async_commit();  // (possibly empty) group, so wait<STAGES - 1> always means tile j
    cp_async_wait<STAGES - 1>();
    const uint32_t src = smem0 + slot_r * slot_bytes;
#pragma unroll
    for (int u = 0; u < U; ++u) sum += read_sum4(read_lds16(src + u * u_bytes));
    slot_w = slot_w + 1 == STAGES ? 0 : slot_w + 1;
    slot_r = slot_r + 1 == STAGES ? 0 : slot_r + 1;
  }
  cp_async_wait<0>();
  read_block_sum(p.out, sum);
}

// ------------------------------------------------------------------------------------------ cp.async.bulk ring
// p.stages slots of p.tile_bytes (contiguous tiles only: the host gives this kernel row_stride = 256), each
// completing on its own mbarrier. Thread 0 issues; trip j: every thread waits for slot j % stages (parity of
// the slot's use count), reads its chunks of it, a block barrier (WAR: the slot is refilled next), then thread 0
// refills the slot with tile j + stages. p.stages tiles in flight while the block waits. Dynamic shared memory:
// 128 bytes of barriers, then p.stages x p.tile_bytes.
constexpr int READ_BULK_MAX_STAGES = 16;

__global__ void read_bulk_kernel(const __grid_constant__ ReadSweepParams p) {
#if __CUDA_ARCH__ >= 900  // cp.async.bulk and mbarrier transaction counts: sm_90 (the file's other kernels: sm_80 too)
  extern __shared__ __align__(128) unsigned char read_smem[];
  uint64_t* bars = reinterpret_cast<uint64_t*>(read_smem);
  unsigned char* ring = read_smem + 128;
  const ReadWalk w(p);
  const int tid = threadIdx.x, NT = blockDim.x;
  const int stages = (int)p.stages;
  const uint32_t tile_bytes = (uint32_t)p.tile_bytes;
  const int64_t steps = p.steps;
  if (tid == 0) {
    for (int s = 0; s < stages; ++s) mbar_init(bars + s, 1);
    fence_barrier_init();
  }
  __syncthreads();  // the barriers are initialised before anyone waits on them
  if (tid == 0)
    for (int s = 0; s < stages && s < steps; ++s) {
      mbar_arrive_expect_tx(bars + s, tile_bytes);
      bulk_load(ring + s * tile_bytes, w.tile(s), tile_bytes, bars + s);
    }
  uint32_t sum = 0u;
  int slot = 0, phase = 0;
#pragma unroll 1
  for (int64_t j = 0; j < steps; ++j) {
    mbar_wait(bars + slot, phase);
    const uint32_t src = smem_addr(ring + slot * tile_bytes);
#pragma unroll 4
    for (uint32_t c = tid * 16u; c < tile_bytes; c += NT * 16u) sum += read_sum4(read_lds16(src + c));
    __syncthreads();  // WAR: every thread has read the slot before it is refilled
    if (tid == 0 && j + stages < steps) {
      mbar_arrive_expect_tx(bars + slot, tile_bytes);
      bulk_load(ring + slot * tile_bytes, w.tile(j + stages), tile_bytes, bars + slot);
    }
    if (++slot == stages) {
      slot = 0;
      phase ^= 1;
    }
  }
  read_block_sum(p.out, sum);
#endif
}

}  // namespace cuflash
