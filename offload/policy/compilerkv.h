// CompilerKV (papers/compilerkv-risk-adaptive-tables.txt): a prefill-time scoring policy driven
// by two tables compiled offline, plus the offline compiler that builds them.
//
// ---- Scoring (Sec. 4.2-4.4, Algorithm 1) ------------------------------------------------
// Per key t of layer l:
//   Ā_{j,t} = 1/(L·H) Σ_l Σ_h A^{(l,h)}_{j,t}                          (Eq. 6, global mean attention)
//   α_t     = Σ_{j∈Ω} Ā_{j,t}                                           (window-cumulative attention)
//   ρ^{(l,h)}_t = ‖v^{(l,h)}_t‖₂ / ((1/T) Σ_k ‖v^{(l,h)}_k‖₂)            (Eq. 7, relative value norm)
//   u^{(l,h)}_t = α_t · ρ^{(l,h)}_t                                     (Eq. 8)
//   û^{(l)}_t   = max_h u^{(l,h)}_t · W_head[l, h]                       (Eq. 10, weighted max-pooling)
// and per decision the risk state:
//   R_struct = −Σ_t Ā'_t log Ā'_t,  Ā'_t = α_t / Σ_k α_k                 (Eqs. 11-12; Alg. 1 lines 7-8)
//   R_sem    = exp(−(1/|Ω|) Σ_{j∈Ω} log P(x_j | x_<j))                   (Eq. 13)
//   s_l      = (l, b_ent, b_ppl, B_l)                                   (Sec. 4.4 state)
//   τ        = T_gate[s_l]                                              (Alg. 1 line 26)
//   I_cand   = {t | û_t ≥ τ}                                            (Eq. 15)
//   S        = I_cand if |I_cand| ≤ B, else Top-B(I_cand, û)             (Eq. 16)
//
// Where this implementation decides what the paper leaves open (each also noted in the code):
//  - Streaming Eq. 6. Observations arrive layer by layer, so Ā for a decision on layer l is the
//    mean over the layers observed so far since Begin() (the latest state of each), each layer's
//    contribution being its q-head mean; a key absent from a layer's cache (dropped there) gets 0
//    from that layer. Keep(l) after all L layers were fed is exactly Eq. 6. α accumulates over
//    every query observed for the layer since Begin() (successive Observe() calls extend Ω).
//  - Heads. Attention is per query head, values (Eq. 7) per kv head; H in Eqs. 7-10 and in
//    W_head[L][H] is the kv-head count, and Ā averages over the query heads. α is global (the
//    same for every head), so u differs across heads only through ρ, as in Alg. 1 lines 14-17.
//  - Eq. 7 uses T = the keys cached for the layer now; when every value norm is 0, ρ = 1.
//  - Shared selection. S^{(l)} is shared by the kv heads of a layer (Alg. 1 line 33): Keep()
//    returns the same positions for every head, and Scores() gives û for every head.
//  - Units of τ. Eq. 15 compares û against τ ∈ [0.8, 1.0], which App. B.1 justifies by û being
//    O(1). As written, α sums to |Ω| over the keys, so û is O(|Ω|/T); we therefore express τ
//    in units of ᾱ = (1/T) Σ_t α_t, i.e. I_cand = {t | û_t/ᾱ ≥ τ}. With ρ's mean of 1 (Eq. 7)
//    this is the O(1) normalisation the appendix assumes. Scores() returns û as written.
//  - Protected keys (sinks, local window) are kept and counted in B; Eqs. 15-16 run over the
//    other keys with B' = B − |protected|. Budget < |protected| is InvalidArgument.
//  - Discretisation. b_ent: the normalised entropy R_struct / ln T in [0, 1] cut into
//    `ent_bins` equal bins (paper: 20). b_ppl: the mean NLL ln R_sem cut into bins of
//    `nll_step` nats, the last bin open (paper: 4 bins); with no token_logprobs the state uses
//    the extra neutral bucket b_ppl = ppl_bins. B_l: log2 buckets of the keep fraction,
//    b_B = min(budget_bins − 1, floor(log2(T / B))) (0 when B ≥ T, the last when B = 0), so
//    tables transfer across context lengths. R_sem uses every distinct query position observed with log-probs
//    since Begin() (a query fed for several layers counts once).
//  - Exact budget (`fill`). The interface asks Keep() for exactly min(B, T) keys; Eq. 16 keeps
//    fewer when |I_cand| < B. fill=1 (default) pads S with the highest-û non-candidates, so the
//    budget is honoured; since I_cand is an upper set of û, the result is then Top-B by û and
//    τ has no effect on the selection (only on last_decision().candidates). fill=0 follows
//    Eq. 16 literally and may keep fewer than B ("elastic retention"), where τ matters.
//  - Neutral tables (tables=neutral): W_head = 1 everywhere and τ chosen from the budget as the
//    B'-th largest û/ᾱ, so Eqs. 15-16 reduce to Top-B by û (a τ < 0 in a tables file means the
//    same, per state). Describe() and the policy summary say so.
//
// ---- Tables file (SaveCompilerKvTables / LoadCompilerKvTables) ------------------------------
// Text, one item per line, numbers in shortest round-trip form, '\n' line ends:
//   kvtier-compilerkv-tables v1
//   layers <L>
//   heads <H>                                 (kv heads)
//   ent_bins <NH>
//   ppl_bins <NP>                             (τ has NP + 1 ppl slots: the last is "no log-probs")
//   budget_bins <NB>
//   nll_step <x>
//   w <l> <W[l][0]> ... <W[l][H-1]>          L lines, l = 0..L-1 in order
//   tau <l> <be> <bp> <τ[..][0]> ... <τ[..][NB-1]>   L·NH·(NP+1) lines, l, be, bp increasing
//   crc32c <8 hex digits>                      CRC-32C of every byte before this line
// Parsing is strict (exact keywords, counts, order, finite numbers, nothing after the checksum);
// any deviation or a checksum mismatch is Corruption naming the file and line. A table whose L
// or H differs from the model is InvalidArgument at Begin(), naming the file.
//
// ---- Offline compiler (Sec. 3.2, 4.3, 4.4) -----------------------------------------------------
// A contextual bandit per table. Gate table: state (l, b_ent, b_ppl, b_B), action τ from
// `tau_actions`, reward Eq. 2 with λ = β/T (T = the layer's cached keys) and Ψ = |I_cand| − B'
// (Eq. 14, signed as written: fewer candidates than B' earn a bonus that the fidelity term must
// outweigh; protected keys are outside both). Head table: state
// (l, h, b_B), action W from `weight_actions`, reward Eq. 2 with λ = 0, measured as the
// marginal effect of setting head h's weight while the others stay 1 (Sec. 4.3).
// Loss proxy: no model supplies NLL here, so L_comp − L_full of Eq. 2 is replaced by the
// attention-output error of the compressed cache: per query head h and window query i,
// o = Σ_t A_{i,t} v_t over all keys, õ = Σ_{t∈S} A_{i,t} v_t / Σ_{t∈S} A_{i,t} (renormalised;
// 0 when S holds no mass), error = mean over (h, i) of ‖õ − o‖₂ / ‖o‖₂ (absolute when ‖o‖ = 0),
// so reward = −error − λΨ. Gate actions are scored with the literal Eq. 16 (fill=0), where τ
// changes the selection; head actions with the budget-derived τ (Top-B by û).
// Fitting: tabular Q(s, a), minimising Eq. 4,
//   α_cql E_s[log Σ_a exp Q(s,a) − E_{a∼π_β} Q(s,a)] + ½ E_{(s,a,r)∼D}[(Q(s,a) − r)²],
// by full-batch gradient descent from Q = 0. The objective is a sum of independent per-state
// terms; each state's term is divided by its record count (same minimiser, a step size that
// does not depend on how often the state occurs). π_β is the empirical action distribution of
// the state's records. Then τ(s) = tau_actions[argmax_a Q(s, a)] (ties: the first), τ = −1
// (from budget) for states without records; W_head[l, h] = argmax_w Q̄(l, h, w) (Eq. 9), Q̄
// the record-weighted mean of Q over the budget buckets with records, 1 without records.
//
// ---- Traces file (SaveCompilerKvTraces / LoadCompilerKvTraces) ------------------------------
//   kvtier-compilerkv-traces v1
//   layers <L> / heads <H> / ent_bins / ppl_bins / budget_bins / nll_step   (as in the tables)
//   tau_actions <k> <a_0> ... <a_{k-1}>
//   weight_actions <k> <w_0> ... <w_{k-1}>
//   records <N>
//   gate <l> <b_ent> <b_ppl> <b_B> <action> <reward>     or
//   head <l> <h> <b_B> <action> <reward>                 N lines
//   crc32c <8 hex digits>
// with the same strictness and errors as the tables file.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "offload/policy/scoring_policy.h"

namespace kvtier {

/// How the risk state is discretised (see the header comment).
struct CompilerKvBins {
  int ent_bins = 20;      ///< N_H entropy bins over R_struct / ln T in [0, 1] (paper: 20)
  int ppl_bins = 4;       ///< N_P perplexity bins (paper: 4); index ppl_bins = no log-probs
  int budget_bins = 6;    ///< log2 buckets of T / B (keep fraction 1..1/2, ..1/4, ...)
  double nll_step = 1.0;  ///< width of a perplexity bin in nats of mean NLL (ln R_sem)

  Status Validate() const;
  /// b_ent of a normalised entropy in [0, 1].
  int EntropyBin(double normalized_entropy) const;
  /// b_ppl of a mean NLL; ppl_bins when there are no log-probs.
  int PplBin(bool has_logprobs, double mean_nll) const;
  /// b_B of a budget over n keys.
  int BudgetBin(int64_t budget, int64_t n) const;
  bool operator==(const CompilerKvBins& o) const = default;
};

/// W_head and T_gate.
struct CompilerKvTables {
  int layers = 0;  ///< L
  int heads = 0;   ///< H (kv heads)
  CompilerKvBins bins;
  std::vector<float> w_head;  ///< [layers][heads]
  std::vector<float> tau;     ///< [layers][ent_bins][ppl_bins + 1][budget_bins]; < 0: from budget

  /// All weights 1, every τ from the budget.
  static CompilerKvTables Neutral(int layers, int heads, const CompilerKvBins& bins);
  size_t tau_index(int layer, int ent_bin, int ppl_bin, int budget_bin) const;
  float weight(int layer, int head) const { return w_head[static_cast<size_t>(layer) * heads + head]; }
  /// Shapes and finiteness; InvalidArgument naming what is wrong.
  Status Validate() const;
  bool operator==(const CompilerKvTables& o) const = default;
};

Status SaveCompilerKvTables(const CompilerKvTables& tables, const std::string& path);
/// NotFound / IOError if unreadable, Corruption (naming file and line) if malformed.
Result<CompilerKvTables> LoadCompilerKvTables(const std::string& path);
/// The same from a file's content; `name` stands for the file in messages. Any bytes are
/// safe to pass (a fuzz target does).
Result<CompilerKvTables> ParseCompilerKvTables(const std::string& content, const std::string& name);

/// Stages 1-2 and the risk coordinates of one layer's latest observation.
struct CompilerKvAnalysis {
  int layer = 0;
  std::vector<int64_t> positions;  ///< [n] keys, increasing
  std::vector<float> alpha;        ///< [n] α_t over the layers seen so far (Eq. 6, window sum)
  std::vector<float> rho;          ///< [kv_heads][n] Eq. 7
  std::vector<float> uhat;         ///< [n] Eq. 10 (u of Eq. 8 is alpha × rho)
  double alpha_mean = 0.0;         ///< ᾱ, the unit of τ
  double r_struct = 0.0;           ///< Eq. 12
  bool has_sem = false;            ///< log-probs were observed
  double r_sem = 0.0;              ///< Eq. 13 (1 when !has_sem)
  int ent_bin = 0;                 ///< b_ent
  int ppl_bin = 0;                 ///< b_ppl (bins.ppl_bins when !has_sem)
  int layers_seen = 0;             ///< layers averaged in Eq. 6
};

/// The outcome of Eqs. 15-16 on one layer.
struct CompilerKvSelection {
  std::vector<int64_t> kept;     ///< indexes into positions, increasing (protected included)
  double tau = 0.0;              ///< τ applied, in units of ᾱ (resolved when from budget)
  bool tau_from_budget = false;  ///< τ was the B'-th largest û/ᾱ
  int64_t candidates = 0;        ///< |I_cand| over the non-protected keys (Eq. 15)
  int64_t protected_count = 0;   ///< sinks + local window kept outside Eqs. 15-16
  int64_t free_budget = 0;       ///< B' = min(B, n) − protected
};

/// Eqs. 15-16 over the non-protected keys (see the header comment). `tau` < 0: from budget.
/// InvalidArgument on size mismatch, budget < 0, or budget < protected (when budget < n).
Result<CompilerKvSelection> SelectCompilerKv(const PolicyGeometry& g, const std::vector<int64_t>& positions,
                                             const std::vector<float>& uhat, double alpha_mean, double tau,
                                             int64_t budget, bool fill);

/// One Keep() decision, for tests and reports.
struct CompilerKvDecision {
  int layer = -1;
  int budget_bin = 0;
  CompilerKvAnalysis analysis;    ///< scalars only (no per-key vectors)
  CompilerKvSelection selection;  ///< scalars only (no `kept`)
};

struct CompilerKvOptions {
  std::string tables = "neutral";  ///< tables file, or "neutral"
  bool fill = true;                ///< pad Eq. 16's set to exactly min(B, T) keys
  CompilerKvBins bins;             ///< ignored when a file is loaded (the file's bins rule)
};

class CompilerKvPolicy final : public ScoringPolicy {
 public:
  /// `tables` null: neutral tables, sized at Begin(). Otherwise the tables in use, whose bins
  /// replace options.bins; options.tables (the file they came from) is what ToString() prints.
  CompilerKvPolicy(const CompilerKvOptions& options, std::shared_ptr<const CompilerKvTables> tables);

  std::string name() const override { return "compilerkv"; }
  std::string ToString() const override;
  Status Begin(const PolicyGeometry& g) override;
  Status Observe(const AttentionObservation& obs) override;
  Result<TokenScores> Scores(int layer) const override;
  Result<KeepSet> Keep(int layer, int64_t budget) override;
  size_t state_bytes() const override;

  /// Stages 1-2 of the layer's latest observation; `head_weights` ([kv_heads]) overrides the
  /// layer's W_head row (the compiler's marginal-contribution actions).
  Result<CompilerKvAnalysis> Analyze(int layer, const std::vector<float>* head_weights = nullptr) const;
  /// The latest Keep() decision (layer -1 before any).
  const CompilerKvDecision& last_decision() const { return last_; }
  /// One line on the tables in use (neutral: "top-B by û").
  std::string Describe() const;
  const CompilerKvTables* tables() const { return tables_.get(); }

 private:
  struct LayerState {
    bool seen = false;
    std::vector<int64_t> positions;  // [n]
    std::vector<float> attn_sum;     // [n] Σ_{j∈Ω} (1/Hq) Σ_h A_{j,t}, accumulated
    std::vector<float> norms;        // [kv_heads][n] ‖v_t‖ of the latest observation
  };

  CompilerKvOptions options_;
  bool neutral_;
  std::shared_ptr<const CompilerKvTables> tables_;
  PolicyGeometry g_;
  bool begun_ = false;
  std::vector<LayerState> layers_;
  int64_t last_logprob_query_ = -1;  // highest query position whose log-prob was counted
  double nll_sum_ = 0.0;
  int64_t nll_count_ = 0;
  CompilerKvDecision last_;
};

/// Builds a policy from options (loads the tables file unless "neutral").
Result<std::unique_ptr<CompilerKvPolicy>> MakeCompilerKvPolicy(const CompilerKvOptions& options);

// ---- offline compiler ---------------------------------------------------------------------

struct CompilerKvTraceRecord {
  enum class Kind : uint8_t { kGate, kHead };
  Kind kind = Kind::kGate;
  int layer = 0;
  int ent_bin = 0;  ///< gate only
  int ppl_bin = 0;  ///< gate only
  int head = 0;     ///< head only
  int budget_bin = 0;
  int action = 0;  ///< index into tau_actions (gate) or weight_actions (head)
  double reward = 0.0;
  bool operator==(const CompilerKvTraceRecord& o) const = default;
};

struct CompilerKvTraces {
  int layers = 0;  ///< 0 until the first recording sets the header
  int heads = 0;
  CompilerKvBins bins;
  std::vector<double> tau_actions;     ///< the gate table's action values (units of ᾱ)
  std::vector<double> weight_actions;  ///< the head table's action values
  std::vector<CompilerKvTraceRecord> records;
  /// Header sane and every record's indexes in range; `what` prefixes messages.
  Status Validate(const std::string& what) const;
  bool operator==(const CompilerKvTraces& o) const = default;
};

Status SaveCompilerKvTraces(const CompilerKvTraces& traces, const std::string& path);
Result<CompilerKvTraces> LoadCompilerKvTraces(const std::string& path);

struct CompilerKvRecordOptions {
  CompilerKvBins bins;
  std::vector<double> tau_actions = {0.8, 0.85, 0.9, 0.95, 1.0};  ///< paper: τ ∈ [0.8, 1.0]
  std::vector<double> weight_actions = {0.25, 0.5, 1.0, 1.5, 2.0};
  double beta = 1.0;  ///< λ = β / T in the gate reward (Eq. 14)
  Status Validate() const;
};

/// Records one sequence: `obs` holds one observation per layer (each layer once, with values;
/// pointers valid during the call), `budget` is B_l for every layer. For each layer with
/// budget < keys, appends one gate record per τ action and one head record per (kv head,
/// weight action). An empty `traces` (layers == 0) takes its header from g and `o`; a
/// non-empty one must match them (InvalidArgument otherwise).
Status RecordCompilerKvTraces(const PolicyGeometry& g, const std::vector<AttentionObservation>& obs,
                              int64_t budget, const CompilerKvRecordOptions& o, CompilerKvTraces* traces);

struct CompilerKvFitOptions {
  double alpha_cql = 1.0;  ///< α of Eq. 4 (conservatism)
  int steps = 500;         ///< gradient steps
  double lr = 0.5;         ///< step size
  Status Validate() const;
};

struct CompilerKvFitResult {
  CompilerKvTables tables;
  std::vector<double> q_gate;      ///< [gate state][tau action], gate_state() order
  std::vector<double> q_head;      ///< [head state][weight action], head_state() order
  std::vector<int64_t> n_gate;     ///< records per gate state
  std::vector<int64_t> n_head;     ///< records per head state
  double objective = 0.0;          ///< Eq. 4 at the end, mean over all records
  int64_t gate_states_fitted = 0;  ///< gate states with records
  int64_t head_states_fitted = 0;
  size_t gate_state(int layer, int ent_bin, int ppl_bin, int budget_bin) const {
    return tables.tau_index(layer, ent_bin, ppl_bin, budget_bin);
  }
  size_t head_state(int layer, int head, int budget_bin) const {
    return (static_cast<size_t>(layer) * tables.heads + head) * tables.bins.budget_bins + budget_bin;
  }
};

/// Eq. 4 on the traces, then Eq. 9 and the gate argmax (see the header comment).
Result<CompilerKvFitResult> FitCompilerKvTables(const CompilerKvTraces& traces,
                                                const CompilerKvFitOptions& o);

}  // namespace kvtier
