#include "integration/kv_trace.h"

#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>

#include "store/checksum.h"
#include "store/coding.h"
#include "store/file_bytes.h"

namespace kvtier {
namespace {

constexpr char kMagic[8] = {'K', 'V', 'T', 'T', 'R', 'A', 'C', 'E'};
// magic, version, reserved, file_bytes, 4 x u32 shape, 3 x i64, n_needles.
constexpr size_t kFixedHeader = 8 + 4 + 4 + 8 + 16 + 24 + 4;
constexpr size_t kFileBytesAt = 16;

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

// Every field goes through store/coding.h: little-endian as the format says, on any host.
Result<std::string> EncodeKvTrace(const KvTrace& t) {
  KVTIER_RETURN_IF_ERROR(t.Validate());
  for (const std::string* s : {&t.source, &t.answer})
    if (s->size() > UINT32_MAX) return InvalidArgument("trace: source/answer text exceeds 4 GiB");
  std::string out;
  out.reserve(kFixedHeader + t.needles.size() * 16 + t.tokens.size() * 4 + t.source.size() + t.answer.size() +
              12 + t.qkv_bytes());
  out.append(kMagic, sizeof(kMagic));
  PutFixed32(&out, KvTrace::kVersion);
  PutFixed32(&out, 0);
  PutFixed64(&out, 0);  // file_bytes, patched below
  for (int d : {t.layers, t.q_heads, t.kv_heads, t.head_dim}) PutFixed32(&out, static_cast<uint32_t>(d));
  PutInt64(&out, t.n_tokens());
  PutInt64(&out, t.context);
  PutInt64(&out, t.question_begin);
  PutFixed32(&out, static_cast<uint32_t>(t.needles.size()));
  for (const TokenRange& r : t.needles) {
    PutInt64(&out, r.begin);
    PutInt64(&out, r.end);
  }
  PutInt32Array(&out, t.tokens.data(), t.tokens.size());
  PutLengthPrefixed(&out, t.source);
  PutLengthPrefixed(&out, t.answer);
  for (int l = 0; l < t.layers; ++l)
    for (const std::vector<float>* a : {&t.q[l], &t.k[l], &t.v[l]})
      PutFloat32Array(&out, a->data(), a->size());
  EncodeFixed64(out.data() + kFileBytesAt, out.size() + sizeof(uint32_t));
  PutFixed32(&out, Crc32c(out.data(), out.size()));
  return out;
}

Result<KvTrace> DecodeKvTrace(const std::string& bytes, const std::string& name) {
  // Everything allocated here is sized from the file: failing to is ResourceExhausted.
  return ReturnOnBadAlloc(
      [&] { return "trace '" + name + "': its q/k/v (" + std::to_string(bytes.size()) + "-byte file)"; },
      [&]() -> Result<KvTrace> {
        const std::string what = "trace '" + name + "': ";
        const size_t size = bytes.size();
        if (size >= sizeof(kMagic) && std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0)
          return Corruption(what + "bad magic (not a kvtier trace file)");
        if (size < kFixedHeader + sizeof(uint32_t))
          return Corruption(what + "truncated: " + std::to_string(size) + " bytes, shorter than the " +
                            std::to_string(kFixedHeader + sizeof(uint32_t)) + "-byte header");
        // Everything between the magic and the CRC; the reader names a field that runs past its end.
        RecordReader r(
            std::string_view(bytes).substr(sizeof(kMagic), size - sizeof(kMagic) - sizeof(uint32_t)),
            what + "header runs past the end of the file");
        uint32_t version = 0, reserved = 0;
        uint64_t file_bytes = 0;
        KVTIER_RETURN_IF_ERROR(r.ReadFixed32(&version, "version"));
        KVTIER_RETURN_IF_ERROR(r.ReadFixed32(&reserved, "reserved"));
        KVTIER_RETURN_IF_ERROR(r.ReadFixed64(&file_bytes, "file_bytes"));
        if (version != KvTrace::kVersion)
          return Corruption(what + "unsupported version " + std::to_string(version) +
                            " (this build reads version " + std::to_string(KvTrace::kVersion) + ")");
        if (size < file_bytes)
          return Corruption(what + "truncated: " + std::to_string(size) + " bytes, the header says " +
                            std::to_string(file_bytes));
        if (size > file_bytes)
          return Corruption(what + "trailing bytes: " + std::to_string(size) + " bytes, the header says " +
                            std::to_string(file_bytes));
        const uint32_t stored_crc = DecodeFixed32(bytes.data() + size - sizeof(uint32_t));
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
        for (uint32_t& d : shape) KVTIER_RETURN_IF_ERROR(r.ReadFixed32(&d, "shape"));
        KVTIER_RETURN_IF_ERROR(r.ReadInt64(&n, "n_tokens"));
        KVTIER_RETURN_IF_ERROR(r.ReadInt64(&t.context, "context"));
        KVTIER_RETURN_IF_ERROR(r.ReadInt64(&t.question_begin, "question_begin"));
        KVTIER_RETURN_IF_ERROR(r.ReadFixed32(&n_needles, "n_needles"));
        for (uint32_t d : shape)
          if (d == 0 || d > 4096)
            return Corruption(what + "geometry mismatch: implausible shape in the header");
        t.layers = static_cast<int>(shape[0]);
        t.q_heads = static_cast<int>(shape[1]);
        t.kv_heads = static_cast<int>(shape[2]);
        t.head_dim = static_cast<int>(shape[3]);
        // Sizes are checked against the bytes left before anything is allocated for them.
        if (n < 0 || static_cast<uint64_t>(n) > r.remaining() / sizeof(int32_t))
          return Corruption(what + "n_tokens " + std::to_string(n) + " does not fit the file");
        if (n_needles > r.remaining() / 16)
          return Corruption(what + "needle count " + std::to_string(n_needles) + " does not fit the file");
        t.needles.resize(n_needles);
        for (TokenRange& rg : t.needles) {
          KVTIER_RETURN_IF_ERROR(r.ReadInt64(&rg.begin, "needle begin"));
          KVTIER_RETURN_IF_ERROR(r.ReadInt64(&rg.end, "needle end"));
        }
        t.tokens.resize(static_cast<size_t>(n));
        KVTIER_RETURN_IF_ERROR(r.ReadInt32Array(t.tokens.data(), t.tokens.size(), "tokens"));
        KVTIER_RETURN_IF_ERROR(r.ReadLengthPrefixed(&t.source, "source"));
        KVTIER_RETURN_IF_ERROR(r.ReadLengthPrefixed(&t.answer, "answer"));
        // 128-bit product: a crafted header must not overflow into a plausible size.
        const unsigned __int128 want = static_cast<unsigned __int128>(t.layers) * static_cast<uint64_t>(n) *
                                       static_cast<uint64_t>(t.q_heads + 2 * t.kv_heads) *
                                       static_cast<uint64_t>(t.head_dim) * sizeof(float);
        if (want != r.remaining())
          return Corruption(what + "geometry mismatch: " + t.geometry().ToString() + " x " +
                            std::to_string(n) + " tokens needs " +
                            std::to_string(static_cast<uint64_t>(want)) + " bytes of q/k/v, the file holds " +
                            std::to_string(r.remaining()));
        t.q.resize(t.layers);
        t.k.resize(t.layers);
        t.v.resize(t.layers);
        for (int l = 0; l < t.layers; ++l) {
          t.q[l].resize(Elems(n, t.q_heads, t.head_dim));
          t.k[l].resize(Elems(n, t.kv_heads, t.head_dim));
          t.v[l].resize(t.k[l].size());
          for (std::vector<float>* a : {&t.q[l], &t.k[l], &t.v[l]})
            KVTIER_RETURN_IF_ERROR(r.ReadFloat32Array(a->data(), a->size(), "q/k/v"));
        }
        Status st = t.Validate();
        if (!st.ok()) return Corruption(what + st.message());
        return t;
      });
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
  KVTIER_ASSIGN_OR_RETURN(std::string bytes, ReadFileBytes(path, "trace file"));
  return ReturnOnBadAlloc([&] { return "trace file '" + path + "': decoding it"; },
                          [&]() -> Result<KvTrace> { return DecodeKvTrace(bytes, path); });
}

}  // namespace kvtier
