// cuda_src/common/ptx.cuh -- the device primitives every cuflash kernel is built from.
//
// Each wrapper is one PTX instruction; the comment names its PTX ISA section and, for the matrix
// instructions, the fragment layout as (lane, reg) -> (row, col). Notation used throughout:
//   lane = threadIdx.x % 32,  g = lane / 4 (the "group", 0..7),  t = lane % 4 (thread in group, 0..3).
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#ifndef INFINITY  // NVRTC has no <math.h>
#define INFINITY __int_as_float(0x7f800000)
#endif

namespace cuflash {

// NVRTC ships no <stdint.h>; these are the only fixed-width types the kernels use.
using int64_t = long long;
using uint32_t = unsigned int;
using uint64_t = unsigned long long;


__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---------------------------------------------------------------------------------------------- cp.async
// PTX ISA 9.7.9.25.3.1 cp.async: 16-byte global -> shared copy that bypasses registers (.cg: L2 only).
// src_size = 0 reads nothing and zero-fills the 16 destination bytes: out-of-range rows of a tile become
// zeros, which the kernels rely on (a zero V row times a zero probability stays 0, never NaN).
__device__ __forceinline__ void cp_async_16(uint32_t dst_smem, const void* src_gmem, bool valid) {
  const int src_size = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst_smem), "l"(src_gmem), "r"(src_size));
}
// The same copy when the source is known to be in range (no src-size operand).
__device__ __forceinline__ void cp_async_16_full(uint32_t dst_smem, const void* src_gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst_smem), "l"(src_gmem));
}
// A 16-byte shared store at a shared-window address (the synchronous copies of rows that are not 16-byte units into
// a ring addressed as cp.async's destinations).
__device__ __forceinline__ void st_shared_16(uint32_t dst_smem, const uint4& x) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst_smem), "r"(x.x), "r"(x.y), "r"(x.z), "r"(x.w)
               : "memory");
}
// blockIdx read through volatile asm: the compiler can neither merge it with an earlier read nor hoist it,
// so a kernel can re-derive its block coordinates after a long loop instead of keeping them live across it.
__device__ __forceinline__ uint3 block_idx_reread() {
  uint3 b;
  asm volatile("mov.u32 %0, %%ctaid.x;\n" : "=r"(b.x));
  asm volatile("mov.u32 %0, %%ctaid.y;\n" : "=r"(b.y));
  asm volatile("mov.u32 %0, %%ctaid.z;\n" : "=r"(b.z));
  return b;
}

// The 16-bit input type of T: fp16 (__half) or bf16 (__nv_bfloat16).
template <typename T>
constexpr bool is_bf16_v = false;
template <>
constexpr bool is_bf16_v<__nv_bfloat16> = true;

// A float scalar of a parameter block (attn/params.cuh) in an 8-byte slot: every field of a block is 8 bytes wide,
// and the host packs the float32 value and 4 zero bytes (cuflash/_params.py, kind FLOAT). Kernels read a float
// from the constant bank. (These fields were doubles: each (float) conversion in device code is F2F.F32.F64 and,
// under -ftz, an FP64 compare, DSETP, which the compiler may place in a main loop. In the Hopper backward's score-
// modifier kernel it sat right after the S^T and dP^T wgmma issue, and that DSETP held 10% of the kernel's warp
// samples, stalled on the math pipe: bench/NOTES.md, "Score modifiers".)
struct alignas(8) f32_slot {
  float v;
  __device__ __forceinline__ operator float() const { return v; }
};

// A float parameter where a kernel starts, in one of these forms (HOLD_*). ptxas takes a float parameter from the
// constant bank at each use (HOLD_NONE, every kernel but those below); a kernel that sits at 255 registers allocates
// differently when the value is an instruction's result instead -- as it was when the blocks held doubles and the
// (float) conversion gave one. Configurations that spilled 4-44 B once the slots were float32 take the form that
// fits them again, named at each kernel (checked, as any register change, by the compile report of every
// configuration under both NVRTCs: CI):
//   HOLD_FADD     x + 0 (x itself for every x but -0, which becomes +0), a value ptxas may recompute where used
//   HOLD_THREAD   x OR-ed with threadIdx.x >> 16: zero (a block has at most 1024 threads), not known to be, so the
//                 value is computed once and kept in a register
//   HOLD_UNIFORM  x OR-ed with blockIdx.x >> 31 (zero: grid dimensions are below 2^31): kept in a uniform register
// (A volatile load of the slot instead, one ULDC under NVRTC 13.5, is a generic load of the parameter's address under
// 13.0 (LD.E.STRONG.SYS): the kernels built so raised illegal-address errors on the GPU.)
enum : int { HOLD_NONE = 0, HOLD_FADD = 1, HOLD_THREAD = 2, HOLD_UNIFORM = 3 };
template <int FORM>
__device__ __forceinline__ float held(float x) {
  if constexpr (FORM == HOLD_FADD) return __fadd_rn(x, 0.f);
  if constexpr (FORM == HOLD_THREAD) return __int_as_float(__float_as_int(x) | (int)(threadIdx.x >> 16));
  if constexpr (FORM == HOLD_UNIFORM) return __int_as_float(__float_as_int(x) | (int)(blockIdx.x >> 31));
  return x;
}

// x through a volatile move: the compiler cannot keep values it derives from x alive through a loop in place of
// deriving them again after it (the same trick as block_idx_reread, for any value).
__device__ __forceinline__ int opaque(int x) {
  asm volatile("mov.b32 %0, %0;" : "+r"(x));
  return x;
}
__device__ __forceinline__ float opaque(float x) {
  asm volatile("mov.b32 %0, %0;" : "+f"(x));
  return x;
}

// 9.7.9.25.3.2/3: close the current group of cp.async; wait until at most N groups are still in flight.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// sm_90 bulk (TMA) reduction of shared memory into global memory: dst[i] += src[i] for bytes / 4 floats (both
// 16-byte aligned, bytes a multiple of 16), completed through bulk async-groups. Generic-proxy writes to the
// source must be fenced (fence_proxy_async_shared) before the issuing thread starts the reduction.
__device__ __forceinline__ void fence_proxy_async_shared() {
#if __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, uint32_t src, int bytes) {
#if __CUDA_ARCH__ >= 900
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst), "r"(src),
               "r"(bytes)
               : "memory");
#endif
}
// The same bulk engine storing instead of adding: dst[i] = src[i] (a deterministic write-once destination).
__device__ __forceinline__ void bulk_store_f32(float* dst, uint32_t src, int bytes) {
#if __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst), "r"(src), "r"(bytes)
               : "memory");
#endif
}
__device__ __forceinline__ void bulk_commit_group() {
#if __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#endif
}
template <int N>  // until at most N bulk groups of this thread are still reading their shared-memory sources
__device__ __forceinline__ void bulk_wait_group_read() {
#if __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
#endif
}
// Programmatic Dependent Launch (PTX ISA griddepcontrol, sm_90). A kernel launched with the programmatic
// stream serialization attribute (cuflash/_launch.py) may start while the kernel before it in the stream still
// runs: `grid_dependency_wait` blocks until that kernel has completed and its writes are visible (it returns at
// once when there is no programmatic dependency: a plain launch), so a secondary kernel may touch only memory its
// primary does not write before it. `grid_launch_dependents` lets the dependent kernel's blocks be scheduled as
// soon as every block of this grid has issued it or exited (no effect without a dependent launched that way).
// Compiled to nothing below sm_90 (the sm_80 code is that of a kernel without them) and with CUFLASH_NO_GRIDDEP
// (the tests' reference build).
__device__ __forceinline__ void grid_dependency_wait() {
#if __CUDA_ARCH__ >= 900 && !defined(CUFLASH_NO_GRIDDEP)
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void grid_launch_dependents() {
#if __CUDA_ARCH__ >= 900 && !defined(CUFLASH_NO_GRIDDEP)
  asm volatile("griddepcontrol.launch_dependents;\n" ::);
#endif
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// ---------------------------------------------------------------------------------------------- ldmatrix
// PTX ISA 9.7.14.5.15 ldmatrix.m8n8.x4.b16: four 8x8 b16 matrices. Lanes 8j..8j+7 give the shared
// addresses of the 8 rows (16 bytes each) of matrix j. Result: r[j] of lane holds matrix j's
// (row g, cols 2t, 2t+1). With .trans, r[j] holds (rows 2t, 2t+1 ; col g) of matrix j instead.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
// PTX ISA 9.7.14.5.16 stmatrix.m8n8.x4.trans.b16 (sm_90): the inverse of ldmatrix_x4_trans. r[j] of a lane holds
// matrix j's (row g, cols 2t, 2t+1); lanes 8j..8j+7 give the addresses of the 8 stored rows of matrix j, and stored
// row c is the matrix's column c (16 bytes: its rows 0..7).
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r[0]),
               "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}

// -------------------------------------------------------------------------------------------- mma.sync
// PTX ISA 9.7.14.5.14 mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32:  D = A B + D.
//   A 16x16 (row-major), 4 x b32 regs:  a0 (g, 2t..2t+1)  a1 (g+8, 2t..)  a2 (g, 2t+8..)  a3 (g+8, 2t+8..)
//   B 16x8 (col-major),  2 x b32 regs:  b0 (k 2t..2t+1, n g)  b1 (k 2t+8..2t+9, n g)
//   C/D 16x8 fp32,       4 regs:        d0,d1 (g, 2t..2t+1)   d2,d3 (g+8, 2t..2t+1)
// Note the C layout equals the A layout of one n8 half: the S accumulator of two adjacent n8 tiles,
// converted to 16-bit pairs, IS the A operand of the next product (P V) -- no shared-memory round trip.
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);

template <>
__device__ __forceinline__ void mma_m16n8k16<__half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                     uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma_m16n8k16<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                            uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ------------------------------------------------------------------------------------------ conversion
// Two fp32 -> one b32 register holding a pair of 16-bit values (low half = first), round to nearest.
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}
template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t x);
template <>
__device__ __forceinline__ float2 unpack2<__half>(uint32_t x) {
  return __half22float2(*reinterpret_cast<__half2*>(&x));
}
template <>
__device__ __forceinline__ float2 unpack2<__nv_bfloat16>(uint32_t x) {
  // bf16 is the top half of an fp32: one shift and one mask (IMAD.U32 / LOP3), no conversion instruction
  return make_float2(__uint_as_float(x << 16), __uint_as_float(x & 0xffff0000u));
}

// ------------------------------------------------------------------------------------------- exp2
// PTX ISA 9.7.4.x ex2.approx.ftz.f32: one MUFU.EX2 (2^x, max rel. error 2^-22, ex2(-inf) = +0).
// The softmax in every kernel is written in base 2 with the scale folded on the host
// (scale_log2 = softmax_scale * log2(e)), so exp(scale * s - m) costs one FFMA + one MUFU.EX2.
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// PTX ISA tanh.approx.f32 (sm_75+): one MUFU.TANH, max relative error 2^-10.987 (the score soft-cap,
// attn/mask.cuh; the products that feed it are rounded to 16 bits on the way in, so the softmax sees inputs of
// about that precision either way).
__device__ __forceinline__ float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
// lg2.approx.ftz.f32: one MUFU.LG2 (log2(x), max abs. error 2^-22 on [0.5, 2], rel. 2^-22 elsewhere; lg2(0) = -inf).
__device__ __forceinline__ float log2_approx(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Max / sum across the 4 lanes of a quad (the lanes that hold one accumulator row): 2 SHFL.BFLY each.
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

}  // namespace cuflash
