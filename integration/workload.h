// Workload: a deterministic synthetic Q/K/V generator shaped like the
// ∞-Bench retrieval tasks (passkey, kv_retrieval).
//
// A long filler context hides `needle_count` needles of `needle_len` tokens;
// the last `question_len` tokens of the context (the question window) and the
// `decode_steps` generated tokens after it carry queries that seek the
// needles. `kvtier run` streams the context through the tiered store in
// windows and compares sparse retrieval attention against full attention on
// the same tokens; both sides regenerate what they need, so every number is a
// pure function of (seed, layer, position, head, lane).
//
// ---- The model ---------------------------------------------------------------
// Notation: D = head_dim, P = D/2 rotary pairs, L = the logit scale. Scores are
// q·k/sqrt(D). Every structured vector below is a unit vector times a
// strength, multiplied by D^(1/4) before it is written, so that the score of
// two structured parts is simply strength_q * strength_k * cos(angle) in logit
// units, whatever D is. Noise is added per component with standard deviation
// `noise`, so the noise·noise part of a score has standard deviation noise^2
// (and a strength-a part crossed with noise has a*noise/D^(1/4)).
//
// Signal band. All structured directions live in the lowest-frequency
// `signal_band` fraction of the rotary pairs (default: the last quarter,
// pairs [P - P/4, P), both dims of each pair); the rest of q and k is noise.
// With Llama-3.1 frequency scaling (rope_scaling = 8, the default) those
// pairs turn less than ~1 radian over 128K positions, so a needle's score
// keeps ~93% of its strength at 128K distance (~40% at 512K); with plain
// RoPE (rope_scaling = 1) the same band keeps only ~25-35% at 64K-128K,
// i.e. the needle signal then decays with distance.
//
// Per (layer, kv head) the generator draws random unit directions in the
// band: a sink direction s; one anchor u_i per needle (orthogonal to s and to
// each other while the band has room); and one topic direction T_j per
// segment j of `topic_len` tokens (orthogonal to s). Topic directions are NOT
// orthogonal to the anchors: a filler segment can resemble a needle by
// chance, as in real text. The topic at position t is
//     topic(t) = normalize((1 - f) T_j + f T_{j+1}),  j = t / topic_len,
//                                                     f = (t % topic_len) / topic_len,
// so it drifts smoothly and two tokens share a topic only within ~topic_len.
// Keys (position t):
//     sink   (t < sink_tokens)        k = sink_strength   * s      + noise
//     needle (t inside needle i)      k = anchor_strength * u_i    + noise
//     other  (filler, question, decode) k = topic_strength * topic(t) + noise
// Queries (every q head of a group shares the directions and gets its own noise):
//     seeker (t >= question_begin)    q = anchor_strength * u_i + sink_query * s + noise
//             with i = (t - question_begin) % needle_count (round-robin over
//             the needles, the same needle for all q heads of the position);
//             with question_anchor_every = N > 1 only every N-th question-window
//             query seeks (i = ((t - question_begin) / N) % needle_count), the
//             others are filler queries; decode steps always seek
//     filler (t < question_begin)     q = topic_strength * topic(t) + sink_query * s + noise
//             and, for the `needle_echo` tokens right after needle i, also
//             + echo_weight * anchor_strength * u_i: text that follows a
//             passkey refers back to it, so the needle is salient while it is
//             in the local window (what InfLLM's representative-key choice
//             relies on); needle_echo = 0 removes that cue.
// So a seeker scores anchor_strength^2 on its needle's tokens, sink_query *
// sink_strength on the sinks, and anchor_strength * topic_strength * cos(u_i,
// topic) on filler; a filler query scores topic_strength^2 on its own topic,
// decaying over ~topic_len, and sink_query * sink_strength on the sinks
// (before the RoPE attenuation above).
// Anisotropic keys (key_decay, key_outliers; off by default): the key noise's std on rotary
// pair p is (1 + p)^-key_decay times key_outlier_scale on the first key_outliers pairs, scaled
// so that the noise keeps its power; `kvtier run --key-spectrum calibrated` sets the decay
// measured on kvtier-tiny's traces (scripts/key_spectrum.py).
// Values: v = N(0, 1) per component for every token (not scaled by `noise`);
// needle tokens add needle_value * sqrt(D) * w_i, where w_i is a random unit
// direction in all D dims (values are not rotated), so the attention output
// of a seeker carries share_i * needle_value * sqrt(D) * w_i and visibly
// changes when retrieval misses needle i.
//
// Needle placement: the haystack is [sink_tokens, question_begin), H tokens.
// Needle i starts at sink_tokens + floor(H * (needle_depth + i * (1 -
// needle_depth) / needle_count)): the first at depth needle_depth of the
// haystack, the others evenly spread towards its end. Validate() rejects
// needles that overlap each other or run into the question window.
//
// RoPE: rotate-half layout (Hugging Face Llama): pair p couples dims p and
// p + D/2 with frequency theta_p = rope_base^(-2p/D), then Llama-3.1 scaling
// (factor rope_scaling, low_freq_factor 1, high_freq_factor 4, original
// context 8192: wavelengths above 8192 are divided by the factor, below 2048
// kept, smoothly blended between). q and k are rotated by their absolute
// position; v is not. apply_rope = false writes the pre-RoPE vectors.
//
// Randomness: a counter-based generator. Each (seed, layer, position,
// stream, head) is hashed to a 64-bit key; lane l of the vector is
// splitmix64's finaliser of key + (l + 1) * 0x9E3779B97F4A7C15, and its four
// 16-bit fields are summed into an Irwin-Hall(4) variate standardised to
// mean 0, variance 1 (an approximate normal bounded to ±3.46; scores sum D of
// them, so they are Gaussian to the eye). Directions come from the same
// generator under separate stream ids. Nothing depends on the order or
// blocking of Generate calls; the loops over lanes vectorise.
//
// Defaults, measured with a naive full softmax (tests/integration/workload_test.cc
// prints them): at 128K context, needle at depth 0.5, a question query puts
// ~0.29-0.35 of its attention on its needle's 8 tokens at head_dim 64 and
// ~0.38-0.48 at head_dim 128 (across seeds); ~0.28 / 0.35 at depth 0 and
// ~0.35 / 0.50 at depth 0.95; ~0.7 / 0.9 at 8K. The other needles get ~0,
// the sinks ~1-3%. Filler queries put ~10-25% on the sinks and ~10% (128K)
// to ~40% (8K) on the last topic_len tokens. With rope_scaling = 1 the needle
// share at 128K drops to ~0.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "store/geometry.h"
#include "store/status.h"

namespace kvtier {

struct WorkloadOptions {
  int64_t context = 131072;      ///< tokens of context (filler + needles + question window)
  int question_len = 64;         ///< last tokens of the context whose queries seek the needle(s)
  int decode_steps = 64;         ///< generated tokens after the context (queries seek the needle too)
  int needle_count = 1;          ///< needles planted
  int needle_len = 8;            ///< tokens per needle
  double needle_depth = 0.5;     ///< depth of the first needle as a fraction of the haystack [sink_tokens,
                                 ///< question_begin); further needles spread evenly to its end
  float anchor_strength = 3.3f;  ///< how strongly needle keys and question queries share a direction (0 = no
                                 ///< signal); seeker-needle score = anchor_strength^2
  float noise = 1.0f;  ///< std of the isotropic per-component noise on q and k (score noise std = noise^2)
  float sink_strength = 8.0f;  ///< key strength of the first `sink_tokens` tokens along the sink direction
  float sink_query =
      0.75f;  ///< every query's component along the sink direction (sink score = sink_query * sink_strength)
  int sink_tokens = 4;          ///< tokens that act as attention sinks
  float topic_strength = 2.0f;  ///< strength of the topic direction in filler keys and filler queries
                                ///< (same-topic score = topic_strength^2)
  int topic_len = 256;  ///< tokens over which the filler's topic direction drifts (gives chunks coherent
                        ///< content and makes filler queries attend locally)
  int question_anchor_every = 1;  ///< in the question window only every N-th query seeks a needle; the others
                                  ///< read like filler (anchor tokens among plain ones, ActQKV's premise)
  int needle_echo = 16;  ///< filler tokens right after a needle whose queries also look back at it (0 = none)
  float echo_weight = 0.5f;     ///< strength of that look-back, as a fraction of anchor_strength
  float needle_value = 1.0f;    ///< needle values add needle_value * sqrt(D) along a per-needle direction
  double signal_band = 0.25;    ///< fraction of rotary pairs (the lowest-frequency ones) that carry all
                                ///< structured directions, in (0, 1]
  double rope_base = 500000.0;  ///< RoPE base (Llama-3 uses 500000)
  double rope_scaling = 8.0;    ///< Llama-3.1 low-frequency scaling factor (1 = plain RoPE)
  bool apply_rope = true;       ///< false: write pre-RoPE q and k (for tests and probe studies)
  /// Anisotropic keys (off by default: decay 0, no outliers): the key noise's std on rotary pair
  /// p (both of its dims; p = 0 turns fastest) is proportional to (1 + p)^-key_decay, times
  /// key_outlier_scale on the first key_outliers pairs, all scaled so that the key noise keeps
  /// its power (D noise^2 a key). Queries, values and the structured directions are unchanged.
  /// Calibrated on kvtier-tiny's trace (docs/benchmarks.md, "A certified hierarchy:
  /// experiment"): decay 0.5, no outlier pair (kKeySpectrumCalibrated).
  double key_decay = 0.0;
  int key_outliers = 0;            ///< pairs whose key noise std is scaled by key_outlier_scale (<= D/2)
  double key_outlier_scale = 1.0;  ///< > 0
  uint64_t seed = 1;               ///< root of every random number

  /// Names the bad field (e.g. needle_depth outside [0,1), needles not
  /// fitting before the question window, context <= question_len).
  Status Validate() const;
};

/// `--key-spectrum`'s calibrated setting: "decay=0.5,outliers=0,scale=1".
inline constexpr const char* kKeySpectrumCalibrated = "decay=0.5,outliers=0,scale=1";
/// Sets key_decay, key_outliers and key_outlier_scale from "off" (isotropic keys), "calibrated"
/// (kKeySpectrumCalibrated) or "decay=A[,outliers=K][,scale=S]" (keys left out keep their
/// defaults 0, 0, 1); InvalidArgument names the bad key or value.
Status ParseKeySpectrum(const std::string& spec, WorkloadOptions* options);
/// "off", or "decay=A,outliers=K,scale=S".
std::string KeySpectrumString(const WorkloadOptions& options);

class Workload {
 public:
  /// An empty workload, only to be assigned to (Generate on it aborts).
  Workload() = default;
  /// Validates `geometry` (head_dim must be even) and `options`.
  static Result<Workload> Create(const Geometry& geometry, const WorkloadOptions& options);

  /// Q [n, q_heads, head_dim], K and V [n, kv_heads, head_dim], fp32, for
  /// positions [begin, end) of `layer`, n = end - begin; positions >= context
  /// are decode steps. Post-RoPE q and k (unless apply_rope is false). A pure
  /// function of (seed, layer, position): any split of a range gives the same
  /// bytes. Any of q/k/v may be null (skipped). Requires 0 <= layer < layers
  /// and 0 <= begin <= end <= total_tokens() (aborts otherwise). Thread-safe.
  void Generate(int layer, int64_t begin, int64_t end, float* q, float* k, float* v) const;

  /// Every needle token position, sorted (needle_count * needle_len entries).
  const std::vector<int64_t>& needle_positions() const { return needle_positions_; }
  /// First token of each needle, sorted (needle_count entries).
  const std::vector<int64_t>& needle_starts() const { return needle_starts_; }
  /// The needle index a query at `position` seeks, or -1 for a filler query
  /// (position < question_begin()).
  int SoughtNeedle(int64_t position) const;
  /// The needle whose echo window (the needle_echo filler tokens right after
  /// it) contains `position`, or -1.
  int EchoedNeedle(int64_t position) const;
  /// The needle index whose tokens include `position`, or -1.
  int NeedleAt(int64_t position) const;
  /// context - question_len.
  int64_t question_begin() const { return options_.context - options_.question_len; }
  /// context + decode_steps.
  int64_t total_tokens() const { return options_.context + options_.decode_steps; }
  const Geometry& geometry() const { return geometry_; }
  const WorkloadOptions& options() const { return options_; }

 private:
  struct Tables;  // directions and RoPE tables, shared by copies (immutable)

  Geometry geometry_;
  WorkloadOptions options_;
  std::vector<int64_t> needle_positions_;
  std::vector<int64_t> needle_starts_;
  std::shared_ptr<const Tables> tables_;
};

}  // namespace kvtier
