// ActQKV's dynamic KV cut-off (Sec. 4.2, Eq. 12, Algorithm 1) as a scalar flow over a POD state:
// the CPU twin that defines what the device grant (kernels/cuda/grant.cu, LaunchEntropyGrant)
// computes, and the one implementation of Eq. 12 on the CPU (retrieval/budget.h's EntropyBudget
// holds its running state in an EntropyGrantState and calls these).
//
// The state's pointers let the same struct describe host memory (EntropyBudget's vectors) or
// device memory (the state, and its arrays, allocated on the device), so that a decode step on
// the device grants layer after layer from the Theta that kernels::SegmentEntropy (Eq. 11)
// wrote, with no host wait between layers.
//
// The arithmetic functions are inline and compile for the host and the device
// (KVTIER_HOST_DEVICE): the kernel and the twin run the same source, in the same operation
// order, so their grants and state are equal bit for bit (no multiply-add to contract; IEEE
// double division and floor on both sides). Plain C++17 with no CUDA include: nvcc compiles it.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>

#include "kernels/cpu/attention.h"  // KernelError
#include "kernels/host_device.h"

namespace kvtier::kernels {

/// The entropy allocator's running state (EntropyBudget's, and the device grant's).
struct EntropyGrantState {
  int layers = 0;                  ///< L, >= 1; theta_sum and theta_count hold L entries
  int min_chunks = 1;              ///< M, >= 1: the minimum of a layer that has chunks
  int64_t remaining = 0;           ///< B_kv: budget left in the current step
  double step_theta_sum = 0.0;     ///< Theta of this step's layers with chunks so far
  int32_t step_theta_count = 0;    ///< how many layers of this step had chunks so far
  double last_theta = 0.0;         ///< Theta of the last layer granted with chunks
  double* theta_sum = nullptr;     ///< [layers]: sum of Theta^l over previous grants of layer l
  int64_t* theta_count = nullptr;  ///< [layers]: how many grants of layer l had chunks
};

/// Starts a step of k chunks per layer (k >= min_chunks, checked by the caller):
/// B_kv = L * k (int64), the step's Theta sum and count reset. The running means stay.
KVTIER_HOST_DEVICE inline void EntropyGrantBeginStep(EntropyGrantState* state, int k) {
  state->remaining = static_cast<int64_t>(state->layers) * k;  // B_kv = L x k
  state->step_theta_sum = 0.0;
  state->step_theta_count = 0;
}

/// ActQKV Eq. 12 for layer `layer` (0 <= layer < L, served shallow -> deep) with n > 0 chunks of
/// Eq. 11 entropy theta (finite, >= 0), from the current state; no state changes.
///   - Theta-bar^j of a deeper layer j: theta_sum[j] / theta_count[j]; a layer never granted
///     yet uses the mean of this step's Theta so far, Theta^l included.
///   - B^l = Theta^l / (Theta^l + sum_{j>l} Theta-bar^j) * B_kv; B_kv / (L - l) when that
///     denominator is 0; B_kv for the last layer (an empty sum).
///   - floor(B^l * (1 + 1e-9)): the relative tolerance keeps a product that is an integer in
///     exact arithmetic; the leftover fraction stays in B_kv for the deeper layers.
///   - Clamp to [min(M, n), min(n, B_kv - M * (L - 1 - l))]: M reserved for every deeper layer.
/// Returns -1 when those bounds cross (the bookkeeping broke: B_kv < M * (L - l)).
KVTIER_HOST_DEVICE inline int64_t EntropyGrantShare(const EntropyGrantState& state, int layer, int n,
                                                    double theta) {
  const int L = state.layers, M = state.min_chunks;
  // Stand-in for unseen layers: the mean of this step's entropies so far, this layer's included.
  const double step_mean = (state.step_theta_sum + theta) / (state.step_theta_count + 1);
  // Eq. 12 denominator: Theta^l + sum_{j>l} Theta-bar^j.
  double deeper = 0.0;
  for (int j = layer + 1; j < L; ++j)
    deeper +=
        state.theta_count[j] > 0 ? state.theta_sum[j] / static_cast<double>(state.theta_count[j]) : step_mean;
  const double budget = static_cast<double>(state.remaining);
  double share;  // B^l before rounding
  if (layer == L - 1) {
    share = budget;  // Eq. 12 with an empty sum: everything that is left
  } else if (theta + deeper > 0.0) {
    share = theta / (theta + deeper) * budget;  // Eq. 12
  } else {
    share = budget / static_cast<double>(L - layer);  // 0/0: even split of what is left
  }
  // Floor (leftover fraction stays in B_kv for the deeper layers), with a 1e-9 relative tolerance.
  const int64_t rounded = static_cast<int64_t>(::floor(share * (1.0 + 1e-9)));
  // Clamp to [min(M, n), min(n, B_kv - M * (deeper layers))]: reserve the deeper layers' minimum.
  const int64_t reserve = static_cast<int64_t>(M) * (L - 1 - layer);
  const int64_t left = state.remaining - reserve;
  const int64_t hi = n < left ? static_cast<int64_t>(n) : left;
  const int64_t lo = M < n ? M : n;
  if (hi < lo) return -1;
  return rounded < lo ? lo : (hi < rounded ? hi : rounded);
}

/// ActQKV Algorithm 1 for one layer: EntropyGrantShare, then the bookkeeping
/// (B_kv -= B^l, Theta^l into this step's sum and, after the layer, into its running mean).
/// n == 0: returns 0 and records nothing (no entropy for a layer without chunks). Returns -1,
/// changing nothing, when the bounds cross.
KVTIER_HOST_DEVICE inline int64_t EntropyGrantTake(EntropyGrantState* state, int layer, int n, double theta) {
  if (n == 0) return 0;
  const int64_t take = EntropyGrantShare(*state, layer, n, theta);
  if (take < 0) return -1;
  state->last_theta = theta;
  state->step_theta_sum += theta;
  ++state->step_theta_count;
  state->remaining -= take;  // Algorithm 1: B_kv <- B_kv - B^l (what the layer actually took)
  // The running mean of layer l is updated only after the layer is processed.
  state->theta_sum[layer] += theta;
  ++state->theta_count[layer];
  return take;
}

/// Why a grant failed (EntropyGrantParams::error); 0 = no failure.
inline constexpr int32_t kEntropyGrantOk = 0;
/// Theta is not finite or is negative (Eq. 11 of finite scores is finite and >= 0).
inline constexpr int32_t kEntropyGrantBadTheta = 1;
/// *non_finite > 0: some of the layer's scores were not finite (Eq. 11 is undefined).
inline constexpr int32_t kEntropyGrantNonFiniteScores = 2;
/// The clamp's bounds crossed (B_kv < M * (L - l)): the step's bookkeeping broke.
inline constexpr int32_t kEntropyGrantBoundsCross = 3;
/// *n < 0, or layer outside [0, L) of the state.
inline constexpr int32_t kEntropyGrantBadArgument = 4;

/// One layer's grant, over device memory (LaunchEntropyGrant) or host memory (EntropyGrantStep).
/// Entropy mode (fixed_k == 0), in this order:
///   - *n < 0 or layer outside [0, state->layers): kEntropyGrantBadArgument;
///   - *n == 0: take 0, state untouched (EntropyBudget::AllocateWithEntropy);
///   - non_finite set and *non_finite > 0: kEntropyGrantNonFiniteScores;
///   - *theta not finite or negative: kEntropyGrantBadTheta;
///   - EntropyGrantTake, -1: kEntropyGrantBoundsCross;
///   - else take = min(grant, cap). The state is charged the whole grant, as EntropyBudget is
///     (the caller clips to its pool as the host path does).
/// A failure writes take = 0, leaves the state untouched, and writes its code to *error (when
/// set) unless *error already holds one: *error keeps the first failure since the caller last
/// cleared it, so one read after a step's layers tells whether any failed.
/// Fixed-k mode ("topk", fixed_k >= 1): take = min(fixed_k, *n, cap) (0 for *n < 0, with
/// kEntropyGrantBadArgument); state, theta and non_finite are not read (may be null).
struct EntropyGrantParams {
  EntropyGrantState* state = nullptr;   ///< entropy mode: the state; its arrays in the same memory
  int layer = 0;                        ///< host value: the layer granted now (0 .. L-1, in order)
  const int32_t* n = nullptr;           ///< [1] the layer's chunk count
  const double* theta = nullptr;        ///< [1] the layer's Eq. 11 entropy (SegmentEntropy's output)
  const int32_t* non_finite = nullptr;  ///< [1] optional: the layer's non-finite score count
  int cap = 0;                          ///< host value, >= 0: the most the hot pool holds
  int fixed_k = 0;                      ///< 0: entropy (Eq. 12); >= 1: topk with this k
  int32_t* take = nullptr;              ///< [1] out: how many chunks the layer takes
  int32_t* error = nullptr;             ///< [1] optional out: the first failure's code
};

/// The flow EntropyGrantParams describes, on pointers the caller can dereference (the kernel's
/// one thread, or the host twin). Arguments are checked by the callers (EntropyGrantCheck).
KVTIER_HOST_DEVICE inline void EntropyGrantRun(const EntropyGrantParams& p) {
  const int32_t n = *p.n;
  int32_t failure = kEntropyGrantOk;
  int64_t take = 0;
  if (p.fixed_k > 0) {
    if (n < 0)
      failure = kEntropyGrantBadArgument;
    else
      take = p.fixed_k < n ? p.fixed_k : n;
  } else if (n < 0 || p.layer < 0 || p.layer >= p.state->layers) {
    failure = kEntropyGrantBadArgument;
  } else if (n > 0) {
    const double theta = *p.theta;
    if (p.non_finite != nullptr && *p.non_finite > 0) {
      failure = kEntropyGrantNonFiniteScores;
    } else if (!(theta >= 0.0 && theta <= DBL_MAX)) {  // NaN fails both comparisons
      failure = kEntropyGrantBadTheta;
    } else {
      take = EntropyGrantTake(p.state, p.layer, n, theta);
      if (take < 0) {
        failure = kEntropyGrantBoundsCross;
        take = 0;
      }
    }
  }
  if (take > p.cap) take = p.cap;
  *p.take = static_cast<int32_t>(take);
  if (failure != kEntropyGrantOk && p.error != nullptr && *p.error == kEntropyGrantOk) *p.error = failure;
}

/// The host-side checks of EntropyGrantParams both entry points make: kBadShape for cap < 0,
/// fixed_k < 0 or layer < 0; kNullPointer for n or take null, or (entropy mode) state or theta
/// null. What lives behind the pointers (n, theta, the state's layers) is checked by the flow.
KernelError EntropyGrantCheck(const EntropyGrantParams& p);

/// CPU twin of LaunchEntropyGrant: EntropyGrantCheck, then EntropyGrantRun over host memory.
KernelError EntropyGrantStep(const EntropyGrantParams& p);

}  // namespace kvtier::kernels
