// Rotary position embedding (RoPE), rotate-half form as Hugging Face Llama and
// models/model.py write it. For i < D/2, with a = position * inv_freq[i]:
//   x'[i]       = x[i] cos a - x[i + D/2] sin a
//   x'[i + D/2] = x[i + D/2] cos a + x[i] sin a
// Angles are computed in double and cos/sin rounded to fp32 once, like the
// PyTorch reference, so the model's logits match it to ~1e-6.
#pragma once

#include <cstdint>
#include <vector>

namespace kvtier::kernels {

/// inv_freq[i] = theta^(-2i / head_dim), i < head_dim / 2 (head_dim even).
std::vector<double> RopeInvFreq(int head_dim, double theta);

/// Rotates x [m, heads, head_dim] fp32 in place, token t at positions[t].
/// inv_freq has head_dim / 2 entries. The cos/sin of small positions are computed once per
/// thread and kept (up to 1 MiB per calling thread, for the last inv_freq it was given): a
/// session rotates the same positions at every layer step. Kept or not, the bits are the same.
void Rope(float* x, int m, int heads, int head_dim, const int64_t* positions, const double* inv_freq);

}  // namespace kvtier::kernels
