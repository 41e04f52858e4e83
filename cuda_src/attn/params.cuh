// cuda_src/attn/params.cuh -- the kernel parameter blocks: forward / split-KV / decode / combine (FwdParams),
// backward (BwdParams), FlashAttention-1 forward and backward (V1FwdParams, V1BwdParams).
//
// Passed by value as the only kernel argument. Every field is 8 bytes wide (pointers, int64_t, and the float
// scalars in 8-byte slots, f32_slot: common/ptx.cuh), so the host packs a block with one struct.pack, by field
// name: cuflash/_params.py holds the host schema of each block, and tests/test_params_layout.py parses this header
// and checks every field's name, order, offset and size against it. A field added here is added there, and the
// test says so if it is not.
#pragma once
#include "../common/ptx.cuh"

namespace cuflash {

struct FwdParams {
  const void* q;          // [b, sq, h, d]   (strides below, in elements; last dim contiguous)
  const void* k;          // [b, sk, hk, d]
  const void* v;          // [b, sk, hk, d]
  void* o;                // [b, sq, h, d]
  float* lse;             // [b, h, sq] fp32, natural log (may be null: not written); packed: [h, total_q]
  float* o_accum;         // split-KV: [splits, b, h, sq, d] fp32 partial outputs; the Hopper forward's persistent
                          // form: stream-K's workspace (flash_fwd_sm90.cu), null: no stream-K
  float* lse_accum;       // split-KV only: [splits, b, h, sq] fp32 partial LSE
  const int* seqlens_k;   // optional [b] int32: valid keys per batch element before this call's append
                          // (KV cache); keys seen = min(seqlens_k[b] + seqlen_k_new, seqlen_k); null: seqlen_k
  // KV-cache indirections, read by the decode kernel only (cuda_src/flash_decode.cu; null: none)
  const int* block_table;      // paged cache: int32 [b, block_table_batch_stride], key row r of element b is row
                               // r % page_size of page block_table[b, r / page_size] (k, v: [pages, page_size, hk,
                               // d], their batch stride the page stride)
  const int* cache_batch_idx;  // int32 [b]: the cache row (batch index of k, v) of element b
  const int* leftpad_k;        // int32 [b]: element b's keys start at this cache row (the rows before it unseen)
  const void* rotary_cos;      // rotary embedding of q (attn/rotary.cuh): [seqlen_ro, rotary_dim / 2], q's dtype
  const void* rotary_sin;
  const int* cu_seqlens_q;  // varlen (packed sequences; attn/seqlen.cuh): int32 [b + 1] prefix sums of the query
  const int* cu_seqlens_k;  // and key counts, rows of [total, h, d] tensors; null: fixed lengths
  const float* alibi_slopes;  // MOD_SCORE: fp32 [batch or 1, nheads], slope of (b, h) at b * alibi_batch_stride + h;
                              // null: no ALiBi
  int64_t q_batch_stride, q_row_stride, q_head_stride;
  int64_t k_batch_stride, k_row_stride, k_head_stride;
  int64_t v_batch_stride, v_row_stride, v_head_stride;
  int64_t o_batch_stride, o_row_stride, o_head_stride;
  int64_t batch, nheads, heads_per_kv, seqlen_q, seqlen_k;  // packed: seqlen_q, seqlen_k = total_q, total_k
  int64_t num_splits;                    // split-KV: the KV tiles of each row are cut into this many ranges
  int64_t seqlen_k_new;                  // keys appended to the cache by this call (see seqlens_k)
  int64_t grid_order;                    // 0: Q tile in grid x (same-head blocks together); 1: (b, h) in x
  f32_slot scale_log2;                   // softmax_scale * log2(e), computed on the host (softcap * log2(e) with
                                         // the soft-cap)
  // score modifiers (attn/mask.cuh; read only by the kernels compiled with MOD_SCORE; alibi_slopes above)
  int64_t alibi_batch_stride;
  int64_t window_left, window_right;  // band [i + diag - left, i + diag + right] (no -1: the host bounds it)
  f32_slot softcap_pre;               // softmax_scale / softcap (scale_log2 is then softcap * log2(e)); 0: off
  f32_slot alibi_mul;                 // ALiBi slope -> kernel score units: 1 / softmax_scale, or 1 / softcap
  int64_t head_dim;                   // the inputs' head dim: <= the kernel's D, a multiple of 8; columns past it
                                      // are zero-filled in shared memory and never stored
  // dropout (attn/dropout.cuh; read only by the kernels compiled with MOD_DROPOUT)
  int64_t rng_seed, rng_offset;       // Philox key and the counter offset of this call
  int64_t dropout_keep;               // keep an element iff its 16-bit random number is below this (65536 (1 - p))
  f32_slot dropout_scale;             // 1 / (1 - p)
  // KV-cache indirections (above)
  int64_t block_table_batch_stride;   // elements between block_table rows
  int64_t page_size;                  // keys per page, a multiple of 16
  int64_t rotary_dim;                 // rotary: columns rotated, a multiple of 16 (0: off)
  int64_t rotary_interleaved;         // 1: pairs (2k, 2k + 1); 0: pairs (k, k + rotary_dim / 2)
  int64_t rotary_q_per_row;           // 1: query row i at position seqlens_k[b] + i (causal or local); 0: all at
                                      // seqlens_k[b]
  int64_t seqlen_ro;                  // rows of rotary_cos / rotary_sin
  // the Hopper forward's persistent form (cuda_src/flash_fwd_sm90.cu, Sm90FwdTiles / Sm90FwdWalk)
  int64_t walk_group;                 // (batch, head)s per group of its tile walk (1: "qtile", all: "bh")
  int64_t walk_slot;                  // its tiles handed out by the counter pair of this slot; < 0: fixed waves
};

}  // namespace cuflash

namespace cuflash {

// Parameter block of the backward kernels (preprocess, main, dq convert). Same 8-byte-field rule as
// FwdParams.
struct BwdParams {
  const void* q;        // [b, sq, h, d]
  const void* k;        // [b, sk, hk, d]
  const void* v;        // [b, sk, hk, d]
  const void* o;        // [b, sq, h, d]  forward output
  const void* dout;     // [b, sq, h, d]  dL/dO
  const float* lse;     // [b, h, sq]     forward LSE (natural log)
  float* lse_log2;      // [b, h, sq_pad] LSE * log2(e); +inf for rows that saw no key and padding rows
  float* delta;         // [b, h, sq_pad] D = rowsum(dO * O); 0 on padding rows
  float* dq_accum;      // fp32 [splits, b, h, sq_pad, d] (splits = KV tiles for "seqpar", else 1)
  void* dq;             // [b, sq, h, d]
  void* dk;             // [b, sk, hk, d]
  void* dv;             // [b, sk, hk, d]
  const int* cu_seqlens_q;  // varlen: as FwdParams'; the fp32 row buffers are then [h, sq_pad] with element b's
  const int* cu_seqlens_k;  // rows from 128 (cu_q[b] / 128 + b) (attn/seqlen.cuh: varlen_pad_start)
  const float* alibi_slopes;  // MOD_SCORE: as FwdParams::alibi_slopes
  void* sk_workspace;  // the Hopper backward's stream-K form: its flags and partial dK, dV (cuflash/_walk.py); null: none
  int64_t q_batch_stride, q_row_stride, q_head_stride;
  int64_t k_batch_stride, k_row_stride, k_head_stride;
  int64_t v_batch_stride, v_row_stride, v_head_stride;
  int64_t o_batch_stride, o_row_stride, o_head_stride;
  int64_t do_batch_stride, do_row_stride, do_head_stride;
  int64_t dq_batch_stride, dq_row_stride, dq_head_stride;
  int64_t dk_batch_stride, dk_row_stride, dk_head_stride;
  int64_t dv_batch_stride, dv_row_stride, dv_head_stride;
  int64_t batch, nheads, heads_per_kv, seqlen_q, seqlen_k, seqlen_q_pad;  // packed: totals; seqlen_q_pad the
                                                                        // padded rows of one head (all elements)
  int64_t dq_strategy;  // 0 atomic (fp32 atomics), 1 seqpar (buffer per KV tile + reduce), 2 loop (no atomics)
  int64_t num_dq_splits;
  f32_slot scale_log2;  // softmax_scale * log2(e)
  f32_slot softmax_scale;
  // score modifiers (as FwdParams)
  int64_t alibi_batch_stride;
  int64_t window_left, window_right;  // band [i + diag - left, i + diag + right] (no -1: the host bounds it)
  f32_slot softcap_pre;               // softmax_scale / softcap (scale_log2 is then softcap * log2(e)); 0: off
  f32_slot alibi_mul;                 // ALiBi slope -> kernel score units: 1 / softmax_scale, or 1 / softcap
  int64_t head_dim;                   // the inputs' head dim: <= the kernel's D, a multiple of 8; columns past it
                                      // are zero-filled in shared memory and never stored
  // dropout (attn/dropout.cuh; read only by the kernels compiled with MOD_DROPOUT)
  int64_t rng_seed, rng_offset;       // Philox key and the counter offset of this call
  int64_t dropout_keep;               // keep an element iff its 16-bit random number is below this (65536 (1 - p))
  f32_slot dropout_scale;             // 1 / (1 - p)
};

}  // namespace cuflash

namespace cuflash {

// Parameter block of the V1 forward kernel (the same rules).
struct V1FwdParams {
  const void* q;   // [b, sq, h, d]   (strides below, in elements; last dim contiguous)
  const void* k;   // [b, sk, hk, d]
  const void* v;   // [b, sk, hk, d]
  void* o;         // [b, sq, h, d]   the output, input dtype (written by the last KV tile of each row)
  float* o_accum;  // [b, h, sq, d]   fp32 running O_i (normalised by l_i), read and written per (j, i)
  float* m;        // [b, h, sq]      running row max of the scaled scores (natural units)
  float* l;        // [b, h, sq]      running row sum of exp(scale * s - m)
  float* lse;      // [b, h, sq]      m + log(l), natural log; -inf for rows that see no key
  int64_t q_batch_stride, q_row_stride, q_head_stride;
  int64_t k_batch_stride, k_row_stride, k_head_stride;
  int64_t v_batch_stride, v_row_stride, v_head_stride;
  int64_t o_batch_stride, o_row_stride, o_head_stride;
  int64_t batch, nheads, heads_per_kv, seqlen_q, seqlen_k;
  f32_slot scale_log2;  // softmax_scale * log2(e)
};

// Parameter block of the V1 backward kernels (main, dQ convert).
struct V1BwdParams {
  const void* q;     // [b, sq, h, d]
  const void* k;     // [b, sk, hk, d]
  const void* v;     // [b, sk, hk, d]
  const void* o;     // [b, sq, h, d]  forward output
  const void* dout;  // [b, sq, h, d]  dL/dO
  const float* m;    // [b, h, sq]     forward row max (natural units of the scaled scores), or the LSE
  const float* l;    // [b, h, sq]     forward row sum, or ones (P = exp(S - LSE) / 1 is the same P)
  float* dq_accum;   // [b, h, sq_pad, d] fp32, zero-initialised: sum over KV tiles of dS K (unscaled)
  void* dq;          // [b, sq, h, d]
  void* dk;          // [b, sk, hk, d]
  void* dv;          // [b, sk, hk, d]
  int64_t q_batch_stride, q_row_stride, q_head_stride;
  int64_t k_batch_stride, k_row_stride, k_head_stride;
  int64_t v_batch_stride, v_row_stride, v_head_stride;
  int64_t o_batch_stride, o_row_stride, o_head_stride;
  int64_t do_batch_stride, do_row_stride, do_head_stride;
  int64_t dq_batch_stride, dq_row_stride, dq_head_stride;
  int64_t dk_batch_stride, dk_row_stride, dk_head_stride;
  int64_t dv_batch_stride, dv_row_stride, dv_head_stride;
  int64_t batch, nheads, heads_per_kv, seqlen_q, seqlen_k, seqlen_q_pad;  // seqlen_q_pad: multiple of BLOCK_M
  f32_slot scale_log2;   // softmax_scale * log2(e)
  f32_slot softmax_scale;
};

}  // namespace cuflash
