"""Fused element-wise kernels for bfloat16 decoding on the CPU: one pass over a row instead of a chain of torch ops.

Between its matmuls a decoder layer runs a dozen small torch operations (RMSNorm alone is six, RoPE five per
tensor, the residual adds, SiLU and the gate product), each a dispatch, an allocation and a pass over memory that
converts bf16 to float and back (what fusing them gains: docs/reports/cpu-kernels.md, ``scripts/cpu_kernels.py``).
These kernels do the same arithmetic in one loop per row, in C compiled at first use with the system's C compiler (``cc -O3 -march=native``, cached under
``~/.cache/dspark/kernels``) and called through ctypes, which releases the GIL during the call:

- ``rms_norm(x, w)`` and ``add_rms_norm(x, branch, w)`` (the residual add and the next norm in one pass),
- ``rope_(qkv, cos, sin)``: RoPE in place on the query and key heads of the fused q/k/v projection's output,
- ``silu_mul(gate_up)``: ``silu(gate) * up`` of the fused gate/up projection's output,
- ``attention(q, keys, values, slots, offsets, lo, hi, scale, work)``: attention of a whole flattened batch over
  the KV pool in one call, every (token, head) row over exactly its own positions (``Decoder.attention_kernel``;
  ``DSPARK_ATTENTION_KERNEL=0`` leaves attention to torch's SDPA; docs/reports/cpu-attention-kernel.md).

They round as the torch ops do (every bf16 product and sum rounded to bf16 where torch rounds it; RMSNorm's
statistics and SiLU in float32), so RoPE, the adds and the products are bitwise torch's; the sum of squares is
added in another order and ``exp`` is a polynomial of its own, so a norm or a SiLU output moves by one bf16 step
now and then. The attention kernel keeps its scores, softmax and
weighted sums in float32 and rounds once, so its outputs can differ from SDPA's by a bf16 step. Each row is
computed alone, whatever the other rows: load independence is kept
(docs/architecture.md §Making a step cheap). Only bfloat16 rows of a model in the decoding layout without
gradients take this path (``Decoder.cpu_kernels``); ``DSPARK_CPU_KERNELS=0`` turns it off, and where no compiler
is found the torch ops run as before (one warning).

Shapes: N = rows (tokens), H = hidden size, M = MLP width, Hq / Hkv = query / KV heads, D = head dim.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from dspark.errors import DSparkError

_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>

static inline float bf2f(uint16_t h) { union { uint32_t u; float f; } v = {(uint32_t)h << 16}; return v.f; }
static inline uint16_t f2bf(float f) {  /* round to nearest even, as torch's c10::BFloat16 */
  union { float f; uint32_t u; } v = {f};
  uint32_t u = v.u, rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16, nan = (u >> 16) | 0x40u;
  return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}
static inline float rnd(float f) { return bf2f(f2bf(f)); }

/* exp(x), branch-free so that loops of it vectorise (Cephes' expf: range reduction by ln 2, degree-6 polynomial);
   x is clamped to [-87.3, 88.4], where exp stays a normal float, so floor(t + 0.5) = trunc(t + 200.5) - 200 */
static inline float fexp(float x) {
  x = x < -87.3365478515625f ? -87.3365478515625f : x;
  x = x > 88.3762626647949f ? 88.3762626647949f : x;
  int32_t ni = (int32_t)(x * 1.44269504088896341f + 200.5f) - 200;
  float n = (float)ni;
  float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  union { int32_t i; float f; } e = {(ni + 127) << 23};
  return p * e.f;
}

#define LANES 16
static float sum_squares(const uint16_t *x, int n) {
  float acc[LANES] = {0};
  int i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int l = 0; l < LANES; l++) { float v = bf2f(x[i + l]); acc[l] += v * v; }
  float s = 0.0f;
  for (; i < n; i++) { float v = bf2f(x[i]); s += v * v; }
  for (int l = 0; l < LANES; l++) s += acc[l];
  return s;
}

/* out = w * bf16(x * rsqrt(mean(x^2) + eps)), row by row: RMSNorm as dspark.modeling.layers.RMSNorm rounds it */
static void norm_row(const uint16_t *x, const uint16_t *w, uint16_t *out, int n, float eps) {
  float r = 1.0f / sqrtf(sum_squares(x, n) / (float)n + eps);
  for (int i = 0; i < n; i++) out[i] = f2bf(bf2f(w[i]) * rnd(bf2f(x[i]) * r));
}

void rms_norm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *out, int64_t rows, int64_t n, float eps) {
  for (int64_t r = 0; r < rows; r++) norm_row(x + r * n, w, out + r * n, (int)n, eps);
}

/* sum = bf16(x + branch); out = RMSNorm(sum) */
void add_rms_norm_bf16(const uint16_t *x, const uint16_t *branch, const uint16_t *w, uint16_t *sum, uint16_t *out,
                       int64_t rows, int64_t n, float eps) {
  for (int64_t r = 0; r < rows; r++) {
    const uint16_t *a = x + r * n, *b = branch + r * n;
    uint16_t *s = sum + r * n;
    for (int64_t i = 0; i < n; i++) s[i] = f2bf(bf2f(a[i]) + bf2f(b[i]));
    norm_row(s, w, out + r * n, (int)n, eps);
  }
}

/* out = bf16(silu(gate)) * up, gate and up the two halves of each row of gu (rows x 2m); in chunks of 256 through a
   float buffer, so that each loop is a plain vector loop */
void silu_mul_bf16(const uint16_t *gu, uint16_t *out, int64_t rows, int64_t m) {
  float buf[256];
  for (int64_t r = 0; r < rows; r++) {
    const uint16_t *__restrict__ g = gu + r * 2 * m, *__restrict__ u = g + m;
    uint16_t *__restrict__ o = out + r * m;
    for (int64_t i0 = 0; i0 < m; i0 += 256) {
      int64_t n = m - i0 < 256 ? m - i0 : 256;
      for (int64_t i = 0; i < n; i++) { float v = bf2f(g[i0 + i]); buf[i] = v / (1.0f + fexp(-v)); }
      for (int64_t i = 0; i < n; i++) o[i0 + i] = f2bf(rnd(buf[i]) * bf2f(u[i0 + i]));
    }
  }
}

/* in place on the first `heads` heads of each row (row stride `stride` elements): x * cos + rotate_half(x) * sin,
   every product and the sum rounded to bf16 as torch's bf16 ops round them; cos and sin (rows x d) in bf16 */
void rope_bf16(uint16_t *x, const uint16_t *cos_, const uint16_t *sin_, int64_t rows, int64_t stride, int64_t heads,
               int64_t d) {
  int64_t half = d / 2;
  for (int64_t r = 0; r < rows; r++) {
    const uint16_t *c = cos_ + r * d, *s = sin_ + r * d;
    for (int64_t h = 0; h < heads; h++) {
      uint16_t *v = x + r * stride + h * d;
      for (int64_t i = 0; i < half; i++) {
        float a = bf2f(v[i]), b = bf2f(v[i + half]);
        float lo = rnd(rnd(a * bf2f(c[i])) + rnd(-b * bf2f(s[i])));
        float hi = rnd(rnd(b * bf2f(c[i + half])) + rnd(a * bf2f(s[i + half])));
        v[i] = f2bf(lo);
        v[i + half] = f2bf(hi);
      }
    }
  }
}

typedef float lanes_t __attribute__((vector_size(LANES * sizeof(float))));  /* GCC/Clang vector extension */
typedef int32_t lane_ids_t __attribute__((vector_size(LANES * sizeof(int32_t))));
#if defined(__clang__)
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (lane_ids_t){__VA_ARGS__})
#endif

/* p[l] (LANES partial sums of key l) -> one vector of the LANES keys' sums: a tree of adds, lane i with lane
   i + LANES/2, then i + LANES/4, ..., the same pairs for every key whatever its place in the tile */
static inline lanes_t reduce_tile(lanes_t *p) {
  lanes_t h[LANES / 2], q[LANES / 4], o[LANES / 8];
  for (int i = 0; i < LANES / 2; i++)  /* key 2i in lanes 0-7, key 2i+1 in lanes 8-15: sums of 2 partials */
    h[i] = SHUFFLE(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
         + SHUFFLE(p[2 * i], p[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < LANES / 4; i++)  /* 4 keys, 4 lanes each: lanes (0-3, 4-7) of each half add */
    q[i] = SHUFFLE(h[2 * i], h[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
         + SHUFFLE(h[2 * i], h[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < LANES / 8; i++)  /* 8 keys, 2 lanes each */
    o[i] = SHUFFLE(q[2 * i], q[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29)
         + SHUFFLE(q[2 * i], q[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return SHUFFLE(o[0], o[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)  /* key l in lane l */
       + SHUFFLE(o[0], o[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

static inline lanes_t load_bf16(const uint16_t *x) {  /* LANES bf16 -> float lanes */
  lanes_t f;
  for (int l = 0; l < LANES; l++) f[l] = bf2f(x[l]);
  return f;
}

static inline lanes_t load_f32(const float *x) {  /* LANES floats (converted once from bf16: the same values) */
  lanes_t f;
  memcpy(&f, x, sizeof f);
  return f;
}

#define MAX_CHUNKS 8  /* head dim at most MAX_CHUNKS * LANES */
#define MAX_ROWS 8    /* rows that share a pass over the keys */

/* Attention of the tokens of R requests over their cached keys. Request r's tokens are rows tok[r] .. tok[r + 1] - 1
   of q (row stride q_stride, hq heads of d, d a multiple of LANES); they read the keys and values of slot slot[r]
   (strides in elements: slot, head, position; d contiguous), token t the positions lo[t] .. hi[t] - 1. Query head h
   reads KV head h / (hq / hkv). The (token, head) rows of a request that read one KV head go over its keys a few
   together (consecutive tokens, up to 24 / (d / LANES) rows: their outputs stay in registers), each key and value
   converted to float once for them; where a request's rows need several such passes (a prompt piece, a verify
   block) its keys and values are converted once for all of them into the scratch after the scores (the same
   floats, so the same results). Each row is still computed alone, the same way whatever the other rows: the
   score of a key as LANES partial sums over the head dim reduced by one fixed tree, a softmax over the row's own
   positions with its own maximum, the weighted values added in position order (positions outside the row's range
   weigh exactly 0, adding nothing), one rounding to bf16 at the end. work: attention_work floats. */
/* One pass of `rows` rows (first row r0; row = token * g + head in the KV head's group) over the keys they read:
   rows and chunks constant where it is called, so that the loops over them unroll and the outputs stay in registers */
static inline __attribute__((always_inline)) void row_group(
    const uint16_t *q, int64_t q_stride, const uint16_t *kb, const uint16_t *vb, int64_t s_pos, const int64_t *lo,
    const int64_t *hi, int64_t hq, int64_t g, int64_t kh, int64_t r0, const int64_t rows, const int64_t chunks,
    float scale, uint16_t *out, float *work, const int conv, const float *kf, const float *vf) {
  /* conv (constant where called): the keys and values already converted to float, position j at kf + j * d */
  const int64_t d = chunks * LANES;
    int64_t ra[MAX_ROWS], rb[MAX_ROWS], A = INT64_MAX, B = 0;
    lanes_t qv[MAX_ROWS][MAX_CHUNKS];
    for (int64_t i = 0; i < rows; i++) {
      int64_t t = (r0 + i) / g, h = kh * g + (r0 + i) % g;
      ra[i] = lo[t];
      rb[i] = hi[t];
      A = ra[i] < A ? ra[i] : A;
      B = rb[i] > B ? rb[i] : B;
      for (int64_t c = 0; c < chunks; c++) qv[i][c] = load_bf16(q + t * q_stride + h * d + c * LANES) * scale;
    }
    int64_t x0 = A / LANES, x1 = (B + LANES - 1) / LANES, stride = (x1 - x0) * LANES;  /* tiles of positions */
    float *sc = work - x0 * LANES;  /* the rows' scores, stride apart, indexed by position */
    for (int64_t x = x0; x < x1; x++) {  /* scores: a tile of keys, each converted once for the rows */
      lanes_t p[MAX_ROWS][LANES];
      int on[MAX_ROWS];
      for (int64_t i = 0; i < rows; i++) on[i] = x * LANES < rb[i] && (x + 1) * LANES > ra[i];
      for (int l = 0; l < LANES; l++) {
        int64_t j = x * LANES + l;
        lanes_t kv[MAX_CHUNKS];
        for (int64_t c = 0; c < chunks; c++)  /* positions past the rows' end read as 0 (their scores unused) */
          kv[c] = j >= B ? (lanes_t){0}
                  : conv ? load_f32(kf + j * d + c * LANES) : load_bf16(kb + j * s_pos + c * LANES);
        for (int64_t i = 0; i < rows; i++) {
          lanes_t sum = {0};
          if (on[i])
            for (int64_t c = 0; c < chunks; c++) sum += qv[i][c] * kv[c];
          p[i][l] = sum;
        }
      }
      for (int64_t i = 0; i < rows; i++)
        if (on[i]) {
          lanes_t s = reduce_tile(p[i]);
          memcpy(sc + i * stride + x * LANES, &s, sizeof s);
        }
    }
    float total[MAX_ROWS];
    for (int64_t i = 0; i < rows; i++) {  /* softmax of each row over its own positions */
      float *s = sc + i * stride + ra[i];
      int64_t n = rb[i] - ra[i], j = 0;
      lanes_t sv = {0}, x;
      float mv[LANES];
      for (int l = 0; l < LANES; l++) mv[l] = -INFINITY;
      for (; j + LANES <= n; j += LANES)  /* the maximum (exact in any order), LANES at a time */
        for (int l = 0; l < LANES; l++) mv[l] = s[j + l] > mv[l] ? s[j + l] : mv[l];
      float m = -INFINITY, sum = 0.0f;
      for (int l = 0; l < LANES; l++) m = mv[l] > m ? mv[l] : m;
      for (; j < n; j++) m = s[j] > m ? s[j] : m;
      for (j = 0; j < n; j++) s[j] = fexp(s[j] - m);
      for (j = 0; j + LANES <= n; j += LANES) {  /* the sum: the row's j-th position in lane j % LANES, a fixed tree */
        memcpy(&x, s + j, sizeof x);
        sv += x;
      }
      for (; j < n; j++) sum += s[j];
      float h[LANES];
      memcpy(h, &sv, sizeof h);
      for (int w = LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++) h[l] += h[l + w];
      total[i] = sum + h[0];
    }
    lanes_t ov[MAX_ROWS][MAX_CHUNKS];
    for (int64_t i = 0; i < rows; i++)
      for (int64_t c = 0; c < chunks; c++) ov[i][c] = (lanes_t){0};
    for (int64_t j = A; j < B; j++) {  /* values: each converted once, added to the rows in position order */
      lanes_t vv[MAX_CHUNKS];
      for (int64_t c = 0; c < chunks; c++)
        vv[c] = conv ? load_f32(vf + j * d + c * LANES) : load_bf16(vb + j * s_pos + c * LANES);
      for (int64_t i = 0; i < rows; i++) {
        float w = j >= ra[i] && j < rb[i] ? sc[i * stride + j] : 0.0f;  /* +0 weight: the sum stays as it is */
        for (int64_t c = 0; c < chunks; c++) ov[i][c] += w * vv[c];
      }
    }
    for (int64_t i = 0; i < rows; i++) {
      float inv = total[i] > 0.0f ? 1.0f / total[i] : 0.0f;
      int64_t t = (r0 + i) / g, h = kh * g + (r0 + i) % g;
      uint16_t *dst = out + t * hq * d + h * d;
      for (int64_t c = 0; c < chunks; c++)
        for (int l = 0; l < LANES; l++) dst[c * LANES + l] = f2bf(ov[i][c][l] * inv);
    }
}

static inline __attribute__((always_inline)) void attention_impl(
    const uint16_t *q, int64_t q_stride, const uint16_t *k, const uint16_t *v, int64_t s_slot, int64_t s_head,
    int64_t s_pos, const int64_t *slot, const int64_t *tok, const int64_t *lo, const int64_t *hi, int64_t R,
    int64_t hq, int64_t hkv, const int64_t d, float scale, uint16_t *out, float *work) {
  const int64_t chunks = d / LANES, g = hq / hkv;
  const int64_t max_rows = 24 / chunks < 1 ? 1 : (24 / chunks > MAX_ROWS ? MAX_ROWS : 24 / chunks);
  int64_t top = 0;  /* the last position any token reads: the scores take MAX_ROWS rows of it, converted keys follow */
  for (int64_t t = 0; t < tok[R]; t++) top = hi[t] > top ? hi[t] : top;
  float *cvt = work + MAX_ROWS * (top + 2 * LANES);
  for (int64_t r = 0; r < R; r++)
    for (int64_t kh = 0; kh < hkv; kh++) {
      const uint16_t *kb = k + slot[r] * s_slot + kh * s_head, *vb = v + slot[r] * s_slot + kh * s_head;
      int64_t first = tok[r] * g, last = tok[r + 1] * g;  /* rows (t, i): t = row / g, head kh * g + row % g */
      const float *kf = NULL, *vf = NULL;
      if (last - first > max_rows) {  /* several passes over these keys (a prompt piece, a verify block): each key and
                                         value converted to float once for all of them, the same values */
        int64_t A = INT64_MAX, B = 0;
        for (int64_t t = tok[r]; t < tok[r + 1]; t++) {
          A = lo[t] < A ? lo[t] : A;
          B = hi[t] > B ? hi[t] : B;
        }
        A = A / LANES * LANES;  /* the passes read whole tiles of positions from there */
        float *kc = cvt, *vc = cvt + (B - A) * d;
        for (int64_t j = A; j < B; j++)
          for (int64_t c = 0; c < chunks; c++) {
            lanes_t x = load_bf16(kb + j * s_pos + c * LANES), y = load_bf16(vb + j * s_pos + c * LANES);
            memcpy(kc + (j - A) * d + c * LANES, &x, sizeof x);
            memcpy(vc + (j - A) * d + c * LANES, &y, sizeof y);
          }
        kf = kc - A * d;  /* indexed by absolute position */
        vf = vc - A * d;
      }
      for (int64_t r0 = first; r0 < last; r0 += max_rows) {
        int64_t rows = last - r0 < max_rows ? last - r0 : max_rows;
        if (kf && rows == 6 && chunks == 4)  /* d = 64: two tokens of three heads (prefill, verify) */
          row_group(q, q_stride, kb, vb, s_pos, lo, hi, hq, g, kh, r0, 6, 4, scale, out, work, 1, kf, vf);
        else if (kf)
          row_group(q, q_stride, kb, vb, s_pos, lo, hi, hq, g, kh, r0, rows, chunks, scale, out, work, 1, kf, vf);
        else if (rows == 3 && chunks == 4)  /* d = 64: a decoding token of three heads */
          row_group(q, q_stride, kb, vb, s_pos, lo, hi, hq, g, kh, r0, 3, 4, scale, out, work, 0, kf, vf);
        else if (rows == 3 && chunks == 8)  /* d = 128 */
          row_group(q, q_stride, kb, vb, s_pos, lo, hi, hq, g, kh, r0, 3, 8, scale, out, work, 0, kf, vf);
        else
          row_group(q, q_stride, kb, vb, s_pos, lo, hi, hq, g, kh, r0, rows, chunks, scale, out, work, 0, kf, vf);
      }
    }
}

/* d a multiple of LANES, at most MAX_CHUNKS * LANES; the common head sizes get code of their own (loops unrolled) */
void attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k, const uint16_t *v, int64_t s_slot,
                    int64_t s_head, int64_t s_pos, const int64_t *slot, const int64_t *tok, const int64_t *lo,
                    const int64_t *hi, int64_t R, int64_t hq, int64_t hkv, int64_t d, float scale, uint16_t *out,
                    float *work) {
  if (d == 64)
    attention_impl(q, q_stride, k, v, s_slot, s_head, s_pos, slot, tok, lo, hi, R, hq, hkv, 64, scale, out, work);
  else if (d == 128)
    attention_impl(q, q_stride, k, v, s_slot, s_head, s_pos, slot, tok, lo, hi, R, hq, hkv, 128, scale, out, work);
  else
    attention_impl(q, q_stride, k, v, s_slot, s_head, s_pos, slot, tok, lo, hi, R, hq, hkv, d, scale, out, work);
}
"""

_LANES = 16  # LANES of the C source: keys per tile

_lib: ctypes.CDLL | None = None
_tried = False


def _cache_dir() -> Path:  # under DSPARK_HOME, as the converted models (dspark.target.presets.dspark_home)
    return Path(os.environ.get("DSPARK_HOME", Path.home() / ".cache" / "dspark")) / "kernels"


def _cpu_key() -> str:  # -march=native code is only good on this kind of CPU
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = os.uname().machine
    return hashlib.sha256((flags + _SOURCE).encode()).hexdigest()[:16]


def _build(target: Path) -> None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise OSError("no C compiler (cc) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src, lib = Path(tmp) / "kernels.c", Path(tmp) / "kernels.so"
        src.write_text(_SOURCE)
        flags = ["-O3", "-march=native", "-fPIC", "-shared", "-fno-math-errno",
                 "-fno-trapping-math"]  # loops with selects and conversions vectorise; no result changes
        if platform.machine().lower() in ("x86_64", "amd64"):
            flags.append("-mprefer-vector-width=512")  # AVX-512 where the CPU has it (x86 compilers only)
        done = subprocess.run([cc, *flags, str(src), "-o", str(lib), "-lm"], capture_output=True, text=True)
        if done.returncode != 0:
            raise OSError(f"{cc} failed: {done.stderr.strip()[-500:]}")
        os.replace(lib, target)  # atomic: processes building at once each leave a whole library


def load() -> ctypes.CDLL | None:
    """The compiled kernels (built once per machine and source), or None: turned off, or no compiler."""
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    if os.environ.get("DSPARK_CPU_KERNELS", "1") == "0":
        return None
    path = _cache_dir() / f"cpu-kernels-{_cpu_key()}.so"
    try:
        if not path.is_file():
            _build(path)
        lib = ctypes.CDLL(str(path))
    except OSError as err:
        print(f"[dspark] warning: fused CPU kernels unavailable ({err}); decoding runs the torch ops", file=sys.stderr)
        return None
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    lib.rms_norm_bf16.argtypes = [ptr, ptr, ptr, i64, i64, f32]
    lib.add_rms_norm_bf16.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, f32]
    lib.silu_mul_bf16.argtypes = [ptr, ptr, i64, i64]
    lib.rope_bf16.argtypes = [ptr, ptr, ptr, i64, i64, i64, i64]
    lib.attention_bf16.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64, f32,
                                   ptr, ptr]
    for fn in (lib.rms_norm_bf16, lib.add_rms_norm_bf16, lib.silu_mul_bf16, lib.rope_bf16, lib.attention_bf16):
        fn.restype = None
    _lib = lib
    return lib


def available() -> bool:
    return load() is not None


def _check(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.dtype != torch.bfloat16 or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"cpu_kernels: contiguous bfloat16 CPU tensors only, got {t.dtype} {t.device} "
                             f"contiguous={t.is_contiguous()}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # (N, H), (H,) -> (N, H)
    _check(x, weight)
    out = torch.empty_like(x)
    _lib.rms_norm_bf16(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps)
    return out


def add_rms_norm(x: torch.Tensor, branch: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:  # (N, H) x2, (H,) -> sum (N, H), its norm (N, H)
    """The residual add and the next RMSNorm in one pass: (x + branch, RMSNorm(x + branch))."""
    _check(x, branch, weight)
    total, out = torch.empty_like(x), torch.empty_like(x)
    _lib.add_rms_norm_bf16(x.data_ptr(), branch.data_ptr(), weight.data_ptr(), total.data_ptr(), out.data_ptr(),
                           x.shape[0], x.shape[1], eps)
    return total, out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # (N, 2M) -> (N, M)
    _check(gate_up)
    m = gate_up.shape[1] // 2
    out = gate_up.new_empty(gate_up.shape[0], m)
    _lib.silu_mul_bf16(gate_up.data_ptr(), out.data_ptr(), gate_up.shape[0], m)
    return out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """RoPE in place on the first ``heads`` heads of each row of ``x`` (N, W), W >= heads * D (the fused q/k/v
    output: q and k heads first); cos and sin (N, D) bfloat16. Returns ``x``."""
    _check(x, cos, sin)
    _lib.rope_bf16(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), x.shape[0], x.shape[1], heads, head_dim)
    return x


def attention_work(last_key: int) -> torch.Tensor:
    """The float32 scratch ``attention`` needs when no token reads past position ``last_key``; allocate once per
    forward and share between the layers."""
    # MAX_ROWS rows of scores, then one request's keys and values converted to float (head dim at most 8 * LANES)
    return torch.empty(8 * (last_key + 2 * _LANES) + 2 * 8 * _LANES * (last_key + _LANES), dtype=torch.float32)

def layers_fit(spec) -> bool:
    """Whether a decoder's layers (a ``DecoderSpec``) can take the element-wise kernels: plain RMSNorms (no offset, no
    sandwich norms) and SiLU. Callers add what their own fused path needs (the target: no q/k norms)."""
    return spec.norm_offset == 0 and not spec.sandwich_norms and spec.hidden_act == "silu"


def attention_fits(attn) -> bool:
    """Whether an ``Attention``'s heads can go through ``attention``: no soft-capping, a head size it serves."""
    return attn.softcap is None and attention_takes(attn.head_dim)


def attention_takes(head_dim: int) -> bool:
    """Whether ``attention`` serves heads of this size (a multiple of 16, at most 128) here:
    ``DSPARK_ATTENTION_KERNEL=0`` leaves attention to torch's SDPA."""
    return (head_dim % _LANES == 0 and head_dim <= 8 * _LANES
            and os.environ.get("DSPARK_ATTENTION_KERNEL", "1") != "0" and available())

#: where prompt pieces attend when the C kernel decodes: ``auto`` (the default), ``kernel`` or ``sdpa``
PROMPT_ATTENTION_MODES = ("auto", "kernel", "sdpa")


def prompts_to_kernel() -> bool:
    """Whether prompt pieces go through ``attention`` with the decoding rows (else through torch's fused attention).

    ``DSPARK_PROMPT_ATTENTION=kernel|sdpa`` chooses; ``auto`` (the default) takes torch's kernel on CPUs with AMX
    tiles, where its flash kernel multiplies query and key tiles with AMX and beats this kernel on long prompts,
    and this kernel elsewhere: on an AVX512-BF16 AMD EPYC without AMX it makes whole prefills 1.09-1.80x faster
    (docs/reports/cpu-attention-kernel.md §Prompts on a CPU without AMX). The choice depends on the
    machine only, never on a timing, so a server computes the same bits on every start."""
    mode = os.environ.get("DSPARK_PROMPT_ATTENTION") or "auto"
    if mode not in PROMPT_ATTENTION_MODES:
        raise DSparkError(f"DSPARK_PROMPT_ATTENTION={mode!r}: expected one of {', '.join(PROMPT_ATTENTION_MODES)}")
    return mode == "kernel" or (mode == "auto" and not has_amx())


@functools.cache
def has_amx() -> bool:
    """Whether this CPU has AMX tiles (torch's probe; False where this torch has none)."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe()) if probe is not None else False


def attention(
    q: torch.Tensor,  # (N, Hq, D) bfloat16, rows of requests concatenated; heads contiguous
    keys: torch.Tensor,  # (P, Hkv, C, D) bfloat16, any strides with D contiguous (the pool, or padded keys)
    values: torch.Tensor,  # (P, Hkv, C, D), the strides of ``keys``
    slots: torch.Tensor,  # (R,) int64: the slot each request reads
    offsets: torch.Tensor,  # (R+1,) int64: request r's tokens are q[offsets[r]:offsets[r+1]]
    lo: torch.Tensor,  # (N,) int64: each token reads positions lo .. hi-1 of its slot
    hi: torch.Tensor,  # (N,) int64
    scale: float,
    work: torch.Tensor,  # float32 scratch from ``attention_work``
) -> torch.Tensor:  # (N, Hq*D)
    """Attention for a flattened batch of variable-length requests in one call, each (token, head) row computed alone:
    its output does not depend on the other rows, on the batch, or on how a prompt is cut into pieces.

    Called once per layer, so nothing is checked here: bfloat16 CPU tensors, a head dim ``attention_takes``,
    the heads of ``q`` and the last dim of keys/values contiguous, keys and values with the same strides, contiguous
    int64 index tensors (``Decoder.use_cpu_kernels`` and ``BatchLayout.kernel_ranges`` see to it)."""
    N, Hq, D = q.shape
    out = q.new_empty(N, Hq * D)
    _lib.attention_bf16(q.data_ptr(), q.stride(0), keys.data_ptr(), values.data_ptr(), keys.stride(0),
                        keys.stride(1), keys.stride(2), slots.data_ptr(), offsets.data_ptr(), lo.data_ptr(),
                        hi.data_ptr(), offsets.shape[0] - 1, Hq, keys.shape[1], D, scale, out.data_ptr(), work.data_ptr())
    return out
