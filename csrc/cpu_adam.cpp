// hf_zero's CPU Adam (ZeRO-Offload, section 5.1): one pass over memory, vectorised with AVX-512 or
// AVX2 chosen at run time, threaded with ATen's parallel_for (OpenMP in torch's CPU builds).
//
// torch's fused CPU AdamW already vectorises; what it lacks is the mixed-precision form ZeRO-Offload
// needs: fp32 master and moments, bf16/fp16 gradients in and bf16/fp16 parameters out, without a
// separate conversion pass over each. That is why this kernel exists.
// The tensor and its Python binding only, not <torch/extension.h> (all of libtorch's C++ API): about 11 s of
// compiling instead of 33 on a 2-core Intel Xeon.
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>

#include "isa.h"

// Scalars as torch computes them, in double, then rounded once to fp32 (1 - beta in fp32 arithmetic would
// differ from torch's by an ulp and so would every update).
struct AdamHyper {
  float one_minus_beta1, beta2, one_minus_beta2, eps, step_size, bias_correction2_sqrt, l2_decay,
      decoupled_decay, grad_scale;
};

// Stands for "no compute-dtype copy to write".
struct NoOut {};

namespace scalar {
template <typename G, typename O>
void adam_range(float* param, const G* grad, float* exp_avg, float* exp_avg_sq, O* out,
                int64_t begin, int64_t end, const AdamHyper& h) {
  for (int64_t i = begin; i < end; ++i) {
    float g = static_cast<float>(grad[i]) * h.grad_scale;
    float p = param[i];
    if (h.l2_decay != 0.0f) g = std::fma(p, h.l2_decay, g);
    if (h.decoupled_decay != 1.0f) p = p * h.decoupled_decay;
    float m = exp_avg[i];
    m = std::fma(h.one_minus_beta1, g - m, m);
    float v = std::fma(h.one_minus_beta2 * g, g, exp_avg_sq[i] * h.beta2);
    float denom = std::sqrt(v) / h.bias_correction2_sqrt + h.eps;
    p = p + (-h.step_size * m) / denom;
    param[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    if constexpr (!std::is_same_v<O, NoOut>) out[i] = static_cast<O>(p);  // c10 rounds to nearest even
  }
}
}  // namespace scalar

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,fma")
namespace avx512 {
using V = __m512;
constexpr int64_t W = 16;
inline V set1(float x) { return _mm512_set1_ps(x); }
inline V add(V a, V b) { return _mm512_add_ps(a, b); }
inline V sub(V a, V b) { return _mm512_sub_ps(a, b); }
inline V mul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V div(V a, V b) { return _mm512_div_ps(a, b); }
inline V vsqrt(V a) { return _mm512_sqrt_ps(a); }
inline V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V load(const float* x) { return _mm512_loadu_ps(x); }
inline V load(const c10::BFloat16* x) {
  __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline V load(const c10::Half* x) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))); }
inline void store(float* x, V v) { _mm512_storeu_ps(x, v); }
inline void store(NoOut*, V) {}
inline void store(c10::BFloat16* x, V v) {  // round to nearest even; NaN stays a quiet NaN, as c10 does
  __m512i bits = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(x), _mm512_cvtepi32_epi16(rounded));
}
inline void store(c10::Half* x, V v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(x), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#include "adam_kernel.h"
}  // namespace avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
using V = __m256;
constexpr int64_t W = 8;
inline V set1(float x) { return _mm256_set1_ps(x); }
inline V add(V a, V b) { return _mm256_add_ps(a, b); }
inline V sub(V a, V b) { return _mm256_sub_ps(a, b); }
inline V mul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V div(V a, V b) { return _mm256_div_ps(a, b); }
inline V vsqrt(V a) { return _mm256_sqrt_ps(a); }
inline V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V load(const float* x) { return _mm256_loadu_ps(x); }
inline V load(const c10::BFloat16* x) {
  __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline V load(const c10::Half* x) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x))); }
inline void store(float* x, V v) { _mm256_storeu_ps(x, v); }
inline void store(NoOut*, V) {}
inline void store(c10::BFloat16* x, V v) {
  __m256i bits = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), nan);
  // packus works per 128-bit lane; the permute puts the two lanes' four halves next to each other.
  __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0b1000);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(x), _mm256_castsi256_si128(packed));
}
inline void store(c10::Half* x, V v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(x), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#include "adam_kernel.h"
}  // namespace avx2
#pragma GCC pop_options

template <typename G, typename O>
static void run(float* param, const G* grad, float* exp_avg, float* exp_avg_sq, O* out, int64_t n,
                const AdamHyper& h) {
  // Grains of 64K elements keep each thread's chunk a multiple of every vector width.
  const Isa isa = active_isa();
  at::parallel_for(0, n, 1 << 16, [&](int64_t begin, int64_t end) {
    if (isa == Isa::kAvx512) avx512::adam_range(param, grad, exp_avg, exp_avg_sq, out, begin, end, h);
    else if (isa == Isa::kAvx2) avx2::adam_range(param, grad, exp_avg, exp_avg_sq, out, begin, end, h);
    else scalar::adam_range(param, grad, exp_avg, exp_avg_sq, out, begin, end, h);
  });
}

template <typename G>
static void run_with_out(float* p, const G* g, float* m, float* v, const c10::optional<at::Tensor>& out,
                         int64_t n, const AdamHyper& h) {
  if (!out.has_value()) return run(p, g, m, v, static_cast<NoOut*>(nullptr), n, h);
  if (out->scalar_type() == at::kBFloat16) return run(p, g, m, v, out->data_ptr<c10::BFloat16>(), n, h);
  if (out->scalar_type() == at::kHalf) return run(p, g, m, v, out->data_ptr<c10::Half>(), n, h);
  return run(p, g, m, v, out->data_ptr<float>(), n, h);
}

// One Adam step on a contiguous fp32 master `param` with its moments, in place. `grad` may be fp32,
// bf16 or fp16 and is multiplied by grad_scale first (unscaling and clipping folded in); `out`, when
// given (fp32, bf16 or fp16), receives the updated parameter in its dtype in the same pass.
void adam_step(at::Tensor param, at::Tensor grad, at::Tensor exp_avg, at::Tensor exp_avg_sq,
               c10::optional<at::Tensor> out, int64_t step, double lr, double beta1, double beta2,
               double eps, double weight_decay, bool adamw_mode, double grad_scale) {
  const int64_t n = param.numel();
  for (const at::Tensor* t : {&param, &exp_avg, &exp_avg_sq}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == n,
                "CPU Adam: param, exp_avg and exp_avg_sq must be contiguous fp32 CPU tensors of one size");
  }
  TORCH_CHECK(grad.device().is_cpu() && grad.is_contiguous() && grad.numel() == n,
              "CPU Adam: grad must be a contiguous CPU tensor the size of param");
  if (out.has_value()) {
    TORCH_CHECK(out->device().is_cpu() && out->is_contiguous() && out->numel() == n,
                "CPU Adam: out must be a contiguous CPU tensor the size of param");
    TORCH_CHECK(out->scalar_type() == at::kFloat || out->scalar_type() == at::kBFloat16 ||
                out->scalar_type() == at::kHalf, "CPU Adam: out must be fp32, bf16 or fp16");
  }
  TORCH_CHECK(step >= 1, "CPU Adam: step counts from 1");
  const double bias_correction1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bias_correction2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  AdamHyper h{static_cast<float>(1.0 - beta1), static_cast<float>(beta2), static_cast<float>(1.0 - beta2),
              static_cast<float>(eps),
              static_cast<float>(lr / bias_correction1), static_cast<float>(std::sqrt(bias_correction2)),
              adamw_mode ? 0.0f : static_cast<float>(weight_decay),
              adamw_mode ? static_cast<float>(1.0 - lr * weight_decay) : 1.0f, static_cast<float>(grad_scale)};
  float* p = param.data_ptr<float>();
  float* m = exp_avg.data_ptr<float>();
  float* v = exp_avg_sq.data_ptr<float>();
  switch (grad.scalar_type()) {
    case at::kFloat: return run_with_out(p, grad.data_ptr<float>(), m, v, out, n, h);
    case at::kBFloat16: return run_with_out(p, grad.data_ptr<c10::BFloat16>(), m, v, out, n, h);
    case at::kHalf: return run_with_out(p, grad.data_ptr<c10::Half>(), m, v, out, n, h);
    default: TORCH_CHECK(false, "CPU Adam: grad must be fp32, bf16 or fp16; got ", grad.scalar_type());
  }
}

std::string isa() { return isa_name(active_isa()); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The GIL is released so that a delayed update can run beside the next forward and backward.
  m.def("adam_step", &adam_step, "One fused Adam/AdamW step (fp32 master and moments; fp32/bf16/fp16 grad and out)",
        py::call_guard<py::gil_scoped_release>());
  m.def("isa", &isa, "The instruction set the kernel runs with");
}
