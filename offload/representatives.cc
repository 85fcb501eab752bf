#include "offload/representatives.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "kernels/cpu/dot.h"
#include "kernels/cpu/representatives.h"

namespace kvtier {

const char* ReprChoiceName(ReprChoice c) {
  switch (c) {
    case ReprChoice::kMass:
      return "mass";
    case ReprChoice::kDiverse:
      return "diverse";
    case ReprChoice::kCluster:
      return "cluster";
  }
  return "unknown";
}

bool ParseReprChoice(const std::string& name, ReprChoice* out) {
  if (name == "mass") {
    *out = ReprChoice::kMass;
    return true;
  }
  if (name == "diverse") {
    *out = ReprChoice::kDiverse;
    return true;
  }
  if (name == "cluster") {
    *out = ReprChoice::kCluster;
    return true;
  }
  return false;
}

const char* ReprHeadsName(ReprHeads h) {
  switch (h) {
    case ReprHeads::kKv:
      return "kv";
    case ReprHeads::kQuery:
      return "query";
  }
  return "unknown";
}

bool ParseReprHeads(const std::string& name, ReprHeads* out) {
  if (name == "kv") {
    *out = ReprHeads::kKv;
    return true;
  }
  if (name == "query") {
    *out = ReprHeads::kQuery;
    return true;
  }
  return false;
}

Status ChooseRepresentatives(const RepresentativeInput& in, uint8_t* repr) {
  const Geometry& g = in.geometry;
  const int cs = in.chunk_size, D = g.head_dim, H = g.kv_heads, R = in.repr_topk;
  // The store validated all of this once at Open; a direct caller gets a named error.
  if (cs <= 0)
    return InvalidArgument("ChooseRepresentatives: chunk_size must be > 0 (got " + std::to_string(cs) + ")");
  if (R <= 0 || R > cs)
    return InvalidArgument("ChooseRepresentatives: repr_topk must be in [1, chunk_size=" +
                           std::to_string(cs) + "] (got " + std::to_string(R) + ")");
  if (H <= 0 || D <= 0)
    return InvalidArgument("ChooseRepresentatives: geometry kv_heads and head_dim must be > 0 (got " +
                           std::to_string(H) + ", " + std::to_string(D) + ")");
  if (in.keys == nullptr || repr == nullptr)
    return InvalidArgument("ChooseRepresentatives: keys and out must not be null");
  const int Hout = in.out_heads == 0 ? H : in.out_heads;
  if (Hout < H || Hout % H != 0)
    return InvalidArgument("ChooseRepresentatives: out_heads (" + std::to_string(Hout) +
                           ") must be 0, kv_heads or a multiple of kv_heads (" + std::to_string(H) + ")");
  const int heads_per_kv = Hout / H;  // out head h takes the keys of kv head h / heads_per_kv
  if (in.mass != nullptr && in.mass_stride < static_cast<size_t>(cs))
    return InvalidArgument("ChooseRepresentatives: mass_stride (" + std::to_string(in.mass_stride) +
                           ") must be >= chunk_size (" + std::to_string(cs) + ")");

  const size_t head_bytes = static_cast<size_t>(D) * DTypeSize(g.dtype);
  std::vector<float> keys;  // converted lazily: only the fallback, diverse and cluster need fp32 keys
  std::vector<int> order(cs);
  std::vector<float> score(cs), mean(D), inv_norm(cs), covered(cs);
  std::vector<char> taken(cs);
  std::vector<int> group(cs);
  int normed_head = -1;  // the head whose keys inv_norm holds
  auto key = [&](int h, int t) { return &keys[(static_cast<size_t>(t) * H + h) * D]; };
  // The chunk's keys in fp32 (converted once) and inv_norm of head h's (once per head).
  auto unit_norms = [&](int h) {
    if (keys.empty()) {
      keys.resize(static_cast<size_t>(cs) * H * D);
      ToFloat(g.dtype, in.keys, keys.data(), keys.size());
    }
    if (normed_head == h) return;
    for (int t = 0; t < cs; ++t) {
      const float nk = kernels::Dot(key(h, t), key(h, t), D);
      inv_norm[t] = nk > 0.0f ? 1.0f / std::sqrt(nk) : 0.0f;
    }
    normed_head = h;
  };
  // The mass rule and its no-statistics fallback: kernels/cpu/representatives.h's flow, which
  // the device seal runs too (the same tokens for the same keys and mass).
  const kernels::MassChoiceShape shape{g.dtype, H, D, cs, R, Hout};
  std::vector<float> scratch(kernels::MassChoiceScratchFloats(shape));
  for (int h = 0; h < Hout; ++h) {
    const int kh = h / heads_per_kv;
    const float* mass = in.mass != nullptr ? in.mass + static_cast<size_t>(h) * in.mass_stride : nullptr;
    const bool statistics = kernels::ChooseMassTokens(shape, in.keys, mass, h, scratch.data(), order.data());
    std::copy_n(scratch.begin(), cs, score.begin());
    if (statistics && in.choice != ReprChoice::kMass && R > 1) {
      // order[0] is the most attended token; each next one maximises
      // mass / top mass - its highest cosine with a token taken (ties: the earlier token).
      unit_norms(kh);
      const float top = score[order[0]];
      std::fill(covered.begin(), covered.end(), -std::numeric_limits<float>::infinity());
      std::fill(taken.begin(), taken.end(), 0);
      for (int r = 0; r + 1 < R; ++r) {
        const int last = order[r];
        taken[last] = 1;
        int next = -1;
        float next_value = 0.0f;
        for (int t = 0; t < cs; ++t) {
          if (taken[t]) continue;
          covered[t] =
              std::max(covered[t], kernels::Dot(key(kh, t), key(kh, last), D) * inv_norm[t] * inv_norm[last]);
          const float value = score[t] / top - covered[t];
          if (next < 0 || value > next_value) {
            next = t;
            next_value = value;
          }
        }
        order[r + 1] = next;
      }
    }
    if (in.choice == ReprChoice::kCluster && R < cs) {
      unit_norms(kh);
      // group[t]: the seed (representative index) token t joins.
      std::fill(group.begin(), group.end(), -1);
      for (int r = 0; r < R; ++r) group[order[r]] = r;
      for (int t = 0; t < cs; ++t) {
        if (group[t] >= 0) continue;
        float best = -std::numeric_limits<float>::infinity();
        for (int r = 0; r < R; ++r) {
          const float c = kernels::Dot(key(kh, t), key(kh, order[r]), D) * inv_norm[t] * inv_norm[order[r]];
          if (group[t] < 0 || c > best) {
            group[t] = r;
            best = c;
          }
        }
      }
      for (int r = 0; r < R; ++r) {
        std::fill(mean.begin(), mean.end(), 0.0f);
        int members = 0;
        for (int t = 0; t < cs; ++t) {
          if (group[t] != r) continue;
          for (int d = 0; d < D; ++d) mean[d] += key(kh, t)[d];
          ++members;
        }
        for (int d = 0; d < D; ++d) mean[d] /= static_cast<float>(members);
        FromFloat(g.dtype, mean.data(), repr + (static_cast<size_t>(r) * Hout + h) * head_bytes, D);
      }
      continue;
    }
    for (int r = 0; r < R; ++r)
      std::memcpy(repr + (static_cast<size_t>(r) * Hout + h) * head_bytes,
                  in.keys + (static_cast<size_t>(order[r]) * H + kh) * head_bytes, head_bytes);
  }
  return Status::Ok();
}

}  // namespace kvtier
