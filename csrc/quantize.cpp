// Block-wise symmetric quantization for ZeRO++ (qwZ weights, qgZ gradients): each block of `block`
// elements is sent as int8 or int4 values and one fp32 scale, absmax / qmax (127 or 7). Vectorised with
// AVX-512 or AVX2 chosen at run time (isa.h), threaded over blocks with ATen's parallel_for.
//
// torch has no block-wise int4/int8 quantizer for CPU tensors with per-block scales (its quantized
// tensors carry per-tensor or per-channel scales, not the ZeRO++ block layout), hence this kernel. The
// arithmetic is the reference's in hf_zero/ops/quantize.py step for step (scale = absmax / qmax; q =
// round-half-even(x / scale), a true division; x = q * scale), so both give the same bits.
// The tensor and its Python binding only, not <torch/extension.h> (all of libtorch's C++ API): about 11 s of
// compiling instead of 33 on a 2-core Intel Xeon.
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "isa.h"

namespace scalar {
inline float absmax(const float* x, int64_t n) {
  float m = 0.0f;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, std::fabs(x[i]));
  return m;
}
inline void quantize(const float* x, int8_t* q, int64_t n, float scale, float qmax) {
  for (int64_t i = 0; i < n; ++i) q[i] = static_cast<int8_t>(std::min(qmax, std::max(-qmax, std::nearbyint(x[i] / scale))));
}
inline void dequantize(const int8_t* q, float* x, int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) x[i] = static_cast<float>(q[i]) * scale;
}
}  // namespace scalar

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl")
namespace avx512 {
constexpr int64_t W = 16;
inline float absmax(const float* x, int64_t n) {
  __m512 m = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + W <= n; i += W) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
  return std::max(_mm512_reduce_max_ps(m), scalar::absmax(x + i, n - i));
}
inline void quantize(const float* x, int8_t* q, int64_t n, float scale, float qmax) {
  const __m512 s = _mm512_set1_ps(scale), hi = _mm512_set1_ps(qmax), lo = _mm512_set1_ps(-qmax);
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    __m512 r = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x + i), s), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    r = _mm512_min_ps(hi, _mm512_max_ps(lo, r));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(r)));
  }
  scalar::quantize(x + i, q + i, n - i, scale, qmax);
}
inline void dequantize(const int8_t* q, float* x, int64_t n, float scale) {
  const __m512 s = _mm512_set1_ps(scale);
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    __m512i wide = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i)));
    _mm512_storeu_ps(x + i, _mm512_mul_ps(_mm512_cvtepi32_ps(wide), s));
  }
  scalar::dequantize(q + i, x + i, n - i, scale);
}
}  // namespace avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2")
namespace avx2 {
constexpr int64_t W = 8;
inline float absmax(const float* x, int64_t n) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 m = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + W <= n; i += W) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
  float lanes[W];
  _mm256_storeu_ps(lanes, m);
  return std::max(*std::max_element(lanes, lanes + W), scalar::absmax(x + i, n - i));
}
inline void quantize(const float* x, int8_t* q, int64_t n, float scale, float qmax) {
  const __m256 s = _mm256_set1_ps(scale), hi = _mm256_set1_ps(qmax), lo = _mm256_set1_ps(-qmax);
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    __m256 r = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + i), s), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256i v = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, r)));
    __m128i p16 = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + i), _mm_packs_epi16(p16, p16));
  }
  scalar::quantize(x + i, q + i, n - i, scale, qmax);
}
inline void dequantize(const int8_t* q, float* x, int64_t n, float scale) {
  const __m256 s = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    __m256i wide = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + i)));
    _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_cvtepi32_ps(wide), s));
  }
  scalar::dequantize(q + i, x + i, n - i, scale);
}
}  // namespace avx2
#pragma GCC pop_options

static void check_layout(const at::Tensor& t, at::ScalarType dtype, int64_t numel, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == dtype && t.numel() == numel,
              "quantize: ", what, " must be a contiguous CPU ", c10::toString(dtype), " tensor of ", numel, " elements");
}

// int4: two values a byte, the even element in the low nibble, two's complement.
static void pack_nibbles(const int8_t* q, uint8_t* packed, int64_t n) {
  for (int64_t i = 0; i < n; i += 2) {
    const uint8_t high = i + 1 < n ? static_cast<uint8_t>(q[i + 1]) & 0xF : 0;
    packed[i / 2] = static_cast<uint8_t>((static_cast<uint8_t>(q[i]) & 0xF) | (high << 4));
  }
}
static void unpack_nibbles(const uint8_t* packed, int8_t* q, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t nibble = i % 2 ? packed[i / 2] >> 4 : packed[i / 2] & 0xF;
    q[i] = static_cast<int8_t>(static_cast<int8_t>(nibble << 4) >> 4);  // sign-extend
  }
}

// Quantizes fp32 `x` block by block into `q` (int8: one value a byte; int4: two a byte, ceil(n / 2) bytes)
// and `scales` (fp32, one a block). An all-zero block gets scale 0 and zeros.
void quantize(at::Tensor x, at::Tensor q, at::Tensor scales, int64_t bits, int64_t block) {
  TORCH_CHECK(bits == 8 || bits == 4, "quantize: bits must be 8 or 4; got ", bits);
  TORCH_CHECK(block > 0 && block % 2 == 0, "quantize: block must be a positive even number; got ", block);
  const int64_t n = x.numel(), blocks = (n + block - 1) / block;
  check_layout(x, at::kFloat, n, "x");
  check_layout(q, bits == 8 ? at::kChar : at::kByte, bits == 8 ? n : (n + 1) / 2, "q");
  check_layout(scales, at::kFloat, blocks, "scales");
  const float qmax = bits == 8 ? 127.0f : 7.0f;
  const float* xs = x.data_ptr<float>();
  float* ss = scales.data_ptr<float>();
  void* out = q.data_ptr();
  const Isa isa = active_isa();
  at::parallel_for(0, blocks, 16, [&](int64_t first, int64_t last) {
    std::vector<int8_t> nibbles(bits == 4 ? block : 0);
    for (int64_t b = first; b < last; ++b) {
      const int64_t begin = b * block, len = std::min(block, n - begin);
      const float* xb = xs + begin;
      const float m = isa == Isa::kAvx512 ? avx512::absmax(xb, len) : isa == Isa::kAvx2 ? avx2::absmax(xb, len)
                                                                                        : scalar::absmax(xb, len);
      const float scale = m / qmax;
      ss[b] = scale;
      int8_t* qb = bits == 8 ? static_cast<int8_t*>(out) + begin : nibbles.data();
      if (scale == 0.0f) std::fill(qb, qb + len, 0);
      else if (isa == Isa::kAvx512) avx512::quantize(xb, qb, len, scale, qmax);
      else if (isa == Isa::kAvx2) avx2::quantize(xb, qb, len, scale, qmax);
      else scalar::quantize(xb, qb, len, scale, qmax);
      if (bits == 4) pack_nibbles(qb, static_cast<uint8_t*>(out) + begin / 2, len);
    }
  });
}

// The inverse: x = q * scale, block by block, into fp32 `x` of n elements.
void dequantize(at::Tensor q, at::Tensor scales, at::Tensor x, int64_t bits, int64_t block) {
  TORCH_CHECK(bits == 8 || bits == 4, "dequantize: bits must be 8 or 4; got ", bits);
  TORCH_CHECK(block > 0 && block % 2 == 0, "dequantize: block must be a positive even number; got ", block);
  const int64_t n = x.numel(), blocks = (n + block - 1) / block;
  check_layout(x, at::kFloat, n, "x");
  check_layout(q, bits == 8 ? at::kChar : at::kByte, bits == 8 ? n : (n + 1) / 2, "q");
  check_layout(scales, at::kFloat, blocks, "scales");
  float* xs = x.data_ptr<float>();
  const float* ss = scales.data_ptr<float>();
  const void* in = q.data_ptr();
  const Isa isa = active_isa();
  at::parallel_for(0, blocks, 16, [&](int64_t first, int64_t last) {
    std::vector<int8_t> nibbles(bits == 4 ? block : 0);
    for (int64_t b = first; b < last; ++b) {
      const int64_t begin = b * block, len = std::min(block, n - begin);
      const int8_t* qb = static_cast<const int8_t*>(in) + begin;
      if (bits == 4) {
        unpack_nibbles(static_cast<const uint8_t*>(in) + begin / 2, nibbles.data(), len);
        qb = nibbles.data();
      }
      if (isa == Isa::kAvx512) avx512::dequantize(qb, xs + begin, len, ss[b]);
      else if (isa == Isa::kAvx2) avx2::dequantize(qb, xs + begin, len, ss[b]);
      else scalar::dequantize(qb, xs + begin, len, ss[b]);
    }
  });
}

std::string isa() { return isa_name(active_isa()); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quantize", &quantize, "Block-wise symmetric int8/int4 quantization of fp32 (scale = absmax / qmax)",
        py::call_guard<py::gil_scoped_release>());
  m.def("dequantize", &dequantize, "x = q * scale, block by block, into fp32", py::call_guard<py::gil_scoped_release>());
  m.def("isa", &isa, "The instruction set the kernel runs with");
}
