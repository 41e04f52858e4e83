// cuda_src/micro/micro_sm90.cu -- Hopper (sm_90a) instruction microbenchmarks, driven by bench/bench_micro_sm90.py.
//
// The instructions the sm_90a forward (flash_fwd_sm90.cu) is built from, one at a time:
//   1. wgmma.mma_async m64nNk16 (HGMMA), fp16 / bf16 -> fp32, A and B in shared memory ("ss": S = Q K^T) or A in
//      registers and B in shared memory ("rs": O += P V with P in registers): throughput with many warpgroups
//      and latency on one warpgroup;
//   2. TMA loads (cp.async.bulk.tensor.4d, UTMALDG) of K/V-shaped boxes from a tensor much larger than L2 into
//      a ring of shared-memory stages, each completing on an mbarrier: bytes per second;
//   3. mbarrier round trips (SYNCS.*): arrive on one barrier, try_wait.parity on another, between two sides of
//      1, 32 or 128 threads (the producer / consumer stage handoff), and one thread's arrive + wait;
//   4. and the Hopper backward's dQ writer: bulk reductions (cp.reduce.async.bulk .add.f32) of 16-32 KB fp32 tiles
//      from shared into global memory, many blocks adding into one, 8 or distinct destination tiles.
//
// Conventions (as cuda_src/micro/micro.cu):
//   * every measured result is stored, so nothing can be removed; operands are random data the host uploads
//     (wgmma) or a tensor the host filled with random bytes (TMA);
//   * clk[block][4] = {clock64 at start, clock64 at end, %smid, steps}: steps = measured instructions (or
//     round trips, or tiles) of ONE warpgroup (thread); the host groups blocks by SM (clock64 is per SM);
//   * kernel parameters are pointers / int64, one 8-byte launch slot each, except the TMA kernel whose FIRST
//     parameter is its 128-byte tensor map (a __grid_constant__ TmaDesc, at offset 0 of the parameter space).
//
// Shared-memory operand tiles use the 128-byte swizzle of cuda_src/common/sm90.cuh, written here by the threads
// (st.shared) rather than by TMA: element (r, c) of a [rows][64] 16-bit chunk (1024-byte aligned) lives at byte
//   r * 128 + ((c / 8) ^ (r % 8)) * 16 + (c % 8) * 2.
//   A (64 x 64, K-major, one chunk per warpgroup):   desc(A, k16 step k) = smem_desc(a + 32 k, 16, 1024)
//   B K-major  (N rows n, 64 columns k, one chunk):  desc(B, k) = smem_desc(b + 32 k, 16, 1024)
//   B MN-major (64 rows k, N columns n, N / 64 chunks of 64 x 128 B, chunk j at b + 8192 j):
//                                                    desc(B, k) = smem_desc(b + 2048 k, 8192, 1024)
// and every product is D[64 x N] += A[64 x 64] B[64 x N] in four k16 steps, so the host can check D.
#include "../common/ptx.cuh"
#include "../common/sm90.cuh"
#include "../common/wgmma.cuh"

namespace cuflash {

// ------------------------------------------------------------------------------------------ helpers
__device__ __forceinline__ uint32_t micro90_smid() {
  uint32_t id;
  asm volatile("mov.u32 %0, %%smid;\n" : "=r"(id));
  return id;
}
__device__ __forceinline__ void micro90_record_clock(int64_t* clk, int64_t t0, int64_t t1, int64_t steps) {
  int64_t* c = clk + 4 * static_cast<int64_t>(blockIdx.x);
  c[0] = t0;
  c[1] = t1;
  c[2] = micro90_smid();
  c[3] = steps;
}
// The first 1024-byte aligned address of dynamic shared memory (the host reserves 1024 bytes of slack).
__device__ __forceinline__ unsigned char* micro90_align1024(unsigned char* p) {
  return p + ((1024u - (smem_addr(p) & 1023u)) & 1023u);
}
// Byte offset of 16-bit element (r, c), c < 64, in a 128-byte-swizzled chunk (see the top of the file).
__device__ __forceinline__ uint32_t micro90_sw128(int r, int c) {
  return static_cast<uint32_t>(r * 128 + ((((c >> 3) ^ (r & 7)) << 4) | ((c & 7) << 1)));
}
__device__ __forceinline__ void micro90_sts_u16(uint32_t addr, unsigned short v) {
  asm volatile("st.shared.u16 [%0], %1;\n" ::"r"(addr), "h"(v) : "memory");
}

// Operand set-up shared by the wgmma kernels. a_g: [3][64][64] 16-bit (row m, column k), warpgroup w uses
// a_g + (w % 3) 4096; b_g: [N][64] (row n, column k): B[k][n] = b_g[n][k]. All threads of the block write B
// (K-major when TRANS_B = 0, MN-major when 1); with A_SMEM warpgroup w writes its A chunk at a_base + 8192 w.
template <int N, int TRANS_B, bool A_SMEM>
__device__ __forceinline__ void micro90_fill_operands(const unsigned short* a_g, const unsigned short* b_g,
                                                      uint32_t a_base, uint32_t b_base) {
  for (int i = threadIdx.x; i < N * 64; i += blockDim.x) {
    const int n = i / 64, k = i % 64;
    const uint32_t off = TRANS_B ? (n / 64) * 8192u + micro90_sw128(k, n % 64) : micro90_sw128(n, k);
    micro90_sts_u16(b_base + off, b_g[i]);
  }
  if constexpr (A_SMEM) {
    const int wg = threadIdx.x / 128;
    const unsigned short* a = a_g + (wg % 3) * 4096;
    const uint32_t a_wg = a_base + wg * 8192u;
    for (int i = threadIdx.x % 128; i < 64 * 64; i += 128) micro90_sts_u16(a_wg + micro90_sw128(i / 64, i % 64), a[i]);
  }
  fence_proxy_async_shared();  // these generic-proxy writes -> visible to wgmma's (async-proxy) reads
  __syncthreads();
}

// The rs A fragment of k16 step k for this thread: rows 16 warp + g (+8), columns 16 k + 2 t (+1) (+8): the
// m16n8k16 A layout of the warp's 16 rows (wgmma.cuh).
__device__ __forceinline__ void micro90_load_a_frag(const unsigned short* a, int k, uint32_t (&f)[4]) {
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int r = 16 * warp + g + 8 * (j & 1), c = 16 * k + 2 * t + 8 * (j >> 1);
    f[j] = static_cast<uint32_t>(a[r * 64 + c]) | (static_cast<uint32_t>(a[r * 64 + c + 1]) << 16);
  }
}

template <typename T, int N, bool RS, int TRANS_B>
__device__ __forceinline__ void micro90_wgmma(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t da, uint64_t db) {
  if constexpr (RS)
    Wgmma<N>::template rs<T, TRANS_B>(d, a, db, 1);
  else
    Wgmma<N>::template ss<T>(d, da, db, 1);
}

// This thread's fragment of a 64 x N accumulator -> dst[64][N] (row 16 warp + g + 8 (e / 2), column
// 8 j + 2 t + e % 2).
template <int N>
__device__ __forceinline__ void micro90_store_acc(float* dst, const float (&d)[N / 8][4]) {
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int j = 0; j < N / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) dst[(16 * warp + g + 8 * (e / 2)) * N + 8 * j + 2 * t + (e % 2)] = d[j][e];
}

// ================================================================================ 1. wgmma
// Most threads per block of the throughput kernel: 3 warpgroups while the accumulators (CH N / 2 registers per
// thread) and the rs A fragments (16) leave room in 168 registers (65536 / 384), else 2 (bench_micro_sm90.py:
// tput_max_threads mirrors this).
template <int N, bool RS, int CH>
__host__ __device__ constexpr int micro90_tput_threads() {
  return CH * N / 2 + (RS ? 16 : 0) <= 128 ? 384 : 256;
}

// Throughput: blockDim.x / 128 warpgroups (1 .. micro90_tput_threads / 128), each with CH independent 64 x N
// accumulators (CH N <= 256: at most 128 accumulator registers per thread). One loop trip = the 4 k16 steps of
// every chain (4 CH wgmma), one commit group; wait_group 1 keeps up to two groups (8 CH products) in flight.
// After `iters` trips every accumulator holds iters * A B. Dynamic shared memory: 1024 (alignment)
// + (RS ? 0 : 3 * 8192) + N * 128 bytes. out_full: block 0's accumulators [warpgroup][chain][64][N];
// out_fold[global thread]: the sum of the thread's accumulators. steps (clk) = 4 CH iters wgmma per warpgroup.
template <typename T, int N, bool RS, int TRANS_B, int CH>
__global__ void __launch_bounds__(micro90_tput_threads<N, RS, CH>(), 1)
    micro90_wgmma_tput_kernel(const unsigned short* a_g, const unsigned short* b_g, float* out_full, float* out_fold,
                              int64_t* clk, int64_t iters) {
  static_assert(N % 16 == 0 && N >= 16 && N <= 256 && CH >= 1 && CH * N <= 256, "wgmma shape / registers");
  static_assert(!TRANS_B || N % 64 == 0, "MN-major B: whole 64-column chunks");
  static_assert(RS || !TRANS_B, "the ss wrapper reads B K-major");
  extern __shared__ __align__(1024) unsigned char micro90_smem[];
  unsigned char* sm = micro90_align1024(micro90_smem);
  const uint32_t a_base = smem_addr(sm) + (threadIdx.x / 128) * 8192u;  // ss: this warpgroup's A chunk
  const uint32_t b_base = smem_addr(sm) + (RS ? 0u : 3u * 8192u);
  micro90_fill_operands<N, TRANS_B, !RS>(a_g, b_g, smem_addr(sm), b_base);

  const unsigned short* a_wg = a_g + ((threadIdx.x / 128) % 3) * 4096;
  uint32_t af[4][4];
  uint64_t da[4], db[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if constexpr (RS) {
      micro90_load_a_frag(a_wg, k, af[k]);
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) af[k][j] = 0u;
    }
    da[k] = smem_desc(a_base + 32u * k, 16, 1024);
    db[k] = TRANS_B ? smem_desc(b_base + 2048u * k, 8192, 1024) : smem_desc(b_base + 32u * k, 16, 1024);
  }
  float acc[CH][N / 8][4];
#pragma unroll
  for (int c = 0; c < CH; ++c)
#pragma unroll
    for (int j = 0; j < N / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[c][j][e] = 0.f;

  __syncthreads();
  const int64_t t0 = clock64();
  wgmma_fence();  // the zeroed accumulators and the A fragments were written by ordinary instructions
#pragma unroll 1
  for (int64_t i = 0; i < iters; ++i) {
#pragma unroll
    for (int k = 0; k < 4; ++k)
#pragma unroll
      for (int c = 0; c < CH; ++c) micro90_wgmma<T, N, RS, TRANS_B>(acc[c], af[k], da[k], db[k]);
    wgmma_commit();
    wgmma_wait<1>();
  }
  wgmma_wait<0>();
#pragma unroll
  for (int c = 0; c < CH; ++c) reg_fence(acc[c]);
  __syncthreads();
  const int64_t t1 = clock64();

  float sum = 0.f;
#pragma unroll
  for (int c = 0; c < CH; ++c)
#pragma unroll
    for (int j = 0; j < N / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) sum += acc[c][j][e];
  out_fold[blockIdx.x * blockDim.x + threadIdx.x] = sum;
  if (blockIdx.x == 0) {
#pragma unroll
    for (int c = 0; c < CH; ++c) micro90_store_acc<N>(out_full + ((threadIdx.x / 128) * CH + c) * 64 * N, acc[c]);
  }
  if (threadIdx.x == 0) micro90_record_clock(clk, t0, t1, iters * 4 * CH);
}

// Latency: one warpgroup (128 threads), one accumulator. A step = G dependent wgmma (k16 steps (G u + g) % 4),
// one commit, wait_group 0: the time until the product can be read. 4 steps per loop trip; after `iters` trips
// d = iters G A B. Shared memory as the throughput kernel (only warpgroup 0's A). out_full: [64][N];
// steps (clk) = 4 iters (divide by G for cycles per wgmma of a dependent chain).
template <typename T, int N, bool RS, int TRANS_B, int G>
__global__ void __launch_bounds__(128, 1)
    micro90_wgmma_latency_kernel(const unsigned short* a_g, const unsigned short* b_g, float* out_full, int64_t* clk,
                                 int64_t iters) {
  static_assert(G >= 1 && G <= 4, "1..4 dependent products per step");
  static_assert(RS || !TRANS_B, "the ss wrapper reads B K-major");
  extern __shared__ __align__(1024) unsigned char micro90_smem[];
  unsigned char* sm = micro90_align1024(micro90_smem);
  const uint32_t a_base = smem_addr(sm);
  const uint32_t b_base = smem_addr(sm) + (RS ? 0u : 3u * 8192u);
  micro90_fill_operands<N, TRANS_B, !RS>(a_g, b_g, a_base, b_base);
  uint32_t af[4][4];
  uint64_t da[4], db[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if constexpr (RS) {
      micro90_load_a_frag(a_g, k, af[k]);
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) af[k][j] = 0u;
    }
    da[k] = smem_desc(a_base + 32u * k, 16, 1024);
    db[k] = TRANS_B ? smem_desc(b_base + 2048u * k, 8192, 1024) : smem_desc(b_base + 32u * k, 16, 1024);
  }
  float acc[N / 8][4];
#pragma unroll
  for (int j = 0; j < N / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
  __syncthreads();
  const int64_t t0 = clock64();
  wgmma_fence();
#pragma unroll 1
  for (int64_t i = 0; i < iters; ++i) {
#pragma unroll
    for (int u = 0; u < 4; ++u) {
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const int k = (G * u + g) % 4;
        micro90_wgmma<T, N, RS, TRANS_B>(acc, af[k], da[k], db[k]);
      }
      wgmma_commit();
      wgmma_wait<0>();
    }
  }
  reg_fence(acc);
  const int64_t t1 = clock64();
  micro90_store_acc<N>(out_full, acc);
  if (threadIdx.x == 0) micro90_record_clock(clk, t0, t1, iters * 4);
}

// ================================================================================ 2. TMA loads
// map: a 4-d tensor map (128, S, H, B) of 16-bit elements, innermost first (the [batch, seqlen, heads, 128]
// K or V of the forward at head dim 128), boxes of 64 columns x ROWS rows, 128-byte swizzle. One tile = the
// ROWS x 128 block of one (head, batch): two boxes, ROWS * 256 bytes; tile t = (row block t % rblocks, head
// (t / rblocks) % heads, batch t / (rblocks heads)). Block b loads tiles b, b + grid, b + 2 grid, ... (mod
// n_tiles), `total` of them, through STAGES shared-memory stages: thread 0 issues, full[s] (count 1 + the
// tile's transaction bytes) completes when the tile has landed, all 128 threads then read one word each of it
// and arrive on empty[s] (count 128), and thread 0 refills stage s once empty[s] completes: the K/V pipeline of
// the forward, one warpgroup being both producer and consumer. Dynamic shared memory: 1024 + STAGES ROWS 256.
// out[global thread] = xor of the words read; steps (clk) = total tiles.
template <int STAGES, int ROWS>
__global__ void __launch_bounds__(128, 1)
    micro90_tma_load_kernel(const __grid_constant__ TmaDesc map, uint32_t* out, int64_t* clk, int64_t n_tiles,
                            int64_t total, int64_t rblocks, int64_t heads) {
  static_assert(STAGES >= 1 && ROWS >= 8 && ROWS <= 256 && ROWS % 8 == 0, "stages / box rows");
  constexpr uint32_t BOX_BYTES = ROWS * 128, STAGE_BYTES = 2 * BOX_BYTES;
  extern __shared__ __align__(1024) unsigned char micro90_smem[];
  unsigned char* sm = micro90_align1024(micro90_smem);
  __shared__ uint64_t full[STAGES], empty[STAGES];
  const int tid = threadIdx.x;
  if (tid == 0) {
    tma_prefetch_desc(&map);
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 128);
    }
    fence_barrier_init();
  }
  __syncthreads();
  int64_t next = blockIdx.x;  // the next tile to issue
  auto issue = [&](int s) {
    const int64_t rb = next % rblocks, bh = next / rblocks;
    const int row = static_cast<int>(rb * ROWS), head = static_cast<int>(bh % heads);
    const int batch = static_cast<int>(bh / heads);
    mbar_arrive_expect_tx(&full[s], STAGE_BYTES);
    tma_load_4d(sm + s * STAGE_BYTES, &map, &full[s], 0, row, head, batch);
    tma_load_4d(sm + s * STAGE_BYTES + BOX_BYTES, &map, &full[s], 64, row, head, batch);
    next += gridDim.x;
    if (next >= n_tiles) next -= n_tiles;
  };
  const int64_t t0 = clock64();
  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s)
      if (s < total) issue(s);
  }
  uint32_t sink = 0u;
#pragma unroll 1
  for (int64_t j = 0; j < total; ++j) {
    const int s = static_cast<int>(j % STAGES), ph = static_cast<int>((j / STAGES) & 1);
    mbar_wait(&full[s], ph);
    sink ^= *reinterpret_cast<const volatile uint32_t*>(sm + s * STAGE_BYTES + tid * (STAGE_BYTES / 128));
    mbar_arrive(&empty[s]);
    if (tid == 0 && j + STAGES < total) {
      mbar_wait(&empty[s], ph);  // every thread has read tile j: stage s is free
      issue(s);
    }
  }
  __syncthreads();
  const int64_t t1 = clock64();
  out[blockIdx.x * blockDim.x + tid] = sink;
  if (tid == 0) micro90_record_clock(clk, t0, t1, total);
}

// ================================================================================ 3. mbarrier
// Round trip between two sides of P threads (side 0: threads [0, P), side 1: threads [128, 128 + P); launch
// with 256 threads): side 0 arrives on bar[0] and waits for bar[1]'s phase, side 1 waits for bar[0]'s phase
// and arrives on bar[1]; each barrier expects P arrivals. One round trip = arrive -> the other side sees the
// phase -> its arrive -> this side sees it: the stage handoff of a producer / consumer pipeline (P = 1: one
// elected thread each; 32: a warp; 128: a warpgroup, as the consumers release a stage). 8 round trips per
// loop trip; steps (clk, thread 0) = 8 iters. out[thread] = the phases seen (a check that they alternated).
template <int P>
__global__ void __launch_bounds__(256, 1) micro90_mbar_pingpong_kernel(uint32_t* out, int64_t* clk, int64_t iters) {
  static_assert(P >= 1 && P <= 128, "threads per side");
  __shared__ uint64_t bar[2];
  if (threadIdx.x == 0) {
    mbar_init(&bar[0], P);
    mbar_init(&bar[1], P);
    fence_barrier_init();
  }
  __syncthreads();
  const int side = threadIdx.x / 128, idx = threadIdx.x % 128;
  if (idx >= P) return;
  uint32_t seen = 0u;
  const int64_t t0 = clock64();
#pragma unroll 1
  for (int64_t i = 0; i < iters; ++i) {
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      if (side == 0) {
        mbar_arrive(&bar[0]);
        mbar_wait(&bar[1], u & 1);
      } else {
        mbar_wait(&bar[0], u & 1);
        mbar_arrive(&bar[1]);
      }
      seen += 1u;
    }
  }
  const int64_t t1 = clock64();
  out[threadIdx.x] = seen;
  if (threadIdx.x == 0) micro90_record_clock(clk, t0, t1, iters * 8);
}

// One thread: arrive on a barrier of count 1 (which completes its phase) and wait for that phase: the cost of
// the mbarrier instructions themselves, without a second party. steps (clk) = 8 iters.
__global__ void __launch_bounds__(32, 1) micro90_mbar_self_kernel(uint32_t* out, int64_t* clk, int64_t iters) {
  __shared__ uint64_t bar;
  if (threadIdx.x != 0) return;
  mbar_init(&bar, 1);
  fence_barrier_init();
  const int64_t t0 = clock64();
#pragma unroll 1
  for (int64_t i = 0; i < iters; ++i) {
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      mbar_arrive(&bar);
      mbar_wait(&bar, u & 1);
    }
  }
  const int64_t t1 = clock64();
  out[0] = static_cast<uint32_t>(iters);
  micro90_record_clock(clk, t0, t1, iters * 8);
}

// ================================================================================ 4. bulk reduction
// The dQ writer of flash_bwd_sm90.cu, alone: block b copies its TILE_BYTES fp32 tile src[b] into shared memory
// (all threads; fenced for the async proxy), then one thread adds it into dst tile (b % n_dst), `iters` times, as
// cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 (one bulk group each), waiting after each until
// the source has been read (WAIT_DONE false: wait_group.read 0, the "atomic" strategy's handoff of the staging) or
// until the adds are done in global memory (true: wait_group 0, "ordered"'s wait before the next KV tile's turn).
// n_dst = 1: every block into one tile (a Q tile that all KV tiles see); 8; grid: distinct tiles. Dynamic shared
// memory: 1024 + TILE_BYTES. dst holds the sums (the host checks them); steps (clk) = iters.
template <int TILE_BYTES, bool WAIT_DONE>
__global__ void __launch_bounds__(128, 1)
    micro90_bulk_reduce_kernel(const float* src, float* dst, int64_t* clk, int64_t iters, int64_t n_dst) {
  static_assert(TILE_BYTES % (128 * 16) == 0, "the tile is a whole number of block-wide float4 copies");
  constexpr int FLOATS = TILE_BYTES / 4;
  extern __shared__ __align__(1024) unsigned char micro90_smem[];
  float* tile = reinterpret_cast<float*>(micro90_align1024(micro90_smem));
  const float* s = src + static_cast<int64_t>(blockIdx.x) * FLOATS;
#pragma unroll 1
  for (int i = 4 * threadIdx.x; i < FLOATS; i += 4 * 128)
    *reinterpret_cast<float4*>(tile + i) = *reinterpret_cast<const float4*>(s + i);
  fence_proxy_async_shared();  // the stores, before the bulk reductions (the async proxy) read them
  __syncthreads();
  if (threadIdx.x != 0) return;
  float* d = dst + (static_cast<int64_t>(blockIdx.x) % n_dst) * FLOATS;
  const uint32_t a = smem_addr(tile);
  const int64_t t0 = clock64();
#pragma unroll 1
  for (int64_t i = 0; i < iters; ++i) {
    bulk_reduce_add_f32(d, a, TILE_BYTES);
    bulk_commit_group();
    if (WAIT_DONE)
      bulk_wait_group<0>();
    else
      bulk_wait_group_read<0>();
  }
  bulk_wait_group<0>();  // (the last adds done before the block ends)
  const int64_t t1 = clock64();
  micro90_record_clock(clk, t0, t1, iters);
}

}  // namespace cuflash
