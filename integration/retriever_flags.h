// RetrieverSpecFlags: the command line's view of the retrieval specs (kvtier run, kvtier
// infinite). A tool's class, not the library's: the engine API takes RetrieverOptions.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "kvtier/options.h"
#include "kvtier/status.h"

namespace kvtier {

/// The command-line view of RetrieverOptions::index and ::alloc: --index / --alloc set a spec,
/// and the shorthands set one key of it: --head-merge (index "heads"), --rerank ("rerank"),
/// --rerank-min ("rerank_min"), --rank-by (alloc "rank"). A shorthand holds whichever order
/// the flags come in (--head-merge max --index Exact is Exact:heads=max). A tool's default
/// for a key (kvtier infinite: heads=max, rank=logit) fills the key where neither the spec nor
/// a shorthand sets it and the spec's kind has it (Exact has heads, Flat does not). Every call
/// rewrites options->index and options->alloc; checking them is RetrieverOptions::Validate's.
class RetrieverSpecFlags {
 public:
  /// The specs in `options` are the starting ones; `options` must outlive this object.
  explicit RetrieverSpecFlags(RetrieverOptions* options);
  Status SetIndex(const std::string& spec);
  Status SetAlloc(const std::string& spec);
  Status SetIndexKey(const std::string& key, const std::string& value);
  Status SetAllocKey(const std::string& key, const std::string& value);
  Status DefaultIndexKey(const std::string& key, const std::string& value);
  Status DefaultAllocKey(const std::string& key, const std::string& value);

 private:
  struct Part {
    std::string base;
    std::vector<std::pair<std::string, std::string>> set, defaults;
  };
  Status Update();
  RetrieverOptions* options_;
  Part index_, alloc_;
};

}  // namespace kvtier
