#include "retrieval/retriever_option_table.h"

#include <string>

namespace kvtier {
namespace {
using R = RetrieverOptions;
}  // namespace

const std::vector<RetrieverOptionDesc>& RetrieverOptionTable() {
  static const std::vector<RetrieverOptionDesc> table = {
      {.name = "probe",
       .field = "probe",
       .flag = "probe",
       .type = OptionType::kString,
       .meaning = "probe builder: act[:eps=..] | mean | question[:base=..,weight=..]",
       KVTIER_OPT_STRING(R, probe)},
      {.name = "alloc",
       .field = "alloc",
       .flag = "alloc",
       .type = OptionType::kString,
       .meaning = "budget allocator: entropy[:min=M,rank=cosine|logit] | topk",
       KVTIER_OPT_STRING(R, alloc)},
      {.name = "index",
       .field = "index",
       .flag = "index",
       .type = OptionType::kString,
       .meaning = "chunk index: Exact[:heads=sum|max,rerank=F,rerank_min=N,theta=E,screen=int8|int4], "
                  "Quest[:heads=sum|max] "
                  "(per-chunk "
                  "key min/max bound) or a FAISS kind (Flat, HNSW32, IVF<n>,Flat)",
       KVTIER_OPT_STRING(R, index)},
      {.name = "budget_tokens",
       .field = "budget_tokens",
       .flag = "budget",
       .meaning = "retrieved tokens per layer and step (budget_tokens / chunk_size chunks; the hot pool must "
                  "hold them; 0 = sinks and local window only)",
       .lo = 0,
       .hi = 1 << 24,
       KVTIER_OPT_INT(R, budget_tokens)},
      {.name = "reuse_cosine",
       .field = "reuse_cosine",
       .flag = "reuse",
       .type = OptionType::kDouble,
       .meaning =
           "while no chunk landed and each kv head's probe keeps this cosine with the one searched for, "
           "rescore the layer's last search's shortlist instead of every chunk (0 = search every step)",
       .dlo = 0.0,
       .dhi = 1.0,
       KVTIER_OPT_DOUBLE(R, reuse_cosine)},
      {.name = "screen_period",
       .field = "screen_period",
       .flag = "screen",
       .meaning =
           "a decode step screens a rotating 1/R of a layer's chunks and rescores its shortlist, instead "
           "of screening every chunk (1 = every chunk every step; needs alloc=entropy and the Exact index)",
       .lo = 1,
       .hi = 1 << 20,
       KVTIER_OPT_INT(R, screen_period)},
  };
  return table;
}

}  // namespace kvtier
