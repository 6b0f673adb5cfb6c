// The kernels as torch operators (`lookahead::linear_f32`, `lookahead::linear_q4`), registered from C++: eager
// calls and compiled graphs reach them through torch's dispatcher alone. Registered from Python, an op of a
// compiled graph called back into the interpreter: 14.4 us a call against 5.5 us so for a one-row 192 x 576
// linear, 121 calls a one-row float32 step of the default model (2-core EPYC, session 29).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

extern "C" void linear_f32(const float *x, const float *wp, const float *bias, float *out, int m_size, int n,
                           int k_size, int threads);
extern "C" void linear_q4(const float *x, const uint8_t *codes, const uint16_t *scales, const float *bias,
                          float *out, int m_size, int n, int k_size, int threads);

namespace {

constexpr int64_t kPanel = 16;  // output features per panel of a packed weight

// x's leading shape with `features` last: the output's shape.
std::vector<int64_t> output_shape(const at::Tensor &x, int64_t features) {
  auto shape = x.sizes().vec();
  shape.back() = features;
  return shape;
}

const float *bias_of(const std::optional<at::Tensor> &bias, int64_t features) {
  if (!bias) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == features,
              "bias must be a contiguous float32 tensor of ", features, " features");
  return bias->data_ptr<float>();
}

// x [..., k] float32, packed: `pack`'s [ceil(n / 16), k, 16] float32 layout of an [n, k] weight.
at::Tensor linear_f32_cpu(const at::Tensor &x, const at::Tensor &packed, const std::optional<at::Tensor> &bias,
                          int64_t features) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat && packed.is_contiguous(),
              "linear_f32 takes a float32 input and a contiguous float32 packed weight");
  TORCH_CHECK(packed.dim() == 3 && packed.size(1) == x.size(-1) && packed.size(2) == kPanel &&
                  packed.size(0) * kPanel >= features && features > 0,
              "packed weight ", packed.sizes(), " does not fit an input of ", x.size(-1), " and ", features,
              " features");
  auto rows = x.reshape({-1, x.size(-1)}).contiguous();
  auto out = at::empty({rows.size(0), features}, x.options());
  linear_f32(rows.data_ptr<float>(), packed.data_ptr<float>(), bias_of(bias, features), out.data_ptr<float>(),
             rows.size(0), features, rows.size(1), at::get_num_threads());
  return out.view(output_shape(x, features));
}

#ifdef __AVX512BF16__
// x [..., k] of any floating type (taken as float32), codes and scales: `pack_q4`'s layout; float32 out.
at::Tensor linear_q4_cpu(const at::Tensor &x, const at::Tensor &codes, const at::Tensor &scales,
                         const std::optional<at::Tensor> &bias) {
  TORCH_CHECK(codes.dim() == 3 && codes.size(2) == 2 * kPanel && codes.size(1) % 8 == 0,
              "linear_q4 takes pack_q4's codes, [n / 16, k / 4, 32] for k a multiple of 32, not ", codes.sizes());
  int64_t features = codes.size(0) * kPanel, inputs = codes.size(1) * 4;
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && scales.scalar_type() == at::kBFloat16 &&
                  scales.is_contiguous() && x.size(-1) == inputs,
              "linear_q4 takes pack_q4's contiguous codes (uint8) and scales (bfloat16) for an input of ", inputs);
  TORCH_CHECK(scales.dim() == 4 && scales.size(0) == codes.size(0) && scales.size(1) == inputs / 32 &&
                  scales.size(2) == 2 && scales.size(3) == kPanel,
              "linear_q4 takes pack_q4's scales, [", codes.size(0), ", ", inputs / 32, ", 2, 16] for these codes, not ",
              scales.sizes());
  auto rows = x.reshape({-1, inputs}).to(at::kFloat).contiguous();
  auto out = at::empty({rows.size(0), features}, rows.options());
  linear_q4(rows.data_ptr<float>(), codes.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t *>(scales.data_ptr()),
            bias_of(bias, features), out.data_ptr<float>(), rows.size(0), features, inputs, at::get_num_threads());
  return out.view(output_shape(x, features));
}
#endif

}  // namespace

TORCH_LIBRARY(lookahead, m) {
  m.def("linear_f32(Tensor x, Tensor packed, Tensor? bias, int features) -> Tensor");
#ifdef __AVX512BF16__
  m.def("linear_q4(Tensor x, Tensor codes, Tensor scales, Tensor? bias) -> Tensor");
#endif
}

TORCH_LIBRARY_IMPL(lookahead, CPU, m) {
  m.impl("linear_f32", &linear_f32_cpu);
#ifdef __AVX512BF16__
  m.impl("linear_q4", &linear_q4_cpu);
#endif
}
