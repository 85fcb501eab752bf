// CompilerKV: scoring (Eqs. 6-16), the tables and traces files, the trace recorder and the
// conservative-Q-learning table compiler (Eq. 4). See compilerkv.h for the definitions.
#include "offload/policy/compilerkv.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <sstream>
#include <system_error>

#include "offload/policy/policies.h"
#include "store/checksum.h"
#include "store/file_bytes.h"

namespace kvtier {
namespace {

constexpr const char* kTablesMagic = "kvtier-compilerkv-tables v1";
constexpr const char* kTracesMagic = "kvtier-compilerkv-traces v1";
constexpr const char* kNeutral = "neutral";

std::string Str(int64_t v) { return std::to_string(v); }

// ---- files ---------------------------------------------------------------------------------

Result<std::string> ReadWholeFile(const std::string& path, const std::string& what) {
  return ReadFileBytes(path, what + ": file");
}

// Writes body + "crc32c <hex>\n" to path via a temporary file and rename.
Status WriteWithChecksum(const std::string& path, const std::string& body, const std::string& what) {
  char crc[32];
  std::snprintf(crc, sizeof(crc), "crc32c %08x\n", Crc32c(body.data(), body.size()));
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) return IOError(what + ": cannot create '" + tmp + "'");
    f << body << crc;
    f.flush();
    if (!f) return IOError(what + ": write of '" + tmp + "' failed");
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    return IOError(what + ": cannot rename '" + tmp + "' to '" + path + "'");
  }
  return Status::Ok();
}

// Strict line reader over a checksummed text file.
class Reader {
 public:
  // Verifies the trailing "crc32c <8 hex>" line against the bytes before it.
  static Result<Reader> Open(const std::string& content, const std::string& where) {
    if (content.empty()) return Corruption(where + ": file is empty");
    if (content.back() != '\n') return Corruption(where + ": truncated (no final newline and checksum line)");
    const size_t last_start = content.rfind('\n', content.size() - 2);
    const size_t start = last_start == std::string::npos ? 0 : last_start + 1;
    const std::string last = content.substr(start, content.size() - 1 - start);
    if (last.size() != 15 || last.compare(0, 7, "crc32c ") != 0)
      return Corruption(where + ": missing checksum line 'crc32c <8 hex digits>' at the end (truncated?)");
    uint32_t stored = 0;
    const auto [ptr, ec] = std::from_chars(last.data() + 7, last.data() + last.size(), stored, 16);
    if (ec != std::errc() || ptr != last.data() + last.size())
      return Corruption(where + ": malformed checksum line '" + last + "'");
    const uint32_t computed = Crc32c(content.data(), start);
    if (computed != stored) {
      char buf[96];
      std::snprintf(buf, sizeof(buf), ": checksum mismatch (stored %08x, computed %08x)", stored, computed);
      return Corruption(where + buf);
    }
    Reader r;
    r.where_ = where;
    size_t pos = 0;
    while (pos < start) {
      const size_t nl = content.find('\n', pos);
      r.lines_.push_back(content.substr(pos, nl - pos));
      pos = nl + 1;
    }
    return r;
  }

  // The next line, which must be `keyword` followed by exactly `fields` space-separated fields
  // (fields < 0: any count >= 0).
  Result<std::vector<std::string>> Next(const std::string& keyword, int fields) {
    if (next_ >= lines_.size())
      return Corruption(Here(next_ + 1) + "expected '" + keyword + "', found end of file");
    const std::string& line = lines_[next_++];
    std::vector<std::string> tok;
    size_t pos = 0;
    while (true) {
      const size_t sp = line.find(' ', pos);
      tok.push_back(line.substr(pos, sp == std::string::npos ? std::string::npos : sp - pos));
      if (tok.back().empty()) return Corruption(Here() + "empty field in '" + line + "'");
      if (sp == std::string::npos) break;
      pos = sp + 1;
    }
    if (tok[0] != keyword) return Corruption(Here() + "expected '" + keyword + "', found '" + line + "'");
    tok.erase(tok.begin());
    if (fields >= 0 && static_cast<int>(tok.size()) != fields)
      return Corruption(Here() + "'" + keyword + "' needs " + Str(fields) + " fields, found " +
                        Str(tok.size()));
    return tok;
  }
  Status ExpectLine(const std::string& text) {
    if (next_ >= lines_.size() || lines_[next_] != text)
      return Corruption(Here(next_ + 1) + "expected '" + text + "'" +
                        (next_ < lines_.size() ? ", found '" + lines_[next_] + "'" : ", found end of file") +
                        (next_ == 0 ? " (not a file of this kind or an unsupported version)" : ""));
    ++next_;
    return Status::Ok();
  }
  Status ExpectEnd() {
    if (next_ != lines_.size())
      return Corruption(Here(next_ + 1) + "unexpected line '" + lines_[next_] + "' before the checksum");
    return Status::Ok();
  }
  Result<int64_t> Int(const std::string& s, int64_t lo, int64_t hi, const char* what) const {
    int64_t v = 0;
    const auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    if (ec != std::errc() || ptr != s.data() + s.size())
      return Corruption(Here() + what + " '" + s + "' is not an integer");
    if (v < lo || v > hi)
      return Corruption(Here() + what + " " + s + " is outside [" + Str(lo) + ", " + Str(hi) + "]");
    return v;
  }
  // An index field that must equal `want` (lines come in a fixed order).
  Status ExpectIndex(const std::string& s, int64_t want, const char* what) const {
    auto v = Int(s, want, want, what);
    return v.ok() ? Status::Ok() : v.status();
  }
  Result<double> Double(const std::string& s, const char* what) const {
    double v = 0;
    const auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    if (ec != std::errc() || ptr != s.data() + s.size() || !std::isfinite(v))
      return Corruption(Here() + what + " '" + s + "' is not a finite number");
    return v;
  }
  Result<float> Float(const std::string& s, const char* what) const {
    float v = 0;
    const auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    if (ec != std::errc() || ptr != s.data() + s.size() || !std::isfinite(v))
      return Corruption(Here() + what + " '" + s + "' is not a finite number");
    return v;
  }
  // The first word of the next line ("" at the end).
  std::string PeekKeyword() const {
    return next_ < lines_.size() ? lines_[next_].substr(0, lines_[next_].find(' ')) : std::string();
  }
  std::string Here() const { return Here(next_); }
  std::string Here(size_t line_no) const {
    return where_ + " line " + Str(static_cast<int64_t>(line_no)) + ": ";
  }

 private:
  std::string where_;
  std::vector<std::string> lines_;
  size_t next_ = 0;
};

std::string Num(double v) { return FormatSpecDouble(v); }
// " <v>" (appended piecewise: GCC 12 warns falsely on " " + std::string&&).
void AppendNum(std::string* out, double v) {
  out->push_back(' ');
  out->append(Num(v));
}
// Shortest text that reads back to the same float (table entries are floats).
void AppendFloat(std::string* out, float v) {
  char buf[32];
  const auto [ptr, ec] = std::to_chars(buf, buf + sizeof(buf), v);
  out->push_back(' ');
  out->append(buf, ec == std::errc() ? ptr : buf);
}

// Header shared by both files: layers, heads and the bins.
void WriteHeader(std::string* out, int layers, int heads, const CompilerKvBins& b) {
  *out += "layers " + Str(layers) + "\nheads " + Str(heads) + "\nent_bins " + Str(b.ent_bins) +
          "\nppl_bins " + Str(b.ppl_bins) + "\nbudget_bins " + Str(b.budget_bins) + "\nnll_step " +
          Num(b.nll_step) + "\n";
}

Status ReadHeader(Reader* r, int* layers, int* heads, CompilerKvBins* b) {
  struct Item {
    const char* key;
    int* dst;
    int64_t hi;
  };
  for (const Item& it :
       {Item{"layers", layers, 1 << 16}, Item{"heads", heads, 1 << 16}, Item{"ent_bins", &b->ent_bins, 1000},
        Item{"ppl_bins", &b->ppl_bins, 100}, Item{"budget_bins", &b->budget_bins, 64}}) {
    KVTIER_ASSIGN_OR_RETURN(auto f, r->Next(it.key, 1));
    KVTIER_ASSIGN_OR_RETURN(int64_t v, r->Int(f[0], 1, it.hi, it.key));
    *it.dst = static_cast<int>(v);
  }
  KVTIER_ASSIGN_OR_RETURN(auto f, r->Next("nll_step", 1));
  KVTIER_ASSIGN_OR_RETURN(b->nll_step, r->Double(f[0], "nll_step"));
  if (!(b->nll_step > 0)) return Corruption(r->Here() + "nll_step must be > 0");
  return Status::Ok();
}

// Mean relative attention-output error of keeping `kept` (indexes) on one observation: the loss
// proxy of the compiler (header comment). `full` holds the full outputs [q_heads][n_queries][D].
double OutputError(const PolicyGeometry& g, const AttentionObservation& obs, const std::vector<double>& full,
                   const std::vector<int64_t>& kept) {
  const int d = g.head_dim;
  std::vector<double> oc(d);
  double total = 0.0;
  for (int h = 0; h < g.q_heads; ++h) {
    const int kvh = h / g.group_size();
    for (int i = 0; i < obs.n_queries; ++i) {
      std::fill(oc.begin(), oc.end(), 0.0);
      double mass = 0.0;
      for (int64_t t : kept) {
        const double a = obs.at(h, i, t);
        if (a == 0.0) continue;
        mass += a;
        const float* v = obs.values + (static_cast<size_t>(t) * g.kv_heads + kvh) * d;
        for (int c = 0; c < d; ++c) oc[c] += a * v[c];
      }
      const double* o = full.data() + (static_cast<size_t>(h) * obs.n_queries + i) * d;
      double diff = 0.0, ref = 0.0;
      for (int c = 0; c < d; ++c) {
        const double x = mass > 0.0 ? oc[c] / mass : 0.0;
        diff += (x - o[c]) * (x - o[c]);
        ref += o[c] * o[c];
      }
      total += ref > 0.0 ? std::sqrt(diff / ref) : std::sqrt(diff);
    }
  }
  return total / (static_cast<double>(g.q_heads) * obs.n_queries);
}

// Action sets: non-empty, finite; τ actions also >= 0 (a negative τ means "from budget").
Status ValidateActions(const std::vector<double>& a, const char* what, bool nonnegative) {
  if (a.empty()) return InvalidArgument(std::string(what) + " is empty");
  if (a.size() > 1000) return InvalidArgument(std::string(what) + " has more than 1000 actions");
  for (double x : a) {
    if (!std::isfinite(x)) return InvalidArgument(std::string(what) + " holds a non-finite value");
    if (nonnegative && x < 0) return InvalidArgument(std::string(what) + " holds a negative value " + Num(x));
  }
  return Status::Ok();
}

}  // namespace

// ---- bins and tables ---------------------------------------------------------------------------

Status CompilerKvBins::Validate() const {
  if (ent_bins < 1 || ent_bins > 1000)
    return InvalidArgument("ent_bins must be in [1, 1000], got " + Str(ent_bins));
  if (ppl_bins < 1 || ppl_bins > 100)
    return InvalidArgument("ppl_bins must be in [1, 100], got " + Str(ppl_bins));
  if (budget_bins < 1 || budget_bins > 64)
    return InvalidArgument("budget_bins must be in [1, 64], got " + Str(budget_bins));
  if (!std::isfinite(nll_step) || nll_step <= 0)
    return InvalidArgument("nll_step must be a finite number > 0, got " + Num(nll_step));
  return Status::Ok();
}

int CompilerKvBins::EntropyBin(double h) const {
  if (!(h > 0)) return 0;
  return static_cast<int>(std::min<double>(ent_bins - 1, std::floor(h * ent_bins)));
}

int CompilerKvBins::PplBin(bool has_logprobs, double mean_nll) const {
  if (!has_logprobs) return ppl_bins;  // the neutral "no model" bucket
  if (!(mean_nll > 0)) return 0;
  return static_cast<int>(std::min<double>(ppl_bins - 1, std::floor(mean_nll / nll_step)));
}

int CompilerKvBins::BudgetBin(int64_t budget, int64_t n) const {
  if (budget >= n) return 0;
  if (budget <= 0) return budget_bins - 1;
  const double b = std::floor(std::log2(static_cast<double>(n) / static_cast<double>(budget)));
  return static_cast<int>(std::clamp<double>(b, 0, budget_bins - 1));
}

CompilerKvTables CompilerKvTables::Neutral(int layers, int heads, const CompilerKvBins& bins) {
  CompilerKvTables t;
  t.layers = layers;
  t.heads = heads;
  t.bins = bins;
  t.w_head.assign(static_cast<size_t>(layers) * heads, 1.0f);
  t.tau.assign(static_cast<size_t>(layers) * bins.ent_bins * (bins.ppl_bins + 1) * bins.budget_bins, -1.0f);
  return t;
}

size_t CompilerKvTables::tau_index(int layer, int ent_bin, int ppl_bin, int budget_bin) const {
  return ((static_cast<size_t>(layer) * bins.ent_bins + ent_bin) * (bins.ppl_bins + 1) + ppl_bin) *
             bins.budget_bins +
         budget_bin;
}

Status CompilerKvTables::Validate() const {
  KVTIER_RETURN_IF_ERROR(bins.Validate());
  if (layers < 1 || heads < 1)
    return InvalidArgument("compilerkv tables: layers and heads must be >= 1, got " + Str(layers) + " and " +
                           Str(heads));
  if (w_head.size() != static_cast<size_t>(layers) * heads)
    return InvalidArgument("compilerkv tables: w_head holds " + Str(w_head.size()) + " values, expected " +
                           Str(static_cast<int64_t>(layers) * heads));
  const size_t nt = static_cast<size_t>(layers) * bins.ent_bins * (bins.ppl_bins + 1) * bins.budget_bins;
  if (tau.size() != nt)
    return InvalidArgument("compilerkv tables: tau holds " + Str(tau.size()) + " values, expected " +
                           Str(nt));
  for (float w : w_head)
    if (!std::isfinite(w)) return InvalidArgument("compilerkv tables: non-finite head weight");
  for (float x : tau)
    if (!std::isfinite(x)) return InvalidArgument("compilerkv tables: non-finite threshold");
  return Status::Ok();
}

Status SaveCompilerKvTables(const CompilerKvTables& t, const std::string& path) {
  KVTIER_RETURN_IF_ERROR(t.Validate());
  std::string out = std::string(kTablesMagic) + "\n";
  WriteHeader(&out, t.layers, t.heads, t.bins);
  for (int l = 0; l < t.layers; ++l) {
    out += "w ";
    out += Str(l);
    for (int h = 0; h < t.heads; ++h) AppendFloat(&out, t.weight(l, h));
    out += "\n";
  }
  for (int l = 0; l < t.layers; ++l)
    for (int be = 0; be < t.bins.ent_bins; ++be)
      for (int bp = 0; bp <= t.bins.ppl_bins; ++bp) {
        out += "tau ";
        out += Str(l) + " " + Str(be) + " " + Str(bp);
        for (int bb = 0; bb < t.bins.budget_bins; ++bb) AppendFloat(&out, t.tau[t.tau_index(l, be, bp, bb)]);
        out += "\n";
      }
  return WriteWithChecksum(path, out, "compilerkv tables");
}

Result<CompilerKvTables> LoadCompilerKvTables(const std::string& path) {
  KVTIER_ASSIGN_OR_RETURN(std::string content, ReadWholeFile(path, "compilerkv tables"));
  return ParseCompilerKvTables(content, path);
}

Result<CompilerKvTables> ParseCompilerKvTables(const std::string& content, const std::string& name) {
  const std::string where = "compilerkv tables '" + name + "'";
  KVTIER_ASSIGN_OR_RETURN(Reader r, Reader::Open(content, where));
  KVTIER_RETURN_IF_ERROR(r.ExpectLine(kTablesMagic));
  CompilerKvTables t;
  KVTIER_RETURN_IF_ERROR(ReadHeader(&r, &t.layers, &t.heads, &t.bins));
  const size_t nt =
      static_cast<size_t>(t.layers) * t.bins.ent_bins * (t.bins.ppl_bins + 1) * t.bins.budget_bins;
  if (nt > (size_t{1} << 26))
    return Corruption(where + ": table of " + Str(nt) + " thresholds is implausibly large");
  // Every number takes at least two bytes of text (a digit and a separator): a header that
  // promises more than the file can hold is refused before anything is allocated for it.
  const size_t nw = static_cast<size_t>(t.layers) * t.heads;
  if (nw + nt > content.size() / 2)
    return Corruption(where + ": header says " + Str(t.layers) + " layers x " + Str(t.heads) + " heads and " +
                      Str(static_cast<int64_t>(nt)) + " thresholds, more numbers than the " +
                      Str(static_cast<int64_t>(content.size())) + "-byte file holds");
  t.w_head.resize(nw);
  t.tau.resize(nt);
  for (int l = 0; l < t.layers; ++l) {
    KVTIER_ASSIGN_OR_RETURN(auto f, r.Next("w", t.heads + 1));
    KVTIER_RETURN_IF_ERROR(r.ExpectIndex(f[0], l, "layer"));
    for (int h = 0; h < t.heads; ++h) {
      KVTIER_ASSIGN_OR_RETURN(t.w_head[static_cast<size_t>(l) * t.heads + h],
                              r.Float(f[h + 1], "head weight"));
    }
  }
  for (int l = 0; l < t.layers; ++l)
    for (int be = 0; be < t.bins.ent_bins; ++be)
      for (int bp = 0; bp <= t.bins.ppl_bins; ++bp) {
        KVTIER_ASSIGN_OR_RETURN(auto f, r.Next("tau", t.bins.budget_bins + 3));
        KVTIER_RETURN_IF_ERROR(r.ExpectIndex(f[0], l, "layer"));
        KVTIER_RETURN_IF_ERROR(r.ExpectIndex(f[1], be, "entropy bin"));
        KVTIER_RETURN_IF_ERROR(r.ExpectIndex(f[2], bp, "perplexity bin"));
        for (int bb = 0; bb < t.bins.budget_bins; ++bb) {
          KVTIER_ASSIGN_OR_RETURN(t.tau[t.tau_index(l, be, bp, bb)], r.Float(f[bb + 3], "threshold"));
        }
      }
  KVTIER_RETURN_IF_ERROR(r.ExpectEnd());
  Status st = t.Validate();
  if (!st.ok()) return Corruption(where + ": " + st.message());
  return t;
}

// ---- Eqs. 15-16 ---------------------------------------------------------------------------------

Result<CompilerKvSelection> SelectCompilerKv(const PolicyGeometry& g, const std::vector<int64_t>& positions,
                                             const std::vector<float>& uhat, double alpha_mean, double tau,
                                             int64_t budget, bool fill) {
  if (uhat.size() != positions.size())
    return InvalidArgument("compilerkv: " + Str(uhat.size()) + " scores for " + Str(positions.size()) +
                           " positions");
  if (budget < 0) return InvalidArgument("compilerkv: budget must be >= 0, got " + Str(budget));
  const int64_t n = static_cast<int64_t>(positions.size());
  // τ is in units of ᾱ (header comment): Eq. 15 compares s_t = û_t / ᾱ with τ; ranking (Top-B)
  // uses û itself (s is a monotone image of it).
  std::vector<float> s(n);
  for (int64_t i = 0; i < n; ++i) s[i] = alpha_mean > 0 ? static_cast<float>(uhat[i] / alpha_mean) : uhat[i];
  const std::vector<int64_t> prot = ProtectedIndexes(g, positions);
  std::vector<char> is_prot(n, 0);
  for (int64_t i : prot) is_prot[i] = 1;
  std::vector<int64_t> rest;
  for (int64_t i = 0; i < n; ++i)
    if (!is_prot[i]) rest.push_back(i);

  CompilerKvSelection sel;
  sel.protected_count = static_cast<int64_t>(prot.size());
  if (budget < n && budget < sel.protected_count)
    return InvalidArgument("compilerkv: budget " + Str(budget) + " is smaller than the " +
                           Str(sel.protected_count) + " protected keys (sinks " + Str(g.sink_tokens) +
                           " + local window " + Str(g.local_tokens) + ")");
  sel.free_budget = std::min(budget, n) - sel.protected_count;
  const int64_t bfree = sel.free_budget;
  sel.tau_from_budget = tau < 0;
  if (sel.tau_from_budget) {
    // Neutral τ: the B'-th largest s, so Eq. 15 admits (at least) the Top-B' keys.
    if (bfree <= 0 || rest.empty()) {
      sel.tau = std::numeric_limits<double>::infinity();
    } else {
      const std::vector<int64_t> top = TopIndexes(uhat, rest, bfree);
      sel.tau = s[top.back()];
    }
  } else {
    sel.tau = tau;
  }
  // Eq. 15: I_cand = {t | û_t ≥ τ} over the non-protected keys.
  std::vector<int64_t> cand;
  for (int64_t i : rest)
    if (static_cast<double>(s[i]) >= sel.tau) cand.push_back(i);
  sel.candidates = static_cast<int64_t>(cand.size());
  std::vector<int64_t> chosen;
  if (budget >= n) {
    chosen = rest;  // nothing to drop
  } else {
    // Eq. 16: all candidates if they fit, else the Top-B' of them by û.
    chosen = sel.candidates <= bfree ? cand : TopIndexes(uhat, cand, bfree);
    if (fill && static_cast<int64_t>(chosen.size()) < bfree) {
      // fill=1: pad with the highest-û non-chosen keys so exactly min(B, n) are kept.
      std::vector<char> in(n, 0);
      for (int64_t i : chosen) in[i] = 1;
      std::vector<int64_t> others;
      for (int64_t i : rest)
        if (!in[i]) others.push_back(i);
      const std::vector<int64_t> pad = TopIndexes(uhat, others, bfree - static_cast<int64_t>(chosen.size()));
      chosen.insert(chosen.end(), pad.begin(), pad.end());
    }
  }
  chosen.insert(chosen.end(), prot.begin(), prot.end());
  std::sort(chosen.begin(), chosen.end());
  sel.kept = std::move(chosen);
  return sel;
}

// ---- the policy ---------------------------------------------------------------------------------

CompilerKvPolicy::CompilerKvPolicy(const CompilerKvOptions& options,
                                   std::shared_ptr<const CompilerKvTables> tables)
    : options_(options), neutral_(tables == nullptr), tables_(std::move(tables)) {
  if (tables_) options_.bins = tables_->bins;
}

std::string CompilerKvPolicy::ToString() const {
  const CompilerKvBins& b = options_.bins;
  return "compilerkv:tables=" + options_.tables + ",fill=" + (options_.fill ? "1" : "0") +
         ",ent_bins=" + Str(b.ent_bins) + ",ppl_bins=" + Str(b.ppl_bins) +
         ",budget_bins=" + Str(b.budget_bins) + ",nll_step=" + Num(b.nll_step);
}

std::string CompilerKvPolicy::Describe() const {
  const std::string fill = options_.fill ? "fill=1: exactly min(B, T) keys, Top-B by û"
                                         : "fill=0: Eq. 16 literally, may keep fewer than B";
  if (neutral_)
    return "compilerkv: neutral tables (W_head = 1, τ = the B-th largest û), so Eqs. 15-16 reduce to Top-B "
           "by û; " +
           fill;
  const CompilerKvTables& t = *tables_;
  float wmin = t.w_head.empty() ? 0.f : *std::min_element(t.w_head.begin(), t.w_head.end());
  float wmax = t.w_head.empty() ? 0.f : *std::max_element(t.w_head.begin(), t.w_head.end());
  int64_t compiled = 0;
  for (float x : t.tau) compiled += x >= 0;
  return "compilerkv: tables '" + options_.tables + "' (" + Str(t.layers) + " layers x " + Str(t.heads) +
         " heads, W_head in [" + Num(wmin) + ", " + Num(wmax) + "], " + Str(compiled) + " of " +
         Str(t.tau.size()) + " risk states with a compiled τ, the rest from the budget); " + fill;
}

Status CompilerKvPolicy::Begin(const PolicyGeometry& g) {
  KVTIER_RETURN_IF_ERROR(g.Validate());
  if (neutral_) {
    tables_ = std::make_shared<const CompilerKvTables>(
        CompilerKvTables::Neutral(g.layers, g.kv_heads, options_.bins));
  } else if (tables_->layers != g.layers || tables_->heads != g.kv_heads) {
    return InvalidArgument("compilerkv: tables file '" + options_.tables + "' holds W_head for " +
                           Str(tables_->layers) + " layers x " + Str(tables_->heads) +
                           " kv heads, but the model has " + Str(g.layers) + " x " + Str(g.kv_heads));
  }
  g_ = g;
  layers_.assign(g.layers, LayerState{});
  last_logprob_query_ = -1;
  nll_sum_ = 0.0;
  nll_count_ = 0;
  last_ = CompilerKvDecision{};
  begun_ = true;
  return Status::Ok();
}

Status CompilerKvPolicy::Observe(const AttentionObservation& obs) {
  // An allocation failure (state grows with the observed keys) is ResourceExhausted.
  return ReturnOnBadAlloc(
      [&] { return name() + " Observe: state for " + std::to_string(obs.n_keys) + " keys"; },
      [&]() -> Status {
        if (!begun_) return FailedPrecondition("compilerkv: Observe before Begin");
        KVTIER_RETURN_IF_ERROR(obs.Validate(g_));
        if (obs.values == nullptr)
          return InvalidArgument("compilerkv: the observation of layer " + Str(obs.layer) +
                                 " has no values (Eq. 7's relative value norm needs them)");
        const int64_t n = obs.n_keys;
        const int kv = g_.kv_heads, d = g_.head_dim;
        std::vector<int64_t> pos(obs.key_positions, obs.key_positions + n);
        // ‖v_t^{(l,h)}‖₂ per kv head (Eq. 7's numerator), kept raw: ρ is formed at scoring time over
        // the keys cached then.
        std::vector<float> norms(static_cast<size_t>(kv) * n);
        for (int64_t t = 0; t < n; ++t)
          for (int h = 0; h < kv; ++h) {
            const float* v = obs.values + (static_cast<size_t>(t) * kv + h) * d;
            double ss = 0.0;
            for (int c = 0; c < d; ++c) ss += static_cast<double>(v[c]) * v[c];
            if (!std::isfinite(ss))
              return InvalidArgument("compilerkv: values of key " + Str(t) + ", kv head " + Str(h) +
                                     " (layer " + Str(obs.layer) + ") are not finite");
            norms[static_cast<size_t>(h) * n + t] = static_cast<float>(std::sqrt(ss));
          }
        // This layer's share of Eq. 6 summed over the window: Σ_{j∈Ω} (1/H_q) Σ_h A_{j,t}.
        std::vector<double> sum(n, 0.0);
        for (int h = 0; h < g_.q_heads; ++h)
          for (int i = 0; i < obs.n_queries; ++i) {
            const float* row = obs.attention + (static_cast<size_t>(h) * obs.n_queries + i) * n;
            for (int64_t t = 0; t < n; ++t) sum[t] += row[t];
          }
        LayerState& st = layers_[obs.layer];
        std::vector<float> acc =
            st.seen ? RemapByPosition(st.positions, st.attn_sum, pos, 0.0f) : std::vector<float>(n, 0.0f);
        for (int64_t t = 0; t < n; ++t) acc[t] += static_cast<float>(sum[t] / g_.q_heads);
        st.positions = std::move(pos);
        st.attn_sum = std::move(acc);
        st.norms = std::move(norms);
        st.seen = true;
        // Eq. 13's sum over Ω: each query position counts once, however many layers feed it.
        if (obs.token_logprobs != nullptr)
          for (int i = 0; i < obs.n_queries; ++i)
            if (obs.query_positions[i] > last_logprob_query_) {
              nll_sum_ -= obs.token_logprobs[i];
              ++nll_count_;
              last_logprob_query_ = obs.query_positions[i];
            }
        return Status::Ok();
      });
}

Result<CompilerKvAnalysis> CompilerKvPolicy::Analyze(int layer,
                                                     const std::vector<float>* head_weights) const {
  if (!begun_) return FailedPrecondition("compilerkv: Analyze/Scores/Keep before Begin");
  if (layer < 0 || layer >= g_.layers)
    return InvalidArgument("compilerkv: layer " + Str(layer) + " out of range [0, " + Str(g_.layers) + ")");
  const LayerState& st = layers_[layer];
  if (!st.seen)
    return FailedPrecondition("compilerkv: no observation of layer " + Str(layer) + " since Begin");
  if (head_weights != nullptr && static_cast<int>(head_weights->size()) != g_.kv_heads)
    return InvalidArgument("compilerkv: " + Str(head_weights->size()) + " head weights for " +
                           Str(g_.kv_heads) + " kv heads");
  CompilerKvAnalysis a;
  a.layer = layer;
  a.positions = st.positions;
  const int64_t n = static_cast<int64_t>(st.positions.size());
  // Eq. 6 over the layers seen so far, then the window sum α_t = Σ_{j∈Ω} Ā_{j,t}.
  std::vector<double> alpha(n, 0.0);
  for (int l = 0; l < g_.layers; ++l) {
    const LayerState& o = layers_[l];
    if (!o.seen) continue;
    ++a.layers_seen;
    if (l == layer || o.positions == st.positions) {  // same keys (the common case): no remap
      for (int64_t t = 0; t < n; ++t) alpha[t] += o.attn_sum[t];
    } else {
      const std::vector<float> m = RemapByPosition(o.positions, o.attn_sum, st.positions, 0.0f);
      for (int64_t t = 0; t < n; ++t) alpha[t] += m[t];
    }
  }
  double alpha_total = 0.0;
  a.alpha.resize(n);
  for (int64_t t = 0; t < n; ++t) {
    alpha[t] /= a.layers_seen;
    a.alpha[t] = static_cast<float>(alpha[t]);
    alpha_total += alpha[t];
  }
  a.alpha_mean = n > 0 ? alpha_total / n : 0.0;
  // Eq. 7: ρ = ‖v_t‖ / ((1/T) Σ_k ‖v_k‖); ρ = 1 when every norm is 0.
  const int kv = g_.kv_heads;
  a.rho.assign(static_cast<size_t>(kv) * n, 1.0f);
  std::vector<double> rho(static_cast<size_t>(kv) * n, 1.0);
  for (int h = 0; h < kv; ++h) {
    double mean = 0.0;
    for (int64_t t = 0; t < n; ++t) mean += st.norms[static_cast<size_t>(h) * n + t];
    mean = n > 0 ? mean / n : 0.0;
    if (mean <= 0.0) continue;
    for (int64_t t = 0; t < n; ++t) {
      rho[static_cast<size_t>(h) * n + t] = st.norms[static_cast<size_t>(h) * n + t] / mean;
      a.rho[static_cast<size_t>(h) * n + t] = static_cast<float>(rho[static_cast<size_t>(h) * n + t]);
    }
  }
  // Eqs. 8 and 10: û_t = max_h (α_t ρ_t^{(h)}) W_head[l, h].
  a.uhat.resize(n);
  for (int64_t t = 0; t < n; ++t) {
    double best = -std::numeric_limits<double>::infinity();
    for (int h = 0; h < kv; ++h) {
      const double w = head_weights != nullptr ? (*head_weights)[h] : tables_->weight(layer, h);
      const double u = alpha[t] * rho[static_cast<size_t>(h) * n + t];  // Eq. 8
      best = std::max(best, u * w);                                     // Eq. 10
    }
    a.uhat[t] = static_cast<float>(best);
  }
  // Eqs. 11-12: entropy of Ā' = α / ‖α‖₁ (Alg. 1 lines 7-8).
  a.r_struct = 0.0;
  if (alpha_total > 0.0)
    for (int64_t t = 0; t < n; ++t) {
      const double p = alpha[t] / alpha_total;
      if (p > 0.0) a.r_struct -= p * std::log(p);
    }
  // Eq. 13: exp of the mean NLL over the observed queries.
  a.has_sem = nll_count_ > 0;
  const double mean_nll = a.has_sem ? nll_sum_ / static_cast<double>(nll_count_) : 0.0;
  a.r_sem = std::exp(mean_nll);
  a.ent_bin = options_.bins.EntropyBin(n > 1 ? a.r_struct / std::log(static_cast<double>(n)) : 0.0);
  a.ppl_bin = options_.bins.PplBin(a.has_sem, mean_nll);
  return a;
}

Result<TokenScores> CompilerKvPolicy::Scores(int layer) const {
  KVTIER_ASSIGN_OR_RETURN(CompilerKvAnalysis a, Analyze(layer));
  TokenScores s;
  s.positions = std::move(a.positions);
  // One selection per layer (Alg. 1 line 33): every kv head reports the pooled û.
  s.per_head.assign(g_.kv_heads, a.uhat);
  return s;
}

Result<KeepSet> CompilerKvPolicy::Keep(int layer, int64_t budget) {
  KVTIER_ASSIGN_OR_RETURN(CompilerKvAnalysis a, Analyze(layer));
  if (budget < 0) return InvalidArgument("compilerkv: budget must be >= 0, got " + Str(budget));
  const int64_t n = static_cast<int64_t>(a.positions.size());
  const int bb = options_.bins.BudgetBin(budget, n);
  const double tau = tables_->tau[tables_->tau_index(layer, a.ent_bin, a.ppl_bin, bb)];  // Alg. 1 line 26
  KVTIER_ASSIGN_OR_RETURN(CompilerKvSelection sel, SelectCompilerKv(g_, a.positions, a.uhat, a.alpha_mean,
                                                                    tau, budget, options_.fill));
  KeepSet ks;
  std::vector<int64_t> kept_pos(sel.kept.size());
  for (size_t i = 0; i < sel.kept.size(); ++i) kept_pos[i] = a.positions[sel.kept[i]];
  ks.per_head.assign(g_.kv_heads, kept_pos);
  // Forget every position not kept (this layer's state only; other layers hold their own keys).
  LayerState& st = layers_[layer];
  const size_t m = sel.kept.size();
  std::vector<float> attn(m), norms(static_cast<size_t>(g_.kv_heads) * m);
  for (size_t i = 0; i < m; ++i) {
    attn[i] = st.attn_sum[sel.kept[i]];
    for (int h = 0; h < g_.kv_heads; ++h)
      norms[static_cast<size_t>(h) * m + i] = st.norms[static_cast<size_t>(h) * n + sel.kept[i]];
  }
  st.positions = kept_pos;
  st.attn_sum = std::move(attn);
  st.norms = std::move(norms);
  // The decision without its per-key vectors (their memory is released, not just cleared).
  last_.layer = layer;
  last_.budget_bin = bb;
  last_.analysis = CompilerKvAnalysis{};
  last_.analysis.layer = a.layer;
  last_.analysis.alpha_mean = a.alpha_mean;
  last_.analysis.r_struct = a.r_struct;
  last_.analysis.has_sem = a.has_sem;
  last_.analysis.r_sem = a.r_sem;
  last_.analysis.ent_bin = a.ent_bin;
  last_.analysis.ppl_bin = a.ppl_bin;
  last_.analysis.layers_seen = a.layers_seen;
  last_.selection = CompilerKvSelection{};
  last_.selection.tau = sel.tau;
  last_.selection.tau_from_budget = sel.tau_from_budget;
  last_.selection.candidates = sel.candidates;
  last_.selection.protected_count = sel.protected_count;
  last_.selection.free_budget = sel.free_budget;
  return ks;
}

size_t CompilerKvPolicy::state_bytes() const {
  size_t b = sizeof(*this) + layers_.capacity() * sizeof(LayerState);
  for (const LayerState& st : layers_)
    b += st.positions.capacity() * sizeof(int64_t) +
         (st.attn_sum.capacity() + st.norms.capacity()) * sizeof(float);
  if (tables_) b += (tables_->w_head.capacity() + tables_->tau.capacity()) * sizeof(float);
  return b;
}

Result<std::unique_ptr<CompilerKvPolicy>> MakeCompilerKvPolicy(const CompilerKvOptions& options) {
  if (options.tables.empty())
    return InvalidArgument("compilerkv: tables must be a file path or 'neutral', got an empty string");
  std::shared_ptr<const CompilerKvTables> tables;
  if (options.tables != kNeutral) {
    KVTIER_ASSIGN_OR_RETURN(CompilerKvTables t, LoadCompilerKvTables(options.tables));
    tables = std::make_shared<const CompilerKvTables>(std::move(t));
  } else {
    KVTIER_RETURN_IF_ERROR(options.bins.Validate());
  }
  return std::make_unique<CompilerKvPolicy>(options, std::move(tables));
}

// ---- traces -------------------------------------------------------------------------------------

Status CompilerKvTraces::Validate(const std::string& what) const {
  if (layers < 1 || heads < 1)
    return InvalidArgument(what + ": layers and heads must be >= 1, got " + Str(layers) + " and " +
                           Str(heads));
  {
    Status st = bins.Validate();
    if (!st.ok()) return InvalidArgument(what + ": " + st.message());
  }
  {
    Status st = ValidateActions(tau_actions, "tau_actions", true);
    if (!st.ok()) return InvalidArgument(what + ": " + st.message());
    st = ValidateActions(weight_actions, "weight_actions", false);
    if (!st.ok()) return InvalidArgument(what + ": " + st.message());
  }
  for (size_t i = 0; i < records.size(); ++i) {
    const CompilerKvTraceRecord& r = records[i];
    const bool gate = r.kind == CompilerKvTraceRecord::Kind::kGate;
    const size_t na = gate ? tau_actions.size() : weight_actions.size();
    const bool ok =
        r.layer >= 0 && r.layer < layers && r.budget_bin >= 0 && r.budget_bin < bins.budget_bins &&
        r.action >= 0 && static_cast<size_t>(r.action) < na && std::isfinite(r.reward) &&
        (gate ? (r.ent_bin >= 0 && r.ent_bin < bins.ent_bins && r.ppl_bin >= 0 && r.ppl_bin <= bins.ppl_bins)
              : (r.head >= 0 && r.head < heads));
    if (!ok)
      return InvalidArgument(what + ": record " + Str(i) + " has an index out of range or a bad reward");
  }
  return Status::Ok();
}

Status SaveCompilerKvTraces(const CompilerKvTraces& t, const std::string& path) {
  KVTIER_RETURN_IF_ERROR(t.Validate("compilerkv traces"));
  std::string out = std::string(kTracesMagic) + "\n";
  WriteHeader(&out, t.layers, t.heads, t.bins);
  for (const auto* acts : {&t.tau_actions, &t.weight_actions}) {
    out += acts == &t.tau_actions ? "tau_actions " : "weight_actions ";
    out += Str(acts->size());
    for (double a : *acts) AppendNum(&out, a);
    out += "\n";
  }
  out += "records ";
  out += Str(t.records.size()) + "\n";
  for (const CompilerKvTraceRecord& r : t.records) {
    out += r.kind == CompilerKvTraceRecord::Kind::kGate ? "gate " : "head ";
    if (r.kind == CompilerKvTraceRecord::Kind::kGate)
      out += Str(r.layer) + " " + Str(r.ent_bin) + " " + Str(r.ppl_bin) + " " + Str(r.budget_bin) + " " +
             Str(r.action) + " " + Num(r.reward) + "\n";
    else
      out += Str(r.layer) + " " + Str(r.head) + " " + Str(r.budget_bin) + " " + Str(r.action) + " " +
             Num(r.reward) + "\n";
  }
  return WriteWithChecksum(path, out, "compilerkv traces");
}

Result<CompilerKvTraces> LoadCompilerKvTraces(const std::string& path) {
  const std::string where = "compilerkv traces '" + path + "'";
  KVTIER_ASSIGN_OR_RETURN(std::string content, ReadWholeFile(path, "compilerkv traces"));
  KVTIER_ASSIGN_OR_RETURN(Reader r, Reader::Open(content, where));
  KVTIER_RETURN_IF_ERROR(r.ExpectLine(kTracesMagic));
  CompilerKvTraces t;
  KVTIER_RETURN_IF_ERROR(ReadHeader(&r, &t.layers, &t.heads, &t.bins));
  for (auto* acts : {&t.tau_actions, &t.weight_actions}) {
    const char* key = acts == &t.tau_actions ? "tau_actions" : "weight_actions";
    KVTIER_ASSIGN_OR_RETURN(auto f, r.Next(key, -1));
    if (f.empty()) return Corruption(r.Here() + key + " has no count");
    KVTIER_ASSIGN_OR_RETURN(int64_t k, r.Int(f[0], 1, 1000, "action count"));
    if (static_cast<int64_t>(f.size()) != k + 1)
      return Corruption(r.Here() + key + " announces " + Str(k) + " actions but lists " + Str(f.size() - 1));
    for (int64_t i = 0; i < k; ++i) {
      KVTIER_ASSIGN_OR_RETURN(double v, r.Double(f[i + 1], "action"));
      acts->push_back(v);
    }
  }
  KVTIER_ASSIGN_OR_RETURN(auto rf, r.Next("records", 1));
  KVTIER_ASSIGN_OR_RETURN(int64_t nrec, r.Int(rf[0], 0, int64_t{1} << 32, "record count"));
  t.records.reserve(static_cast<size_t>(std::min<int64_t>(nrec, 1 << 20)));
  const int64_t ka = static_cast<int64_t>(t.tau_actions.size()),
                kw = static_cast<int64_t>(t.weight_actions.size());
  for (int64_t i = 0; i < nrec; ++i) {
    CompilerKvTraceRecord rec;
    std::vector<std::string> f;
    if (r.PeekKeyword() != "head") {
      KVTIER_ASSIGN_OR_RETURN(f, r.Next("gate", 6));
      rec.kind = CompilerKvTraceRecord::Kind::kGate;
      KVTIER_ASSIGN_OR_RETURN(int64_t l, r.Int(f[0], 0, t.layers - 1, "layer"));
      KVTIER_ASSIGN_OR_RETURN(int64_t be, r.Int(f[1], 0, t.bins.ent_bins - 1, "entropy bin"));
      KVTIER_ASSIGN_OR_RETURN(int64_t bp, r.Int(f[2], 0, t.bins.ppl_bins, "perplexity bin"));
      KVTIER_ASSIGN_OR_RETURN(int64_t bb, r.Int(f[3], 0, t.bins.budget_bins - 1, "budget bin"));
      KVTIER_ASSIGN_OR_RETURN(int64_t a, r.Int(f[4], 0, ka - 1, "action"));
      KVTIER_ASSIGN_OR_RETURN(rec.reward, r.Double(f[5], "reward"));
      rec.layer = static_cast<int>(l);
      rec.ent_bin = static_cast<int>(be);
      rec.ppl_bin = static_cast<int>(bp);
      rec.budget_bin = static_cast<int>(bb);
      rec.action = static_cast<int>(a);
    } else {
      KVTIER_ASSIGN_OR_RETURN(f, r.Next("head", 5));
      rec.kind = CompilerKvTraceRecord::Kind::kHead;
      KVTIER_ASSIGN_OR_RETURN(int64_t l, r.Int(f[0], 0, t.layers - 1, "layer"));
      KVTIER_ASSIGN_OR_RETURN(int64_t h, r.Int(f[1], 0, t.heads - 1, "head"));
      KVTIER_ASSIGN_OR_RETURN(int64_t bb, r.Int(f[2], 0, t.bins.budget_bins - 1, "budget bin"));
      KVTIER_ASSIGN_OR_RETURN(int64_t a, r.Int(f[3], 0, kw - 1, "action"));
      KVTIER_ASSIGN_OR_RETURN(rec.reward, r.Double(f[4], "reward"));
      rec.layer = static_cast<int>(l);
      rec.head = static_cast<int>(h);
      rec.budget_bin = static_cast<int>(bb);
      rec.action = static_cast<int>(a);
    }
    t.records.push_back(rec);
  }
  KVTIER_RETURN_IF_ERROR(r.ExpectEnd());
  return t;
}

Status CompilerKvRecordOptions::Validate() const {
  KVTIER_RETURN_IF_ERROR(bins.Validate());
  KVTIER_RETURN_IF_ERROR(ValidateActions(tau_actions, "tau_actions", true));
  KVTIER_RETURN_IF_ERROR(ValidateActions(weight_actions, "weight_actions", false));
  if (!std::isfinite(beta) || beta < 0)
    return InvalidArgument("beta must be a finite number >= 0, got " + Num(beta));
  return Status::Ok();
}

Status RecordCompilerKvTraces(const PolicyGeometry& g, const std::vector<AttentionObservation>& obs,
                              int64_t budget, const CompilerKvRecordOptions& o, CompilerKvTraces* traces) {
  KVTIER_RETURN_IF_ERROR(g.Validate());
  KVTIER_RETURN_IF_ERROR(o.Validate());
  if (traces == nullptr) return InvalidArgument("compilerkv recorder: traces is null");
  if (budget < 0) return InvalidArgument("compilerkv recorder: budget must be >= 0, got " + Str(budget));
  if (static_cast<int>(obs.size()) != g.layers)
    return InvalidArgument("compilerkv recorder: " + Str(obs.size()) + " observations for " + Str(g.layers) +
                           " layers (one per layer is required: Eq. 6 averages over all of them)");
  std::vector<char> have(g.layers, 0);
  for (const AttentionObservation& ob : obs) {
    if (ob.layer < 0 || ob.layer >= g.layers)
      return InvalidArgument("compilerkv recorder: observation layer " + Str(ob.layer) + " out of range");
    if (have[ob.layer]++)
      return InvalidArgument("compilerkv recorder: layer " + Str(ob.layer) + " observed twice");
  }
  if (traces->layers == 0) {
    traces->layers = g.layers;
    traces->heads = g.kv_heads;
    traces->bins = o.bins;
    traces->tau_actions = o.tau_actions;
    traces->weight_actions = o.weight_actions;
  } else if (traces->layers != g.layers || traces->heads != g.kv_heads || !(traces->bins == o.bins) ||
             traces->tau_actions != o.tau_actions || traces->weight_actions != o.weight_actions) {
    return InvalidArgument(
        "compilerkv recorder: the traces were recorded with another geometry, bins or action set");
  }
  CompilerKvOptions po;
  po.bins = o.bins;
  CompilerKvPolicy p(po, nullptr);
  KVTIER_RETURN_IF_ERROR(p.Begin(g));
  for (const AttentionObservation& ob : obs) KVTIER_RETURN_IF_ERROR(p.Observe(ob));
  const int d = g.head_dim;
  for (const AttentionObservation& ob : obs) {
    const int l = ob.layer;
    KVTIER_ASSIGN_OR_RETURN(CompilerKvAnalysis an, p.Analyze(l));
    const int64_t n = static_cast<int64_t>(an.positions.size());
    if (budget >= n) continue;  // nothing is dropped: no decision to learn from
    // Full outputs o = Σ_t A_{i,t} v_t, the reference of the loss proxy.
    std::vector<double> full(static_cast<size_t>(g.q_heads) * ob.n_queries * d, 0.0);
    for (int h = 0; h < g.q_heads; ++h)
      for (int i = 0; i < ob.n_queries; ++i) {
        double* out = full.data() + (static_cast<size_t>(h) * ob.n_queries + i) * d;
        for (int64_t t = 0; t < n; ++t) {
          const double a = ob.at(h, i, t);
          if (a == 0.0) continue;
          const float* v = ob.values + (static_cast<size_t>(t) * g.kv_heads + h / g.group_size()) * d;
          for (int c = 0; c < d; ++c) out[c] += a * v[c];
        }
      }
    const int bb = o.bins.BudgetBin(budget, n);
    // Gate table: reward Eq. 2 with λ = β/T and Ψ = |I_cand| − B' (Eq. 14), literal Eq. 16.
    const double lambda = o.beta / static_cast<double>(n);
    for (size_t a = 0; a < o.tau_actions.size(); ++a) {
      KVTIER_ASSIGN_OR_RETURN(
          CompilerKvSelection sel,
          SelectCompilerKv(g, an.positions, an.uhat, an.alpha_mean, o.tau_actions[a], budget,
                           /*fill=*/false));
      CompilerKvTraceRecord r;
      r.kind = CompilerKvTraceRecord::Kind::kGate;
      r.layer = l;
      r.ent_bin = an.ent_bin;
      r.ppl_bin = an.ppl_bin;
      r.budget_bin = bb;
      r.action = static_cast<int>(a);
      const double psi = static_cast<double>(sel.candidates - sel.free_budget);
      r.reward = -OutputError(g, ob, full, sel.kept) - lambda * psi;
      traces->records.push_back(r);
    }
    // Head table: reward Eq. 2 with λ = 0; head h's weight set to the action, the others 1.
    for (int h = 0; h < g.kv_heads; ++h)
      for (size_t a = 0; a < o.weight_actions.size(); ++a) {
        std::vector<float> w(g.kv_heads, 1.0f);
        w[h] = static_cast<float>(o.weight_actions[a]);
        KVTIER_ASSIGN_OR_RETURN(CompilerKvAnalysis aw, p.Analyze(l, &w));
        KVTIER_ASSIGN_OR_RETURN(CompilerKvSelection sel, SelectCompilerKv(g, aw.positions, aw.uhat,
                                                                          aw.alpha_mean, -1.0, budget, true));
        CompilerKvTraceRecord r;
        r.kind = CompilerKvTraceRecord::Kind::kHead;
        r.layer = l;
        r.head = h;
        r.budget_bin = bb;
        r.action = static_cast<int>(a);
        r.reward = -OutputError(g, ob, full, sel.kept);
        traces->records.push_back(r);
      }
  }
  return Status::Ok();
}

// ---- conservative Q-learning (Eq. 4) ------------------------------------------------------------

Status CompilerKvFitOptions::Validate() const {
  if (!std::isfinite(alpha_cql) || alpha_cql < 0)
    return InvalidArgument("alpha_cql must be a finite number >= 0, got " + Num(alpha_cql));
  if (steps < 0) return InvalidArgument("steps must be >= 0, got " + Str(steps));
  if (!std::isfinite(lr) || lr <= 0) return InvalidArgument("lr must be a finite number > 0, got " + Num(lr));
  return Status::Ok();
}

namespace {

// Per-(state, action) sufficient statistics of the records.
struct BanditStats {
  size_t states = 0, actions = 0;
  std::vector<int64_t> count;  // [states][actions]
  std::vector<double> rsum;    // Σ r
  std::vector<double> r2sum;   // Σ r²
  std::vector<int64_t> n;      // [states]
  BanditStats(size_t s, size_t a)
      : states(s), actions(a), count(s * a, 0), rsum(s * a, 0.0), r2sum(s * a, 0.0), n(s, 0) {}
  void Add(size_t s, int a, double r) {
    count[s * actions + a] += 1;
    rsum[s * actions + a] += r;
    r2sum[s * actions + a] += r * r;
    n[s] += 1;
  }
};

double LogSumExp(const double* q, size_t k) {
  double m = -std::numeric_limits<double>::infinity();
  for (size_t a = 0; a < k; ++a) m = std::max(m, q[a]);
  double s = 0.0;
  for (size_t a = 0; a < k; ++a) s += std::exp(q[a] - m);
  return m + std::log(s);
}

// Gradient descent on each state's share of Eq. 4, divided by its record count n_s:
//   α (log Σ_a e^{Q(s,a)} − Σ_a p_a Q(s,a)) + (1/2n_s) Σ_i (Q(s,a_i) − r_i)²,  p_a = c_{s,a}/n_s,
// whose gradient is α (softmax_a − p_a) + p_a (Q(s,a) − r̄_{s,a}). Returns Q and adds each
// state's unnormalised term to *objective.
std::vector<double> FitBandit(const BanditStats& b, const CompilerKvFitOptions& o, double* objective) {
  const size_t k = b.actions;
  std::vector<double> q(b.states * k, 0.0);
  std::vector<double> p(k), rbar(k), sm(k);
  for (size_t s = 0; s < b.states; ++s) {
    if (b.n[s] == 0) continue;
    double* qs = q.data() + s * k;
    for (size_t a = 0; a < k; ++a) {
      const int64_t c = b.count[s * k + a];
      p[a] = static_cast<double>(c) / b.n[s];
      rbar[a] = c > 0 ? b.rsum[s * k + a] / c : 0.0;
    }
    for (int step = 0; step < o.steps; ++step) {
      const double lse = LogSumExp(qs, k);
      for (size_t a = 0; a < k; ++a) sm[a] = std::exp(qs[a] - lse);
      for (size_t a = 0; a < k; ++a)
        qs[a] -= o.lr * (o.alpha_cql * (sm[a] - p[a]) + p[a] * (qs[a] - rbar[a]));
    }
    double term = 0.0, eq = 0.0;
    for (size_t a = 0; a < k; ++a) {
      eq += p[a] * qs[a];
      const int64_t c = b.count[s * k + a];
      term += 0.5 * (c * qs[a] * qs[a] - 2.0 * qs[a] * b.rsum[s * k + a] + b.r2sum[s * k + a]);
    }
    *objective += b.n[s] * o.alpha_cql * (LogSumExp(qs, k) - eq) + term;
  }
  return q;
}

size_t Argmax(const double* q, size_t k) {
  size_t best = 0;
  for (size_t a = 1; a < k; ++a)
    if (q[a] > q[best]) best = a;
  return best;
}

}  // namespace

Result<CompilerKvFitResult> FitCompilerKvTables(const CompilerKvTraces& traces,
                                                const CompilerKvFitOptions& o) {
  KVTIER_RETURN_IF_ERROR(o.Validate());
  KVTIER_RETURN_IF_ERROR(traces.Validate("compilerkv traces"));
  if (traces.records.empty()) return InvalidArgument("compilerkv compiler: the traces hold no records");
  CompilerKvFitResult res;
  res.tables = CompilerKvTables::Neutral(traces.layers, traces.heads, traces.bins);
  const size_t gate_states = res.tables.tau.size();
  const size_t head_states = static_cast<size_t>(traces.layers) * traces.heads * traces.bins.budget_bins;
  BanditStats gate(gate_states, traces.tau_actions.size()), head(head_states, traces.weight_actions.size());
  for (const CompilerKvTraceRecord& r : traces.records) {
    if (r.kind == CompilerKvTraceRecord::Kind::kGate)
      gate.Add(res.gate_state(r.layer, r.ent_bin, r.ppl_bin, r.budget_bin), r.action, r.reward);
    else
      head.Add(res.head_state(r.layer, r.head, r.budget_bin), r.action, r.reward);
  }
  double objective = 0.0;
  res.q_gate = FitBandit(gate, o, &objective);
  res.q_head = FitBandit(head, o, &objective);
  res.objective = objective / static_cast<double>(traces.records.size());
  res.n_gate = gate.n;
  res.n_head = head.n;
  // Gate table: τ(s) = the argmax action; states without records keep τ from the budget.
  const size_t ka = gate.actions;
  for (size_t s = 0; s < gate_states; ++s) {
    if (gate.n[s] == 0) continue;
    ++res.gate_states_fitted;
    res.tables.tau[s] = static_cast<float>(traces.tau_actions[Argmax(res.q_gate.data() + s * ka, ka)]);
  }
  // Head table, Eq. 9: W[l, h] = argmax_w Q̄(l, h, w) over the budget buckets with records.
  const size_t kw = head.actions;
  for (int l = 0; l < traces.layers; ++l)
    for (int h = 0; h < traces.heads; ++h) {
      std::vector<double> qbar(kw, 0.0);
      int64_t total = 0;
      for (int bb = 0; bb < traces.bins.budget_bins; ++bb) {
        const size_t s = res.head_state(l, h, bb);
        if (head.n[s] == 0) continue;
        ++res.head_states_fitted;
        total += head.n[s];
        for (size_t a = 0; a < kw; ++a) qbar[a] += head.n[s] * res.q_head[s * kw + a];
      }
      if (total == 0) continue;
      res.tables.w_head[static_cast<size_t>(l) * traces.heads + h] =
          static_cast<float>(traces.weight_actions[Argmax(qbar.data(), kw)]);
    }
  return res;
}

// ---- factory ------------------------------------------------------------------------------------

namespace policies {

Result<std::unique_ptr<ScoringPolicy>> MakeCompilerKv(const FactorySpec& fs, const std::string& spec) {
  CompilerKvOptions o;
  std::vector<std::pair<std::string, std::string>> bin_keys;  // bins set explicitly, to check against a file
  for (const auto& [key, value] : fs.params) {
    if (key == "tables") {
      o.tables = value;
    } else if (key == "fill") {
      KVTIER_ASSIGN_OR_RETURN(int v, ParseSpecInt(spec, key, value));
      if (v != 0 && v != 1)
        return InvalidArgument("fill must be 0 or 1 in spec '" + spec + "', got " + value);
      o.fill = v == 1;
    } else if (key == "ent_bins" || key == "ppl_bins" || key == "budget_bins") {
      KVTIER_ASSIGN_OR_RETURN(int v, ParseSpecInt(spec, key, value));
      (key == "ent_bins" ? o.bins.ent_bins : key == "ppl_bins" ? o.bins.ppl_bins : o.bins.budget_bins) = v;
      bin_keys.emplace_back(key, value);
    } else if (key == "nll_step") {
      KVTIER_ASSIGN_OR_RETURN(o.bins.nll_step, ParseSpecDouble(spec, key, value));
      bin_keys.emplace_back(key, value);
    } else {
      return UnknownKey(fs, spec, key, "tables, fill, ent_bins, ppl_bins, budget_bins, nll_step");
    }
  }
  {
    Status st = o.bins.Validate();
    if (!st.ok()) return InvalidArgument(st.message() + " in spec '" + spec + "'");
  }
  KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<CompilerKvPolicy> p, MakeCompilerKvPolicy(o));
  if (p->tables() != nullptr) {
    // The file's bins rule; a spec that names different ones is a mistake worth reporting.
    const CompilerKvBins& fb = p->tables()->bins;
    for (const auto& [key, value] : bin_keys) {
      const bool same = key == "ent_bins"      ? fb.ent_bins == o.bins.ent_bins
                        : key == "ppl_bins"    ? fb.ppl_bins == o.bins.ppl_bins
                        : key == "budget_bins" ? fb.budget_bins == o.bins.budget_bins
                                               : fb.nll_step == o.bins.nll_step;
      if (!same) {
        const std::string file_value = key == "ent_bins"      ? Str(fb.ent_bins)
                                       : key == "ppl_bins"    ? Str(fb.ppl_bins)
                                       : key == "budget_bins" ? Str(fb.budget_bins)
                                                              : Num(fb.nll_step);
        return InvalidArgument("spec '" + spec + "' sets " + key + "=" + value + " but tables file '" +
                               o.tables + "' was compiled with " + key + "=" + file_value);
      }
    }
  }
  return std::unique_ptr<ScoringPolicy>(std::move(p));
}

PolicyInfo CompilerKvInfo() {
  const CompilerKvBins b;
  PolicyInfo info;
  info.name = "compilerkv";
  info.summary =
      "keeps the Top-B keys by û = max_h α·ρ·W_head (window-summed global mean attention × relative value "
      "norm, head-weighted max-pool), gated by a risk threshold τ(l, entropy bin, perplexity bin, budget "
      "bin) "
      "from compiled tables; tables=neutral: W_head = 1 and τ from the budget, i.e. Top-B by û";
  info.source =
      "papers/compilerkv-risk-adaptive-tables.txt Sec. 4.2-4.4, Eqs. 6-16, Algorithm 1; compiler Eq. 2-4, 9";
  info.params = {
      {"tables", kNeutral,
       "tables file from `kvtier compile-tables`, or 'neutral' (W_head = 1, τ = B-th largest û)"},
      {"fill", "1", "1: pad Eq. 16's set to exactly min(B, T) keys; 0: Eq. 16 literally (may keep fewer)"},
      {"ent_bins", Str(b.ent_bins), "entropy bins over R_struct / ln T (a tables file's value rules)"},
      {"ppl_bins", Str(b.ppl_bins), "perplexity bins (plus one for 'no log-probs'; the file's value rules)"},
      {"budget_bins", Str(b.budget_bins), "log2 buckets of T / B (the file's value rules)"},
      {"nll_step", Num(b.nll_step), "perplexity bin width in nats of mean NLL (the file's value rules)"},
  };
  return info;
}

}  // namespace policies
}  // namespace kvtier
