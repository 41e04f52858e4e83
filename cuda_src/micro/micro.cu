// cuda_src/micro/micro.cu -- instruction-level microbenchmarks, driven by bench/bench_micro.py.
//
// Why the attention kernels look the way they do, measured one instruction at a time:
//   mma.sync m16n8k16 (HMMA), ldmatrix (LDSM) and shared-memory bank conflicts, cp.async (LDGSTS) vs plain
//   loads, ex2.approx vs exp2f / __expf / expf, the folded softmax scale (one FFMA), global atomics for the
//   dQ accumulation (RED / ATOM, scalar and vector), warp shuffles (SHFL.BFLY).
//
// Every kernel is a template so that one NVRTC module holds only the instantiation it was asked for.
// Conventions shared by all kernels:
//   * operands come from a hash of the thread index (random, non-zero, never denormal) and every result
//     is stored, so nothing can be constant-folded or removed;
//   * clk[block][4] = {clock64 at start, clock64 at end, %smid, steps}: "steps" is the number of measured
//     instructions (or calls) ONE thread/warp executed; the host turns it into work per clock per SM by
//     grouping blocks by SM (clock64 is a per-SM counter, so only clocks of one SM are compared);
//   * kernel parameters are plain pointers / int64 / float, each in its own 8-byte launch slot.
#include "../common/ptx.cuh"

namespace cuflash {

// ------------------------------------------------------------------------------------------ helpers
// lowbias32 integer hash (C. Wellons): decorrelates neighbouring thread indices.
__device__ __forceinline__ uint32_t micro_hash(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}
// Uniform in +-[0.5, 1): never zero, never denormal.
__device__ __forceinline__ float micro_rand(uint32_t h) {
  const float mag = 0.5f + static_cast<float>(h >> 8) * 0x1p-25f;
  return (h & 1u) ? -mag : mag;
}
__device__ __forceinline__ uint32_t micro_smid() {
  uint32_t id;
  asm volatile("mov.u32 %0, %%smid;\n" : "=r"(id));
  return id;
}
__device__ __forceinline__ void micro_record_clock(int64_t* clk, int64_t t0, int64_t t1, int64_t steps) {
  if (threadIdx.x == 0) {
    int64_t* c = clk + 4 * static_cast<int64_t>(blockIdx.x);
    c[0] = t0;
    c[1] = t1;
    c[2] = micro_smid();
    c[3] = steps;
  }
}
// Shared-memory accesses as volatile asm with a memory clobber: the compiler may neither drop them nor move
// them across the cp.async / st.shared that produce the data (PTX ISA, Data Movement: ld, st).
__device__ __forceinline__ uint32_t micro_lds_u32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ void micro_sts_v4(uint32_t addr, uint4 v) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// ================================================================================ 1. dependent chains
// An "op" is a per-thread object with a State and step(State&) that performs ONE measured instruction (or
// library call) whose result is the next step's input:
//   latency    = micro_chain_kernel<Op, 1> on one warp:       clock64 cycles / steps
//   throughput = micro_chain_kernel<Op, ILP> on many warps:   ILP independent chains per thread
// UNROLL x ILP = 64 steps per loop trip, so the loop counter and branch are < 5% of the instructions.

// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32 (ptx.cuh; PTX ISA, Warp Level Matrix
// Multiply-Accumulate: mma): D = A B + D, D chains.
// 2 * 16 * 8 * 16 = 4096 FLOP per warp-step. A and B are fixed per thread (scale p0 keeps D finite: once
// |D| is large the constant increment rounds away instead of overflowing).
template <typename T>
struct MicroMmaF32 {
  struct State {
    float d[4];
  };
  uint32_t a[4], b0, b1;
  __device__ MicroMmaF32(uint32_t seed, float p0, float) {
#pragma unroll
    for (int i = 0; i < 4; ++i)
      a[i] = pack2<T>(p0 * micro_rand(micro_hash(seed + 2 * i)), p0 * micro_rand(micro_hash(seed + 2 * i + 1)));
    b0 = pack2<T>(p0 * micro_rand(micro_hash(seed + 8)), p0 * micro_rand(micro_hash(seed + 9)));
    b1 = pack2<T>(p0 * micro_rand(micro_hash(seed + 10)), p0 * micro_rand(micro_hash(seed + 11)));
  }
  __device__ void init(State& s, uint32_t seed) const {
#pragma unroll
    for (int e = 0; e < 4; ++e) s.d[e] = micro_rand(micro_hash(seed + e));
  }
  __device__ void step(State& s) const { mma_m16n8k16<T>(s.d, a, b0, b1); }
  __device__ float fold(const State& s) const { return s.d[0] + s.d[1] + s.d[2] + s.d[3]; }
};

// mma.sync.aligned.m16n8k16.row.col.f16.f16.f16.f16 (PTX ISA, Warp Level MMA: mma): fp16 accumulate, C/D 2 x b32
// registers of half2: d0 = (g, 2t..2t+1), d1 = (g+8, 2t..2t+1). Not used by the attention kernels (the
// softmax statistics need fp32); measured to show what fp32 accumulation costs.
struct MicroMmaF16Acc {
  struct State {
    uint32_t d[2];
  };
  uint32_t a[4], b0, b1;
  __device__ MicroMmaF16Acc(uint32_t seed, float p0, float) {
#pragma unroll
    for (int i = 0; i < 4; ++i)
      a[i] = pack2<__half>(p0 * micro_rand(micro_hash(seed + 2 * i)), p0 * micro_rand(micro_hash(seed + 2 * i + 1)));
    b0 = pack2<__half>(p0 * micro_rand(micro_hash(seed + 8)), p0 * micro_rand(micro_hash(seed + 9)));
    b1 = pack2<__half>(p0 * micro_rand(micro_hash(seed + 10)), p0 * micro_rand(micro_hash(seed + 11)));
  }
  __device__ void init(State& s, uint32_t seed) const {
    s.d[0] = pack2<__half>(micro_rand(micro_hash(seed)), micro_rand(micro_hash(seed + 1)));
    s.d[1] = pack2<__half>(micro_rand(micro_hash(seed + 2)), micro_rand(micro_hash(seed + 3)));
  }
  __device__ void step(State& s) const {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f16.f16.f16.f16 {%0, %1}, {%2, %3, %4, %5}, {%6, %7}, {%0, %1};\n"
        : "+r"(s.d[0]), "+r"(s.d[1])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  __device__ float fold(const State& s) const {
    const float2 x = unpack2<__half>(s.d[0]), y = unpack2<__half>(s.d[1]);
    return x.x + x.y + y.x + y.y;
  }
};

// The four ways to write the softmax exponential; apply() is the function under test.
//   Ex2Approx: ex2.approx.ftz.f32 (ptx.cuh exp2_approx; PTX ISA, Floating Point: ex2): one MUFU.EX2.
//   Exp2f:     CUDA exp2f (2 ulp); with -ftz=true (CuPy's default) the same single MUFU.EX2.
//   ExpFast:   CUDA __expf(y) = ex2.approx(y * log2 e): FMUL + MUFU.EX2; error grows with |y|.
//   Expf:      CUDA expf (2 ulp): range reduction in FFMAs, then MUFU.EX2 and a scale.
struct MicroEx2Approx {
  static __device__ __forceinline__ float apply(float x) { return exp2_approx(x); }
};
struct MicroExp2f {
  static __device__ __forceinline__ float apply(float x) { return exp2f(x); }
};
struct MicroExpFast {
  static __device__ __forceinline__ float apply(float x) { return __expf(x); }
};
struct MicroExpf {
  static __device__ __forceinline__ float apply(float x) { return expf(x); }
};
// NEG = true:  x = apply(-x): stays in (0, 1] (fixed point of 2^-x = x: 0.64, of e^-x = x: 0.57), but on
//              sm_90 the negation is one more instruction (FADD; MUFU has no negated source): throughput runs.
// NEG = false: x = apply(x): nothing but the function in the chain, but x reaches +inf after 5 steps; these
//              pipelines have data-independent latency, so the latency run (and the SASS count) use this.
template <class F, bool NEG>
struct MicroExp {
  struct State {
    float x;
  };
  __device__ MicroExp(uint32_t, float, float) {}
  __device__ void init(State& s, uint32_t seed) const { s.x = fabsf(micro_rand(micro_hash(seed))); }
  __device__ void step(State& s) const { s.x = F::apply(NEG ? -s.x : s.x); }
  __device__ float fold(const State& s) const { return s.x; }
};

// tanh.approx.f32 (ptx.cuh tanh_approx; PTX ISA, Floating Point: tanh): one MUFU.TANH, the soft-cap's function.
// Chain: x = tanh(x), which shrinks toward 0 slowly (x - x^3 / 3) and never reaches a denormal in these lengths.
struct MicroTanh {
  struct State {
    float x;
  };
  __device__ MicroTanh(uint32_t, float, float) {}
  __device__ void init(State& s, uint32_t seed) const { s.x = 0.5f + fabsf(micro_rand(micro_hash(seed))); }
  __device__ void step(State& s) const { s.x = tanh_approx(s.x); }
  __device__ float fold(const State& s) const { return s.x; }
};
// One soft-capped score as the kernels' softmax computes it: tanh, the exponent's FFMA, ex2 (two MUFU results).
// p0 = softcap * scale_log2, p1 = the row max times it. Chain: x = 2^(p0 tanh(x) - p1), in (0, 1] for p1 >= p0.
struct MicroCapExp {
  struct State {
    float x;
  };
  float a, m;
  __device__ MicroCapExp(uint32_t, float p0, float p1) : a(p0), m(p1) {}
  __device__ void init(State& s, uint32_t seed) const { s.x = micro_rand(micro_hash(seed)); }
  __device__ void step(State& s) const { s.x = exp2_approx(__fmaf_rn(tanh_approx(s.x), a, -m)); }
  __device__ float fold(const State& s) const { return s.x; }
};

// Softmax argument, unfolded: (s - m) * scale = FADD + FMUL (not contractible: the subtraction comes first).
// p0 = scale_log2, p1 = m. Chain: x = (x - m) * scale, a contraction to a fixed point: stays finite.
struct MicroScaleUnfolded {
  struct State {
    float x;
  };
  float scale, m;
  __device__ MicroScaleUnfolded(uint32_t, float p0, float p1) : scale(p0), m(p1) {}
  __device__ void init(State& s, uint32_t seed) const { s.x = micro_rand(micro_hash(seed)); }
  __device__ void step(State& s) const { s.x = __fmul_rn(__fsub_rn(s.x, m), scale); }
  __device__ float fold(const State& s) const { return s.x; }
};
// Folded: s * scale - m * scale with m * scale precomputed once per row (here: on the host, p1): one FFMA.
struct MicroScaleFolded {
  struct State {
    float x;
  };
  float scale, m_scaled;
  __device__ MicroScaleFolded(uint32_t, float p0, float p1) : scale(p0), m_scaled(p1) {}
  __device__ void init(State& s, uint32_t seed) const { s.x = micro_rand(micro_hash(seed)); }
  __device__ void step(State& s) const { s.x = __fmaf_rn(s.x, scale, -m_scaled); }
  __device__ float fold(const State& s) const { return s.x; }
};

// shfl.sync.bfly.b32 (PTX ISA, Data Movement: shfl.sync): one SHFL.BFLY, lane ^ 1 (volatile: never folded).
struct MicroShflBfly {
  struct State {
    uint32_t x;
  };
  __device__ MicroShflBfly(uint32_t, float, float) {}
  __device__ void init(State& s, uint32_t seed) const { s.x = micro_hash(seed) | 1u; }
  __device__ void step(State& s) const {
    asm volatile("shfl.sync.bfly.b32 %0, %1, 1, 0x1f, 0xffffffff;\n" : "=r"(s.x) : "r"(s.x));
  }
  __device__ float fold(const State& s) const { return __uint_as_float(s.x & 0x3fffffffu); }
};
// The row max of the attention kernels (ptx.cuh quad_max): 2 x (SHFL.BFLY + FMNMX) per call.
struct MicroQuadMax {
  struct State {
    float x;
  };
  __device__ MicroQuadMax(uint32_t, float, float) {}
  __device__ void init(State& s, uint32_t seed) const { s.x = micro_rand(micro_hash(seed)); }
  __device__ void step(State& s) const { s.x = quad_max(s.x); }
  __device__ float fold(const State& s) const { return s.x; }
};

// clk as described at the top; out[global thread] = fold of the chains. p0, p1 are op parameters.
template <class Op, int ILP>
__global__ void __launch_bounds__(128, 8)
    micro_chain_kernel(float* out, int64_t* clk, int64_t iters, float p0, float p1) {
  static_assert(ILP >= 1 && 64 % ILP == 0, "ILP must divide 64");
  constexpr int UNROLL = 64 / ILP;
  const uint32_t gtid = blockIdx.x * blockDim.x + threadIdx.x;
  const Op op(micro_hash(gtid * 0x9e3779b9u + 1u), p0, p1);
  typename Op::State s[ILP];
#pragma unroll
  for (int k = 0; k < ILP; ++k) op.init(s[k], micro_hash(gtid * ILP + k + 0x1234567u) * 16u);
  __syncthreads();
  const int64_t t0 = clock64();
#pragma unroll 1
  for (int64_t i = 0; i < iters; ++i) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u)
#pragma unroll
      for (int k = 0; k < ILP; ++k) op.step(s[k]);
  }
  __syncthreads();
  const int64_t t1 = clock64();
  float acc = 0.f;
#pragma unroll
  for (int k = 0; k < ILP; ++k) acc += op.fold(s[k]);
  out[gtid] = acc;
  micro_record_clock(clk, t0, t1, iters * UNROLL * ILP);
}

// Straight-line chain of N steps, never launched: the SASS of <Op, 2N> minus <Op, N>, divided by N, is the
// instruction count (and opcode mix) of one step.
template <class Op, int N>
__global__ void micro_count_kernel(float* out, float p0, float p1) {
  const uint32_t gtid = blockIdx.x * blockDim.x + threadIdx.x;
  const Op op(micro_hash(gtid), p0, p1);
  typename Op::State s;
  op.init(s, micro_hash(gtid + 777u));
#pragma unroll
  for (int n = 0; n < N; ++n) op.step(s);
  out[gtid] = op.fold(s);
}

// out[i] = F::apply(in[i]) for the host's float64 error check; in and out are [n] fp32.
template <class F>
__global__ void micro_exp_eval_kernel(const float* in, float* out, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = F::apply(in[i]);
}

// ================================================================================ 2. ldmatrix
// ldmatrix.sync.aligned.m8n8.{x1,x2,x4}{,.trans}.shared.b16 (PTX ISA, Warp Level MMA: ldmatrix): X 8x8 b16 matrices;
// lanes 8j..8j+7 give the row addresses of matrix j (x1: lanes 0-7 only, x2: lanes 0-15).
// r[j] of lane (g = lane/4, t = lane%4) = matrix j (row g, cols 2t, 2t+1), or with .trans (rows 2t, 2t+1; col g).
template <int X, bool TRANS>
__device__ __forceinline__ void micro_ldsm(uint32_t (&r)[X], uint32_t addr) {
  static_assert(X == 1 || X == 2 || X == 4, "ldmatrix loads 1, 2 or 4 matrices");
  if constexpr (X == 4 && !TRANS) {
    ldmatrix_x4(r, addr);
  } else if constexpr (X == 4) {
    ldmatrix_x4_trans(r, addr);
  } else if constexpr (X == 2 && !TRANS) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
  } else if constexpr (X == 2) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(addr));
  } else if constexpr (!TRANS) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(addr));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(addr));
  }
}

// The 16-bit value stored at (row, col) of matrix 0 (rows 0..7 of the chain tile) such that every lane's
// r[0] IS the shared address it must give next: lane l's row address is A_l = base + l * row_bytes.
//   plain:  lane l gets (row l/4, cols 2(l%4), 2(l%4)+1)      -> (row, col) holds half (col & 1) of A_{4 row + col/2}
//   .trans: lane l gets (rows 2(l%4), 2(l%4)+1 ; col l/4)     -> (row, col) holds half (row & 1) of A_{4 col + row/2}
// (half 0 = low 16 bits, at the lower address). Mirrored by bench_micro.ldsm_chain_tile for the CPU test.
template <bool TRANS>
__device__ __forceinline__ unsigned short micro_ldsm_chain_half(int row, int col, uint32_t base, uint32_t row_bytes) {
  const int l = TRANS ? 4 * col + row / 2 : 4 * row + col / 2;
  const int hi = TRANS ? (row & 1) : (col & 1);
  const uint32_t a = base + static_cast<uint32_t>(l) * row_bytes;
  return static_cast<unsigned short>(hi ? (a >> 16) : (a & 0xffffu));
}

// Latency: one warp, ldmatrix -> ldmatrix pointer chase with no other instruction in the chain. The tile is
// [32 rows][136 halves] (a padded row); lane l's row address A_l = base + l * 272. Before timing, one load
// checks the fixed point on every lane; if it does not hold the kernel stores a marker and times nothing
// (a wrong address would be a fatal shared-memory fault). Launch with exactly 32 threads; out is [64]:
// out[lane] = final address ^ A_lane (0 = the chain held), out[32 + lane] = the other result registers.
template <int X, bool TRANS>
__global__ void micro_ldsm_latency_kernel(uint32_t* out, int64_t* clk, int64_t iters) {
  constexpr int ROWS = 32, LDS = 136;  // halves per row
  constexpr uint32_t ROW_BYTES = LDS * 2;
  __shared__ __align__(16) unsigned short tile[ROWS * LDS];
  const int lane = threadIdx.x % 32;
  const uint32_t base = smem_addr(tile);
  for (int i = threadIdx.x; i < ROWS * LDS; i += blockDim.x)
    tile[i] = static_cast<unsigned short>(micro_hash(i + 99u) | 1u);
  __syncthreads();
  for (int i = threadIdx.x; i < 8 * 8; i += blockDim.x) {  // matrix 0 = rows 0..7, cols 0..7
    const int row = i / 8, col = i % 8;
    tile[row * LDS + col] = micro_ldsm_chain_half<TRANS>(row, col, base, ROW_BYTES);
  }
  __syncthreads();
  const uint32_t my_addr = base + lane * ROW_BYTES;
  uint32_t r[X];
  micro_ldsm<X, TRANS>(r, my_addr);
  if (!__all_sync(0xffffffffu, r[0] == my_addr)) {
    out[threadIdx.x] = 0xdeadbeefu;  // layout mismatch: nothing timed
    micro_record_clock(clk, 0, 0, 0);
    return;
  }
  uint32_t addr = r[0];
  const int64_t t0 = clock64();
#pragma unroll 1
  for (int64_t i = 0; i < iters; ++i) {
#pragma unroll
    for (int u = 0; u < 64; ++u) {
      micro_ldsm<X, TRANS>(r, addr);
      addr = r[0];
    }
  }
  const int64_t t1 = clock64();
  uint32_t other = 0u;  // keeps the other result registers live
#pragma unroll
  for (int j = 1; j < X; ++j) other ^= r[j];
  out[threadIdx.x] = addr ^ my_addr;
  out[32 + threadIdx.x] = other;
  micro_record_clock(clk, t0, t1, iters * 64);
}

// Bandwidth: every warp reads a whole K tile [64 keys][128 dims] (16-bit) with the lane addresses of the
// forward's S = Q K^T B operand (flash_fwd.cu): row = 16 np + lane%8 + 8 (lane/16), col = 16 kd + 8 ((lane/8)%2),
// kd < 8, np < 4: 32 ldmatrix per pass. LDS = row length in halves: 136 (padded, +8: the 8 rows of one 8x8
// matrix start 4 banks apart -> conflict-free) or 128 (unpadded: 256-byte rows, all 8 rows in the same 4
// banks -> 8-way conflict). The tile offsets are compile-time immediates of LDSM [R + imm].
template <int X, bool TRANS, int LDS>
__global__ void __launch_bounds__(128, 8) micro_ldsm_tput_kernel(uint32_t* out, int64_t* clk, int64_t iters) {
  constexpr int ROWS = 64, D = 128;
  static_assert(LDS >= D && LDS % 8 == 0, "rows must hold D halves and stay 16-byte aligned");
  __shared__ __align__(16) unsigned short tile[ROWS * LDS];
  for (int i = threadIdx.x; i < ROWS * LDS; i += blockDim.x)
    tile[i] = static_cast<unsigned short>(micro_hash(i + 7u * blockIdx.x) | 1u);
  __syncthreads();
  const int lane = threadIdx.x % 32;
  const uint32_t lane_addr = smem_addr(tile + ((lane % 8) + (lane / 16) * 8) * LDS + ((lane / 8) % 2) * 8);
  uint32_t acc[X];
#pragma unroll
  for (int j = 0; j < X; ++j) acc[j] = 0u;
  const int64_t t0 = clock64();
#pragma unroll 1
  for (int64_t i = 0; i < iters; ++i) {
#pragma unroll
    for (int kd = 0; kd < D / 16; ++kd)
#pragma unroll
      for (int np = 0; np < ROWS / 16; ++np) {
        uint32_t r[X];
        micro_ldsm<X, TRANS>(r, lane_addr + (np * 16 * LDS + kd * 16) * 2);
#pragma unroll
        for (int j = 0; j < X; ++j) acc[j] ^= r[j];
      }
  }
  __syncthreads();
  const int64_t t1 = clock64();
  uint32_t sink = 0u;
#pragma unroll
  for (int j = 0; j < X; ++j) sink += acc[j];
  out[blockIdx.x * blockDim.x + threadIdx.x] = sink;
  micro_record_clock(clk, t0, t1, iters * (D / 16) * (ROWS / 16));
}

// ================================================================================ 3. global -> shared copies
// src = [n_tiles][tile] of 16-byte chunks, a buffer much larger than L2. Block b copies tiles b, b + grid,
// b + 2 grid, ... (wrapping; the host makes n_tiles a multiple of the grid) for `total` tiles in all.
// Each thread copies chunks u * NT + tid of a tile (a warp covers 512 contiguous bytes per u) and then
// reads back the first word of each of ITS OWN chunks: no __syncthreads is needed, and the read proves
// the data arrived.

// cp.async (ptx.cuh cp_async_16; PTX ISA, Data Movement: cp.async, cp.async.commit_group, cp.async.wait_group:
// cp.async.cg.shared.global, 16 B, L2 only -> LDGSTS.E.BYPASS.128):
// STAGES tiles of 4 chunks per thread in flight, one commit group per tile, wait_group<STAGES - 1> before
// reading the oldest: the pipeline of the attention kernels, without registers holding the data.
// Dynamic shared memory: STAGES * 4 * NT * 16 bytes.
template <int STAGES>
__global__ void micro_copy_cp_async_kernel(const uint4* src, uint32_t* out, int64_t* clk, int64_t n_tiles,
                                           int64_t total) {
  static_assert(STAGES >= 2, "need at least double buffering");
  constexpr int U = 4;  // chunks per thread per tile
  extern __shared__ __align__(16) unsigned char micro_smem[];
  const int NT = blockDim.x, tid = threadIdx.x;
  const uint32_t smem0 = smem_addr(micro_smem);
  auto chunk_addr = [&](int stage, int u) { return smem0 + ((stage * U + u) * NT + tid) * 16u; };
  int64_t t_issue = blockIdx.x;  // next tile to issue
  int stage_w = 0, stage_r = 0;
  auto issue = [&]() {
    const uint4* tile = src + t_issue * (U * NT);
#pragma unroll
    for (int u = 0; u < U; ++u) cp_async_16(chunk_addr(stage_w, u), tile + u * NT + tid, true);
    t_issue += gridDim.x;
    if (t_issue >= n_tiles) t_issue -= n_tiles;
    stage_w = stage_w + 1 == STAGES ? 0 : stage_w + 1;
  };
  __syncthreads();
  const int64_t t0 = clock64();
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < total) issue();
    cp_async_commit();
  }
  uint32_t sink = 0u;
#pragma unroll 1
  for (int64_t j = 0; j < total; ++j) {
    if (j + STAGES - 1 < total) issue();  // into the stage this thread read in the previous trip
    cp_async_commit();                    // (possibly empty) group, so wait<STAGES - 1> always means tile j
    cp_async_wait<STAGES - 1>();
#pragma unroll
    for (int u = 0; u < U; ++u) sink ^= micro_lds_u32(chunk_addr(stage_r, u));
    stage_r = stage_r + 1 == STAGES ? 0 : stage_r + 1;
  }
  cp_async_wait<0>();
  __syncthreads();
  const int64_t t1 = clock64();
  out[blockIdx.x * blockDim.x + tid] = sink;
  micro_record_clock(clk, t0, t1, total);
}

// Plain loads: U 16-byte LDG per thread into registers, then STS.128 into shared memory and read back: the
// pre-Ampere way. Only U chunks per thread are in flight and the data occupy 4 U registers.
// Dynamic shared memory: U * NT * 16 bytes.
template <int U>
__global__ void micro_copy_ldg_kernel(const uint4* src, uint32_t* out, int64_t* clk, int64_t n_tiles,
                                      int64_t total) {
  extern __shared__ __align__(16) unsigned char micro_smem[];
  const int NT = blockDim.x, tid = threadIdx.x;
  const uint32_t smem0 = smem_addr(micro_smem);
  int64_t t = blockIdx.x;
  uint32_t sink = 0u;
  __syncthreads();
  const int64_t t0 = clock64();
#pragma unroll 1
  for (int64_t j = 0; j < total; ++j) {
    const uint4* tile = src + t * (U * NT);
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = tile[u * NT + tid];
#pragma unroll
    for (int u = 0; u < U; ++u) micro_sts_v4(smem0 + (u * NT + tid) * 16u, v[u]);
#pragma unroll
    for (int u = 0; u < U; ++u) sink ^= micro_lds_u32(smem0 + (u * NT + tid) * 16u);
    t += gridDim.x;
    if (t >= n_tiles) t -= n_tiles;
  }
  __syncthreads();
  const int64_t t1 = clock64();
  out[blockIdx.x * blockDim.x + tid] = sink;
  micro_record_clock(clk, t0, t1, total);
}

// ================================================================================ 4. global atomics
// Every block adds (or stores) a [64 x 128] tile `iters` times into dst + blockIdx.x * block_stride
// (elements of fp32; 16-bit ops address the same bytes as pairs of 16-bit values, 8192 of them per tile):
//   block_stride = 0          -> all blocks hit ONE tile: the dQ accumulation of the backward
//                                (every KV block adds its dQ contribution to the same Q rows)
//   block_stride = 64 * 128   -> each block its own tile: no contention
// Thread tid handles elements (j * NT + tid) * ELEMS of the tile, so a warp covers 32 * ELEMS contiguous
// elements per instruction. Plain stores and red.* are volatile asm: repeated stores to one address in a
// loop may not be merged or sunk out of the loop. NT must be 256 (any other block size does nothing).
struct MicroStoreF32 {  // st.global.f32 (PTX ISA, Data Movement: st) -> STG.E
  static constexpr int ELEMS = 1;
  static __device__ __forceinline__ void apply(float* p, float v, float&) {
    asm volatile("st.global.f32 [%0], %1;\n" ::"l"(p), "f"(v) : "memory");
  }
};
struct MicroStoreV4 {  // st.global.v4.f32 -> STG.E.128
  static constexpr int ELEMS = 4;
  static __device__ __forceinline__ void apply(float* p, float v, float&) {
    asm volatile("st.global.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "f"(v), "f"(v + 1.f), "f"(v + 2.f),
                 "f"(v + 3.f)
                 : "memory");
  }
};
struct MicroAtomAddF32 {  // atomicAdd with its return value used -> ATOM (a round trip to L2)
  static constexpr int ELEMS = 1;
  static __device__ __forceinline__ void apply(float* p, float v, float& acc) { acc += atomicAdd(p, v); }
};
struct MicroRedF32 {  // red.global.add.f32 (PTX ISA, Parallel Synchronization: red) -> RED; fire and forget,
                      // what atomicAdd compiles to when its result is unused
  static constexpr int ELEMS = 1;
  static __device__ __forceinline__ void apply(float* p, float v, float&) {
    asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(p), "f"(v) : "memory");
  }
};
// red.global.add.v2.f32 / .v4.f32: vector red, sm_90 and PTX ISA 8.1+ (one REDG.E.ADD.F32x2 / F32x4; the
// backward's atomicAdd(float2*) compiles to the same). Below sm_90: scalar reds, so the file compiles
// everywhere; bench_micro skips these on cc < 9.0.
struct MicroRedV2F32 {
  static constexpr int ELEMS = 2;
  static __device__ __forceinline__ void apply(float* p, float v, float&) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(p), "f"(v), "f"(v + 1.f) : "memory");
#else
    asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(p), "f"(v) : "memory");
    asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(p + 1), "f"(v + 1.f) : "memory");
#endif
  }
};
struct MicroRedV4F32 {
  static constexpr int ELEMS = 4;
  static __device__ __forceinline__ void apply(float* p, float v, float&) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "f"(v), "f"(v + 1.f), "f"(v + 2.f),
                 "f"(v + 3.f)
                 : "memory");
#else
#pragma unroll
    for (int i = 0; i < 4; ++i) asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(p + i), "f"(v + i) : "memory");
#endif
  }
};
// 16-bit pairs: p points at 16-bit element e of the tile viewed as 16-bit. atomicAdd(__half2*) /
// atomicAdd(__nv_bfloat162*) with the result unused: on sm_90 a generic-address ATOM .F16x2 / .BF16x2 plus
// a shared-memory fallback branch (the pointer's space is unknown), not a RED.
struct MicroAtomAddF16x2 {
  static constexpr int ELEMS = 2;
  static __device__ __forceinline__ void apply(float* p, float v, float&) {
    atomicAdd(reinterpret_cast<__half2*>(p), __floats2half2_rn(v, v + 1.f));
  }
};
struct MicroAtomAddBf16x2 {
  static constexpr int ELEMS = 2;
  static __device__ __forceinline__ void apply(float* p, float v, float&) {
    atomicAdd(reinterpret_cast<__nv_bfloat162*>(p), __floats2bfloat162_rn(v, v + 1.f));
  }
};
// The same with explicit PTX (red.global.add.noftz.{f16x2,bf16x2}): a global-space RED, no
// generic-address test; bf16x2 needs sm_90 (sm_80: the atomicAdd above).
struct MicroRedF16x2 {
  static constexpr int ELEMS = 2;
  static __device__ __forceinline__ void apply(float* p, float v, float&) {
    const uint32_t x = pack2<__half>(v, v + 1.f);
    asm volatile("red.global.add.noftz.f16x2 [%0], %1;\n" ::"l"(p), "r"(x) : "memory");
  }
};
struct MicroRedBf16x2 {
  static constexpr int ELEMS = 2;
  static __device__ __forceinline__ void apply(float* p, float v, float& acc) {
#if __CUDA_ARCH__ >= 900
    const uint32_t x = pack2<__nv_bfloat16>(v, v + 1.f);
    asm volatile("red.global.add.noftz.bf16x2 [%0], %1;\n" ::"l"(p), "r"(x) : "memory");
#else
    MicroAtomAddBf16x2::apply(p, v, acc);
#endif
  }
};
template <class Op>
struct MicroElemBytes {
  static constexpr int value = 4;
};
template <>
struct MicroElemBytes<MicroAtomAddF16x2> {
  static constexpr int value = 2;
};
template <>
struct MicroElemBytes<MicroAtomAddBf16x2> {
  static constexpr int value = 2;
};
template <>
struct MicroElemBytes<MicroRedF16x2> {
  static constexpr int value = 2;
};
template <>
struct MicroElemBytes<MicroRedBf16x2> {
  static constexpr int value = 2;
};

// out[global thread] = sum of ATOM return values (0 for the other ops).
template <class Op>
__global__ void micro_atomic_kernel(float* dst, float* out, int64_t iters, int64_t block_stride) {
  constexpr int NT = 256, TILE = 64 * 128, ELEMS = Op::ELEMS, BYTES = MicroElemBytes<Op>::value;
  static_assert(TILE % (NT * ELEMS) == 0, "the tile is a whole number of block-wide instructions");
  if (blockDim.x != NT) return;  // the host's KernelSpec fixes 256 threads
  const int tid = threadIdx.x;
  // tile base in bytes; element e (of BYTES bytes) of the tile lives at byte e * BYTES
  unsigned char* tile = reinterpret_cast<unsigned char*>(dst + blockIdx.x * block_stride);
  const float v = 0x1p-10f * micro_rand(micro_hash(blockIdx.x * NT + tid + 1u));
  float acc = 0.f;
#pragma unroll 1
  for (int64_t i = 0; i < iters; ++i) {
#pragma unroll
    for (int j = 0; j < TILE / (NT * ELEMS); ++j)
      Op::apply(reinterpret_cast<float*>(tile + ((j * NT + tid) * ELEMS) * BYTES), v, acc);
  }
  out[blockIdx.x * NT + tid] = acc;
}

}  // namespace cuflash
