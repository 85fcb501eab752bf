#include "integration/infbench/score.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <vector>

namespace kvtier::infbench {
namespace {

using nlohmann::json;
using U32 = std::u32string;

// UTF-8 to code points (an invalid byte becomes U+FFFD, as Python's "replace").
U32 Decode(const std::string& s) {
  U32 out;
  size_t i = 0;
  while (i < s.size()) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    const int extra = c < 0x80 ? 0 : (c >> 5) == 6 ? 1 : (c >> 4) == 14 ? 2 : (c >> 3) == 30 ? 3 : -1;
    char32_t cp = extra == 0 ? c : extra == 1 ? (c & 0x1F) : extra == 2 ? (c & 0x0F) : (c & 0x07);
    bool ok = extra >= 0 && i + static_cast<size_t>(extra) < s.size();
    for (int k = 1; ok && k <= extra; ++k) {
      const unsigned char d = static_cast<unsigned char>(s[i + static_cast<size_t>(k)]);
      ok = (d >> 6) == 2;
      cp = (cp << 6) | (d & 0x3F);
    }
    if (!ok) {
      out.push_back(0xFFFD);
      ++i;
    } else {
      out.push_back(cp);
      i += static_cast<size_t>(extra) + 1;
    }
  }
  return out;
}

std::string Encode(const U32& s) {
  std::string out;
  for (char32_t c : s) {
    if (c < 0x80) {
      out.push_back(static_cast<char>(c));
    } else if (c < 0x800) {
      out.push_back(static_cast<char>(0xC0 | (c >> 6)));
      out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
    } else if (c < 0x10000) {
      out.push_back(static_cast<char>(0xE0 | (c >> 12)));
      out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
      out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
    } else {
      out.push_back(static_cast<char>(0xF0 | (c >> 18)));
      out.push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3F)));
      out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
      out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
    }
  }
  return out;
}

// Python's str.isspace (what str.split() splits at).
bool IsSpace(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}
bool IsDigit(char32_t c) { return c >= U'0' && c <= U'9'; }
char32_t Lower(char32_t c) {
  if ((c >= U'A' && c <= U'Z') || (c >= 0xC0 && c <= 0xDE && c != 0xD7)) return c + 0x20;
  return c;
}
char32_t Upper(char32_t c) {
  if ((c >= U'a' && c <= U'z') || (c >= 0xE0 && c <= 0xFE && c != 0xF7)) return c - 0x20;
  return c;
}

// str.split()
std::vector<U32> Split(const U32& s) {
  std::vector<U32> words;
  U32 w;
  for (char32_t c : s) {
    if (IsSpace(c)) {
      if (!w.empty()) words.push_back(std::move(w));
      w.clear();
    } else {
      w.push_back(c);
    }
  }
  if (!w.empty()) words.push_back(std::move(w));
  return words;
}

// Every character of `chars` replaced by a space.
U32 Blank(U32 s, const U32& chars) {
  for (char32_t& c : s)
    if (chars.find(c) != U32::npos) c = U' ';
  return s;
}
U32 Replace(U32 s, const U32& what, const U32& with) {
  for (size_t at = s.find(what); at != U32::npos; at = s.find(what, at + with.size()))
    s.replace(at, what.size(), with);
  return s;
}
U32 Strip(const U32& s) {
  size_t b = 0, e = s.size();
  while (b < e && IsSpace(s[b])) ++b;
  while (e > b && IsSpace(s[e - 1])) --e;
  return s.substr(b, e - b);
}
U32 CollapseSpaces(U32 s) {
  while (s.find(U"  ") != U32::npos) s = Replace(s, U"  ", U" ");
  return s;
}
bool StartsWith(const U32& s, const U32& p) { return s.size() >= p.size() && s.compare(0, p.size(), p) == 0; }

// re.split("[^0-9]", s) without the empty pieces: the runs of digits.
std::vector<U32> DigitRuns(const U32& s) {
  std::vector<U32> runs;
  U32 r;
  for (char32_t c : s) {
    if (IsDigit(c)) {
      r.push_back(c);
    } else if (!r.empty()) {
      runs.push_back(std::move(r));
      r.clear();
    }
  }
  if (!r.empty()) runs.push_back(std::move(r));
  return runs;
}

// The first value of a list, or the value.
const json& First(const json& gt) { return gt.is_array() ? gt.at(0) : gt; }
// A scalar as text: a string as it is, a number as Python's str() writes it.
U32 Text(const json& v) {
  if (v.is_string()) return Decode(v.get<std::string>());
  if (v.is_number_integer()) return Decode(std::to_string(v.get<int64_t>()));
  return Decode(v.dump());
}
std::vector<U32> Texts(const json& gt) {
  std::vector<U32> out;
  if (gt.is_array())
    for (const json& v : gt) out.push_back(Text(v));
  else
    out.push_back(Text(gt));
  return out;
}

// Python's int(word) on ASCII: optional sign, digits with single underscores between them.
bool ParseInt(const U32& w, int64_t* out) {
  size_t i = 0;
  bool neg = false;
  if (i < w.size() && (w[i] == U'+' || w[i] == U'-')) neg = w[i++] == U'-';
  if (i >= w.size() || !IsDigit(w[i])) return false;
  int64_t v = 0;
  for (; i < w.size(); ++i) {
    if (w[i] == U'_' && i + 1 < w.size() && IsDigit(w[i + 1]) && IsDigit(w[i - 1])) continue;
    if (!IsDigit(w[i])) return false;
    if (v > (INT64_MAX - 9) / 10) return false;
    v = v * 10 + (w[i] - U'0');
  }
  *out = neg ? -v : v;
  return true;
}

// collections.Counter intersection F1 (compute_scores.f1_score).
double F1(const std::vector<U32>& pred, const std::vector<U32>& truth) {
  std::map<U32, int> a, b;
  for (const U32& t : pred) ++a[t];
  for (const U32& t : truth) ++b[t];
  int same = 0;
  for (const auto& [t, n] : a) {
    auto it = b.find(t);
    if (it != b.end()) same += std::min(n, it->second);
  }
  if (same == 0) return 0;
  const double p = static_cast<double>(same) / pred.size(), r = static_cast<double>(same) / truth.size();
  return 2 * p * r / (p + r);
}

bool IsAsciiPunct(char32_t c) {
  return c < 0x80 && c > 0x20 && c != 0x7F && !std::isalnum(static_cast<int>(c));
}
bool IsWordChar(char32_t c) {
  return c >= 0x80 ? !IsSpace(c) : (std::isalnum(static_cast<int>(c)) != 0 || c == U'_');
}

// compute_scores.normalize_answer: lower, remove punctuation, remove articles, fix white space.
U32 NormalizeAnswer(const U32& s) {
  U32 t;
  for (char32_t c : s)
    if (!IsAsciiPunct(Lower(c))) t.push_back(Lower(c));
  // re.sub(r"\b(a|an|the)\b", " ", t)
  U32 u;
  for (size_t i = 0; i < t.size();) {
    const bool boundary_before = i == 0 || !IsWordChar(t[i - 1]);
    bool replaced = false;
    if (boundary_before)
      for (const U32& art : {U32(U"the"), U32(U"an"), U32(U"a")}) {
        if (t.compare(i, art.size(), art) == 0 &&
            (i + art.size() == t.size() || !IsWordChar(t[i + art.size()]))) {
          u.push_back(U' ');
          i += art.size();
          replaced = true;
          break;
        }
      }
    if (!replaced) u.push_back(t[i++]);
  }
  U32 out;
  for (const U32& w : Split(u)) {
    if (!out.empty()) out.push_back(U' ');
    out += w;
  }
  return out;
}

const U32 kChinesePunctuation =
    U"\uff01\uff1f\uff61\u3002\uff02\uff03\uff04\uff05\uff06\uff07\uff08\uff09\uff0a\uff0b\uff0c\uff0d\uff0f"
    U"\uff1a\uff1b\uff1c\uff1d\uff1e\uff20\uff3b\uff3c\uff3d\uff3e\uff3f\uff40\uff5b\uff5c\uff5d\uff5e\uff5f"
    U"\uff60\uff62\uff63\uff64\u3001\u3003\u300b\u300c\u300d\u300e\u300f\u3010\u3011\u3014\u3015\u3016\u3017"
    U"\u3018\u3019\u301a\u301b\u301c\u301d\u301e\u301f\u3030\u303e\u303f\u2013\u2014\u2018\u2019\u201b\u201c"
    U"\u201d\u201e\u201f\u2026\u2027\ufe4f.";

// compute_scores.normalize_zh_answer: lower, remove punctuation, remove all white space.
U32 NormalizeZh(const U32& s) {
  U32 out;
  for (char32_t c : s) {
    c = Lower(c);
    if (IsAsciiPunct(c) || kChinesePunctuation.find(c) != U32::npos || IsSpace(c)) continue;
    out.push_back(c);
  }
  return out;
}

// rouge_score's tokenizer: lower-case, runs of [a-z0-9].
std::vector<std::string> RougeTokens(const std::string& s) {
  std::vector<std::string> out;
  std::string t;
  for (char32_t c : Decode(s)) {
    c = Lower(c);
    if ((c >= U'a' && c <= U'z') || IsDigit(c)) {
      t.push_back(static_cast<char>(c));
    } else if (!t.empty()) {
      out.push_back(std::move(t));
      t.clear();
    }
  }
  if (!t.empty()) out.push_back(std::move(t));
  return out;
}

// Indices into `ref` of one LCS of ref and can (rouge_score's _backtrack_norec).
std::vector<size_t> LcsIndices(const std::vector<std::string>& ref, const std::vector<std::string>& can) {
  const size_t R = ref.size(), C = can.size();
  std::vector<std::vector<int>> t(R + 1, std::vector<int>(C + 1, 0));
  for (size_t i = 1; i <= R; ++i)
    for (size_t j = 1; j <= C; ++j)
      t[i][j] = ref[i - 1] == can[j - 1] ? t[i - 1][j - 1] + 1 : std::max(t[i - 1][j], t[i][j - 1]);
  std::vector<size_t> lcs;
  size_t i = R, j = C;
  while (i > 0 && j > 0) {
    if (ref[i - 1] == can[j - 1]) {
      lcs.push_back(i - 1);
      --i;
      --j;
    } else if (t[i][j - 1] > t[i - 1][j]) {
      --j;
    } else {
      --i;
    }
  }
  std::reverse(lcs.begin(), lcs.end());
  return lcs;
}

std::vector<std::vector<std::string>> RougeSentences(const std::string& text) {
  std::vector<std::vector<std::string>> out;
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    const std::string sent = text.substr(pos, end - pos);
    if (!sent.empty()) out.push_back(RougeTokens(sent));
    pos = end + 1;
  }
  return out;
}

Status BadTruth(const std::string& task, const json& gt, const std::string& why) {
  return InvalidArgument("∞-Bench " + task + ": ground truth " + gt.dump().substr(0, 80) + " " + why);
}

}  // namespace

double RougeLsum(const std::string& prediction, const std::string& reference) {
  const auto ref = RougeSentences(reference), can = RougeSentences(prediction);
  size_t m = 0, n = 0;
  std::map<std::string, int> cnt_r, cnt_c;
  for (const auto& s : ref)
    for (const auto& t : s) ++m, ++cnt_r[t];
  for (const auto& s : can)
    for (const auto& t : s) ++n, ++cnt_c[t];
  if (ref.empty() || can.empty() || m == 0 || n == 0) return 0;
  size_t hits = 0;
  for (const auto& r : ref) {
    std::set<size_t> uni;
    for (const auto& c : can)
      for (size_t i : LcsIndices(r, c)) uni.insert(i);
    for (size_t i : uni) {
      const std::string& t = r[i];
      if (cnt_c[t] > 0 && cnt_r[t] > 0) {
        ++hits;
        --cnt_c[t];
        --cnt_r[t];
      }
    }
  }
  const double recall = static_cast<double>(hits) / m, precision = static_cast<double>(hits) / n;
  return precision + recall > 0 ? 2 * precision * recall / (precision + recall) : 0;
}

Result<double> ScoreOne(const std::string& task, const std::string& prediction,
                        const std::string& ground_truth_json, const std::string& family) {
  json gt;
  try {
    gt = json::parse(ground_truth_json);
  } catch (const json::parse_error& e) {
    return InvalidArgument("∞-Bench " + task + ": ground truth is not JSON (" + std::string(e.what()) + ")");
  }
  if (gt.is_array() && gt.empty()) return BadTruth(task, gt, "is an empty list");
  const U32 pred = Decode(prediction);
  if (task == "passkey" || task == "number_string") {
    const auto runs = DigitRuns(pred);
    return runs.empty() ? 0.0 : static_cast<double>(runs[0] == Text(First(gt)));
  }
  if (task == "kv_retrieval" || task == "longdialogue_qa_eng") {
    auto words = Split(Blank(pred, U"\n:\"'.,?!{}"));
    if (task == "longdialogue_qa_eng")
      for (U32& w : words)
        for (char32_t& c : w) c = Upper(c);
    const U32 label = Text(First(gt));
    return static_cast<double>(std::find(words.begin(), words.end(), label) != words.end());
  }
  if (task == "code_run") {
    const auto words = Split(Blank(Strip(pred), U"\n.`'\":"));
    int64_t got = 0, want = 0;
    if (words.empty() || !ParseInt(words.back(), &got)) return 0.0;
    if (!ParseInt(Text(First(gt)), &want)) return BadTruth(task, gt, "is not an integer");
    return static_cast<double>(got == want);
  }
  if (task == "math_find") {
    const json& label = First(gt);
    if (!label.is_number()) return BadTruth(task, gt, "is not a number");
    // re.search(r"\d+\.\d+|\d+", pred)
    for (size_t i = 0; i < pred.size(); ++i) {
      if (!IsDigit(pred[i])) continue;
      size_t j = i;
      while (j < pred.size() && IsDigit(pred[j])) ++j;
      size_t end = j;
      if (j + 1 < pred.size() && pred[j] == U'.' && IsDigit(pred[j + 1])) {
        end = j + 1;
        while (end < pred.size() && IsDigit(pred[end])) ++end;
      }
      const std::string num = Encode(pred.substr(i, end - i));
      if (label.is_number_integer()) {
        // int(first_num): a float like "3.5" raises in the benchmark's scorer (no score).
        if (num.find('.') != std::string::npos) return 0.0;
        int64_t v = 0;
        if (!ParseInt(Decode(num), &v)) return 0.0;
        return static_cast<double>(v == label.get<int64_t>());
      }
      return static_cast<double>(std::stod(num) == label.get<double>());
    }
    return 0.0;
  }
  if (task == "math_calc") {
    if (!gt.is_array()) return BadTruth(task, gt, "is not a list");
    std::vector<U32> runs = DigitRuns(pred);
    if (family == "gpt4" && !runs.empty()) runs.erase(runs.begin());
    size_t matched = 0;
    for (size_t i = 0; i < gt.size() && i < runs.size(); ++i) {
      int64_t v = 0;
      if (!gt[i].is_number_integer()) return BadTruth(task, gt, "holds a value that is not an integer");
      if (!ParseInt(runs[i], &v) || v != gt[i].get<int64_t>()) break;
      ++matched;
    }
    return static_cast<double>(matched) / static_cast<double>(gt.size());
  }
  if (task == "code_debug") {
    if (!gt.is_array() || gt.size() != 2) return BadTruth(task, gt, "is not [function name, option letter]");
    const U32 letter = Text(gt[1]), fn = Text(gt[0]);
    const U32 head = pred.substr(0, 2);
    if (head == letter + U"." || head == letter + U":") return 1.0;
    U32 p = Strip(pred);
    for (const U32& c :
         {U32(U"\n"), U32(U"`"), U32(U"'"), U32(U"\""), U32(U"-"), U32(U"*"), U32(U"Option"), U32(U"option")})
      p = Replace(p, c, U" ");
    p = CollapseSpaces(p);
    for (const U32& prefix : {U32(U"answer is:"), U32(U"is:"), U32(U"answer:")}) {
      const size_t idx = p.find(prefix);
      if (idx == U32::npos) continue;
      if (p.size() < idx + prefix.size() + 1) return 0.0;
      const U32 after = p.substr(idx + prefix.size() + 1);
      return static_cast<double>(StartsWith(after, letter) || StartsWith(after, fn));
    }
    return 0.0;
  }
  if (task == "longbook_choice_eng") {
    const std::vector<U32> labels = Texts(gt);
    auto in_label = [&](const U32& s) { return std::find(labels.begin(), labels.end(), s) != labels.end(); };
    if (pred.empty()) return 0.0;
    if (U32(U"ABCD").find(pred[0]) != U32::npos) return static_cast<double>(in_label(U32(1, pred[0])));
    U32 p = CollapseSpaces(Blank(pred, U"\n\"'.,?!{}"));
    for (const U32& prefix : {U32(U"answer is:"), U32(U"answer:"), U32(U"answer is"), U32(U"option is")}) {
      const size_t idx = p.find(prefix);
      if (idx == U32::npos) continue;
      if (p.size() < idx + prefix.size() + 1) return 0.0;
      const U32 after = p.substr(idx + prefix.size() + 1);
      for (const U32& s : labels)
        if (StartsWith(after, s)) return 1.0;
      return 0.0;
    }
    for (const U32& w : Split(p))
      if (U32(U"ABCD").find(w) != U32::npos) return static_cast<double>(in_label(w));
    return 0.0;
  }
  if (task == "longbook_qa_eng" || task == "longbook_qa_chn") {
    double best = 0;
    for (const U32& truth : Texts(gt)) {
      std::vector<U32> a, b;
      if (task == "longbook_qa_eng") {
        a = Split(NormalizeAnswer(pred));
        b = Split(NormalizeAnswer(truth));
      } else {
        for (char32_t c : NormalizeZh(pred)) a.push_back(U32(1, c));
        for (char32_t c : NormalizeZh(truth)) b.push_back(U32(1, c));
      }
      best = std::max(best, F1(a, b));
    }
    return best;
  }
  if (task == "longbook_sum_eng") {
    double best = 0;
    for (const U32& truth : Texts(gt)) best = std::max(best, RougeLsum(prediction, Encode(truth)));
    return best;
  }
  return InvalidArgument("unknown ∞-Bench task '" + task + "'");
}

}  // namespace kvtier::infbench
