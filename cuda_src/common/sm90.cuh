// cuda_src/common/sm90.cuh -- the Hopper primitives of the sm_90a kernels: mbarriers, the tensor memory
// accelerator (TMA: cp.async.bulk.tensor), shared-memory matrix descriptors and the fences of wgmma, named
// barriers and setmaxnreg. One PTX instruction per wrapper, as in ptx.cuh; sections of the PTX ISA 8.x.
//
// Shared-memory tiles. Every operand tile is stored as TMA writes it with CU_TENSOR_MAP_SWIZZLE_128B: the tile's
// columns in chunks of 64 16-bit elements (128 bytes, one box of the tensor map), each chunk `rows` rows of
// 128 bytes, 1024-byte aligned, the 16-byte pieces of row r permuted by r % 8 (piece p lands at p ^ (r % 8)).
// That is the layout wgmma reads with the 128-byte swizzle mode of a matrix descriptor:
//   K-major operand (rows = M or N, columns = K: Q, K):   SBO = 1024 (8 rows), LBO unused; the k16 step k of a
//                                                         chunk starts 32 k bytes into it
//   MN-major operand (rows = K, columns = N: V):          SBO = 1024 (8 rows of K), LBO = rows * 128 (the next
//                                                         64-column chunk); the k16 step k starts at k * 2048
#pragma once
#include "ptx.cuh"

namespace cuflash {

// The 128-byte CUtensorMap the host encodes (cuTensorMapEncodeTiled) and passes by value in a
// __grid_constant__ parameter: TMA instructions take its generic address.
struct alignas(64) TmaDesc {
  uint64_t opaque[16];
};

// ------------------------------------------------------------------------------------------ mbarrier (9.7.13.15)
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count));
}
// Makes the initialised barriers visible to the async proxy (TMA) and the other threads (then __syncthreads).
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// Arrive (count 1) and expect `bytes` more transaction bytes in the current phase (the TMA loads complete them).
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
// Wait until the phase of parity `phase` has completed (a fresh barrier: parity 1 counts as completed).
__device__ __forceinline__ void mbar_wait(uint64_t* bar, int phase) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(phase)
      : "memory");
}

// ------------------------------------------------------------------------------- TMA (9.7.9.27 cp.async.bulk.tensor)
// One box of a 4-d tensor map (coordinates innermost first, in elements) -> shared memory at dst, completing
// `box bytes` of transactions on bar. Out-of-range elements are written as zeros and still count.
__device__ __forceinline__ void tma_load_4d(void* dst, const TmaDesc* map, uint64_t* bar, int c0, int c1, int c2,
                                            int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, "
      "%6}], [%2];\n" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}
// The reverse: a box of shared memory at src (laid out as tma_load_4d writes it, the map's swizzle) -> the box of a
// 4-d tensor map at these coordinates, through this thread's bulk async-groups (bulk_commit_group, then
// bulk_wait_group_read before src is reused or the block exits). Out-of-range elements are not written; generic
// writes to src must be fenced first (fence_proxy_async_shared).
__device__ __forceinline__ void tma_store_4d(const TmaDesc* map, const void* src, int c0, int c1, int c2, int c3) {
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(smem_addr(src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
               : "memory");
}

// A warpgroup's fp32 accumulator fragments (wgmma's C layout: this thread's rows r0 and r0 + 8, columns 8 f + 2 tq
// and + 1 of each n8 block f) -> 16-bit values in a tile of ROWS rows in the layout above (64-column chunk c at
// + c * ROWS * 128), for tma_store_4d: the blocks of columns below D (a quad's 4-byte stores of one row fill one
// 16-byte piece; the 8 rows of a store land on 8 different pieces, so no bank is hit twice).
template <typename T, int D, int ROWS, int NF>
__device__ __forceinline__ void stage_frags(unsigned char* tile, const float (&acc)[NF][4], int r0, int tq) {
#pragma unroll
  for (int f = 0; f < NF; ++f) {
    if (f * 8 >= D) continue;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = r0 + 8 * h;
      *reinterpret_cast<uint32_t*>(tile + (f / 8) * ROWS * 128 + r * 128 + (((f % 8) ^ (r % 8)) * 16) + tq * 4) =
          pack2<T>(acc[f][2 * h], acc[f][2 * h + 1]);
    }
  }
}

// 9.7.9.25.4.1 cp.async.bulk: `bytes` contiguous bytes global -> shared memory at dst (both 16-byte aligned, bytes
// a multiple of 16), completing that many transaction bytes on bar.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   smem_addr(dst)),
               "l"(reinterpret_cast<uint64_t>(src)), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
}
__device__ __forceinline__ void tma_prefetch_desc(const TmaDesc* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// ------------------------------------------------------------------------ wgmma descriptors and fences (9.7.15)
// Matrix descriptor of a 128-byte-swizzled tile at shared address `addr` (see the layout above).
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)(lbo_bytes >> 4) << 16) |
         ((uint64_t)(sbo_bytes >> 4) << 32) | (1ull << 62);
}
// Orders this thread's register accesses before the wgmma that follow (the accumulators, the A fragments).
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Until at most N committed groups of this warpgroup are still running.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accesses of these registers across an asynchronous wgmma (no instruction).
template <int R, int C>
__device__ __forceinline__ void reg_fence(float (&x)[R][C]) {
#pragma unroll
  for (int i = 0; i < R; ++i)
#pragma unroll
    for (int j = 0; j < C; ++j) asm volatile("" : "+f"(x[i][j])::"memory");
}
template <int R, int C>
__device__ __forceinline__ void reg_fence(uint32_t (&x)[R][C]) {
#pragma unroll
  for (int i = 0; i < R; ++i)
#pragma unroll
    for (int j = 0; j < C; ++j) asm volatile("" : "+r"(x[i][j])::"memory");
}

// --------------------------------------------------------- cross-CTA counters and the async proxy's global writes
// Loads with acquire / adds with release semantics at GPU scope (9.7.13.4 memory consistency): a counter one CTA
// bumps after its writes, another waits on before its own.
__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void red_release_gpu_add(int* p, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
// Orders this thread's generic-proxy and async-proxy (bulk copy, TMA) accesses of global memory.
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
}
// Until at most N bulk async-groups of this thread are pending, their writes included (the .read form only waits
// for their shared-memory sources: common/ptx.cuh).
template <int N>
__device__ __forceinline__ void bulk_wait_group() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}

// ----------------------------------------------------------------- named barriers (9.7.13.1) and setmaxnreg (9.7.19.5)
// Barrier `id` (1..15; 0 is __syncthreads) of `threads` threads: wait for it / arrive without waiting.
__device__ __forceinline__ void named_bar_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_bar_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// The warpgroup's per-thread register count from here on (every thread of the warpgroup executes it).
template <int REGS>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGS));
}
template <int REGS>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGS));
}

}  // namespace cuflash
