// The ops the decode stack (decode_stack.cpp) calls directly, without torch's dispatcher: each is
// defined in its own file and registered there as a torch op too.
//
// They live in a namespace named after the build (-DTANDEM_OPS=tandem_avx2, ...): both builds are
// loaded into one process, and a shared name would let one build's calls bind to the other's code.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace TANDEM_OPS {

at::Tensor matmul(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                  const std::optional<at::Tensor>& offset, int64_t bits, int64_t group_size, int64_t rows,
                  const std::optional<at::Tensor>& bias);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor rotary_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor silu_mul(const at::Tensor& gate_up);
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, double scale);

}  // namespace TANDEM_OPS
