#include "integration/retriever_flags.h"

#include <functional>

#include "retrieval/budget.h"
#include "retrieval/chunk_index.h"
#include "retrieval/retriever.h"

namespace kvtier {

RetrieverSpecFlags::RetrieverSpecFlags(RetrieverOptions* options) : options_(options) {
  index_.base = options->index;
  alloc_.base = options->alloc;
}

Status RetrieverSpecFlags::SetIndex(const std::string& spec) {
  index_.base = spec;
  return Update();
}

Status RetrieverSpecFlags::SetAlloc(const std::string& spec) {
  alloc_.base = spec;
  return Update();
}

namespace {
void Put(std::vector<std::pair<std::string, std::string>>* keys, const std::string& key,
         const std::string& value) {
  for (auto& kv : *keys)
    if (kv.first == key) {
      kv.second = value;
      return;
    }
  keys->emplace_back(key, value);
}
}  // namespace

Status RetrieverSpecFlags::SetIndexKey(const std::string& key, const std::string& value) {
  Put(&index_.set, key, value);
  return Update();
}

Status RetrieverSpecFlags::SetAllocKey(const std::string& key, const std::string& value) {
  Put(&alloc_.set, key, value);
  return Update();
}

Status RetrieverSpecFlags::DefaultIndexKey(const std::string& key, const std::string& value) {
  Put(&index_.defaults, key, value);
  return Update();
}

Status RetrieverSpecFlags::DefaultAllocKey(const std::string& key, const std::string& value) {
  Put(&alloc_.defaults, key, value);
  return Update();
}

Status RetrieverSpecFlags::Update() {
  auto build = [](const Part& part,
                  const std::function<bool(const std::string&)>& kind_has) -> Result<std::string> {
    std::string spec = part.base;
    for (const auto& [key, value] : part.set) {
      KVTIER_ASSIGN_OR_RETURN(spec, SetSpecKey(spec, key, value));
    }
    for (const auto& [key, value] : part.defaults) {
      if (!SpecKey(spec, key).empty()) continue;
      auto with = SetSpecKey(spec, key, value);
      if (with.ok() && kind_has(*with)) spec = *with;
    }
    return spec;
  };
  KVTIER_ASSIGN_OR_RETURN(
      std::string index, build(index_, [](const std::string& s) { return CanonicalChunkIndexSpec(s).ok(); }));
  KVTIER_ASSIGN_OR_RETURN(std::string alloc,
                          build(alloc_, [](const std::string& s) { return MakeBudgetAllocator(s).ok(); }));
  options_->index = index;
  options_->alloc = alloc;
  return Status::Ok();
}

}  // namespace kvtier
