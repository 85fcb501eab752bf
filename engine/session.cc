#include "kvtier/session.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <new>

#include "engine/compress.h"
#include "engine/device_lane.h"
#include "engine/option_table.h"
#include "engine/session_internal.h"
#include "kernels/cpu/entropy_grant.h"
#include "kernels/cpu/rope.h"
#include "kernels/dtype.h"
#include "kvtier/kvtier.h"
#include "offload/attention_backend.h"
#if KVTIER_HAVE_CUDA
#include "offload/cuda_hot_tier.h"
#endif
#include "offload/device_sync.h"
#include "offload/observe_queries.h"
#include "offload/policy/scoring_policy.h"
#include "offload/tiered_store.h"
#include "retrieval/chunk_index.h"
#include "retrieval/retriever.h"

namespace kvtier {
namespace {

double MsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// Store::Open makes every Store a TieredStore; another implementation is refused.
Result<TieredStore*> Tiered(const char* what, Store* store) {
  auto* tiered = dynamic_cast<TieredStore*>(store);
  if (tiered == nullptr)
    return InvalidArgument(std::string(what) + ": the store was not opened by Store::Open");
  return tiered;
}

// Marks the calling thread as running a step while it lives (offload/device_sync.h) and adds
// the waits made meanwhile to a session's counts: the ones on this thread to
// SessionCounters::host_syncs, the workers' (threads inside no step) to worker_host_syncs.
class HostSyncScope {
 public:
  explicit HostSyncScope(SessionCounters* into)
      : into_(into), thread_start_(HostSyncsOnThisThread()), worker_start_(WorkerHostSyncsTotal()) {}
  ~HostSyncScope() {
    into_->host_syncs += HostSyncsOnThisThread() - thread_start_;
    into_->worker_host_syncs += WorkerHostSyncsTotal() - worker_start_;
  }
  HostSyncScope(const HostSyncScope&) = delete;
  HostSyncScope& operator=(const HostSyncScope&) = delete;

 private:
  const HostSyncStepScope step_;
  SessionCounters* into_;
  uint64_t thread_start_;
  uint64_t worker_start_;
};

}  // namespace

Result<PositionMode> ParsePositionMode(const std::string& s) {
  if (s == "absolute") return PositionMode::kAbsolute;
  if (s == "infllm") return PositionMode::kInfLLM;
  return InvalidArgument("unknown position mode '" + s + "' (absolute | infllm)");
}

const char* PositionModeName(PositionMode mode) {
  return mode == PositionMode::kInfLLM ? "infllm" : "absolute";
}

Result<std::vector<uint64_t>> SelectAllChunks(int, const float*, const int64_t*, int,
                                              const std::vector<ChunkInfo>& chunks) {
  std::vector<uint64_t> out;
  out.reserve(chunks.size());
  for (const ChunkInfo& c : chunks) out.push_back(c.key.index);
  return out;
}

constexpr double kFastReuseCosine = 0.8;

std::vector<std::string> RetrievalPresetNames() { return {"kvtier", "kvtier-fast", "actqkv", "infllm"}; }

Result<RetrievalPreset> MakeRetrievalPreset(const std::string& name) {
  RetrievalPreset p;
  if (name == "infllm") {  // InfLLM: the mean of the window's queries, a fixed top-k, mean representatives
    p.retrieval.probe = "mean";
    p.retrieval.alloc = "topk";
    p.retrieval.index = "Flat";
  } else if (name == "actqkv") {  // ActQKV Algorithm 1: Eq. 7-9 probe, Eq. 10-12 cut-off, cosine order
    p.retrieval.probe = "act";
    p.retrieval.alloc = "entropy:rank=cosine";
    p.retrieval.index = "Exact:heads=sum";
  } else if (name == "kvtier") {  // ActQKV's probe and budget; the most interested head decides, logit order
    p.retrieval = RecommendedRetrieval();
  } else if (name == "kvtier-fast") {
    // kvtier's choice, searched less often: while no chunk landed in or left a layer and its
    // probe keeps cosine >= kFastReuseCosine with the one searched for, a decode step rescores
    // the layer's last shortlist instead of searching (retriever.h). Not exact; held to answers
    // and needle hits (docs/benchmarks.md, "The kvtier-fast preset"). Screening a slice
    // (screen_period) is not part of it: on the trained model it lost answers.
    p.retrieval = RecommendedRetrieval();
    p.retrieval.reuse_cosine = kFastReuseCosine;
  } else {
    return InvalidArgument("unknown preset '" + name + "' (known: kvtier, kvtier-fast, actqkv, infllm)");
  }
  if (name != "kvtier" && name != "kvtier-fast")
    p.repr_topk = 4;  // InfLLM's and ActQKV's r_k; kvtier leaves it to the store
  return p;
}

Result<RetrieverOptions> PaperRetrieval(const std::string& preset, const RetrieverOptions& configured) {
  KVTIER_ASSIGN_OR_RETURN(RetrievalPreset p, MakeRetrievalPreset(preset));
  RetrieverOptions r = p.retrieval;
  r.budget_tokens = configured.budget_tokens;
  KVTIER_ASSIGN_OR_RETURN(std::string kind, CanonicalChunkIndexSpec(configured.index));
  // Exact scores a chunk by its best representative; InfLLM's score is their mean, which
  // every FAISS kind computes (chunk_index.h).
  const bool exact = kind.rfind("Exact", 0) == 0;
  if (preset == "infllm" && exact) return r;
  r.index = configured.index;
  auto summed = SetSpecKey(r.index, "heads", "sum");
  if (summed.ok() && CanonicalChunkIndexSpec(*summed).ok())
    r.index = *summed;  // kinds without the key keep theirs
  return r;
}

RetrieverOptions RecommendedRetrieval() { return RetrieverOptions{}; }

Status SessionOptions::Validate() const {
  // Each option's own range (engine/option_table.h's rows), then the retrieval it asks for.
  KVTIER_RETURN_IF_ERROR(CheckOptionRanges(SessionOptionTable(), *this));
  if (retrieve) KVTIER_RETURN_IF_ERROR(retrieval.Validate());
  return Status::Ok();
}

Status SessionOptions::Validate(const StoreOptions& store) const {
  KVTIER_RETURN_IF_ERROR(Validate());
  if (!retrieve || store.chunk_size <= 0 || store.chunk_bytes() == 0) return Status::Ok();
  const int64_t want = retrieval.budget_tokens / store.chunk_size;
  const int64_t pool = static_cast<int64_t>(store.hot_bytes / store.chunk_bytes());
  if (want <= pool) return Status::Ok();
  return InvalidArgument("budget_tokens " + std::to_string(retrieval.budget_tokens) + " needs " +
                         std::to_string(want) + " chunks of " + std::to_string(store.chunk_size) +
                         " tokens, and the hot slot pool holds " + std::to_string(pool) + " (hot_bytes " +
                         std::to_string(store.hot_bytes) + ", " + std::to_string(store.chunk_bytes()) +
                         " bytes a chunk): raise hot_bytes to at least " +
                         std::to_string(static_cast<uint64_t>(want) * store.chunk_bytes()) +
                         " or lower budget_tokens to at most " + std::to_string(pool * store.chunk_size));
}

SessionImpl::SessionImpl(TieredStore* store, SequenceId seq, const SessionOptions& options)
    : store_(store), seq_(seq), options_(options), plan_(std::make_unique<AttentionPlan>()) {
  const Geometry& g = store->options().geometry;
  if (options.positions == PositionMode::kInfLLM)
    inv_freq_ = kernels::RopeInvFreq(g.head_dim, options.rope_theta);
  last_chunks_.resize(static_cast<size_t>(g.layers));
  kept_.resize(static_cast<size_t>(g.layers));
}

SessionImpl::~SessionImpl() { ReleaseReservation(); }

const Geometry& SessionImpl::geometry() const { return store_->options().geometry; }

void SessionImpl::ReleaseReservation() {
  if (reservation_ != 0) store_->ReleaseHotSlots(reservation_);
  reservation_ = 0;
  reserved_slots_ = 0;
}

Result<std::unique_ptr<Session>> Session::Open(Store* base, const SessionOptions& options) {
  if (base == nullptr) return InvalidArgument("Session::Open: store is null");
  KVTIER_ASSIGN_OR_RETURN(TieredStore * store, Tiered("Session::Open", base));
  KVTIER_RETURN_IF_ERROR(options.Validate());
  KVTIER_ASSIGN_OR_RETURN(SequenceId seq, store->CreateSequence());
  auto s = Attach(store, seq, options);
  if (!s.ok())
    store->DropSequence(seq).IgnoreError();  // nothing was appended: leave no empty sequence behind
  return s;
}

Result<std::unique_ptr<Session>> Session::Attach(Store* base, SequenceId seq, const SessionOptions& options) {
  if (base == nullptr) return InvalidArgument("Session::Attach: store is null");
  KVTIER_ASSIGN_OR_RETURN(TieredStore * store, Tiered("Session::Attach", base));
  if (Status st = options.Validate(store->options()); !st.ok())
    return Status(st.code(), "Session: " + st.message());
  const Geometry& g = store->options().geometry;
  if (options.positions == PositionMode::kInfLLM && g.head_dim % 2 != 0)
    return InvalidArgument("Session: infllm positions need an even head_dim for RoPE (got " +
                           std::to_string(g.head_dim) + ")");
  KVTIER_RETURN_IF_ERROR(store->SequenceLength(seq, 0).status());  // NotFound names the sequence
  try {
    std::unique_ptr<SessionImpl> s(new SessionImpl(store, seq, options));
    // Sized for decode (one query); a prefill window grows a device workspace once.
    KVTIER_ASSIGN_OR_RETURN(s->backend_, MakeAttentionBackend(store->hot_tier(), g, 1));
    if (options.retrieve) {
      KVTIER_ASSIGN_OR_RETURN(s->retriever_, Retriever::Create(store, options.retrieval));
      // Admission: the budget in chunks (Validate checked that hot_bytes holds it; an engine's
      // own tier may hold fewer slots than hot_bytes gives, hence the min).
      const int64_t slots = std::min<int64_t>(options.retrieval.budget_tokens / store->options().chunk_size,
                                              store->hot_tier()->slot_capacity());
      if (slots > 0) {
        auto r = store->ReserveHotSlots(seq, static_cast<int32_t>(slots));
        if (!r.ok())
          return Status(r.status().code(), "Session: budget_tokens " +
                                               std::to_string(options.retrieval.budget_tokens) +
                                               " (chunk_size " + std::to_string(store->options().chunk_size) +
                                               "): " + r.status().message());
        s->reservation_ = *r;
        s->reserved_slots_ = static_cast<int32_t>(slots);
      }
    }
    return std::unique_ptr<Session>(std::move(s));
  } catch (const std::bad_alloc&) {
    return ResourceExhausted("Session: out of memory creating the session's state");
  }
}

void SessionImpl::ApplyRope(float* x, int m, int heads, const int64_t* positions) const {
  if (inv_freq_.empty()) return;  // kAbsolute: the engine applied RoPE
  kernels::Rope(x, m, heads, geometry().head_dim, positions, inv_freq_.data());
}

namespace {

// Index of the first NaN or infinity among n elements of `src` (dtype t), or n when all are
// finite: an element is non-finite when its exponent bits are all ones. The scan ORs the test
// over blocks (vectorised, one read of the bytes) and looks for the element only in a block
// that has one.
template <typename U, U kExponent>
size_t FirstNonFiniteOf(const void* src, size_t n) {
  const auto* bytes = static_cast<const uint8_t*>(src);
  constexpr size_t kBlock = 4096;
  for (size_t b = 0; b < n; b += kBlock) {
    const size_t e = std::min(n, b + kBlock);
    unsigned bad = 0;
    for (size_t i = b; i < e; ++i) {
      U x;
      std::memcpy(&x, bytes + i * sizeof(U), sizeof(U));
      bad |= (x & kExponent) == kExponent;
    }
    if (bad == 0) continue;
    for (size_t i = b; i < e; ++i) {
      U x;
      std::memcpy(&x, bytes + i * sizeof(U), sizeof(U));
      if ((x & kExponent) == kExponent) return i;
    }
  }
  return n;
}

size_t FirstNonFinite(DType t, const void* src, size_t n) {
  switch (t) {
    case DType::kF32:
      return FirstNonFiniteOf<uint32_t, 0x7f800000u>(src, n);
    case DType::kF16:
      return FirstNonFiniteOf<uint16_t, 0x7c00u>(src, n);
    case DType::kBF16:
      return FirstNonFiniteOf<uint16_t, 0x7f80u>(src, n);
  }
  return n;
}

std::string FormatFloat(float x) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", static_cast<double>(x));
  return buf;
}

// A prefill window's attention that also feeds the representative-key statistics: the
// backend attends the dense parts (sinks | local) with their per-key mass in a softmax over
// those parts only (ObserveQueries' definition, offload/observe_queries.h), then the retrieved chunks, and
// merges the two by log-sum-exp (AttentionBackend::RunWithDenseMass), on the tier's device.
// The local window's mass goes to the store; no key is read twice and no second pass runs.
// `q_device` / `out_on_device`: as AttentionBackend::RunOnDevice (AttendDevice), else host out.
Status AttendAndObserve(TieredStore* store, SequenceId seq, int layer, AttentionBackend* backend,
                        const AttentionPlanInput& in, AttentionPlan* plan, float* out, const float* q_device,
                        bool out_on_device) {
  KVTIER_RETURN_IF_ERROR(plan->Build(in));
  const kernels::SlotAttentionParams& p = plan->params();
  std::vector<float> mass[kernels::kMaxDenseParts];
  float* mass_of[kernels::kMaxDenseParts] = {};
  for (int i = 1; i < p.n_dense; ++i) {  // part 0 is the sinks: its mass is not kept
    mass[i].resize(static_cast<size_t>(p.kv_heads) * std::max(1, p.dense[i].n_tokens));
    mass_of[i] = mass[i].data();
  }
  KVTIER_RETURN_IF_ERROR(out_on_device ? backend->RunOnDevice(*plan, q_device, out, mass_of)
                                       : backend->RunWithDenseMass(*plan, out, mass_of));
  for (int i = 1; i < p.n_dense; ++i)
    if (p.dense[i].n_tokens > 0)
      KVTIER_RETURN_IF_ERROR(store->AddLocalAttention(seq, layer, p.dense[i].first_position,
                                                      p.dense[i].n_tokens, mass[i].data()));
  return Status::Ok();
}

}  // namespace

Status SessionImpl::CheckFiniteKv(int layer, const void* k, const void* v, int n, DType dtype) const {
  // Malformed calls are refused by the store's Append, which names what is wrong.
  if (k == nullptr || v == nullptr || n <= 0 || dtype != geometry().dtype) return Status::Ok();
  const Geometry& g = geometry();
  const size_t elems = static_cast<size_t>(n) * g.token_elems();
  for (int which = 0; which < 2; ++which) {
    const void* x = which == 0 ? k : v;
    const size_t i = FirstNonFinite(dtype, x, elems);
    if (i == elems) continue;
    float value = 0;
    ToFloat(dtype, static_cast<const uint8_t*>(x) + i * DTypeSize(dtype), &value, 1);
    const size_t token = i / g.token_elems();
    const size_t head = i % g.token_elems() / static_cast<size_t>(g.head_dim);
    const size_t d = i % static_cast<size_t>(g.head_dim);
    const char* name = which == 0 ? "k" : "v";
    return InvalidArgument("Session::Append: layer " + std::to_string(layer) + ": " + name + "[" +
                           std::to_string(token) + "][" + std::to_string(head) + "][" + std::to_string(d) +
                           "] = " + FormatFloat(value) + " (token " + std::to_string(token) + " of the " +
                           std::to_string(n) + " appended, kv head " + std::to_string(head) +
                           ") is not finite; K/V must be finite (attention over a NaN or inf gives "
                           "non-finite outputs), nothing of this call was appended");
  }
  return Status::Ok();
}

Status SessionImpl::Append(int layer, const void* k, const void* v, int n, DType dtype, MemorySpace space) {
  const HostSyncScope syncs(&counters_);
  if (dropped_) return FailedPrecondition("Session::Append: the session's sequence was dropped");
  if (space == MemorySpace::kHost) KVTIER_RETURN_IF_ERROR(CheckFiniteKv(layer, k, v, n, dtype));
  KVTIER_RETURN_IF_ERROR(store_->Append(seq_, layer, k, v, n, dtype, space));
  counters_.tokens_appended += static_cast<uint64_t>(n);
  return Status::Ok();
}

Result<void*> SessionImpl::DeviceTier(const char* what) const {
#if KVTIER_HAVE_CUDA
  if (auto* cuda = dynamic_cast<CudaHotTier*>(store_->hot_tier()); cuda != nullptr)
    return static_cast<void*>(cuda);
#endif
  return FailedPrecondition(
      std::string("Session::") + what + ": the store's hot tier is \"" +
      DeviceName(store_->hot_tier()->device()) +
      "\": device pointers and a stream need the \"cuda\" hot tier (StoreOptions::device = Device::kCuda)"
#if !KVTIER_HAVE_CUDA
      " and a build with CUDA (this one has none)"
#endif
      "; host memory goes through Append and Attend");
}

Status SessionImpl::AppendDevice(int layer, const void* k, const void* v, int n, DType dtype, void* stream) {
  const HostSyncScope syncs(&counters_);
  if (dropped_) return FailedPrecondition("Session::AppendDevice: the session's sequence was dropped");
  KVTIER_ASSIGN_OR_RETURN(void* tier, DeviceTier("AppendDevice"));
#if KVTIER_HAVE_CUDA
  auto* cuda = static_cast<CudaHotTier*>(tier);
  // The copies start after the engine's writes of k and v, and the engine's later work (which
  // may overwrite k and v) after the copies: both on the device.
  KVTIER_RETURN_IF_ERROR(cuda->WaitForStream(stream));
  const Status appended = store_->Append(seq_, layer, k, v, n, dtype, MemorySpace::kDevice, /*ordered=*/true);
  const Status ordered = cuda->MakeStreamWait(stream);
  KVTIER_RETURN_IF_ERROR(appended);
  KVTIER_RETURN_IF_ERROR(ordered);
  counters_.tokens_appended += static_cast<uint64_t>(n);
  return Status::Ok();
#else
  (void)tier, (void)layer, (void)k, (void)v, (void)n, (void)dtype, (void)stream;
  return Internal("Session::AppendDevice: unreachable without CUDA");
#endif
}

Status SessionImpl::AttendDevice(int layer, const float* q, const int64_t* positions, int m, float* out,
                                 void* stream, AttendStats* stats) {
  const HostSyncScope syncs(&counters_);
  if (dropped_) return FailedPrecondition("Session::AttendDevice: the session's sequence was dropped");
  KVTIER_ASSIGN_OR_RETURN(void* tier, DeviceTier("AttendDevice"));
  if (q == nullptr || out == nullptr)
    return InvalidArgument("Session::AttendDevice: q and out must not be null");
  if (m <= 0 || m > (1 << 20))
    return InvalidArgument("Session::AttendDevice: m = " + std::to_string(m) + " queries (1 .. 1048576)");
#if KVTIER_HAVE_CUDA
  auto* cuda = static_cast<CudaHotTier*>(tier);
  const Geometry& g = geometry();
  const size_t q_bytes = static_cast<size_t>(m) * g.q_heads * g.head_dim * sizeof(float);
  // The queries come down once, after the engine wrote them: the host's retrieval and checks
  // read this copy; the attention reads q where the engine left it.
  KVTIER_RETURN_IF_ERROR(cuda->WaitForStream(stream));
  Status st = Status::Ok();
  if (QueriesStayOnDevice(m)) {
    // The device lane runs the whole layer step with no host wait where it can; otherwise the
    // retrieval backend builds the probe from q and checks it where it is: no copy down.
    Result<bool> on_lane = AttendOnLane(layer, q, stream, positions, m, out, stats);
    if (!on_lane.ok())
      st = on_lane.status();
    else if (!*on_lane)
      st = AttendLayer("AttendDevice", layer, nullptr, q, stream, positions, m, out, /*out_on_device=*/true,
                       stats);
    const Status ordered = cuda->MakeStreamWait(stream);
    KVTIER_RETURN_IF_ERROR(st);
    return ordered;
  }
  if (q_host_ == nullptr || q_host_->size() < q_bytes) {
    auto buffer = HostBuffer::Allocate(std::max<size_t>(q_bytes, 4096), /*want_pinned=*/true);
    if (!buffer.ok())
      st = buffer.status();
    else
      q_host_ = std::move(*buffer);
  }
  if (st.ok()) {
    const HotTier::DownloadOp down{q_host_->data(), reinterpret_cast<const uint8_t*>(q), q_bytes};
    auto ticket = cuda->DownloadBatchAsync(&down, 1);
    st = ticket.ok() ? cuda->WaitTransfer(*ticket) : ticket.status();
    if (!st.ok())
      st = Status(st.code(), "Session::AttendDevice: layer " + std::to_string(layer) +
                                 ": copying the queries down: " + st.message());
  }
  if (st.ok())
    st = AttendLayer("AttendDevice", layer, reinterpret_cast<const float*>(q_host_->data()), q, stream,
                     positions, m, out, /*out_on_device=*/true, stats);
  // The engine's later work starts after the attention wrote `out`, whatever happened above.
  const Status ordered = cuda->MakeStreamWait(stream);
  KVTIER_RETURN_IF_ERROR(st);
  return ordered;
#else
  (void)tier, (void)layer, (void)positions, (void)stream, (void)stats;
  return Internal("Session::AttendDevice: unreachable without CUDA");
#endif
}

Result<bool> SessionImpl::AttendOnLane(int layer, const float* q, void* stream, const int64_t* positions,
                                       int m, float* out, AttendStats* stats) {
#if KVTIER_HAVE_CUDA
  if (!lane_enabled_ || lane_unavailable_) return false;
  const uint64_t step = counters_.steps;
  // The reports of earlier steps that are done (no wait): last_chunks_ and the counters.
  KVTIER_RETURN_IF_ERROR(TakeLaneReports(step, /*wait=*/false));
  KVTIER_RETURN_IF_ERROR(PollDeferredFetches());
  KVTIER_RETURN_IF_ERROR(CheckLayerCall("AttendDevice", layer, nullptr, positions, m, /*in_step=*/true,
                                        /*q_on_device=*/true));
  q_rot_of_ = nullptr;
  try {
    // The layer step's store visit, as GatherFor's (landing, background error, hot view, the
    // index's updates); the lane makes no second one: its chunks come from warm, not hot slots.
    KVTIER_ASSIGN_OR_RETURN(ChunkCursor cursor, retriever_->Cursor(seq_, layer));
    ChunkUpdate* updates = retriever_->step_update();
    LayerStepView step_view;
    // Chunks whose download is still in flight do not land here (no wait): the lane scores them
    // from representatives it chooses on the device (DeviceLane::PrepareLayer's `sealing`).
    KVTIER_RETURN_IF_ERROR(store_->BeginLayerStep(seq_, layer, &cursor, updates, &step_view,
                                                  Retriever::kSyncBatch, LandRule::kCompleteOnly));
    if (!step_view.background.ok())
      return Status(step_view.background.code(), "Session::AttendDevice: layer " + std::to_string(layer) +
                                                     ": " + step_view.background.message());
    const HotView& view = step_view.hot;
    KVTIER_RETURN_IF_ERROR(CheckPositionsHeld("AttendDevice", layer, positions, m, view.n_tokens));
    const StepPlan& plan = PlanStep(m, view);
    auto prepared = retriever_->PrepareLaneLayer(seq_, layer, updates);
    if (!prepared.ok())
      return Status(prepared.status().code(), "Session::AttendDevice: " + prepared.status().message());
    const Retriever::LaneLayer& sel = *prepared;
    kernels::EntropyGrantState* grant = sel.entropy ? retriever_->grant_state() : nullptr;
    if (!step_view.sealing.empty() && !sel.sealed_rows) return false;  // the host path lands them (a wait)
    if (sel.n + step_view.sealing.size() == 0 || sel.k == 0 || (sel.entropy && grant == nullptr))
      return false;  // the host path
    if (lane_ == nullptr) {
      const Geometry& g = geometry();
      const StoreOptions& so = store_->options();
      DeviceLaneOptions lo;
      lo.layers = g.layers;
      lo.q_heads = g.q_heads;
      lo.kv_heads = g.kv_heads;
      lo.head_dim = g.head_dim;
      lo.dtype = g.dtype;
      lo.chunk_tokens = so.chunk_size;
      // A step's chunks (L x k) stay in the pool for the next step; no layer's grant (at most
      // L x k, and at most the hot pool, as the host path clips it) overflows it.
      const int64_t step_chunks = static_cast<int64_t>(g.layers) * sel.k;
      lo.slots = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(step_chunks, sel.cap)));
      lo.max_rows = sel.entropy ? lo.slots : std::max(1, std::min(sel.k, sel.cap));
      lo.rope_inv_freq = inv_freq_;
      lo.defer_cold = options_.defer_cold_chunks;
      auto lane = DeviceLane::Create(store_, seq_, retriever_->backend()->stream(), lo);
      if (!lane.ok()) {
        lane_unavailable_ = true;  // e.g. no memory for its pool: every layer keeps the host path
        return false;
      }
      lane_ = std::move(*lane);
    }
    AttentionPlanInput in = plan.base;
    DeviceLane::LayerCall call;
    call.layer = layer;
    call.step = step;
    call.select = &sel;
    call.q = q;
    call.q_stream = stream;
    call.rope_position = inv_freq_.empty() ? 0 : plan.rel[0];
    call.grant = grant;
    bool launched = false;
    for (int tries = 0; !launched && tries < 4; ++tries) {
      // Warm addresses for the layer's rows (re-asked when the warm epoch moved under them; a row
      // with no warm copy has none, and is deferred when chosen).
      KVTIER_ASSIGN_OR_RETURN(bool prepared, lane_->PrepareLayer(layer, *sel.row_ids, step_view.sealing));
      if (!prepared) {
        // A row with no warm copy (defer_cold_chunks off), or more chunks landing than the lane
        // scores: the host path fetches or lands them.
        ++lane_unprepared_layers_;
        return false;
      }
      while (lane_->ring_full()) KVTIER_RETURN_IF_ERROR(TakeLaneReports(step, /*wait=*/true));
      KVTIER_ASSIGN_OR_RETURN(launched, lane_->Launch(call, &in));
    }
    if (!launched) return false;  // warm kept turning over: the host path
    lane_k_ = sel.k;
    lane_landing_rows_ += step_view.sealing.size();
    retriever_->LaneServed(layer);
    // The attention: sinks | the lane's slots | local, on the tier's stream after the lane's.
    const auto t0 = std::chrono::steady_clock::now();
    in.q = nullptr;
    if (!inv_freq_.empty()) {  // as AttendLayer for device queries
      in.q_rope_positions = plan.positions.data();
      in.rope_inv_freq = inv_freq_.data();
      in.chunks_rope_position = plan.local_start;
      in.sinks_rope_position = plan.sinks_are_memory ? plan.local_start : kernels::kRopeAtKeyPositions;
    }
    in.sinks = view.sinks;
    in.local = view.local;
    in.n_local = view.n_local_spans;
    auto* cuda = static_cast<CudaHotTier*>(store_->hot_tier());
    Status st = cuda->WaitForStream(lane_->stream());
    if (st.ok()) st = plan_->Build(in);
    if (st.ok()) st = backend_->RunOnDevice(*plan_, q, out, nullptr);
    if (!st.ok())
      return Status(st.code(), "Session::AttendDevice: layer " + std::to_string(layer) + ": " + st.message());
    next_layer_ = layer + 1;
    counters_.attends += 1;
    ++lane_layer_steps_;
    AttendStats lane_stats;
    lane_stats.attention_ms = MsSince(t0);
    counters_.attention_ms += lane_stats.attention_ms;
    if (stats) *stats = lane_stats;  // the chunks are known one step late (WaitForDevice)
    return true;
  } catch (const std::bad_alloc&) {
    return ResourceExhausted("Session::AttendDevice: out of memory (layer " + std::to_string(layer) + ")");
  }
#else
  (void)layer, (void)q, (void)stream, (void)positions, (void)m, (void)out, (void)stats;
  return false;
#endif
}

Status SessionImpl::PollDeferredFetches() {
  Status first = Status::Ok();
  for (size_t i = 0; i < deferred_fetches_.size();) {
    const auto& [layer, fetch] = deferred_fetches_[i];
    if (!fetch.Ready()) {
      ++i;
      continue;
    }
    // Done: the chunks it read are in warm, and the lane's next PrepareLayer finds their sources.
    // A chunk warm had no room for stays deferred and is asked for again when chosen again.
    const Status st = fetch.status();
    if (!st.ok() && st.code() != StatusCode::kResourceExhausted && first.ok())
      first = Status(st.code(), "Session::AttendDevice: layer " + std::to_string(layer) +
                                    ": bringing deferred chunks back to warm: " + st.message());
    if (lane_) lane_->RefreshRows(layer);
    deferred_fetches_.erase(deferred_fetches_.begin() + static_cast<std::ptrdiff_t>(i));
  }
  return first;
}

Status SessionImpl::ApplyLaneReport(const LaneStepReport& report) {
  Status first = Status::Ok();
  for (const LaneLayerReport& r : report.layers) {
    ++lane_reports_read_;
    last_chunks_[static_cast<size_t>(r.layer)] = r.chunks;
    counters_.chunks_attended += r.chunks.size();
    counters_.max_layer_chunks = std::max<uint64_t>(counters_.max_layer_chunks, r.chunks.size());
    if (!r.deferred.empty()) {
      // Chosen with no warm copy: the step attended without them; a warm-only fetch brings them
      // back to warm on a transfer worker (no hot slot, no upload, nothing waited for here), and
      // a later step's lane finds their sources (PollDeferredFetches). A chunk warm has no room
      // for stays deferred; it is asked for again when chosen again.
      counters_.chunks_deferred += r.deferred.size();
      Result<WarmFetchHandle> fetch = store_->FetchToWarm(seq_, r.layer, r.deferred);
      if (fetch.ok())
        deferred_fetches_.emplace_back(r.layer, std::move(*fetch));
      else if (fetch.status().code() != StatusCode::kResourceExhausted && first.ok())
        first = Status(fetch.status().code(),
                       "Session::AttendDevice: layer " + std::to_string(r.layer) +
                           ": bringing deferred chunks back to warm: " + fetch.status().message());
    }
    if (!first.ok()) continue;
    const std::string where = "Session::AttendDevice: step " + std::to_string(report.step) + ", layer " +
                              std::to_string(r.layer) + ": ";
    const int d = geometry().head_dim;
    if (r.q_non_finite > 0)
      first = InvalidArgument(where + "q[0][" + std::to_string(r.q_first / d) + "][" +
                              std::to_string(r.q_first % d) + "] is not finite (" +
                              std::to_string(r.q_non_finite) +
                              " NaN or infinite value(s), found on the device lane and read one step late); "
                              "queries must be finite");
    else if (r.grant_error == kernels::kEntropyGrantNonFiniteScores || r.non_finite > 0)
      first = InvalidArgument(where + std::to_string(r.non_finite) + " cosine score(s) are not finite");
    else if (r.grant_error != kernels::kEntropyGrantOk)
      first =
          Internal(where + "the device's Eq. 12 grant failed (code " + std::to_string(r.grant_error) + ")");
    else if (r.skipped > 0 || static_cast<int32_t>(r.chunks.size() + r.deferred.size()) != r.take ||
             static_cast<int32_t>(r.deferred.size()) != r.no_source)
      first = Internal(where + "the device chunk table served " + std::to_string(r.chunks.size()) + " of " +
                       std::to_string(r.take) + " chunks (" + std::to_string(r.skipped) + " skipped, " +
                       std::to_string(r.deferred.size()) + " deferred of " + std::to_string(r.no_source) +
                       " with no source)");
  }
  return first;
}

Status SessionImpl::TakeLaneReports(uint64_t before_step, bool wait) {
  if (lane_ == nullptr) return Status::Ok();
  Status first = Status::Ok();
  for (;;) {
    LaneStepReport report;
    KVTIER_ASSIGN_OR_RETURN(bool got, lane_->TakeReport(before_step, wait, &report));
    if (!got) break;
    const Status st = ApplyLaneReport(report);
    if (first.ok()) first = st;
  }
  return first;
}

Status SessionImpl::LeaveLane() {
  if (lane_ == nullptr) return Status::Ok();
  const Status reports = TakeLaneReports(UINT64_MAX, /*wait=*/true);
  if (lane_->grant_on_device()) {
    kernels::EntropyGrantState* grant = retriever_ ? retriever_->grant_state() : nullptr;
    KVTIER_RETURN_IF_ERROR(lane_->ReturnGrantState(grant, counters_.steps, lane_k_));
  }
  return reports;
}

Status SessionImpl::WaitForDevice() {
  const HostSyncScope syncs(&counters_);
  return TakeLaneReports(UINT64_MAX, /*wait=*/true);
}

bool SessionImpl::QueriesStayOnDevice(int m) const {
  return in_step_ && step_ == StepKind::kDecode && m == 1 && retriever_ != nullptr && !selector_ &&
         retriever_->SelectsDecodeOnBackend() && options_.keep_queries == 0;
}

Status SessionImpl::BeginStep(StepKind kind) {
  if (dropped_) return FailedPrecondition("Session::BeginStep: the session's sequence was dropped");
  if (kind != StepKind::kPrefill && kind != StepKind::kDecode)
    return InvalidArgument("Session::BeginStep: unknown step kind " + std::to_string(static_cast<int>(kind)));
  step_ = kind;
  in_step_ = true;
  next_layer_ = 0;
  step_plan_.valid = false;
  if (retriever_) retriever_->BeginStep();
  counters_.steps += 1;
  return Status::Ok();
}

Status SessionImpl::CheckLayerCall(const char* what, int layer, const float* q, const int64_t* positions,
                                   int m, bool in_step, bool q_on_device) const {
  const Geometry& g = geometry();
  if (dropped_)
    return FailedPrecondition(std::string("Session::") + what + ": the session's sequence was dropped");
  if (in_step && !in_step_)
    return FailedPrecondition(std::string("Session::") + what + ": call BeginStep first");
  if (layer < 0 || layer >= g.layers)
    return InvalidArgument(std::string("Session::") + what + ": layer " + std::to_string(layer) +
                           " outside [0, " + std::to_string(g.layers) + ")");
  // Retrieval serves layers 0, 1, ..., L-1 in that order, none skipped (the entropy budget
  // of Eq. 12 flows from shallow to deep layers); without it, layers only go forward.
  const bool every_layer = retriever_ != nullptr && !selector_;
  if (in_step && (every_layer ? layer != next_layer_ : layer < next_layer_))
    return FailedPrecondition(std::string("Session::") + what + ": layer " + std::to_string(layer) +
                              " where layer " + std::to_string(next_layer_) +
                              (every_layer ? "" : " or a deeper one") +
                              " comes next in this step; layers go shallow to deep, each once per step");
  if (m <= 0)
    return InvalidArgument(std::string("Session::") + what + ": m must be > 0 (got " + std::to_string(m) +
                           ")");
  if (in_step && step_ == StepKind::kDecode && m != 1)
    return InvalidArgument(std::string("Session::") + what +
                           ": a decode step takes one query (got m = " + std::to_string(m) + ")");
  if ((q == nullptr && !q_on_device) || positions == nullptr)
    return InvalidArgument(std::string("Session::") + what + ": q and positions must not be null");
  const size_t q_elems = static_cast<size_t>(g.q_heads) * g.head_dim;
  // Queries on the device are checked there (the retrieval backend's CountNonFinite).
  const size_t bad_q = q_on_device ? static_cast<size_t>(m) * q_elems
                                   : FirstNonFinite(DType::kF32, q, static_cast<size_t>(m) * q_elems);
  if (bad_q < static_cast<size_t>(m) * q_elems)
    return InvalidArgument(std::string("Session::") + what + ": layer " + std::to_string(layer) + ": q[" +
                           std::to_string(bad_q / q_elems) + "][" +
                           std::to_string(bad_q % q_elems / static_cast<size_t>(g.head_dim)) + "][" +
                           std::to_string(bad_q % static_cast<size_t>(g.head_dim)) +
                           "] = " + FormatFloat(q[bad_q]) + " is not finite; queries must be finite");
  if (positions[0] < 0)
    return InvalidArgument(std::string("Session::") + what +
                           ": positions must be >= 0 (positions[0] = " + std::to_string(positions[0]) +
                           "); a query's position is its token's index in the "
                           "sequence, counted from 0");
  for (int t = 1; t < m; ++t)
    if (positions[t] <= positions[t - 1])
      return InvalidArgument(std::string("Session::") + what + ": positions must increase (positions[" +
                             std::to_string(t) + "] = " + std::to_string(positions[t]) + ")");
  return Status::Ok();
}

Status SessionImpl::CheckPositionsHeld(const char* what, int layer, const int64_t* positions, int m,
                                       int64_t held) const {
  const std::string call = std::string("Session::") + what + ": layer " + std::to_string(layer);
  const std::string got =
      " (got " + std::to_string(positions[0]) + ".." + std::to_string(positions[m - 1]) + ")";
  if (held == 0)
    return FailedPrecondition(call +
                              " holds no tokens: append the step's K/V to the layer before its queries"
                              " attend" +
                              got);
  const std::string holds = call + " holds positions 0.." + std::to_string(held - 1);
  if (held < m)
    return InvalidArgument(holds + ", fewer tokens than the " + std::to_string(m) +
                           " queries: a window's K/V are appended before its queries" + got);
  // Strictly increasing (CheckLayerCall) from held - m to held - 1: exactly the last m tokens.
  if (positions[0] != held - m || positions[m - 1] != held - 1)
    return InvalidArgument(holds + ": the " + std::to_string(m) + " queries must be at its last " +
                           std::to_string(m) + " appended tokens, " + std::to_string(held - m) + ".." +
                           std::to_string(held - 1) + got);
  return Status::Ok();
}

const SessionImpl::StepPlan& SessionImpl::PlanStep(int m, const HotView& view) {
  StepPlanKey key;
  key.m = m;
  key.held = view.n_tokens;
  key.sinks_first = view.sinks.first_position;
  key.sinks_tokens = view.sinks.n_tokens;
  key.n_local = view.n_local_spans;
  for (int i = 0; i < view.n_local_spans; ++i) {
    key.local_first[i] = view.local[i].first_position;
    key.local_tokens[i] = view.local[i].n_tokens;
  }
  StepPlan& p = step_plan_;
  if (p.valid && p.key == key) return p;
  p.valid = false;
  p.key = key;
  p.positions.resize(static_cast<size_t>(m));
  for (int t = 0; t < m; ++t) p.positions[static_cast<size_t>(t)] = view.n_tokens - m + t;
  p.local_start = view.n_local_spans ? view.local[0].first_position : view.n_tokens;
  p.sinks_are_memory = view.sinks.first_position + view.sinks.n_tokens < p.local_start;
  const Geometry& g = geometry();
  p.base = AttentionPlanInput{};
  p.base.q_heads = g.q_heads;
  p.base.kv_heads = g.kv_heads;
  p.base.head_dim = g.head_dim;
  p.base.dtype = g.dtype;
  p.base.scale = 1.0f / std::sqrt(static_cast<float>(g.head_dim));
  p.base.n_queries = m;
  p.base.positions = p.positions.data();
  p.base.pool = PoolOf(store_->hot_tier());
  if (!inv_freq_.empty()) {
    p.rel.resize(static_cast<size_t>(m));
    for (int t = 0; t < m; ++t)
      p.rel[static_cast<size_t>(t)] = p.positions[static_cast<size_t>(t)] - p.local_start;
    p.sink_key_positions.resize(static_cast<size_t>(view.sinks.n_tokens));
    for (int t = 0; t < view.sinks.n_tokens; ++t)
      p.sink_key_positions[static_cast<size_t>(t)] =
          p.sinks_are_memory ? p.local_start : view.sinks.first_position + t;
    for (int i = 0; i < 2; ++i) {
      const int n = i < view.n_local_spans ? view.local[i].n_tokens : 0;
      p.local_key_positions[i].resize(static_cast<size_t>(n));
      for (int t = 0; t < n; ++t)
        p.local_key_positions[i][static_cast<size_t>(t)] = view.local[i].first_position + t;
    }
  }
  p.valid = true;
  step_plan_builds_ += 1;
  return p;
}

const float* SessionImpl::MemoryQueries(const float* q, int m, const StepPlan& plan) {
  if (inv_freq_.empty()) return q;  // kAbsolute: the engine's queries are memory's view already
  const Geometry& g = geometry();
  q_mem_.assign(q, q + static_cast<size_t>(m) * g.q_heads * g.head_dim);
  kernels::Rope(q_mem_.data(), m, g.q_heads, g.head_dim, plan.rel.data(), inv_freq_.data());
  return q_mem_.data();
}

const float* SessionImpl::TrueQueries(const float* q, const int64_t* positions, int m) {
  if (inv_freq_.empty()) return q;  // kAbsolute: already rotated at their true positions
  if (q_rot_of_ == q) return q_rot_.data();
  const Geometry& g = geometry();
  q_rot_.assign(q, q + static_cast<size_t>(m) * g.q_heads * g.head_dim);
  kernels::Rope(q_rot_.data(), m, g.q_heads, g.head_dim, positions, inv_freq_.data());
  q_rot_of_ = q;
  return q_rot_.data();
}

void SessionImpl::KeepQueries(int layer, const float* q, const int64_t* positions, int m) {
  if (options_.keep_queries <= 0) return;
  // Kept for Compress as attention sees them: rotated at their true positions.
  q = TrueQueries(q, positions, m);
  const size_t q_elems = static_cast<size_t>(geometry().q_heads) * geometry().head_dim;
  std::deque<KeptQuery>& ring = kept_[static_cast<size_t>(layer)];
  for (int i = std::max(0, m - options_.keep_queries); i < m; ++i) {
    const float* row = q + static_cast<size_t>(i) * q_elems;
    ring.push_back(KeptQuery{positions[i], std::vector<float>(row, row + q_elems)});
    if (ring.size() > static_cast<size_t>(options_.keep_queries)) ring.pop_front();
  }
}

Status SessionImpl::Observe(int layer, const float* q, const int64_t* positions, int m) {
  const HostSyncScope syncs(&counters_);
  KVTIER_RETURN_IF_ERROR(CheckLayerCall("Observe", layer, q, positions, m, /*in_step=*/false));
  q_rot_of_ = nullptr;
  KVTIER_ASSIGN_OR_RETURN(HotView view, GetHotView(*store_, seq_, layer));
  KVTIER_RETURN_IF_ERROR(CheckPositionsHeld("Observe", layer, positions, m, view.n_tokens));
  const StepPlan& plan = PlanStep(m, view);
  KeepQueries(layer, q, plan.positions.data(), m);
  const float* q_mem = MemoryQueries(q, m, plan);  // memory's view needs L0
  return ObserveLocked(layer, q, q_mem, m, view, plan);
}

bool SessionImpl::ObservesStatistics() const {
  return options_.observe_prefill && store_->options().repr_topk < store_->options().chunk_size;
}

Status SessionImpl::ObserveLocked(int layer, const float* q, const float* q_mem, int m, const HotView& view,
                                  const StepPlan& plan) {
  if (ObservesStatistics()) KVTIER_RETURN_IF_ERROR(ObserveStatistics(layer, q, m, view, plan));
  if (retriever_) KVTIER_RETURN_IF_ERROR(retriever_->Observe(layer, q_mem, m));
  return Status::Ok();
}

Status SessionImpl::ObserveStatistics(int layer, const float* q, int m, const HotView& view,
                                      const StepPlan& plan) {
  const int64_t* positions = plan.positions.data();
  if (inv_freq_.empty()) return ObserveQueries(*store_, seq_, layer, q, positions, m);
  // kInfLLM. The model attends the local window at its true positions and the sinks at L0 once
  // chunks separate them (Attend's rotations), with queries at their true positions; the sinks
  // join the softmax, only the local window's mass is kept (the store's pass does the same).
  // This pass runs on the host: on a device tier the sinks and local window are read back first
  // (as ObserveQueries does; Attend of a prefill window takes the statistics on the device).
  const Geometry& g = geometry();
  const float* q_true = TrueQueries(q, positions, m);
  const size_t tok = g.token_elems();
  const int n_parts = 1 + view.n_local_spans;
  HotView host_view = view;
  std::vector<std::vector<uint8_t>> host_copy;
  KVTIER_RETURN_IF_ERROR(
      HostCopyOfView(store_->hot_tier(), tok * DTypeSize(g.dtype), &host_view, &host_copy));
  std::vector<std::vector<float>> k(n_parts), v(n_parts);
  std::vector<kernels::KvSpan> parts(n_parts);
  for (int i = 0; i < n_parts; ++i) {
    const kernels::KvSpan& sp = i == 0 ? host_view.sinks : host_view.local[i - 1];
    const size_t n = static_cast<size_t>(sp.n_tokens) * tok;
    k[i].resize(std::max<size_t>(1, n));
    v[i].resize(std::max<size_t>(1, n));
    if (n > 0) {
      ToFloat(g.dtype, sp.k, k[i].data(), n);
      ToFloat(g.dtype, sp.v, v[i].data(), n);
      const std::vector<int64_t>& pos = i == 0 ? plan.sink_key_positions : plan.local_key_positions[i - 1];
      kernels::Rope(k[i].data(), sp.n_tokens, g.kv_heads, g.head_dim, pos.data(), inv_freq_.data());
    }
    parts[i] = kernels::KvSpan{k[i].data(), v[i].data(), sp.n_tokens, sp.first_position, nullptr};
  }
  return AddWindowMass(*store_, seq_, layer, DType::kF32, q_true, positions, m, std::move(parts),
                       "Session: the representative-key statistics");
}

Status SessionImpl::SetQuestion(int layer, const float* q, int m) {
  if (dropped_) return FailedPrecondition("Session::SetQuestion: the session's sequence was dropped");
  if (!retriever_) return FailedPrecondition("Session::SetQuestion: retrieval is off (retrieve = false)");
  return retriever_->SetQuestion(layer, q, m);
}

Result<LayerParts> SessionImpl::Gather(int layer, const float* q, const int64_t* positions, int m) {
  const HostSyncScope syncs(&counters_);
  return GatherFor("Gather", layer, q, positions, m);
}

Result<LayerParts> SessionImpl::GatherFor(const char* what, int layer, const float* q,
                                          const int64_t* positions, int m, bool observe,
                                          const float* q_device, void* q_stream) {
  const bool q_on_device = q == nullptr && q_device != nullptr;
  KVTIER_RETURN_IF_ERROR(CheckLayerCall(what, layer, q, positions, m, /*in_step=*/true, q_on_device));
  if (q_on_device && !QueriesStayOnDevice(m))
    return Internal(std::string("Session::") + what +
                    ": the queries stayed on the device for a step that needs them");
  // The host path: the lane's reports read and the allocator's state back on the host.
  KVTIER_RETURN_IF_ERROR(LeaveLane());
  q_rot_of_ = nullptr;
  try {
    const bool decode = step_ == StepKind::kDecode;
    LayerParts lp;
    // The layer step's first store visit (TieredStore::BeginLayerStep): lands the layer's
    // sealed chunks (the session drives its sequence), and reads the background error, the
    // hot view and, with retrieval, the index's chunk updates, under one lock entry. The
    // second is the fetch below; the handle's release is the last lock entry.
    ChunkCursor cursor;
    ChunkUpdate* updates = nullptr;
    if (retriever_ && !selector_) {
      KVTIER_ASSIGN_OR_RETURN(cursor, retriever_->Cursor(seq_, layer));
      updates = retriever_->step_update();
    }
    LayerStepView step;
    KVTIER_RETURN_IF_ERROR(store_->BeginLayerStep(seq_, layer, updates ? &cursor : nullptr, updates, &step,
                                                  Retriever::kSyncBatch));
    // A lower tier that failed a background write of any session: reported here too, not
    // only by the Append or WaitForDurable that may come much later.
    if (!step.background.ok())
      return Status(step.background.code(), std::string("Session::") + what + ": layer " +
                                                std::to_string(layer) + ": " + step.background.message());
    const HotView& view = step.hot;
    KVTIER_RETURN_IF_ERROR(CheckPositionsHeld(what, layer, positions, m, view.n_tokens));
    const StepPlan& plan = PlanStep(m, view);
    lp.local_start = plan.local_start;
    const float* q_sel = q_on_device ? nullptr : MemoryQueries(q, m, plan);
    if (selector_ || !retriever_) {
      KVTIER_ASSIGN_OR_RETURN(std::vector<ChunkInfo> chunks, store_->ListChunks(seq_, layer));
      const auto t0 = std::chrono::steady_clock::now();
      KVTIER_ASSIGN_OR_RETURN(lp.chunks, selector_ ? selector_(layer, q_sel, positions, m, chunks)
                                                   : SelectAllChunks(layer, q_sel, positions, m, chunks));
      lp.stats.search_ms = MsSince(t0);
    } else {
      // A prefill window's queries also feed the representative-key statistics (the attention
      // they pay to the local window; Attend takes them from its own attention and passes
      // observe = false); Select builds the probe from the window, which is the probe's
      // Observe too (ActQKV's running statistics see every window once).
      if (!decode && ObservesStatistics() && observe)
        KVTIER_RETURN_IF_ERROR(ObserveStatistics(layer, q, m, view, plan));
      auto select = [&]() -> Result<LayerSelection> {
        if (!q_on_device) return retriever_->Select(seq_, layer, q_sel, m, decode, updates);
        BackendQueries queries;
        queries.q = q_device;
        queries.q_heads = geometry().q_heads;
        if (!inv_freq_.empty()) {  // memory sees the query at its position minus L0 (MemoryQueries)
          queries.rope_inv_freq = inv_freq_.data();
          queries.rope_position = plan.rel[0];
        }
        queries.after_stream = q_stream;
        Result<LayerSelection> on_device = retriever_->SelectDecodeOnBackend(seq_, layer, queries, updates);
        if (!on_device.ok())
          return Status(on_device.status().code(),
                        std::string("Session::") + what + ": " + on_device.status().message());
        return on_device;
      };
      Result<LayerSelection> selected = select();
      KVTIER_ASSIGN_OR_RETURN(LayerSelection sel, std::move(selected));
      lp.chunks = std::move(sel.chunks);
      lp.stats.probe_ms = sel.probe_ms;
      lp.stats.search_ms = sel.search_ms;
      lp.stats.alloc_ms = sel.alloc_ms;
      lp.stats.entropy = sel.entropy;
      lp.stats.chunks_clipped = sel.clipped;
      counters_.chunks_clipped += sel.clipped;
      lp.stats.reused = sel.reused;
      lp.stats.sliced = sel.sliced;
      lp.stats.first_stage_bytes = sel.first_stage_bytes;
      lp.stats.rescoring_bytes = sel.rescoring_bytes;
      counters_.first_stage_bytes += sel.first_stage_bytes;
      counters_.rescoring_bytes += sel.rescoring_bytes;
      counters_.selections_reused += sel.reused ? 1 : 0;
      counters_.selections_sliced += sel.sliced ? 1 : 0;
    }
    const auto t0 = std::chrono::steady_clock::now();
    if (!lp.chunks.empty()) {
      // A retrieval grant past the reservation takes only slots no other session's
      // reservation claims (see "Sharing the hot slot pool" in session.h); a selector's
      // choice, and full attention, are fetched whole.
      const bool fit = retriever_ && !selector_ && reservation_ != 0;
      KVTIER_ASSIGN_OR_RETURN(lp.fetch, store_->FetchChunks(seq_, layer, lp.chunks,
                                                            fit ? FetchFit::kWithinClaims : FetchFit::kAll));
      if (const size_t kept = lp.fetch.spans().size(); kept < lp.chunks.size()) {
        lp.stats.chunks_clipped += lp.chunks.size() - kept;
        counters_.chunks_clipped += lp.chunks.size() - kept;
        lp.chunks.resize(kept);
      }
      KVTIER_RETURN_IF_ERROR(lp.fetch.Wait());
    }
    lp.stats.fetch_ms = MsSince(t0);
    lp.n_chunks = lp.chunks.size();
    lp.stats.chunks = lp.n_chunks;
    lp.parts.reserve(lp.n_chunks + 3);
    lp.parts.push_back(view.sinks);
    if (!lp.fetch.empty())
      for (const kernels::KvSpan& sp : lp.fetch.spans()) lp.parts.push_back(sp);
    for (int i = 0; i < view.n_local_spans; ++i) lp.parts.push_back(view.local[i]);
    // The attention reads K and V of every token of the parts once (a count, not a measurement).
    int64_t attended_tokens = 0;
    for (const kernels::KvSpan& sp : lp.parts) attended_tokens += sp.n_tokens;
    lp.stats.attention_bytes = static_cast<uint64_t>(attended_tokens) * geometry().token_kv_bytes();
    counters_.attention_bytes += lp.stats.attention_bytes;
    // InfLLM positions (see the top of session.h): chunks at L0; the sinks at L0 once chunks
    // separate them from the local window; the local window at its true positions.
    lp.rope_positions.assign(lp.parts.size(), -1);
    if (plan.sinks_are_memory) lp.rope_positions[0] = lp.local_start;
    for (size_t i = 1; i <= lp.n_chunks; ++i) lp.rope_positions[i] = lp.local_start;

    if (!q_on_device) KeepQueries(layer, q, plan.positions.data(), m);
    next_layer_ = layer + 1;
    last_chunks_[static_cast<size_t>(layer)] = lp.chunks;
    counters_.attends += 1;
    counters_.chunks_attended += lp.n_chunks;
    counters_.max_layer_chunks = std::max<uint64_t>(counters_.max_layer_chunks, lp.n_chunks);
    counters_.probe_ms += lp.stats.probe_ms;
    counters_.search_ms += lp.stats.search_ms;
    counters_.alloc_ms += lp.stats.alloc_ms;
    counters_.fetch_ms += lp.stats.fetch_ms;
    return lp;
  } catch (const std::bad_alloc&) {
    return ResourceExhausted(std::string("Session::") + what + ": out of memory (layer " +
                             std::to_string(layer) + ", m = " + std::to_string(m) + ")");
  }
}

Status SessionImpl::Attend(int layer, const float* q, const int64_t* positions, int m, float* out,
                           AttendStats* stats) {
  const HostSyncScope syncs(&counters_);
  if (out == nullptr) return InvalidArgument("Session::Attend: out must not be null");
  return AttendLayer("Attend", layer, q, nullptr, nullptr, positions, m, out, /*out_on_device=*/false, stats);
}

Status SessionImpl::AttendLayer(const char* what, int layer, const float* q, const float* q_device,
                                void* q_stream, const int64_t* positions, int m, float* out,
                                bool out_on_device, AttendStats* stats) {
  // A prefill window's representative-key statistics come from this attention (the kernel's
  // per-key mass, summed over each kv head's query heads, on the tier's device), not from a
  // second pass in Gather. A store whose representatives are per query head (ReprHeads::kQuery)
  // needs each query head's mass, which the kernel does not split: Gather's host pass gives it
  // (AddWindowMass, one pass per GQA member over the sinks and local window, so its softmax
  // leaves out the retrieved chunks).
  const bool observe_here = retriever_ && !selector_ && ObservesStatistics() && in_step_ &&
                            step_ == StepKind::kPrefill && store_->options().repr_heads == ReprHeads::kKv;
  KVTIER_ASSIGN_OR_RETURN(
      LayerParts lp, GatherFor(what, layer, q, positions, m, /*observe=*/!observe_here, q_device, q_stream));
  try {
    const auto t0 = std::chrono::steady_clock::now();
    // The plan: sinks | retrieved chunks (slots of the hot pool) | local runs, the order
    // Gather lists them in, over the step plan GatherFor built or reused for this layer.
    const StepPlan& step = step_plan_;
    AttentionPlanInput in = step.base;
    in.q = q;
    if (!inv_freq_.empty()) {
      // Queries at their true positions; each part's keys rotated where memory puts them, by
      // the attention kernel as it reads them (the store keeps keys before RoPE), on the tier's
      // device: the retrieved chunks at L0, the sinks at L0 once chunks separate them from the
      // local window (else at their own positions), the local runs at their own positions.
      if (q != nullptr) {
        in.q = TrueQueries(q, step.positions.data(), m);
        q_device = nullptr;  // the kernel reads the rotated host copy, uploaded with the plan
      } else {
        in.q_rope_positions = step.positions.data();  // the kernel rotates the device queries
      }
      in.rope_inv_freq = inv_freq_.data();
      in.chunks_rope_position = step.local_start;
      in.sinks_rope_position = step.sinks_are_memory ? step.local_start : kernels::kRopeAtKeyPositions;
    }
    in.sinks = lp.parts[0];
    in.chunks = lp.n_chunks ? lp.parts.data() + 1 : nullptr;
    in.n_chunks = lp.n_chunks;
    in.local = lp.parts.data() + 1 + lp.n_chunks;
    in.n_local = static_cast<int>(lp.parts.size() - 1 - lp.n_chunks);
    Status st = observe_here ? AttendAndObserve(store_, seq_, layer, backend_.get(), in, plan_.get(), out,
                                                q_device, out_on_device)
                             : plan_->Build(in);
    if (st.ok() && !observe_here)
      st = out_on_device ? backend_->RunOnDevice(*plan_, q_device, out, nullptr) : backend_->Run(*plan_, out);
    if (!st.ok())
      return Status(st.code(), std::string("Session::") + what + ": layer " + std::to_string(layer) + ": " +
                                   st.message());
    lp.stats.attention_ms = MsSince(t0);
    lp.Release();  // unpinning is bookkeeping under the store lock, not attention: timed by neither
    counters_.attention_ms += lp.stats.attention_ms;
    if (stats) *stats = lp.stats;
    return Status::Ok();
  } catch (const std::bad_alloc&) {
    return ResourceExhausted(std::string("Session::") + what + ": out of memory (layer " +
                             std::to_string(layer) + ")");
  }
}

Result<CompressReport> SessionImpl::Compress(const std::string& policy_spec, int64_t kv_budget,
                                             int n_queries) {
  const HostSyncScope syncs(&counters_);
  if (dropped_) return FailedPrecondition("Session::Compress: the session's sequence was dropped");
  if (options_.keep_queries <= 0)
    return FailedPrecondition(
        "Session::Compress: no queries kept (set SessionOptions.keep_queries > 0): the policy "
        "observes the attention of the most recent queries");
  if (n_queries < 0)
    return InvalidArgument("Session::Compress: n_queries must be >= 0 (got " + std::to_string(n_queries) +
                           ")");
  const StoreOptions& so = store_->options();
  if (kv_budget < static_cast<int64_t>(so.n_sink) + so.n_local)
    return InvalidArgument("Session::Compress: kv_budget (" + std::to_string(kv_budget) +
                           ") must cover the sinks and the local window (" +
                           std::to_string(so.n_sink + so.n_local) + ")");
  const Geometry& g = so.geometry;
  const size_t q_elems = static_cast<size_t>(g.q_heads) * g.head_dim;
  try {
    if (!policy_ || policy_spec != policy_spec_) {
      KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<ScoringPolicy> p, MakeScoringPolicy(policy_spec));
      PolicyGeometry pg;
      pg.layers = g.layers;
      pg.q_heads = g.q_heads;
      pg.kv_heads = g.kv_heads;
      pg.head_dim = g.head_dim;
      pg.sink_tokens = so.n_sink;
      pg.local_tokens = so.n_local;
      KVTIER_RETURN_IF_ERROR(p->Begin(pg));
      policy_ = std::move(p);
      policy_spec_ = policy_spec;
    }
    // The session drives its sequence: what it sealed lands now, so the keys read back below
    // and the chunk counts cover every token appended.
    KVTIER_RETURN_IF_ERROR(store_->Flush(seq_));
    for (int l = 0; l < g.layers; ++l) {
      KVTIER_ASSIGN_OR_RETURN(LayerKeys lk, ReadLayerKeys(store_, seq_, l));
      const int64_t n = static_cast<int64_t>(lk.positions.size());
      // kInfLLM stores keys before RoPE: rotate them where attention sees them (memory at L0,
      // the local window at its true positions), so the policy scores the attention the model
      // really gives every held key. Queries were kept rotated at their true positions.
      if (!inv_freq_.empty()) {
        KVTIER_ASSIGN_OR_RETURN(uint64_t sealed, store_->ChunkCount(seq_, l));
        const int64_t l0 = ChunkFirstToken(sealed, so.n_sink, so.chunk_size);
        std::vector<int64_t> rope_pos(lk.positions);
        if (sealed > 0)
          for (int64_t& p : rope_pos) p = std::max(p, l0);
        kernels::Rope(lk.keys.data(), static_cast<int>(n), g.kv_heads, g.head_dim, rope_pos.data(),
                      inv_freq_.data());
      }
      const std::deque<KeptQuery>& ring = kept_[static_cast<size_t>(l)];
      const int want = n_queries > 0 ? n_queries : static_cast<int>(ring.size());
      const int mq = std::min<int>(want, static_cast<int>(ring.size()));
      if (mq < 1)
        return FailedPrecondition("Session::Compress: no queries kept for layer " + std::to_string(l));
      std::vector<float> q(static_cast<size_t>(mq) * q_elems);
      std::vector<int64_t> qpos(static_cast<size_t>(mq));
      for (int i = 0; i < mq; ++i) {
        const KeptQuery& src = ring[ring.size() - static_cast<size_t>(mq) + static_cast<size_t>(i)];
        qpos[static_cast<size_t>(i)] = src.position;
        std::copy(src.q.begin(), src.q.end(),
                  q.begin() + static_cast<ptrdiff_t>(static_cast<size_t>(i) * q_elems));
      }
      std::vector<float> attn(static_cast<size_t>(g.q_heads) * mq * static_cast<size_t>(n));
      ExactAttentionRows(g, q.data(), qpos.data(), mq, lk.keys.data(), lk.positions.data(), n, attn.data());
      AttentionObservation obs;
      obs.layer = l;
      obs.n_queries = mq;
      obs.n_keys = n;
      obs.key_positions = lk.positions.data();
      obs.query_positions = qpos.data();
      obs.attention = attn.data();
      obs.keys = lk.keys.data();
      obs.values = lk.values.data();
      KVTIER_RETURN_IF_ERROR(policy_->Observe(obs));
    }
    CompressReport rep;
    rep.policy = policy_->ToString();
    rep.compress_every = policy_->compress_every();
    for (int l = 0; l < g.layers; ++l) {
      KVTIER_ASSIGN_OR_RETURN(uint64_t n_chunks, store_->ChunkCount(seq_, l));
      KVTIER_ASSIGN_OR_RETURN(TokenScores ts, policy_->Scores(l));
      KVTIER_ASSIGN_OR_RETURN(KeepSet keep, policy_->Keep(l, kv_budget));
      KVTIER_ASSIGN_OR_RETURN(int64_t chunk_budget, ChunkBudget(*store_, seq_, l, kv_budget));
      const std::vector<uint64_t> drop =
          ChunksToDrop(ts, keep, so.n_sink, so.chunk_size, n_chunks, chunk_budget);
      uint64_t dropped = 0;
      KVTIER_RETURN_IF_ERROR(store_->DropChunks(seq_, l, drop, &dropped));
      if (retriever_) KVTIER_RETURN_IF_ERROR(retriever_->Sync(seq_, l));  // the index drops them too
      rep.dropped_chunks += dropped;
    }
    KVTIER_ASSIGN_OR_RETURN(rep.kept_tokens, KeptTokensPerLayer(*store_, seq_, g.layers));
    counters_.compressions += 1;
    counters_.dropped_chunks += rep.dropped_chunks;
    return rep;
  } catch (const std::bad_alloc&) {
    return ResourceExhausted("Session::Compress: out of memory reading the keys back");
  }
}

Status SessionImpl::Close() {
  if (dropped_) return FailedPrecondition("Session::Close: the session's sequence was dropped");
  in_step_ = false;
  ReleaseReservation();
  return store_->CloseSequence(seq_);
}

Status SessionImpl::Drop() {
  if (dropped_) return FailedPrecondition("Session::Drop: the session's sequence was dropped already");
  lane_.reset();  // its reads of the sequence's warm copies finish first
  KVTIER_RETURN_IF_ERROR(store_->DropSequence(seq_));
  ReleaseReservation();
  dropped_ = true;
  in_step_ = false;
  return Status::Ok();
}

}  // namespace kvtier

namespace kvtier {
const char* Version() { return KVTIER_VERSION; }
}  // namespace kvtier
