// libFuzzer target: every factory string kvtier parses from users (flags, specs in
// files): scoring policies, demotion policies, probes, budget allocators, chunk index
// specs, device names and RetrieverOptions::Parse. The first byte picks the factory,
// the rest is the string. What parses must print back (ToString / canonical form) to a
// string that parses again to the same thing.
#include <cstddef>
#include <cstdint>
#include <string>

#include "offload/demotion_policy.h"
#include "offload/hot_tier.h"
#include "offload/policy/scoring_policy.h"
#include "retrieval/budget.h"
#include "retrieval/chunk_index.h"
#include "retrieval/probe.h"
#include "retrieval/retriever.h"

using namespace kvtier;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0 || size > 512) return 0;
  const std::string spec(reinterpret_cast<const char*>(data + 1), size - 1);
  const Geometry g{2, 4, 2, 16, DType::kF32};
  switch (data[0] % 7) {
    case 0: {
      // A tables= path would read a file of the fuzzer's choosing (the table format
      // has its own target).
      if (spec.find("tables") != std::string::npos) return 0;
      auto p = MakeScoringPolicy(spec);
      if (p.ok()) {
        auto again = MakeScoringPolicy((*p)->ToString());
        if (!again.ok() || (*again)->ToString() != (*p)->ToString()) __builtin_trap();
      }
      break;
    }
    case 1:
      (void)MakeDemotionPolicy(spec);
      break;
    case 2:
      (void)MakeProbeBuilder(spec, g);
      break;
    case 3:
      (void)MakeBudgetAllocator(spec);
      break;
    case 4: {
      auto canon = CanonicalChunkIndexSpec(spec);
      if (canon.ok()) {
        auto again = CanonicalChunkIndexSpec(*canon);
        if (!again.ok() || *again != *canon) __builtin_trap();
        // Building a FAISS index takes most of a second (and runs uninstrumented code):
        // FAISS specs are fuzzed as far as their parsing and canonical form.
        if (canon->rfind("Exact", 0) == 0) (void)MakeChunkIndex(spec, ChunkShape{2, 16, 2, DType::kF32});
      }
      break;
    }
    case 5:
      (void)ParseDevice(spec);
      break;
    case 6: {
      auto o = RetrieverOptions::Parse(spec);
      if (o.ok()) {
        auto again = RetrieverOptions::Parse(o->ToString());
        if (!again.ok() || again->ToString() != o->ToString()) __builtin_trap();
      }
      break;
    }
  }
  return 0;
}
