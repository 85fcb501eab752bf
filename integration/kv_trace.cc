#include "integration/kv_trace.h"

#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>

#include "store/checksum.h"

namespace kvtier {
namespace {

constexpr char kMagic[8] = {'K', 'V', 'T', 'T', 'R', 'A', 'C', 'E'};
// magic, version, reserved, file_bytes, 4 x u32 shape, 3 x i64, n_needles.
constexpr size_t kFixedHeader = 8 + 4 + 4 + 8 + 16 + 24 + 4;
constexpr size_t kFileBytesAt = 16;

template <typename T>
void Put(std::string* out, T v) {
  out->append(reinterpret_cast<const char*>(&v), sizeof(T));
}

void PutString(std::string* out, const std::string& s) {
  Put<uint32_t>(out, static_cast<uint32_t>(s.size()));
  out->append(s);
}

// Bounds-checked cursor over the file's bytes (before the CRC).
struct Cursor {
  const char* p;
  size_t left;
  template <typename T>
  bool Get(T* v) {
    if (left < sizeof(T)) return false;
    std::memcpy(v, p, sizeof(T));
    p += sizeof(T);
    left -= sizeof(T);
    return true;
  }
  bool GetBytes(void* dst, size_t n) {
    if (left < n) return false;
    std::memcpy(dst, p, n);
    p += n;
    left -= n;
    return true;
  }
  bool GetString(std::string* s) {
    uint32_t n = 0;
    if (!Get(&n) || left < n) return false;
    s->assign(p, n);
    p += n;
    left -= n;
    return true;
  }
};

// Elements of one layer's q, k or v for n tokens of `heads` heads.
size_t Elems(int64_t n, int heads, int head_dim) {
  return static_cast<size_t>(n) * static_cast<size_t>(heads) * static_cast<size_t>(head_dim);
}

}  // namespace

uint64_t KvTrace::qkv_bytes() const {
  return static_cast<uint64_t>(layers) * Elems(n_tokens(), q_heads + 2 * kv_heads, head_dim) * sizeof(float);
}

Status KvTrace::Validate() const {
  Status g = geometry().Validate();
  if (!g.ok()) return InvalidArgument("trace: " + g.message());
  const int64_t n = n_tokens();
  if (!(0 < question_begin && question_begin < context && context < n))
    return InvalidArgument("trace: need 0 < question_begin (" + std::to_string(question_begin) +
                           ") < context (" + std::to_string(context) + ") < n_tokens (" + std::to_string(n) +
                           "): a question window and at least one decode step");
  if (needles.empty()) return InvalidArgument("trace: no needle range (run's needle hit rate needs one)");
  for (const TokenRange& r : needles)
    if (!(0 <= r.begin && r.begin < r.end && r.end <= context))
      return InvalidArgument("trace: needle range [" + std::to_string(r.begin) + ", " +
                             std::to_string(r.end) + ") is empty or not inside the prompt [0, " +
                             std::to_string(context) + ")");
  if (q.size() != static_cast<size_t>(layers) || k.size() != q.size() || v.size() != q.size())
    return InvalidArgument("trace: q/k/v hold " + std::to_string(q.size()) + "/" + std::to_string(k.size()) +
                           "/" + std::to_string(v.size()) + " layers, geometry says " +
                           std::to_string(layers));
  for (int l = 0; l < layers; ++l)
    if (q[l].size() != Elems(n, q_heads, head_dim) || k[l].size() != Elems(n, kv_heads, head_dim) ||
        v[l].size() != Elems(n, kv_heads, head_dim))
      return InvalidArgument("trace: layer " + std::to_string(l) + " q/k/v sizes do not match " +
                             std::to_string(n) + " tokens of geometry " + geometry().ToString());
  return Status::Ok();
}

Result<std::string> EncodeKvTrace(const KvTrace& t) {
  KVTIER_RETURN_IF_ERROR(t.Validate());
  std::string out;
  out.reserve(kFixedHeader + t.needles.size() * 16 + t.tokens.size() * 4 + t.source.size() + t.answer.size() +
              12 + t.qkv_bytes());
  out.append(kMagic, sizeof(kMagic));
  Put<uint32_t>(&out, KvTrace::kVersion);
  Put<uint32_t>(&out, 0);
  Put<uint64_t>(&out, 0);  // file_bytes, patched below
  for (int d : {t.layers, t.q_heads, t.kv_heads, t.head_dim}) Put<uint32_t>(&out, static_cast<uint32_t>(d));
  Put<int64_t>(&out, t.n_tokens());
  Put<int64_t>(&out, t.context);
  Put<int64_t>(&out, t.question_begin);
  Put<uint32_t>(&out, static_cast<uint32_t>(t.needles.size()));
  for (const TokenRange& r : t.needles) {
    Put<int64_t>(&out, r.begin);
    Put<int64_t>(&out, r.end);
  }
  out.append(reinterpret_cast<const char*>(t.tokens.data()), t.tokens.size() * sizeof(int32_t));
  PutString(&out, t.source);
  PutString(&out, t.answer);
  for (int l = 0; l < t.layers; ++l)
    for (const std::vector<float>* a : {&t.q[l], &t.k[l], &t.v[l]})
      out.append(reinterpret_cast<const char*>(a->data()), a->size() * sizeof(float));
  const uint64_t total = out.size() + sizeof(uint32_t);
  std::memcpy(out.data() + kFileBytesAt, &total, sizeof(total));
  Put<uint32_t>(&out, Crc32c(out.data(), out.size()));
  return out;
}

Result<KvTrace> DecodeKvTrace(const std::string& bytes, const std::string& name) {
  const std::string what = "trace '" + name + "': ";
  const size_t size = bytes.size();
  if (size >= sizeof(kMagic) && std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0)
    return Corruption(what + "bad magic (not a kvtier trace file)");
  if (size < kFixedHeader + sizeof(uint32_t))
    return Corruption(what + "truncated: " + std::to_string(size) + " bytes, shorter than the " +
                      std::to_string(kFixedHeader + sizeof(uint32_t)) + "-byte header");
  Cursor c{bytes.data() + sizeof(kMagic), size - sizeof(kMagic) - sizeof(uint32_t)};
  uint32_t version = 0, reserved = 0;
  uint64_t file_bytes = 0;
  c.Get(&version);
  c.Get(&reserved);
  c.Get(&file_bytes);
  if (version != KvTrace::kVersion)
    return Corruption(what + "unsupported version " + std::to_string(version) +
                      " (this build reads version " + std::to_string(KvTrace::kVersion) + ")");
  if (size < file_bytes)
    return Corruption(what + "truncated: " + std::to_string(size) + " bytes, the header says " +
                      std::to_string(file_bytes));
  if (size > file_bytes)
    return Corruption(what + "trailing bytes: " + std::to_string(size) + " bytes, the header says " +
                      std::to_string(file_bytes));
  uint32_t stored_crc = 0;
  std::memcpy(&stored_crc, bytes.data() + size - sizeof(uint32_t), sizeof(uint32_t));
  const uint32_t crc = Crc32c(bytes.data(), size - sizeof(uint32_t));
  if (crc != stored_crc) {
    char buf[96];
    std::snprintf(buf, sizeof(buf), "CRC mismatch (stored %08x, computed %08x): the file is corrupt",
                  stored_crc, crc);
    return Corruption(what + buf);
  }

  // The CRC held, so what follows only fails for a file written wrong (not damaged).
  KvTrace t;
  uint32_t shape[4];
  int64_t n = 0;
  uint32_t n_needles = 0;
  for (uint32_t& d : shape) c.Get(&d);
  c.Get(&n);
  c.Get(&t.context);
  c.Get(&t.question_begin);
  c.Get(&n_needles);
  for (uint32_t d : shape)
    if (d == 0 || d > 4096) return Corruption(what + "geometry mismatch: implausible shape in the header");
  t.layers = static_cast<int>(shape[0]);
  t.q_heads = static_cast<int>(shape[1]);
  t.kv_heads = static_cast<int>(shape[2]);
  t.head_dim = static_cast<int>(shape[3]);
  if (n < 0 || static_cast<uint64_t>(n) > c.left / sizeof(int32_t))
    return Corruption(what + "n_tokens " + std::to_string(n) + " does not fit the file");
  if (n_needles > c.left / 16)
    return Corruption(what + "needle count " + std::to_string(n_needles) + " does not fit the file");
  t.needles.resize(n_needles);
  for (TokenRange& r : t.needles) {
    c.Get(&r.begin);
    c.Get(&r.end);
  }
  t.tokens.resize(static_cast<size_t>(n));
  if (!c.GetBytes(t.tokens.data(), t.tokens.size() * sizeof(int32_t)) || !c.GetString(&t.source) ||
      !c.GetString(&t.answer))
    return Corruption(what + "header runs past the end of the file");
  // 128-bit product: a crafted header must not overflow into a plausible size.
  const unsigned __int128 want = static_cast<unsigned __int128>(t.layers) * static_cast<uint64_t>(n) *
                                 static_cast<uint64_t>(t.q_heads + 2 * t.kv_heads) *
                                 static_cast<uint64_t>(t.head_dim) * sizeof(float);
  if (want != c.left)
    return Corruption(what + "geometry mismatch: " + t.geometry().ToString() + " x " + std::to_string(n) +
                      " tokens needs " + std::to_string(static_cast<uint64_t>(want)) +
                      " bytes of q/k/v, the file holds " + std::to_string(c.left));
  t.q.resize(t.layers);
  t.k.resize(t.layers);
  t.v.resize(t.layers);
  for (int l = 0; l < t.layers; ++l) {
    t.q[l].resize(Elems(n, t.q_heads, t.head_dim));
    t.k[l].resize(Elems(n, t.kv_heads, t.head_dim));
    t.v[l].resize(t.k[l].size());
    for (std::vector<float>* a : {&t.q[l], &t.k[l], &t.v[l]})
      c.GetBytes(a->data(), a->size() * sizeof(float));
  }
  Status st = t.Validate();
  if (!st.ok()) return Corruption(what + st.message());
  return t;
}

Status WriteKvTrace(const std::string& path, const KvTrace& trace) {
  KVTIER_ASSIGN_OR_RETURN(std::string bytes, EncodeKvTrace(trace));
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) return IOError("trace: cannot create '" + tmp + "'");
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!f) return IOError("trace: write of '" + tmp + "' failed");
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    return IOError("trace: cannot rename '" + tmp + "' to '" + path + "'");
  }
  return Status::Ok();
}

Result<KvTrace> ReadKvTrace(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return NotFound("cannot open trace file '" + path + "'");
  std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (f.bad()) return IOError("read of trace file '" + path + "' failed");
  return DecodeKvTrace(bytes, path);
}

}  // namespace kvtier
