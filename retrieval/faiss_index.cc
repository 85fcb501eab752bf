#include "retrieval/faiss_index.h"

#include <faiss/Index.h>
#include <faiss/IndexFlat.h>
#include <faiss/IndexFlatCodes.h>
#include <faiss/IndexHNSW.h>
#include <faiss/IndexIDMap.h>
#include <faiss/IndexIVF.h>
#include <faiss/IndexPreTransform.h>
#include <faiss/impl/FaissException.h>
#include <faiss/impl/IDSelector.h>
#include <faiss/index_factory.h>
#include <faiss/invlists/DirectMap.h>
#include <faiss/invlists/InvertedLists.h>
#include <omp.h>
#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <new>
#include <numeric>
#include <regex>
#include <utility>

#include "kernels/cpu/dot.h"
#include "kernels/tbb_tsan.h"
#include "store/factory_spec.h"

namespace kvtier {
namespace {

using faiss_idx_t = faiss::Index::idx_t;
using kernels::Dot;

constexpr uint64_t kMaxId = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());

// FaissException::what() reads "Error in <function> at <file>:<line>: <msg>";
// the function signature is noise for a user, keep the message.
std::string FaissMessage(const std::exception& e) {
  const std::string what = e.what();
  static const std::regex kLocation(R"(\.(cpp|h|cu):[0-9]+: )");
  std::smatch m;
  if (std::regex_search(what, m, kLocation)) return what.substr(m.position(0) + m.length(0));
  return what;
}

// Turns an exception thrown inside a FAISS call into a Status naming the call.
Status FromException(const std::string& what_failed, const std::exception& e) {
  if (dynamic_cast<const std::bad_alloc*>(&e)) return ResourceExhausted(what_failed + ": out of memory");
  return Internal(what_failed + ": FAISS: " + FaissMessage(e));
}

// The FAISS index a factory string describes, configured with the options,
// plus the facts about it the FaissVectorIndex needs.
struct Built {
  std::unique_ptr<faiss::Index> index;
  size_t nlist = 0;             // IVF lists, 0 if not IVF
  bool needs_training = false;  // !is_trained at construction
  bool can_remove = false;      // remove_ids implemented (Flat family, IVF)
  bool exact = false;           // exhaustive search over float vectors
  bool hnsw = false;            // an HNSW graph (efSearch applies)
};

// Checks, before index_factory sees a description, what FAISS itself gets wrong (measured on
// Debian's FAISS with the fuzz target tests/fuzz/fuzz_factory_strings.cc):
//  * "PQ0" anywhere ("PQ0", "IVF64,PQ0", "Refine(PQ0)", "PQ0x4fs") divides by zero inside
//    FAISS: SIGFPE, the process dies. A product quantizer needs M >= 1 sub-quantizers.
//  * index_factory allocates at construction what the numbers name, before any vector is
//    added: "IVF50000000,Flat" took 2.5 GB for its inverted lists, "PQ4x20" asked for 4 GiB of
//    centroids. Every number is capped at kMaxFactoryNumber (a 2M-token layer has 65536
//    chunks of 32, so more IVF lists, HNSW neighbours or PCA dimensions than that never
//    serve a chunk index) and code widths at 16 bits (2^16 centroids per sub-quantizer).
//  * "HNSW0" and "HNSW1" (also "HNSW00", "IVF64_HNSW1,Flat") build a graph whose level
//    table FAISS leaves short (set_default_probas with 1 / log(M) infinite or negative), so
//    asking it how many neighbours a level has reads past the table: garbage, different from
//    one parse to the next (the fuzz target's round trip trapped on it). HNSW needs M >= 2,
//    checked here on the description, before any graph exists.
//  * When an IVF's second part throws (PQ<M> with M not dividing the dimension, or more than
//    8 bits per code, which FAISS's IVF-PQ refuses), index_factory leaks the coarse quantizer
//    it already built: those are refused here with the reason instead.
constexpr int64_t kMaxFactoryNumber = 65536;
constexpr int kMaxCodeBits = 16;

Status CheckFactoryDescription(const std::string& factory, int dim) {
  const std::string quoted = "'" + factory + "'";
  // Every run of digits, and whether an 'x' (a code width: PQ8x10, RQ1x8) precedes it.
  for (size_t i = 0; i < factory.size();) {
    if (!std::isdigit(static_cast<unsigned char>(factory[i]))) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < factory.size() && std::isdigit(static_cast<unsigned char>(factory[j]))) ++j;
    const std::string digits = factory.substr(i, j - i);
    const bool bits = i > 0 && factory[i - 1] == 'x';
    const int64_t cap = bits ? kMaxCodeBits : kMaxFactoryNumber;
    if (digits.size() > 6 || std::stoll(digits) > cap)
      return InvalidArgument("FaissIndexOptions.factory " + quoted + ": " +
                             (bits ? "code width " : "number ") + digits + " exceeds " + std::to_string(cap) +
                             (bits ? " bits (2^bits centroids per sub-quantizer are allocated up front)"
                                   : " (index_factory allocates what the numbers name before any vector is "
                                     "added; a chunk index never needs more)"));
    i = j;
  }
  static const std::regex kHnsw(R"(HNSW([0-9]+))");
  for (auto it = std::sregex_iterator(factory.begin(), factory.end(), kHnsw); it != std::sregex_iterator();
       ++it)
    if (std::stoll((*it)[1]) < 2)
      return InvalidArgument("FaissIndexOptions.factory " + quoted + ": " + (*it)[0].str() +
                             ": HNSW needs M >= 2 neighbours per node (got " +
                             std::to_string(std::stoll((*it)[1])) + ")");
  // A product quantizer as a part of its own: at the start, or after ',' or '(' (not OPQ's
  // rotation, "OPQ16_64", whose M divides its output dimension).
  static const std::regex kPq(R"((^|[,(])PQ([0-9]+)(x([0-9]+))?)");
  const bool ivf = factory.rfind("IVF", 0) == 0 || factory.find(",IVF") != std::string::npos ||
                   factory.find("(IVF") != std::string::npos;
  for (auto it = std::sregex_iterator(factory.begin(), factory.end(), kPq); it != std::sregex_iterator();
       ++it) {
    const std::string part = (*it)[0].str().substr((*it)[1].length());
    const int64_t m = std::stoll((*it)[2]);
    if (m < 1)
      return InvalidArgument("FaissIndexOptions.factory " + quoted + ": " + part +
                             " has no sub-quantizer (PQ<M> needs M >= 1)");
    if (dim % m != 0)
      return InvalidArgument("FaissIndexOptions.factory " + quoted + ": " + part + " needs M = " +
                             std::to_string(m) + " to divide the vector dimension " + std::to_string(dim));
    if (ivf && (*it)[4].matched && std::stoll((*it)[4]) > 8)
      return InvalidArgument("FaissIndexOptions.factory " + quoted + ": " + part +
                             " inside an IVF: FAISS's IVF-PQ takes at most 8 bits per code");
  }
  return Status::Ok();
}

Result<Built> BuildFaiss(int dim, const FaissIndexOptions& o) {
  const std::string quoted = "'" + o.factory + "'";
  if (o.factory.empty())
    return InvalidArgument(
        "FaissIndexOptions.factory must not be empty (a FAISS index_factory description such as \"Flat\", "
        "\"HNSW32\" or \"IVF1024,Flat\")");
  KVTIER_RETURN_IF_ERROR(CheckFactoryDescription(o.factory, dim));
  if (o.ivf_nprobe < 1)
    return InvalidArgument("FaissIndexOptions.ivf_nprobe must be >= 1 (got " + std::to_string(o.ivf_nprobe) +
                           ")");
  if (o.hnsw_ef_search < 1)
    return InvalidArgument("FaissIndexOptions.hnsw_ef_search must be >= 1 (got " +
                           std::to_string(o.hnsw_ef_search) + ")");
  if (o.train_min < 0)
    return InvalidArgument("FaissIndexOptions.train_min must be >= 0 (got " + std::to_string(o.train_min) +
                           "; 0 picks FAISS's rule of thumb)");

  Built b;
  try {
    b.index.reset(faiss::index_factory(dim, o.factory.c_str(), faiss::METRIC_INNER_PRODUCT));
  } catch (const std::exception& e) {
    return InvalidArgument("FaissIndexOptions.factory " + quoted +
                           " is not a usable FAISS index_factory description (dimension " +
                           std::to_string(dim) + "): " + FaissMessage(e));
  }
  if (!b.index)
    return InvalidArgument("FaissIndexOptions.factory " + quoted + ": index_factory returned nothing");

  // Find the core index under id maps and pre-transforms.
  faiss::Index* core = b.index.get();
  bool has_idmap = false, transformed = false;
  for (;;) {
    if (auto* m = dynamic_cast<faiss::IndexIDMap*>(core)) {
      has_idmap = true;
      core = m->index;
    } else if (auto* p = dynamic_cast<faiss::IndexPreTransform*>(core)) {
      transformed = true;
      core = p->index;
    } else {
      break;
    }
  }
  auto* ivf = dynamic_cast<faiss::IndexIVF*>(core);
  auto* hnsw = dynamic_cast<faiss::IndexHNSW*>(core);
  if (ivf) {
    if (ivf->nlist == 0)
      return InvalidArgument("FaissIndexOptions.factory " + quoted +
                             ": IVF needs at least one list (nlist = 0)");
    b.nlist = ivf->nlist;
    ivf->nprobe = std::min<size_t>(static_cast<size_t>(o.ivf_nprobe), ivf->nlist);
  }
  if (hnsw) {
    // Level 1 exists: CheckFactoryDescription refused M < 2, whose level table FAISS leaves short.
    const int m = hnsw->hnsw.nb_neighbors(1);
    if (m < 2)
      return InvalidArgument("FaissIndexOptions.factory " + quoted +
                             ": HNSW needs M >= 2 neighbours per node (got " + std::to_string(m) + ")");
    hnsw->hnsw.efSearch = o.hnsw_ef_search;
    b.hnsw = true;
  }
  b.needs_training = !b.index->is_trained;
  b.can_remove = ivf != nullptr || dynamic_cast<faiss::IndexFlatCodes*>(core) != nullptr;
  b.exact = !transformed && dynamic_cast<faiss::IndexFlat*>(core) != nullptr;
  if (ivf && o.train_min > 0 && static_cast<size_t>(o.train_min) < ivf->nlist)
    return InvalidArgument("FaissIndexOptions.train_min (" + std::to_string(o.train_min) +
                           ") must be >= nlist (" + std::to_string(ivf->nlist) + ") of factory " + quoted +
                           ": k-means needs a training vector per list (0 picks 39 x nlist)");
  try {
    if (ivf && !has_idmap) {
      // Chunk indices go in as IVF ids; a hash-table direct map makes
      // remove_ids O(1) per id instead of a scan of every list.
      ivf->set_direct_map_type(faiss::DirectMap::Hashtable);
    } else if (!has_idmap && !ivf) {
      auto wrapped = std::make_unique<faiss::IndexIDMap2>(b.index.get());
      wrapped->own_fields = true;
      (void)b.index.release();  // `wrapped` owns it now; released only once that cannot throw
      b.index = std::move(wrapped);
    }
  } catch (const std::exception& e) {
    return InvalidArgument("FaissIndexOptions.factory " + quoted +
                           ": cannot attach chunk ids: " + FaissMessage(e));
  }
  return b;
}

size_t DefaultTrainMin(const Built& b, const FaissIndexOptions& o) {
  if (!b.needs_training) return 0;
  if (o.train_min > 0) return static_cast<size_t>(o.train_min);
  return 39 * (b.nlist > 0 ? b.nlist : 256);
}

bool AllFinite(const float* v, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (!std::isfinite(v[i])) return false;
  return true;
}

// Scales v[0..D) to unit L2 norm; a zero vector stays zero. Non-finite input
// stays non-finite so that Add and Search reject it instead of hiding it.
void NormaliseHead(float* v, int D) {
  double ss = 0.0;
  for (int d = 0; d < D; ++d) ss += static_cast<double>(v[d]) * v[d];
  if (ss == 0.0) {
    std::fill_n(v, D, 0.0f);  // also turns -0.0 into +0.0
    return;
  }
  if (!std::isfinite(ss)) return;
  const float inv = static_cast<float>(1.0 / std::sqrt(ss));
  for (int d = 0; d < D; ++d) v[d] *= inv;
}

uint64_t FaissBytes(const faiss::Index* ix) {
  if (ix == nullptr) return 0;
  if (auto* m2 = dynamic_cast<const faiss::IndexIDMap2*>(ix))
    return m2->id_map.capacity() * sizeof(faiss_idx_t) + m2->rev_map.size() * 32 +
           m2->rev_map.bucket_count() * sizeof(void*) + FaissBytes(m2->index);
  if (auto* m = dynamic_cast<const faiss::IndexIDMap*>(ix))
    return m->id_map.capacity() * sizeof(faiss_idx_t) + FaissBytes(m->index);
  if (auto* p = dynamic_cast<const faiss::IndexPreTransform*>(ix))
    return FaissBytes(p->index) +
           static_cast<uint64_t>(p->d) * p->d * sizeof(float);  // transform: about d x d
  if (auto* h = dynamic_cast<const faiss::IndexHNSW*>(ix))
    return FaissBytes(h->storage) + h->hnsw.neighbors.capacity() * sizeof(faiss::HNSW::storage_idx_t) +
           h->hnsw.offsets.capacity() * sizeof(size_t) + h->hnsw.levels.capacity() * sizeof(int);
  if (auto* f = dynamic_cast<const faiss::IndexFlatCodes*>(ix)) return f->codes.capacity();
  if (auto* ivf = dynamic_cast<const faiss::IndexIVF*>(ix)) {
    uint64_t b = FaissBytes(ivf->quantizer);
    if (auto* al = dynamic_cast<const faiss::ArrayInvertedLists*>(ivf->invlists)) {
      for (size_t l = 0; l < al->nlist; ++l)
        b += al->codes[l].capacity() + al->ids[l].capacity() * sizeof(faiss_idx_t);
    } else {
      b += static_cast<uint64_t>(ivf->ntotal) * (ivf->code_size + sizeof(faiss_idx_t));
    }
    b += ivf->direct_map.array.capacity() * sizeof(faiss_idx_t) + ivf->direct_map.hashtable.size() * 32;
    return b;
  }
  return static_cast<uint64_t>(ix->ntotal) * ix->d * sizeof(float);  // unknown kind: assume float storage
}

// Runs the FAISS calls of one search on the calling thread only. A single
// query gains nothing from FAISS's OpenMP regions (Flat and IVF parallelise
// over queries, HNSW walks one graph path), but entering one costs a team
// wake-up and a barrier: on a loaded machine that measured 15-40 ms per
// search instead of 0.1-0.3 ms. The thread count is an OpenMP ICV of the
// calling thread alone, so concurrent searches and the caller's own OpenMP
// use are unaffected once it is restored.
class SingleThreadedOmp {
 public:
  SingleThreadedOmp() : saved_(omp_get_max_threads()) { omp_set_num_threads(1); }
  ~SingleThreadedOmp() { omp_set_num_threads(saved_); }
  SingleThreadedOmp(const SingleThreadedOmp&) = delete;
  SingleThreadedOmp& operator=(const SingleThreadedOmp&) = delete;

 private:
  int saved_;
};

// (score, chunk index) ordered best first: higher score, then smaller index.
struct Better {
  bool operator()(const std::pair<float, uint64_t>& a, const std::pair<float, uint64_t>& b) const {
    return a.first != b.first ? a.first > b.first : a.second < b.second;
  }
};

}  // namespace

// ---- options --------------------------------------------------------------------

Status FaissIndexOptions::Validate() const { return Validate(kValidateDim); }

Status FaissIndexOptions::Validate(int dim) const {
  if (dim <= 0) return InvalidArgument("FaissVectorIndex dim must be > 0 (got " + std::to_string(dim) + ")");
  auto built = BuildFaiss(dim, *this);
  return built.ok() ? Status::Ok() : built.status();
}

// ---- spec strings ---------------------------------------------------------------

Result<FaissIndexOptions> FaissIndexOptions::Parse(const std::string& spec) {
  KVTIER_ASSIGN_OR_RETURN(FactorySpec fs, ParseFactorySpec(spec, "index"));
  FaissIndexOptions o;
  o.factory = fs.name;
  auto at_least = [&](const std::string& key, const std::string& value, int lo) -> Result<int> {
    KVTIER_ASSIGN_OR_RETURN(int v, ParseSpecInt(spec, key, value));
    if (v < lo)
      return InvalidArgument("bad value '" + value + "' for key '" + key + "' in index spec '" + spec +
                             "' (expected an integer >= " + std::to_string(lo) + ")");
    return v;
  };
  for (const auto& [key, value] : fs.params) {
    if (key == "nprobe") {
      KVTIER_ASSIGN_OR_RETURN(o.ivf_nprobe, at_least(key, value, 1));
    } else if (key == "ef") {
      KVTIER_ASSIGN_OR_RETURN(o.hnsw_ef_search, at_least(key, value, 1));
    } else if (key == "train_min") {
      KVTIER_ASSIGN_OR_RETURN(o.train_min, at_least(key, value, 0));
    } else if (key == "heads") {
      if (value == "max")
        return InvalidArgument("heads=max in index spec '" + spec +
                               "' needs the Exact index (a FAISS vector "
                               "concatenates the kv heads, so its inner product is the sum over heads)");
      if (value != "sum")
        return InvalidArgument("bad value '" + value + "' for key 'heads' in index spec '" + spec +
                               "' (a FAISS index sums over kv heads: heads=sum)");
    } else if (key == "rerank" || key == "rerank_min") {
      return InvalidArgument("key '" + key + "' in index spec '" + spec +
                             "' applies to the Exact index only (a FAISS index scores its vectors exactly)");
    } else {
      return InvalidArgument("unknown key '" + key + "' for FAISS index '" + fs.name + "' in spec '" + spec +
                             "' (known: nprobe, ef, train_min, heads)");
    }
  }
  auto built = BuildFaiss(kValidateDim, o);
  if (!built.ok()) return InvalidArgument("index spec '" + spec + "': " + built.status().message());
  for (const auto& [key, value] : fs.params) {
    const char* applies = nullptr;
    if (key == "nprobe" && built->nlist == 0) applies = "IVF indexes";
    if (key == "ef" && !built->hnsw) applies = "HNSW indexes";
    if (key == "train_min" && !built->needs_training) applies = "indexes that train (IVF, PQ, ...)";
    if (applies)
      return InvalidArgument("key '" + key + "' in index spec '" + spec + "' applies to " + applies +
                             " only, not to '" + o.factory + "'");
  }
  return o;
}

std::string FaissIndexOptions::ToString() const {
  auto built = BuildFaiss(kValidateDim, *this);
  const bool ivf = !built.ok() || built->nlist > 0, hnsw = !built.ok() || built->hnsw,
             trains = !built.ok() || built->needs_training;
  std::vector<std::string> keys;
  if (ivf) keys.push_back("nprobe=" + std::to_string(ivf_nprobe));
  if (hnsw) keys.push_back("ef=" + std::to_string(hnsw_ef_search));
  if (trains) keys.push_back("train_min=" + std::to_string(train_min));
  std::string out = factory;
  for (size_t i = 0; i < keys.size(); ++i) out += (i == 0 ? ":" : ",") + keys[i];
  return out;
}

// ---- vectors --------------------------------------------------------------------

void FaissVectorIndex::ChunkVector(const float* repr, int R, int H, int D, float* out) {
  if (out == nullptr || H <= 0 || D <= 0) return;
  const size_t hd = static_cast<size_t>(H) * D;
  std::fill_n(out, hd, 0.0f);
  if (repr == nullptr || R <= 0) return;
  // Sum first, normalise after: the 1/R of the mean cancels in the normalisation.
  for (int r = 0; r < R; ++r) {
    const float* row = repr + static_cast<size_t>(r) * hd;
    for (size_t i = 0; i < hd; ++i) out[i] += row[i];
  }
  for (int h = 0; h < H; ++h) NormaliseHead(out + static_cast<size_t>(h) * D, D);
}

void FaissVectorIndex::ProbeVector(const float* probe, int H, int D, float* out) {
  if (out == nullptr || H <= 0 || D <= 0) return;
  const size_t hd = static_cast<size_t>(H) * D;
  if (probe == nullptr) {
    std::fill_n(out, hd, 0.0f);
    return;
  }
  if (out != probe) std::copy_n(probe, hd, out);
  for (int h = 0; h < H; ++h) NormaliseHead(out + static_cast<size_t>(h) * D, D);
}

// ---- lifetime -------------------------------------------------------------------

FaissVectorIndex::FaissVectorIndex(int dim, const FaissIndexOptions& options, size_t train_min,
                                   bool can_remove, bool exact)
    : dim_(dim), options_(options), train_min_(train_min), can_remove_(can_remove), exact_(exact) {}

FaissVectorIndex::~FaissVectorIndex() = default;

Result<std::unique_ptr<FaissVectorIndex>> FaissVectorIndex::Create(int dim,
                                                                   const FaissIndexOptions& options) {
  if (dim <= 0) return InvalidArgument("FaissVectorIndex dim must be > 0 (got " + std::to_string(dim) + ")");
  KVTIER_ASSIGN_OR_RETURN(Built b, BuildFaiss(dim, options));
  const size_t train_min = DefaultTrainMin(b, options);
  std::unique_ptr<FaissVectorIndex> index(
      new FaissVectorIndex(dim, options, train_min, b.can_remove, b.exact));
  index->faiss_ = std::move(b.index);
  index->live_ = !b.needs_training;
  return index;
}

// ---- flat copy ------------------------------------------------------------------

size_t FaissVectorIndex::RowOf(uint64_t id) const {
  auto it = std::lower_bound(ids_.begin(), ids_.end(), id);
  return it != ids_.end() && *it == id ? static_cast<size_t>(it - ids_.begin()) : ids_.size();
}

Status FaissVectorIndex::Rebuild() {
  faiss_.reset();
  live_ = false;
  tombstones_.clear();
  KVTIER_ASSIGN_OR_RETURN(Built b, BuildFaiss(dim_, options_));
  const size_t n = ids_.size();
  if (b.needs_training && n < train_min_) {  // keep collecting; searches scan the flat copy
    faiss_ = std::move(b.index);
    return Status::Ok();
  }
  const std::string what =
      "FaissVectorIndex '" + options_.factory + "': building over " + std::to_string(n) + " vectors";
  try {
    if (b.needs_training) b.index->train(static_cast<faiss_idx_t>(n), vecs_.data());
    if (n > 0) {
      std::vector<faiss_idx_t> labels(ids_.begin(), ids_.end());
      b.index->add_with_ids(static_cast<faiss_idx_t>(n), vecs_.data(), labels.data());
    }
  } catch (const std::exception& e) {
    return FromException(what, e);
  }
  faiss_ = std::move(b.index);
  live_ = true;
  return Status::Ok();
}

// ---- writes ---------------------------------------------------------------------

Status FaissVectorIndex::Add(uint64_t chunk_index, const float* vec) {
  return AddBatch(1, &chunk_index, vec);
}

Status FaissVectorIndex::AddBatch(size_t n, const uint64_t* chunk_indices, const float* vecs) {
  if (n == 0) return Status::Ok();
  if (chunk_indices == nullptr)
    return InvalidArgument("FaissVectorIndex::Add: chunk_indices must not be null");
  if (vecs == nullptr) return InvalidArgument("FaissVectorIndex::Add: vec must not be null");
  const size_t d = static_cast<size_t>(dim_);
  bool hits_tombstone = false;
  for (size_t i = 0; i < n; ++i) {
    const uint64_t id = chunk_indices[i];
    if (id > kMaxId)
      return InvalidArgument("FaissVectorIndex::Add: chunk index " + std::to_string(id) +
                             " does not fit FAISS ids (< 2^63)");
    if (RowOf(id) != ids_.size())
      return AlreadyExists("FaissVectorIndex::Add: chunk " + std::to_string(id) + " is already indexed");
    if (!AllFinite(vecs + i * d, d))
      return InvalidArgument("FaissVectorIndex::Add: vector of chunk " + std::to_string(id) +
                             " has a NaN or infinite component");
    hits_tombstone = hits_tombstone || tombstones_.count(id) > 0;
  }
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return chunk_indices[a] < chunk_indices[b]; });
  for (size_t i = 1; i < n; ++i)
    if (chunk_indices[order[i]] == chunk_indices[order[i - 1]])
      return InvalidArgument("FaissVectorIndex::AddBatch: chunk " + std::to_string(chunk_indices[order[i]]) +
                             " appears twice in the batch");

  // Into the flat copy, keeping rows sorted by chunk index.
  const size_t old_n = ids_.size();
  try {
    if (old_n == 0 || chunk_indices[order[0]] > ids_.back()) {  // the usual case: newly sealed chunks
      if (ids_.capacity() < old_n + n) {  // grow geometrically: one-at-a-time Adds stay amortised O(d)
        ids_.reserve(std::max(old_n + n, 2 * ids_.capacity()));
        vecs_.reserve(ids_.capacity() * d);
      }
      for (size_t i : order) {
        ids_.push_back(chunk_indices[i]);
        vecs_.insert(vecs_.end(), vecs + i * d, vecs + (i + 1) * d);
      }
    } else {  // merge
      std::vector<uint64_t> ids;
      std::vector<float> rows;
      ids.reserve(old_n + n);
      rows.reserve((old_n + n) * d);
      size_t a = 0, b = 0;
      while (a < old_n || b < n) {
        if (b == n || (a < old_n && ids_[a] < chunk_indices[order[b]])) {
          ids.push_back(ids_[a]);
          rows.insert(rows.end(), vecs_.begin() + a * d, vecs_.begin() + (a + 1) * d);
          ++a;
        } else {
          const size_t i = order[b++];
          ids.push_back(chunk_indices[i]);
          rows.insert(rows.end(), vecs + i * d, vecs + (i + 1) * d);
        }
      }
      ids_.swap(ids);
      vecs_.swap(rows);
    }
  } catch (const std::bad_alloc&) {
    ids_.resize(std::min(ids_.size(), old_n));  // append path may have grown partially
    vecs_.resize(ids_.size() * d);
    return ResourceExhausted("FaissVectorIndex::Add: out of memory growing the flat copy to " +
                             std::to_string(old_n + n) + " vectors");
  }
  // Undo: drop the batch's rows again (they are exactly the given ids).
  auto undo = [&]() {
    std::vector<uint64_t> ids;
    std::vector<float> rows;
    ids.reserve(old_n);
    rows.reserve(old_n * d);
    size_t b = 0;
    for (size_t a = 0; a < ids_.size(); ++a) {
      if (b < n && ids_[a] == chunk_indices[order[b]]) {
        ++b;
        continue;
      }
      ids.push_back(ids_[a]);
      rows.insert(rows.end(), vecs_.begin() + a * d, vecs_.begin() + (a + 1) * d);
    }
    ids_.swap(ids);
    vecs_.swap(rows);
  };

  Status st;
  if (live_ && !hits_tombstone) {
    try {
      std::vector<faiss_idx_t> labels(chunk_indices, chunk_indices + n);
      faiss_->add_with_ids(static_cast<faiss_idx_t>(n), vecs, labels.data());
    } catch (const std::exception& e) {
      st = FromException(
          "FaissVectorIndex '" + options_.factory + "': adding " + std::to_string(n) + " vectors", e);
    }
    if (!st.ok()) {
      undo();
      // FAISS may hold part of the batch: rebuild it from the flat copy. If
      // that fails too, searches fall back to exact scans (still correct).
      Rebuild().IgnoreError();
    }
    return st;
  }
  if (!live_ && faiss_ && ids_.size() < train_min_) return Status::Ok();  // still collecting training vectors
  // Due for training, a tombstoned id comes back, or an earlier failure left
  // FAISS unusable: build it from the flat copy.
  st = Rebuild();
  if (!st.ok()) {
    undo();
    Rebuild().IgnoreError();
  }
  return st;
}

Status FaissVectorIndex::Remove(uint64_t chunk_index) {
  const size_t row = RowOf(chunk_index);
  if (row == ids_.size())
    return NotFound("FaissVectorIndex::Remove: chunk " + std::to_string(chunk_index) + " is not indexed");
  const size_t d = static_cast<size_t>(dim_);
  Status st;
  bool rebuild = false;
  if (live_) {
    if (can_remove_) {
      try {
        const faiss_idx_t label = static_cast<faiss_idx_t>(chunk_index);
        faiss::IDSelectorArray sel(1, &label);
        const size_t removed = faiss_->remove_ids(sel);
        if (removed != 1)
          st = Internal("FaissVectorIndex '" + options_.factory + "': FAISS removed " +
                        std::to_string(removed) + " vectors for chunk " + std::to_string(chunk_index) +
                        " (expected 1)");
      } catch (const std::exception& e) {
        st = FromException(
            "FaissVectorIndex '" + options_.factory + "': removing chunk " + std::to_string(chunk_index), e);
      }
      rebuild = !st.ok();
    } else {
      tombstones_.insert(chunk_index);
      rebuild = static_cast<double>(tombstones_.size()) >
                kTombstoneRebuildFraction * static_cast<double>(faiss_->ntotal);
    }
  }
  ids_.erase(ids_.begin() + row);
  vecs_.erase(vecs_.begin() + row * d, vecs_.begin() + (row + 1) * d);
  // The chunk has left the flat copy, so it can no longer be returned; a
  // failed FAISS removal is repaired by a rebuild (exact scans if that fails).
  if (rebuild) return Rebuild();
  return Status::Ok();
}

// ---- reads ----------------------------------------------------------------------

void FaissVectorIndex::ExactTopK(const float* probe, size_t take, std::vector<uint64_t>* ids,
                                 std::vector<float>* scores) const {
  const size_t n = ids_.size(), d = static_cast<size_t>(dim_);
  std::vector<std::pair<float, uint64_t>> heap;  // worst of the best `take` on top
  heap.reserve(take);
  Better better;
  for (size_t r = 0; r < n; ++r) {
    const std::pair<float, uint64_t> c{Dot(vecs_.data() + r * d, probe, dim_), ids_[r]};
    if (heap.size() < take) {
      heap.push_back(c);
      std::push_heap(heap.begin(), heap.end(), better);
    } else if (better(c, heap.front())) {
      std::pop_heap(heap.begin(), heap.end(), better);
      heap.back() = c;
      std::push_heap(heap.begin(), heap.end(), better);
    }
  }
  std::sort_heap(heap.begin(), heap.end(), better);  // best first
  ids->resize(heap.size());
  if (scores) scores->resize(heap.size());
  for (size_t i = 0; i < heap.size(); ++i) {
    (*ids)[i] = heap[i].second;
    if (scores) (*scores)[i] = heap[i].first;
  }
}

Status FaissVectorIndex::Search(const float* probe_vec, int k, std::vector<uint64_t>* ids,
                                std::vector<float>* scores) const {
  if (probe_vec == nullptr) return InvalidArgument("FaissVectorIndex::Search: probe_vec must not be null");
  if (ids == nullptr) return InvalidArgument("FaissVectorIndex::Search: ids must not be null");
  if (k < 0)
    return InvalidArgument("FaissVectorIndex::Search: k must be >= 0 (got " + std::to_string(k) + ")");
  ids->clear();
  if (scores) scores->clear();
  if (!AllFinite(probe_vec, static_cast<size_t>(dim_)))
    return InvalidArgument("FaissVectorIndex::Search: probe_vec has a NaN or infinite component");
  const size_t n = ids_.size();
  if (k == 0 || n == 0) return Status::Ok();
  const size_t take = std::min(static_cast<size_t>(k), n);
  if (!live_ || take == n) {
    ExactTopK(probe_vec, take, ids, scores);
    return Status::Ok();
  }

  // Ask FAISS for one more than needed (to see whether a tie straddles the
  // k-th place) plus the tombstones expected among the candidates.
  const size_t want = take + 1;
  const size_t ntotal = static_cast<size_t>(faiss_->ntotal);
  const size_t t = tombstones_.size();
  size_t kq = want + (t > 0 ? (want * t + n - 1) / n + 16 : 0);
  std::vector<float> dist;
  std::vector<faiss_idx_t> label;
  std::vector<size_t> live;  // positions in dist/label of live candidates
  try {
    SingleThreadedOmp one_thread;
    for (;;) {
      kq = std::min(kq, ntotal);
      dist.resize(kq);
      label.resize(kq);
      faiss_->search(1, probe_vec, static_cast<faiss_idx_t>(kq), dist.data(), label.data());
      live.clear();
      size_t returned = 0;
      for (size_t i = 0; i < kq && label[i] >= 0; ++i, ++returned)
        if (t == 0 || tombstones_.count(static_cast<uint64_t>(label[i])) == 0) live.push_back(i);
      // More would help only if FAISS filled every slot and tombstones ate some.
      if (live.size() >= want || returned < kq || kq == ntotal) break;
      kq *= 2;
    }
  } catch (const std::exception& e) {
    return FromException(
        "FaissVectorIndex '" + options_.factory + "': FAISS search (k=" + std::to_string(kq) + ")", e);
  }
  if (live.size() < take || (exact_ && live.size() > take && dist[live[take - 1]] == dist[live[take]])) {
    ExactTopK(probe_vec, take, ids, scores);
    return Status::Ok();
  }

  // Exact scores from the flat copy, then best first with ties to the smaller index.
  std::vector<std::pair<float, uint64_t>> cand;
  cand.reserve(live.size());
  const size_t d = static_cast<size_t>(dim_);
  for (size_t i : live) {
    const uint64_t id = static_cast<uint64_t>(label[i]);
    const size_t row = RowOf(id);
    if (row == n)
      return Internal("FaissVectorIndex '" + options_.factory + "': FAISS returned chunk " +
                      std::to_string(id) + " which is not in the flat copy");
    cand.emplace_back(Dot(vecs_.data() + row * d, probe_vec, dim_), id);
  }
  const size_t out = std::min(take, cand.size());
  std::partial_sort(cand.begin(), cand.begin() + out, cand.end(), Better{});
  ids->resize(out);
  if (scores) scores->resize(out);
  for (size_t i = 0; i < out; ++i) {
    (*ids)[i] = cand[i].second;
    if (scores) (*scores)[i] = cand[i].first;
  }
  return Status::Ok();
}

Status FaissVectorIndex::ScoreAll(const float* probe_vec, std::vector<uint64_t>* ids,
                                  std::vector<float>* scores) const {
  if (probe_vec == nullptr) return InvalidArgument("FaissVectorIndex::ScoreAll: probe_vec must not be null");
  if (ids == nullptr || scores == nullptr)
    return InvalidArgument("FaissVectorIndex::ScoreAll: ids and scores must not be null");
  if (!AllFinite(probe_vec, static_cast<size_t>(dim_)))
    return InvalidArgument("FaissVectorIndex::ScoreAll: probe_vec has a NaN or infinite component");
  const size_t n = ids_.size(), d = static_cast<size_t>(dim_);
  *ids = ids_;
  scores->resize(n);
  float* out = scores->data();
  TsanForkJoin fj;  // kernels/tbb_tsan.h
  tbb::parallel_for(tbb::blocked_range<size_t>(0, n, 512),
                    fj.Body([&](const tbb::blocked_range<size_t>& range) {
                      for (size_t r = range.begin(); r < range.end(); ++r)
                        out[r] = Dot(vecs_.data() + r * d, probe_vec, dim_);
                    }));
  fj.Join();
  return Status::Ok();
}

size_t FaissVectorIndex::size() const { return ids_.size(); }
int FaissVectorIndex::dim() const { return dim_; }
std::string FaissVectorIndex::factory() const { return options_.factory; }
bool FaissVectorIndex::trained() const { return live_; }
size_t FaissVectorIndex::tombstones() const { return tombstones_.size(); }

uint64_t FaissVectorIndex::memory_bytes() const {
  return ids_.capacity() * sizeof(uint64_t) + vecs_.capacity() * sizeof(float) + tombstones_.size() * 32 +
         FaissBytes(faiss_.get());
}

// ---- FaissChunkIndex ------------------------------------------------------------

Result<std::unique_ptr<FaissChunkIndex>> FaissChunkIndex::Create(const ChunkShape& shape,
                                                                 const FaissIndexOptions& options) {
  KVTIER_RETURN_IF_ERROR(shape.Validate());
  KVTIER_ASSIGN_OR_RETURN(auto vectors, FaissVectorIndex::Create(shape.dim(), options));
  return std::unique_ptr<FaissChunkIndex>(new FaissChunkIndex(shape, std::move(vectors)));
}

Status FaissChunkIndex::Add(const std::vector<uint64_t>& chunks, const ReprReader& read) {
  const int R = shape_.repr, HD = shape_.dim();
  std::vector<float> repr(shape_.repr_floats());
  std::vector<uint64_t> ids;
  std::vector<float> vecs;
  std::vector<std::pair<uint64_t, float>> norms;
  for (uint64_t i : chunks) {
    Status st = read(i, repr.data());
    if (st.code() == StatusCode::kNotFound) continue;  // a hole: nothing to index
    KVTIER_RETURN_IF_ERROR(st);
    ids.push_back(i);
    vecs.resize(ids.size() * HD);
    // InfLLM scores a chunk by the sum of q.k over its representatives, i.e. the dot product
    // with their mean: the index holds the raw mean (no normalisation), so top-k keeps key
    // norms, as attention does.
    float* v = vecs.data() + (ids.size() - 1) * HD;
    std::fill(v, v + HD, 0.0f);
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < HD; ++j) v[j] += repr[static_cast<size_t>(r) * HD + j] / static_cast<float>(R);
    norms.emplace_back(i, std::sqrt(Dot(v, v, HD)));
  }
  if (ids.empty()) return Status::Ok();
  KVTIER_RETURN_IF_ERROR(vectors_->AddBatch(ids.size(), ids.data(), vecs.data()));
  for (const auto& [i, n] : norms) {
    if (norm_.size() <= i) norm_.resize(i + 1, 0.0f);
    norm_[i] = n;
  }
  Changed();
  return Status::Ok();
}

Status FaissChunkIndex::Remove(const std::vector<uint64_t>& chunks) {
  Changed();
  for (uint64_t idx : chunks) {
    Status st = vectors_->Remove(idx);
    if (!st.ok() && st.code() != StatusCode::kNotFound) return st;
  }
  return Status::Ok();
}

Status FaissChunkIndex::Score(const float* probe, ChunkScores* out) const {
  if (out == nullptr) return InvalidArgument("FaissChunkIndex::Score: out must not be null");
  KVTIER_RETURN_IF_ERROR(vectors_->ScoreAll(probe, &out->ids, &out->logit));
  first_stage_bytes_.fetch_add(out->ids.size() * (static_cast<uint64_t>(shape_.dim()) + 1) * sizeof(float),
                               std::memory_order_relaxed);
  out->logit_error.clear();  // exact scores
  out->cosine_error.clear();
  // Eq. 10: the cosine of the probe and the chunk's vector (kv heads concatenated): the raw
  // inner product over both norms.
  const float probe_norm = std::sqrt(Dot(probe, probe, shape_.dim()));
  out->cosine.resize(out->logit.size());
  for (size_t i = 0; i < out->logit.size(); ++i) {
    const float den = probe_norm * norm_[out->ids[i]];
    out->cosine[i] = den > 0.0f ? out->logit[i] / den : 0.0f;
  }
  Stamp(out);
  return Status::Ok();
}

Status FaissChunkIndex::Best(const float* probe, const ChunkScores& screened, ChunkRank rank, size_t take,
                             std::vector<uint64_t>* out) const {
  (void)probe;  // the screened scores are exact already
  if (out == nullptr) return InvalidArgument("FaissChunkIndex::Best: out must not be null");
  KVTIER_RETURN_IF_ERROR(CheckCurrent(screened, "FaissChunkIndex::Best"));
  const std::vector<float>& by = screened.by(rank);
  if (by.size() != screened.ids.size())
    return InvalidArgument("FaissChunkIndex::Best: " + std::to_string(screened.ids.size()) + " ids but " +
                           std::to_string(by.size()) + " " + ChunkRankName(rank) + " scores");
  *out = TakeBest(by, screened.ids, take);
  return Status::Ok();
}

Status FaissChunkIndex::Search(const float* probe, size_t k, std::vector<uint64_t>* out) const {
  const size_t kk = std::min(k, static_cast<size_t>(std::numeric_limits<int>::max()));
  const size_t n = vectors_->size();
  if (n > 0 && kk > 0 && (vectors_->exhaustive() || !vectors_->trained() || kk >= n))
    first_stage_bytes_.fetch_add(n * static_cast<uint64_t>(shape_.dim()) * sizeof(float),
                                 std::memory_order_relaxed);
  return vectors_->Search(probe, static_cast<int>(kk), out, nullptr);
}

uint64_t FaissChunkIndex::memory_bytes() const {
  return vectors_->memory_bytes() + norm_.capacity() * sizeof(float);
}

}  // namespace kvtier
