"""Fused element-wise kernels for bfloat16 decoding on the CPU: one pass over a row instead of a chain of torch ops.

Between its matmuls a decoder layer runs a dozen small torch operations (RMSNorm alone is six, RoPE five per
tensor, the residual adds, SiLU and the gate product), each a dispatch, an allocation and a pass over memory that
converts bf16 to float and back (what fusing them gains: docs/reports/cpu-kernels.md, ``scripts/cpu_kernels.py``).
These kernels do the same arithmetic in one loop per row, in C compiled at first use with the system's C compiler (``cc -O3 -march=native``, cached under
``~/.cache/dspark/kernels``) and called through ctypes, which releases the GIL during the call:

- ``rms_norm(x, w)`` and ``add_rms_norm(x, branch, w)`` (the residual add and the next norm in one pass),
- ``rope_(qkv, cos, sin)``: RoPE in place on the query and key heads of the fused q/k/v projection's output,
- ``silu_mul(gate_up)``: ``silu(gate) * up`` of the fused gate/up projection's output.

They round as the torch ops do (every bf16 product and sum rounded to bf16 where torch rounds it; RMSNorm's
statistics and SiLU in float32), so RoPE, the adds and the products are bitwise torch's; the sum of squares is
added in another order and ``exp`` is a polynomial of its own, so a norm or a SiLU output moves by one bf16 step
now and then. Each row is computed alone, whatever the other rows: load independence is kept
(docs/architecture.md §Making a step cheap). Only bfloat16 rows of a model in the decoding layout without
gradients take this path (``Decoder.cpu_kernels``); ``DSPARK_CPU_KERNELS=0`` turns it off, and where no compiler
is found the torch ops run as before (one warning).

Shapes: N = rows (tokens), H = hidden size, M = MLP width, Hq / Hkv = query / KV heads, D = head dim.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

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
"""

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
    for fn in (lib.rms_norm_bf16, lib.add_rms_norm_bf16, lib.silu_mul_bf16, lib.rope_bf16):
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
