// The synthetic workload's key-spectrum knob (`kvtier run --key-spectrum`,
// integration/workload.h ParseKeySpectrum): the key noise's power per rotary pair follows the
// documented decay and outliers with its total kept, "calibrated" is the documented setting, "off"
// gives the isotropic bytes, and bad specs are refused.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "integration/workload.h"

namespace kvtier {
namespace {

// Per pair p of head 0's pre-RoPE keys: the mean square over `n` filler tokens.
std::vector<double> PairPower(const WorkloadOptions& base, const std::string& spectrum, int D) {
  WorkloadOptions o = base;
  EXPECT_TRUE(ParseKeySpectrum(spectrum, &o).ok()) << spectrum;
  const Geometry g{1, 2, 1, D, DType::kF32};
  auto w = Workload::Create(g, o);
  EXPECT_TRUE(w.ok()) << w.status().ToString();
  const int64_t n = 4000;
  std::vector<float> k(static_cast<size_t>(n) * D);
  w.value().Generate(0, 100, 100 + n, nullptr, k.data(), nullptr);
  std::vector<double> power(D / 2, 0.0);
  for (int64_t t = 0; t < n; ++t)
    for (int d = 0; d < D; ++d) power[d % (D / 2)] += static_cast<double>(k[t * D + d]) * k[t * D + d] / n;
  return power;
}

TEST(WorkloadKeySpectrum, ShapesTheKeyNoiseAsDocumented) {
  WorkloadOptions o;
  o.context = 8192;
  o.apply_rope = false;
  o.topic_strength = 0.0f;  // noise alone in the keys (the filler's topic is 0)
  o.sink_tokens = 0;
  const int D = 64, P = D / 2;
  const std::vector<double> iso = PairPower(o, "off", D);
  const std::vector<double> decayed = PairPower(o, "decay=0.5", D);
  const std::vector<double> outlier = PairPower(o, "decay=0,outliers=2,scale=4", D);
  double iso_sum = 0, dec_sum = 0, out_sum = 0;
  for (int p = 0; p < P; ++p) {
    iso_sum += iso[p];
    dec_sum += decayed[p];
    out_sum += outlier[p];
  }
  // The noise keeps its power; isotropic pairs hold 2 noise^2 each.
  EXPECT_NEAR(dec_sum / iso_sum, 1.0, 0.02);
  EXPECT_NEAR(out_sum / iso_sum, 1.0, 0.02);
  EXPECT_NEAR(iso[0] / iso[P - 1], 1.0, 0.1);
  // decay=0.5: the power on pair p is ~ (1 + p)^-1.
  EXPECT_NEAR(decayed[0] / decayed[P - 1], static_cast<double>(P), 0.1 * P);
  EXPECT_NEAR(decayed[1] / decayed[3], 2.0, 0.2);
  // outliers=2,scale=4: pairs 0 and 1 hold 16x the power of the others.
  EXPECT_NEAR(outlier[0] / outlier[5], 16.0, 1.6);
  EXPECT_NEAR(outlier[1] / outlier[P - 1], 16.0, 1.6);
  EXPECT_NEAR(outlier[2] / outlier[P - 1], 1.0, 0.1);
  // "calibrated" is the documented setting; "off" restores the isotropic bytes.
  WorkloadOptions c = o;
  ASSERT_TRUE(ParseKeySpectrum("calibrated", &c).ok());
  EXPECT_EQ(KeySpectrumString(c), "decay=0.5,outliers=0,scale=1");
  ASSERT_TRUE(ParseKeySpectrum("off", &c).ok());
  EXPECT_EQ(KeySpectrumString(c), "off");
  EXPECT_EQ(PairPower(c, "off", D), iso);
  for (const char* bad : {"decay=-1", "decay", "outliers=1.5", "scale=0", "wobble=1"}) {
    WorkloadOptions b = o;
    EXPECT_FALSE(ParseKeySpectrum(bad, &b).ok()) << bad;
  }
  WorkloadOptions too_many = o;
  ASSERT_TRUE(ParseKeySpectrum("decay=0,outliers=40,scale=2", &too_many).ok());
  EXPECT_FALSE(Workload::Create(Geometry{1, 2, 1, D, DType::kF32}, too_many).ok());
}

}  // namespace
}  // namespace kvtier
