#include "retrieval/retriever.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <numeric>

#include "retrieval/retriever_option_table.h"
#include "store/factory_spec.h"

namespace kvtier {
namespace {

double MsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// The chunks of an allocator's grant `take` that a hot slot pool of `cap` chunks cannot hold.
size_t BeyondPool(int take, size_t cap) {
  const size_t granted = static_cast<size_t>(std::max(0, take));
  return granted > cap ? granted - cap : 0;
}

// reuse_cosine as ToString spells it: the shortest text that reads back to the same double.
std::string FormatReuse(double c) {
  char buf[32];
  for (int digits = 1; digits <= 17; ++digits) {
    std::snprintf(buf, sizeof(buf), "%.*g", digits, c);
    if (std::strtod(buf, nullptr) == c) break;
  }
  return buf;
}

// The spec's last item: " reuse=C", or nothing when reuse is off (the default).
std::string ReuseItem(double c) { return c != 0.0 ? " reuse=" + FormatReuse(c) : ""; }
// The spec's " screen=R", or nothing when every step screens every chunk (the default).
std::string ScreenItem(int r) { return r != 1 ? " screen=" + std::to_string(r) : ""; }

// The shortlist a search keeps for reuse_cosine: kReuseShortlist x the grant `t`, and at
// least t + t / 8 + 2 (Retriever::ReuseLast needs the next grant to fit).
constexpr size_t kReuseShortlist = 3;
size_t ShortlistSize(size_t t) { return std::max(kReuseShortlist * t, t + t / 8 + 2); }
// The shortlist the rolling screen (screen_period > 1) keeps: kSliceShortlist x the grant `t`,
// and at least t + t / 8 + 2 (the next grant moves by a chunk or two). Twice, not three times:
// each step rescores it exactly, and the slice brings in what it lacks.
constexpr size_t kSliceShortlist = 2;
size_t SliceShortlistSize(size_t t) { return std::max(kSliceShortlist * t, t + t / 8 + 2); }

// Any valid geometry checks a probe spec (the probe needs one to be built).
const Geometry kSpecGeometry{1, 1, 1, 2, DType::kF32};

}  // namespace

// ---- options and spec strings -------------------------------------------------------

Status RetrieverOptions::Validate() const {
  KVTIER_RETURN_IF_ERROR(CheckOptionRanges(RetrieverOptionTable(), *this));
  auto i = CanonicalChunkIndexSpec(index);
  if (!i.ok()) return InvalidArgument("index: " + i.status().message());
  auto a = MakeBudgetAllocator(alloc);
  if (!a.ok()) return InvalidArgument("alloc: " + a.status().message());
  if (screen_period > 1 && !(*a)->reads_scores())
    return InvalidArgument("screen_period " + std::to_string(screen_period) +
                           " needs an allocator that reads every chunk's score (alloc=entropy), not '" +
                           alloc + "': the topk allocator takes the index's top k (screen_period 1)");
  if (screen_period > 1 && i->rfind("Exact", 0) != 0)
    return InvalidArgument("screen_period " + std::to_string(screen_period) +
                           " needs the Exact index kind, not '" + *i +
                           "' (FAISS kinds cannot screen part of their chunks)");
  auto p = MakeProbeBuilder(probe, kSpecGeometry);
  if (!p.ok()) return InvalidArgument("probe: " + p.status().message());
  return Status::Ok();
}

std::string RetrieverOptions::ToString() const {
  // Each part canonical where it parses; as given where it does not (Validate names it).
  auto p = MakeProbeBuilder(probe, kSpecGeometry);
  auto a = MakeBudgetAllocator(alloc);
  auto i = CanonicalChunkIndexSpec(index);
  return "probe=" + (p.ok() ? (*p)->ToString() : probe) + " alloc=" + (a.ok() ? (*a)->ToString() : alloc) +
         " index=" + (i.ok() ? *i : index) + " budget=" + std::to_string(budget_tokens) +
         ReuseItem(reuse_cosine) + ScreenItem(screen_period);
}

Result<RetrieverOptions> RetrieverOptions::Parse(const std::string& spec) {
  RetrieverOptions o;
  std::vector<std::string> seen;
  size_t pos = 0;
  while (pos < spec.size()) {
    if (spec[pos] == ' ') {
      ++pos;
      continue;
    }
    const size_t end = std::min(spec.find(' ', pos), spec.size());
    const std::string item = spec.substr(pos, end - pos);
    pos = end;
    const size_t eq = item.find('=');
    if (eq == std::string::npos || eq == 0 || eq + 1 == item.size())
      return InvalidArgument("malformed item '" + item + "' in retriever spec '" + spec +
                             "' (expected key=value)");
    const std::string key = item.substr(0, eq), value = item.substr(eq + 1);
    if (std::find(seen.begin(), seen.end(), key) != seen.end())
      return InvalidArgument("duplicate key '" + key + "' in retriever spec '" + spec + "'");
    seen.push_back(key);
    if (key == "probe") {
      o.probe = value;
    } else if (key == "alloc") {
      o.alloc = value;
    } else if (key == "index") {
      o.index = value;
    } else if (key == "budget") {
      KVTIER_ASSIGN_OR_RETURN(o.budget_tokens, ParseSpecInt(spec, key, value));
    } else if (key == "reuse") {
      KVTIER_ASSIGN_OR_RETURN(o.reuse_cosine, ParseSpecDouble(spec, key, value));
    } else if (key == "screen") {
      KVTIER_ASSIGN_OR_RETURN(o.screen_period, ParseSpecInt(spec, key, value));
    } else {
      return InvalidArgument("unknown key '" + key + "' in retriever spec '" + spec +
                             "' (known: probe, alloc, index, budget, reuse, screen)");
    }
  }
  KVTIER_RETURN_IF_ERROR(o.Validate());
  return o;
}

Result<std::string> SetSpecKey(const std::string& spec, const std::string& key, const std::string& value) {
  KVTIER_ASSIGN_OR_RETURN(FactorySpec fs, ParseFactorySpec(spec, "factory"));
  bool found = false;
  for (auto& kv : fs.params)
    if (kv.first == key) {
      kv.second = value;
      found = true;
    }
  if (!found) fs.params.emplace_back(key, value);
  std::string out = fs.name;
  for (size_t i = 0; i < fs.params.size(); ++i)
    out += (i == 0 ? ":" : ",") + fs.params[i].first + "=" + fs.params[i].second;
  return out;
}

std::string SpecKey(const std::string& spec, const std::string& key) {
  auto fs = ParseFactorySpec(spec, "factory");
  if (!fs.ok()) return "";
  for (const auto& kv : fs->params)
    if (kv.first == key) return kv.second;
  return "";
}

// ---- Retriever ----------------------------------------------------------------------

Result<std::unique_ptr<Retriever>> Retriever::Create(TieredStore* store, const RetrieverOptions& options) {
  if (store == nullptr) return InvalidArgument("Retriever needs a store");
  std::unique_ptr<RetrievalBackend> backend;
  HotTier* hot = store->hot_tier();
  auto canonical = CanonicalChunkIndexSpec(options.index);
  const bool exact = canonical.ok() && canonical->rfind("Exact", 0) == 0;  // FAISS kinds stay on the host
  if (hot != nullptr && hot->device() == Device::kCuda && exact) {
    // The device scorer builds a decode probe per kv head from the queries (BackendQueries);
    // it has no per-query-head probe.
    if (store->options().repr_heads == ReprHeads::kQuery)
      return InvalidArgument(
          "Retriever: repr_heads=query (representatives per query head) is not served by the cuda "
          "retrieval backend, which pools a decode probe per kv head; use an index kind that stays on "
          "the host (a FAISS kind such as Flat) or repr_heads=kv on a cuda tier");
    KVTIER_ASSIGN_OR_RETURN(backend, MakeRetrievalBackend("cuda"));
  }
  return Create(store, options, std::move(backend));
}

Result<std::unique_ptr<Retriever>> Retriever::Create(TieredStore* store, const RetrieverOptions& options,
                                                     std::unique_ptr<RetrievalBackend> backend) {
  if (store == nullptr) return InvalidArgument("Retriever needs a store");
  KVTIER_RETURN_IF_ERROR(options.Validate());
  auto r = std::unique_ptr<Retriever>(new Retriever(store, options));
  const StoreOptions& so = store->options();
  // Representatives per query head (ReprHeads::kQuery) are scored by a probe per query head, as
  // InfLLM scores with the query heads themselves: the probe builder sees an MHA geometry
  // (kv_heads = q_heads), so every builder's per-kv-head pooling over a GQA group is the
  // identity and its probe is [q_heads, head_dim], the index's heads.
  Geometry probe_geometry = so.geometry;
  probe_geometry.kv_heads = so.repr_head_count();
  if (backend != nullptr && so.repr_heads == ReprHeads::kQuery)
    return InvalidArgument(
        "Retriever: repr_heads=query (representatives per query head) cannot use a retrieval backend: "
        "its probe kernels pool a decode probe per kv head");
  r->shape_ = ChunkShape{so.repr_head_count(), so.geometry.head_dim, so.repr_topk, so.geometry.dtype};
  KVTIER_ASSIGN_OR_RETURN(r->probe_, MakeProbeBuilder(options.probe, probe_geometry));
  KVTIER_ASSIGN_OR_RETURN(r->alloc_, MakeBudgetAllocator(options.alloc));
  {
    // Checks the index spec against the real shape (e.g. a FAISS PQ<m> needs m | dimension).
    auto index = MakeChunkIndex(options.index, r->shape_);
    if (!index.ok()) return InvalidArgument("index: " + index.status().message());
    if (so.index_bytes > 0)
      KVTIER_RETURN_IF_ERROR((*index)->SetMemoryCap(so.index_bytes / so.geometry.layers));
    r->mirrors_ = dynamic_cast<ExactChunkIndex*>(index->get()) != nullptr;  // Index() attaches these
    r->spec_ = "probe=" + r->probe_->ToString() + " alloc=" + r->alloc_->ToString() +
               " index=" + (*index)->ToString() + " budget=" + std::to_string(options.budget_tokens) +
               ReuseItem(options.reuse_cosine) + ScreenItem(options.screen_period);
  }
  r->backend_ = std::move(backend);
  r->k_ = options.budget_tokens / so.chunk_size;
  r->probe_buf_.resize(probe_geometry.token_elems());
  r->probe_vec_.resize(probe_geometry.token_elems());
  return r;
}

void Retriever::BeginStep() { alloc_->BeginStep(store_->options().geometry.layers, std::max(1, k_)); }

Result<Retriever::LayerIndex*> Retriever::Index(SequenceId seq, int layer) {
  const uint64_t key = seq * 65536 + static_cast<uint64_t>(layer);
  auto it = indexes_.find(key);
  if (it == indexes_.end()) {
    LayerIndex li;
    KVTIER_ASSIGN_OR_RETURN(li.index, MakeChunkIndex(options_.index, shape_));
    if (const uint64_t cap = store_->options().index_bytes; cap > 0)
      KVTIER_RETURN_IF_ERROR(li.index->SetMemoryCap(cap / store_->options().geometry.layers));
    if (backend_ != nullptr)
      if (auto* exact = dynamic_cast<ExactChunkIndex*>(li.index.get()); exact != nullptr) {
        KVTIER_RETURN_IF_ERROR(exact->AttachBackend(backend_.get()));
        li.mirrored = exact;
      }  // FAISS kinds: the host, on any tier
    it = indexes_.emplace(key, std::move(li)).first;
  }
  return &it->second;
}

Status Retriever::Sync(SequenceId seq, int layer) {
  KVTIER_ASSIGN_OR_RETURN(LayerIndex * li, Index(seq, layer));
  // One store call per layer step: the chunks landed and dropped since the last one. A first
  // sync over a long sequence takes them kSyncBatch at a time.
  bool first = true;
  do {
    KVTIER_RETURN_IF_ERROR(store_->ChunkUpdatesSince(seq, layer, li->cursor, &update_, kSyncBatch));
    // More than a batch: the index grows once, to all of them.
    if (first && !update_.complete) li->index->Reserve(update_.added.size() + update_.pending);
    first = false;
    KVTIER_RETURN_IF_ERROR(ApplyUpdate(li, update_));
  } while (!update_.complete);
  ShrinkUpdate(&update_);
  return Status::Ok();
}

Result<ChunkCursor> Retriever::Cursor(SequenceId seq, int layer) {
  KVTIER_ASSIGN_OR_RETURN(LayerIndex * li, Index(seq, layer));
  return li->cursor;
}

Status Retriever::Apply(SequenceId seq, int layer, const ChunkUpdate& update) {
  KVTIER_ASSIGN_OR_RETURN(LayerIndex * li, Index(seq, layer));
  if (update.since.chunks != li->cursor.chunks || update.since.drops != li->cursor.drops)
    return Sync(seq, layer);  // taken from another cursor: the index asks the store itself
  if (!update.complete) li->index->Reserve(update.added.size() + update.pending);
  KVTIER_RETURN_IF_ERROR(ApplyUpdate(li, update));
  if (&update == &step_update_) ShrinkUpdate(&step_update_);
  return update.complete ? Status::Ok() : Sync(seq, layer);
}

void Retriever::ShrinkUpdate(ChunkUpdate* update) const {
  if (update->repr.size() > 64 * shape_.repr_floats()) {
    std::vector<float>().swap(update->repr);
    std::vector<uint64_t>().swap(update->added);
  }
}

Status Retriever::ApplyUpdate(LayerIndex* li, const ChunkUpdate& update) {
  const size_t repr_elems = shape_.repr_floats();
  if (!update.added.empty()) {
    const std::vector<uint64_t>& added = update.added;
    KVTIER_RETURN_IF_ERROR(li->index->Add(added, [&](uint64_t i, float* repr) -> Status {
      const auto it = std::lower_bound(added.begin(), added.end(), i);
      if (it == added.end() || *it != i)
        return NotFound("chunk " + std::to_string(i) + " was not handed over");
      const float* src = update.repr.data() + static_cast<size_t>(it - added.begin()) * repr_elems;
      std::copy(src, src + repr_elems, repr);
      return Status::Ok();
    }));
  }
  if (!update.added.empty() || !update.dropped.empty()) ForgetSearch(li);
  if (!update.dropped.empty()) li->roll_valid = false;  // rows shift: the kept cosines are off
  li->cursor.chunks = update.next.chunks;               // added (Add is all or nothing): never added twice
  if (!update.dropped.empty()) KVTIER_RETURN_IF_ERROR(li->index->Remove(update.dropped));
  li->cursor.drops = update.next.drops;
  return Status::Ok();
}

Status Retriever::Forget(SequenceId seq, int layer, const std::vector<uint64_t>& chunk_indices) {
  KVTIER_RETURN_IF_ERROR(Sync(seq, layer));  // index everything first, so nothing dropped is added later
  KVTIER_ASSIGN_OR_RETURN(LayerIndex * li, Index(seq, layer));
  ForgetSearch(li);
  li->roll_valid = false;
  return li->index->Remove(chunk_indices);
}

Status Retriever::Observe(int layer, const float* q, int m) {
  return probe_->Build(layer, q, m, probe_buf_.data());
}

Status Retriever::SetQuestion(int layer, const float* q, int m) { return probe_->SetQuestion(layer, q, m); }

Result<LayerSelection> Retriever::Select(SequenceId seq, int layer, const float* q, int m, bool decode,
                                         const ChunkUpdate* update) {
  return CountedSelect(seq, layer, q, m, decode, update, nullptr);
}

Result<LayerSelection> Retriever::SelectDecodeOnBackend(SequenceId seq, int layer,
                                                        const BackendQueries& queries,
                                                        const ChunkUpdate* update) {
  if (!SelectsDecodeOnBackend())
    return FailedPrecondition(
        "Retriever::SelectDecodeOnBackend: the selection runs on the host here (no backend, or reuse_cosine "
        "compares probes on the host): pass the query in host memory");
  if (queries.q == nullptr) return InvalidArgument("Retriever::SelectDecodeOnBackend: the query is null");
  return CountedSelect(seq, layer, nullptr, 1, /*decode=*/true, update, &queries);
}

Result<Retriever::LaneLayer> Retriever::PrepareLaneLayer(SequenceId seq, int layer,
                                                         const ChunkUpdate* update) {
  if (!SelectsDecodeOnBackend())
    return FailedPrecondition(
        "Retriever::PrepareLaneLayer: the selection runs on the host here (no backend "
        "mirror, or reuse_cosine compares probes on the host)");
  KVTIER_RETURN_IF_ERROR(update != nullptr ? Apply(seq, layer, *update) : Sync(seq, layer));
  KVTIER_ASSIGN_OR_RETURN(LayerIndex * li, Index(seq, layer));
  if (li->mirrored == nullptr)
    return FailedPrecondition("Retriever::PrepareLaneLayer: layer " + std::to_string(layer) +
                              "'s index keeps no backend mirror");
  ForgetSearch(li);  // the lane's choice is not on the host: no shortlist to reuse
  LaneLayer out;
  KVTIER_ASSIGN_OR_RETURN(out.score, li->mirrored->MirrorView());
  out.row_ids = &li->mirrored->row_ids();
  out.n = static_cast<int>(out.row_ids->size());
  const StoreOptions& so = store_->options();
  out.cap = static_cast<int>(std::min<uint64_t>(so.hot_bytes / so.chunk_bytes(), INT32_MAX));
  out.k = k_;
  out.entropy = alloc_->reads_scores();
  out.rank = out.entropy ? alloc_->rank() : ChunkRank::kLogit;
  out.sealed_rows = so.repr_choice == ReprChoice::kMass && li->mirrored->RowsAreRepresentatives();
  return out;
}

void Retriever::LaneServed(int layer) {
  alloc_->MarkServed(layer);
  ++selections_;
}

Result<LayerSelection> Retriever::CountedSelect(SequenceId seq, int layer, const float* q, int m, bool decode,
                                                const ChunkUpdate* update, const BackendQueries* queries) {
  // The layer's index reads, counted by the index per call: the difference around the selection
  // (a reused search's subset adds its own reads in ReuseLast).
  return ReturnOnBadAlloc([&] { return "Retriever::Select: layer " + std::to_string(layer) + "'s index"; },
                          [&]() -> Result<LayerSelection> {
                            KVTIER_ASSIGN_OR_RETURN(LayerIndex * li, Index(seq, layer));
                            const IndexReadBytes before = li->index->read_bytes();
                            KVTIER_ASSIGN_OR_RETURN(LayerSelection sel,
                                                    SelectLayer(seq, layer, q, m, decode, update, queries));
                            const IndexReadBytes after = li->index->read_bytes();
                            sel.first_stage_bytes += after.first_stage - before.first_stage;
                            sel.rescoring_bytes += after.rescoring - before.rescoring;
                            read_bytes_.first_stage += sel.first_stage_bytes;
                            read_bytes_.rescoring += sel.rescoring_bytes;
                            return sel;
                          });
}

Status Retriever::QueriesFinite(int layer, int32_t count, int32_t first) const {
  if (count == 0) return Status::Ok();
  const int d = store_->options().geometry.head_dim;
  return InvalidArgument("layer " + std::to_string(layer) + ": q[0][" + std::to_string(first / d) + "][" +
                         std::to_string(first % d) + "] is not finite (" + std::to_string(count) +
                         " NaN or infinite value(s), found where the query is, on the device); queries must "
                         "be finite");
}

Result<LayerSelection> Retriever::SelectLayer(SequenceId seq, int layer, const float* q, int m, bool decode,
                                              const ChunkUpdate* update, const BackendQueries* queries) {
  // Scratch grows with the layer's chunks and the window: an allocation failure is ResourceExhausted.
  return ReturnOnBadAlloc(
      [&] { return "Retriever::Select: scores of layer " + std::to_string(layer) + "'s chunks"; },
      [&]() -> Result<LayerSelection> {
        LayerSelection sel;
        const StoreOptions& so = store_->options();
        auto t0 = std::chrono::steady_clock::now();
        if (queries == nullptr) {
          KVTIER_RETURN_IF_ERROR(decode ? probe_->BuildDecode(layer, q, probe_buf_.data())
                                        : probe_->Build(layer, q, m, probe_buf_.data()));
          std::copy(probe_buf_.begin(), probe_buf_.end(), probe_vec_.begin());
        }  // else the backend builds it (SelectOnBackend)
        sel.probe_ms = MsSince(t0);

        t0 = std::chrono::steady_clock::now();
        KVTIER_RETURN_IF_ERROR(update != nullptr ? Apply(seq, layer, *update) : Sync(seq, layer));
        KVTIER_ASSIGN_OR_RETURN(LayerIndex * li, Index(seq, layer));
        const ChunkIndex& index = *li->index;
        const int n = static_cast<int>(index.size());
        if (k_ == 0 || n == 0) {
          // StreamingLLM-style budget 0, or nothing sealed yet: only sinks + local.
          if (queries != nullptr) {  // nothing to select, and still no NaN query passes
            int32_t bad = 0, first = 0;
            KVTIER_RETURN_IF_ERROR(backend_->CheckQueries(*queries, so.geometry.head_dim, &bad, &first));
            KVTIER_RETURN_IF_ERROR(QueriesFinite(layer, bad, first));
          }
          LayerScores none{nullptr, 0};
          KVTIER_ASSIGN_OR_RETURN(int unused, alloc_->Allocate(layer, none));
          (void)unused;
          sel.search_ms = MsSince(t0);
          return sel;
        }
        // Never more than the hot slot pool holds: the entropy cut-off can hand one layer most of
        // the step's budget.
        const size_t cap = so.hot_bytes / so.chunk_bytes();
        ++selections_;
        if (options_.reuse_cosine > 0.0 && li->last_valid) {
          KVTIER_ASSIGN_OR_RETURN(bool reused, ReuseLast(li, layer, n, cap, &sel));
          if (reused) {
            sel.search_ms = MsSince(t0);
            return sel;
          }
        }
        if (li->mirrored != nullptr) {
          sel.search_ms = MsSince(t0);
          KVTIER_RETURN_IF_ERROR(SelectOnBackend(li, layer, n, cap, &sel, queries));
          return sel;
        }
        if (queries != nullptr)
          return FailedPrecondition("Retriever::SelectDecodeOnBackend: layer " + std::to_string(layer) +
                                    "'s index keeps no backend mirror");
        if (options_.screen_period > 1 && decode) {
          KVTIER_ASSIGN_OR_RETURN(bool rolled, ScreenSlice(li, layer, n, cap, &sel));
          if (rolled) {
            sel.search_ms = MsSince(t0);
            return sel;
          }
        }
        if (!alloc_->reads_scores()) {
          // Fixed k: the index serves its top k (approximate kinds stay sub-linear).
          const size_t k = std::min(static_cast<size_t>(k_), cap);
          KVTIER_RETURN_IF_ERROR(
              index.Search(probe_vec_.data(),
                           options_.reuse_cosine > 0.0 ? std::min(cap, ShortlistSize(k)) : k, &sel.chunks));
          RememberSearch(li, sel.chunks, sel.chunks.size(), 0.0);
          sel.chunks.resize(std::min(sel.chunks.size(), k));
          sel.search_ms = MsSince(t0);
          t0 = std::chrono::steady_clock::now();
          KVTIER_ASSIGN_OR_RETURN(int take, alloc_->Allocate(layer, LayerScores{nullptr, n}));
          sel.chunks.resize(std::min<size_t>(sel.chunks.size(), static_cast<size_t>(take)));
          sel.clipped = BeyondPool(take, cap);
          sel.alloc_ms = MsSince(t0);
          return sel;
        }
        // The entropy cut-off needs every chunk's score (Eq. 10-11 over the whole cache): the
        // allocator reads the screened Eq. 10 cosines (with the index's "theta" certificate, the
        // chunks that weigh most in Eq. 11 rescored exactly until Θ is within it), then the index
        // returns the layer's B^l best by the allocator's rank (refined from the stored keys
        // where the screen was approximate).
        KVTIER_RETURN_IF_ERROR(index.Screen(probe_vec_.data(), &scores_));
        if (const double target = index.entropy_error_target(); target > 0.0) {
          double theta_bound = 0.0;
          KVTIER_RETURN_IF_ERROR(index.RefineForEntropy(probe_vec_.data(), target, &scores_, &theta_bound));
        }
        sel.search_ms = MsSince(t0);
        t0 = std::chrono::steady_clock::now();
        KVTIER_ASSIGN_OR_RETURN(int take, alloc_->Allocate(layer, LayerScores{scores_.cosine.data(), n}));
        sel.entropy = alloc_->last_entropy();  // Θ^ℓ, computed once by the allocator
        sel.alloc_ms = MsSince(t0);
        t0 = std::chrono::steady_clock::now();
        const size_t t = std::min(static_cast<size_t>(std::max(0, take)), cap);
        sel.clipped = BeyondPool(take, cap);
        // With reuse on, the shortlist a reusing step rescores (ReuseLast): the best
        // kReuseShortlist x the grant, and never fewer than a few more than the grant (a later
        // step's Eq. 12 grant from the same entropy moves by a chunk or two).
        const size_t shortlist = options_.reuse_cosine > 0.0  ? ShortlistSize(t)
                                 : options_.screen_period > 1 ? SliceShortlistSize(t)
                                                              : t;
        const size_t keep = std::min({static_cast<size_t>(n), cap, shortlist});
        KVTIER_RETURN_IF_ERROR(index.Best(probe_vec_.data(), scores_, alloc_->rank(), keep, &sel.chunks));
        RememberSearch(li, sel.chunks, sel.chunks.size(), sel.entropy);
        if (options_.screen_period > 1) {
          // A decode step's full screen starts the rolling screen over (a prefill window's
          // probe is another query's: the next decode step screens every chunk again).
          li->roll_valid = decode && !sel.chunks.empty();
          if (li->roll_valid) {
            li->roll_ids = scores_.ids;
            li->roll_cos = scores_.cosine;
            KeepEntropySums(li);
            li->roll_cursor = 0;
            li->roll_shortlist = sel.chunks;
            li->roll_granted = t;
            li->roll_evicted = index.evicted_chunks();
          }
        }
        sel.chunks.resize(std::min(sel.chunks.size(), t));
        sel.search_ms += MsSince(t0);
        return sel;
      });
}

Result<bool> Retriever::ReuseLast(LayerIndex* li, int layer, int n, size_t cap, LayerSelection* sel) {
  for (int h = 0; h < shape_.kv_heads; ++h) {  // the probe's heads (query heads under repr_heads=query)
    const size_t off = static_cast<size_t>(h) * shape_.head_dim;
    if (Cosine(probe_vec_.data() + off, li->last_probe.data() + off, shape_.head_dim) < options_.reuse_cosine)
      return false;  // this head's probe moved: search again
  }
  // The grant the stored search's entropy gets now; the stored choice must cover it.
  const size_t want =
      std::min(static_cast<size_t>(std::max(0, alloc_->WouldTake(layer, n, li->last_theta))), cap);
  if (want > li->last_chunks.size()) return false;
  int take = 0;
  if (alloc_->reads_scores()) {
    KVTIER_ASSIGN_OR_RETURN(take, alloc_->AllocateWithEntropy(layer, n, li->last_theta));
    sel->entropy = alloc_->last_entropy();
  } else {
    KVTIER_ASSIGN_OR_RETURN(take, alloc_->Allocate(layer, LayerScores{nullptr, n}));
  }
  const size_t t = std::min({static_cast<size_t>(std::max(0, take)), cap, li->last_chunks.size()});
  // The shortlist rescored exactly for this step's probe (the Exact kind); kinds that cannot
  // score chosen chunks alone take the stored choice as it is. The first reuse of a search
  // scores the shortlist where it lies in the index; the second gathers it side by side
  // (GatherSubset), which costs about two scattered scorings and makes each later one a
  // fraction of one.
  if (li->last_reuses == 1) {
    const Status gathered = li->index->GatherSubset(li->last_chunks, &li->last_subset);
    if (gathered.ok()) {
      li->last_gathered = true;
    } else if (gathered.code() != StatusCode::kFailedPrecondition) {
      return gathered;
    }
  }
  if (li->last_gathered) {
    const uint64_t read0 = li->last_subset->read_bytes();
    KVTIER_RETURN_IF_ERROR(li->last_subset->Score(probe_vec_.data(), &reuse_scores_));
    sel->rescoring_bytes += li->last_subset->read_bytes() - read0;
    sel->chunks = TakeBest(reuse_scores_.by(alloc_->rank()), reuse_scores_.ids, t);
  } else {
    const Status rescored =
        li->index->BestOf(probe_vec_.data(), li->last_chunks, alloc_->rank(), t, &sel->chunks);
    if (rescored.code() == StatusCode::kFailedPrecondition) {
      sel->chunks.assign(li->last_chunks.begin(), li->last_chunks.begin() + static_cast<ptrdiff_t>(t));
    } else {
      KVTIER_RETURN_IF_ERROR(rescored);
    }
  }
  ++li->last_reuses;
  sel->clipped = BeyondPool(take, cap);
  sel->reused = true;
  ++reused_selections_;
  return true;
}

// Eq. 11 over the kept cosines, kept as sums: Theta = log Z - W / Z with Z = sum_i e^{s_i} and
// W = sum_i s_i e^{s_i} (the softmax's entropy; cosines lie in [-1, 1], so no shift by the
// maximum is needed). Each term is added as it is stored (e^{s_i} in roll_exp), so replacing a
// cosine subtracts exactly what was added.
void Retriever::KeepEntropySums(LayerIndex* li) {
  li->roll_exp.resize(li->roll_cos.size());
  li->roll_z = li->roll_w = 0.0;
  for (size_t i = 0; i < li->roll_cos.size(); ++i) {
    li->roll_exp[i] = static_cast<float>(std::exp(static_cast<double>(li->roll_cos[i])));
    li->roll_z += li->roll_exp[i];
    li->roll_w += static_cast<double>(li->roll_cos[i]) * li->roll_exp[i];
  }
}

void Retriever::KeepCosine(LayerIndex* li, size_t row, float cosine) {
  li->roll_z -= li->roll_exp[row];
  li->roll_w -= static_cast<double>(li->roll_cos[row]) * li->roll_exp[row];
  li->roll_cos[row] = cosine;
  li->roll_exp[row] = static_cast<float>(std::exp(static_cast<double>(cosine)));
  li->roll_z += li->roll_exp[row];
  li->roll_w += static_cast<double>(cosine) * li->roll_exp[row];
}

double Retriever::KeptEntropy(const LayerIndex& li) {
  if (li.roll_cos.size() <= 1) return 0.0;
  const double h = std::log(li.roll_z) - li.roll_w / li.roll_z;
  return h > 0.0 || !std::isfinite(h) ? h : 0.0;  // NaN stays NaN: the allocator refuses it
}

Result<bool> Retriever::ScreenSlice(LayerIndex* li, int layer, int n, size_t cap, LayerSelection* sel) {
  const ChunkIndex& index = *li->index;
  const size_t known = li->roll_ids.size(), total = static_cast<size_t>(n);
  if (!li->roll_valid || li->roll_evicted != index.evicted_chunks() || known > total || known == 0 ||
      li->roll_shortlist.empty())
    return false;
  const ChunkRank rank = alloc_->rank();
  const float* probe = probe_vec_.data();
  // Candidates rescored exactly: the shortlist and the chunks that landed since (screened
  // into the kept cosines first).
  std::vector<uint64_t> cand = li->roll_shortlist;
  // The neighbours of the last step's choice (retriever.h: a head that reads on crosses into
  // them); ids no row holds (past the last chunk, dropped) are not scored.
  const size_t granted = std::min(li->roll_granted, li->roll_shortlist.size());
  for (size_t i = 0; i < granted; ++i) {
    const uint64_t c = li->roll_shortlist[i];
    cand.push_back(c + 1);
    if (c > 0) cand.push_back(c - 1);
  }
  if (total > known) {
    KVTIER_RETURN_IF_ERROR(index.ScreenRows(probe, known, total, &roll_part_));
    li->roll_ids.insert(li->roll_ids.end(), roll_part_.ids.begin(), roll_part_.ids.end());
    li->roll_cos.resize(total, 0.0f);
    li->roll_exp.resize(total, 0.0f);
    for (size_t i = 0; i < roll_part_.ids.size(); ++i) KeepCosine(li, known + i, roll_part_.cosine[i]);
    cand.insert(cand.end(), roll_part_.ids.begin(), roll_part_.ids.end());
  }
  // This step's slice of the rows known before: ceil(known / R) of them from the cursor, in
  // whole int8 blocks of 8 rows, back to row 0 after the last.
  const size_t period = static_cast<size_t>(options_.screen_period);
  const size_t len = ((known + period - 1) / period + 7) / 8 * 8;
  const size_t begin = li->roll_cursor < known ? li->roll_cursor : 0;
  const size_t end = std::min(known, begin + len);
  li->roll_cursor = end < known ? end : 0;
  KVTIER_RETURN_IF_ERROR(index.ScreenRows(probe, begin, end, &roll_part_));
  for (size_t i = 0; i < roll_part_.ids.size(); ++i) KeepCosine(li, begin + i, roll_part_.cosine[i]);
  // Once a round, the sums afresh: updates never pile up rounding.
  if (li->roll_cursor == 0) KeepEntropySums(li);
  // The shortlist and the new chunks rescored exactly; their exact cosines replace the kept
  // ones, and the layer's grant comes from Eq. 11 over every chunk's latest cosine.
  KVTIER_RETURN_IF_ERROR(index.ScoreChunks(probe, cand, &roll_exact_));
  auto keep_cosines = [&](const ChunkScores& s) {
    for (size_t i = 0; i < s.ids.size(); ++i) {
      const auto it = std::lower_bound(li->roll_ids.begin(), li->roll_ids.end(), s.ids[i]);
      if (it != li->roll_ids.end() && *it == s.ids[i])
        KeepCosine(li, static_cast<size_t>(it - li->roll_ids.begin()), s.cosine[i]);
    }
  };
  keep_cosines(roll_exact_);
  const double theta = KeptEntropy(*li);
  const size_t want = std::min(static_cast<size_t>(std::max(0, alloc_->WouldTake(layer, n, theta))), cap);
  if (want == 0 || want > roll_exact_.ids.size()) return false;  // outgrew the shortlist: screen all
  KVTIER_ASSIGN_OR_RETURN(int take, alloc_->AllocateWithEntropy(layer, n, theta));
  sel->entropy = alloc_->last_entropy();
  const size_t t = std::min({static_cast<size_t>(std::max(0, take)), cap, roll_exact_.ids.size()});
  // A slice chunk can be among the t best of candidates and slice only if its screened score
  // plus its error bound reaches the t-th best exact candidate score: those are rescored.
  const std::vector<float>& exact_by = roll_exact_.by(rank);
  const float reach =
      t > 0 ? KthLargest(exact_by.data(), static_cast<int64_t>(exact_by.size()), static_cast<int64_t>(t))
            : std::numeric_limits<float>::infinity();
  const std::vector<float>& slice_by = roll_part_.by(rank);
  const std::vector<float>& slice_err = roll_part_.error_by(rank);
  std::vector<uint64_t> extra;
  for (size_t i = 0; i < slice_by.size(); ++i) {
    const float upper = slice_by[i] + (slice_err.empty() ? 0.0f : slice_err[i]);
    if (upper < reach) continue;  // NaN compares false: such a chunk is rescored
    const uint64_t id = roll_part_.ids[i];
    if (!std::binary_search(roll_exact_.ids.begin(), roll_exact_.ids.end(), id)) extra.push_back(id);
  }
  if (!extra.empty()) {
    KVTIER_RETURN_IF_ERROR(index.ScoreChunks(probe, extra, &roll_part_));
    keep_cosines(roll_part_);
    // Merge by ascending chunk index (TakeBest breaks ties to the smaller index).
    ChunkScores merged;
    size_t a = 0, b = 0;
    while (a < roll_exact_.ids.size() || b < roll_part_.ids.size()) {
      const bool from_a = b == roll_part_.ids.size() ||
                          (a < roll_exact_.ids.size() && roll_exact_.ids[a] < roll_part_.ids[b]);
      const ChunkScores& src = from_a ? roll_exact_ : roll_part_;
      const size_t i = from_a ? a++ : b++;
      merged.ids.push_back(src.ids[i]);
      merged.logit.push_back(src.logit[i]);
      merged.cosine.push_back(src.cosine[i]);
    }
    roll_exact_ = std::move(merged);
  }
  // With reuse on, the shortlist is the length a reusing step needs (as after a full screen), and
  // the slice is a search the next step may reuse: a chunk landing (which ends reuse) must not
  // keep a layer off reuse until its next full screen.
  const size_t keep = options_.reuse_cosine > 0.0 ? ShortlistSize(t) : SliceShortlistSize(t);
  li->roll_shortlist = TakeBest(roll_exact_.by(rank), roll_exact_.ids, std::min(cap, keep));
  li->roll_granted = t;
  RememberSearch(li, li->roll_shortlist, li->roll_shortlist.size(), theta);
  sel->chunks.assign(li->roll_shortlist.begin(), li->roll_shortlist.begin() + static_cast<ptrdiff_t>(t));
  sel->clipped = BeyondPool(take, cap);
  sel->sliced = true;
  ++sliced_selections_;
  return true;
}

void Retriever::ForgetSearch(LayerIndex* li) {
  li->last_valid = false;
  li->last_gathered = false;
  li->last_reuses = 0;
}

void Retriever::RememberSearch(LayerIndex* li, const std::vector<uint64_t>& chunks, size_t keep,
                               double theta) {
  if (options_.reuse_cosine <= 0.0) return;
  li->last_valid = true;
  li->last_probe = probe_vec_;
  li->last_chunks.assign(chunks.begin(),
                         chunks.begin() + static_cast<ptrdiff_t>(std::min(keep, chunks.size())));
  li->last_theta = theta;
  li->last_gathered = false;
  li->last_reuses = 0;
}

Status Retriever::SelectOnBackend(LayerIndex* li, int layer, int n, size_t cap, LayerSelection* sel,
                                  const BackendQueries* queries) {
  // The same choice as the host path with rerank=0: topk takes the top min(k, cap) by logit
  // and the allocator cuts it to min(k, n); entropy takes the top min(B^l, cap) by its rank.
  // The device's top-k starts before Eq. 12 has run, so it brings back the most the allocator
  // can grant (MaxTake) and the host keeps the first B^l (device_scorer.h says why).
  const bool entropy = alloc_->reads_scores();
  size_t most = static_cast<size_t>(alloc_->MaxTake(layer, n));
  // With reuse on, topk brings back its shortlist too (entropy's MaxTake is the step's budget).
  if (options_.reuse_cosine > 0.0 && !entropy) most = std::min(static_cast<size_t>(n), ShortlistSize(most));
  const int k_max = static_cast<int>(std::min(most, cap));
  auto t0 = std::chrono::steady_clock::now();
  double theta = 0.0;
  int32_t non_finite = 0;
  const ChunkRank rank = entropy ? alloc_->rank() : ChunkRank::kLogit;
  if (queries == nullptr) {
    KVTIER_RETURN_IF_ERROR(li->mirrored->SelectOnBackend(probe_vec_.data(), rank, entropy, k_max,
                                                         &sel->chunks, &theta, &non_finite));
  } else {
    int32_t bad = 0, first = 0;
    KVTIER_RETURN_IF_ERROR(li->mirrored->SelectOnBackend(*queries, rank, entropy, k_max, &sel->chunks, &theta,
                                                         &non_finite, &bad, &first));
    KVTIER_RETURN_IF_ERROR(QueriesFinite(layer, bad, first));
  }
  if (non_finite == 0) {
    // The shortlist: the best of the k_max brought back (best first), as many as the host
    // path keeps for the grant this entropy gets now.
    const int want = entropy ? alloc_->WouldTake(layer, n, theta) : std::min(k_, n);
    RememberSearch(li, sel->chunks, ShortlistSize(static_cast<size_t>(std::max(0, want))), theta);
  }
  sel->search_ms += MsSince(t0);
  t0 = std::chrono::steady_clock::now();
  if (!entropy) {
    KVTIER_ASSIGN_OR_RETURN(int take, alloc_->Allocate(layer, LayerScores{nullptr, n}));
    sel->chunks.resize(std::min<size_t>(sel->chunks.size(), static_cast<size_t>(std::max(0, take))));
    sel->clipped = BeyondPool(take, cap);
    sel->alloc_ms = MsSince(t0);
    return Status::Ok();
  }
  // Eq. 11 holds for finite scores only (the host path's allocator refuses others, and so here).
  if (non_finite > 0)
    return InvalidArgument("BudgetAllocator::Allocate: " + std::to_string(non_finite) +
                           " cosine score(s) of layer " + std::to_string(layer) + " are not finite");
  KVTIER_ASSIGN_OR_RETURN(int take, alloc_->AllocateWithEntropy(layer, n, theta));
  sel->entropy = alloc_->last_entropy();
  sel->chunks.resize(std::min({sel->chunks.size(), static_cast<size_t>(std::max(0, take)), cap}));
  sel->clipped = BeyondPool(take, cap);
  sel->alloc_ms = MsSince(t0);
  return Status::Ok();
}

Status Retriever::ObserveAndScore(SequenceId seq, int layer, const float* q, int m,
                                  std::vector<uint64_t>* ids, std::vector<float>* scores) {
  KVTIER_RETURN_IF_ERROR(probe_->Build(layer, q, m, probe_buf_.data()));
  std::copy(probe_buf_.begin(), probe_buf_.end(), probe_vec_.begin());
  KVTIER_RETURN_IF_ERROR(Sync(seq, layer));
  KVTIER_ASSIGN_OR_RETURN(LayerIndex * li, Index(seq, layer));
  ChunkScores s;
  KVTIER_RETURN_IF_ERROR(li->index->Score(probe_vec_.data(), &s));
  *ids = std::move(s.ids);
  *scores = std::move(s.logit);
  return Status::Ok();
}

uint64_t Retriever::compressed_chunks() const {
  uint64_t n = 0;
  for (const auto& [key, li] : indexes_)
    if (li.index) n += li.index->compressed_chunks();
  return n;
}

uint64_t Retriever::evicted_chunks() const {
  uint64_t n = 0;
  for (const auto& [key, li] : indexes_)
    if (li.index) n += li.index->evicted_chunks();
  return n;
}

uint64_t Retriever::memory_bytes() const {
  uint64_t b = 0;
  for (const auto& [key, li] : indexes_)
    if (li.index) b += li.index->memory_bytes() + (li.last_subset ? li.last_subset->memory_bytes() : 0);
  return b;
}

}  // namespace kvtier
