#include "offload/store_records.h"

#include "store/coding.h"

namespace kvtier {
namespace store_records {

std::string StoreLayout::ToString() const {
  return "geometry " + geometry.ToString() + ", n_sink " + std::to_string(n_sink) + ", n_local " +
         std::to_string(n_local) + ", chunk_size " + std::to_string(chunk_size) + ", repr_topk " +
         std::to_string(repr_topk) + ", repr_heads " + (repr_heads == ReprHeads::kQuery ? "query" : "kv");
}

std::string EncodeStoreRecord(const StoreLayout& o) {
  std::string out;
  const bool query = o.repr_heads == ReprHeads::kQuery;
  PutFixed32(&out, kStoreMagic);
  PutFixed32(&out, query ? kStoreRecordQueryHeadsVersion : kRecordVersion);
  const Geometry& g = o.geometry;
  PutInt32(&out, g.layers);
  PutInt32(&out, g.q_heads);
  PutInt32(&out, g.kv_heads);
  PutInt32(&out, g.head_dim);
  PutFixed8(&out, static_cast<uint8_t>(g.dtype));
  PutInt32(&out, o.n_sink);
  PutInt32(&out, o.n_local);
  PutInt32(&out, o.chunk_size);
  PutInt32(&out, o.repr_topk);
  if (query) PutFixed8(&out, 1);
  return out;
}

Result<StoreLayout> DecodeStoreRecord(std::string_view bytes, const std::string& where) {
  RecordReader r(bytes, where + ": store record is malformed");
  uint32_t magic = 0, version = 0;
  KVTIER_RETURN_IF_ERROR(r.ReadFixed32(&magic, "magic"));
  if (magic != kStoreMagic) return Corruption(r.what() + ": bad magic");
  KVTIER_RETURN_IF_ERROR(r.ReadFixed32(&version, "version"));
  if (version != kRecordVersion && version != kStoreRecordQueryHeadsVersion)
    return Corruption(r.what() + ": version " + std::to_string(version) + ", this build reads " +
                      std::to_string(kRecordVersion) + " and " +
                      std::to_string(kStoreRecordQueryHeadsVersion));
  StoreLayout l;
  int32_t shape[4];
  for (int32_t& d : shape) KVTIER_RETURN_IF_ERROR(r.ReadInt32(&d, "geometry"));
  uint8_t dt = 0;
  KVTIER_RETURN_IF_ERROR(r.ReadFixed8(&dt, "dtype"));
  if (dt > static_cast<uint8_t>(DType::kBF16))
    return Corruption(r.what() + ": dtype " + std::to_string(dt) + " is not a storage dtype");
  l.geometry = Geometry{shape[0], shape[1], shape[2], shape[3], static_cast<DType>(dt)};
  KVTIER_RETURN_IF_ERROR(r.ReadInt32(&l.n_sink, "n_sink"));
  KVTIER_RETURN_IF_ERROR(r.ReadInt32(&l.n_local, "n_local"));
  KVTIER_RETURN_IF_ERROR(r.ReadInt32(&l.chunk_size, "chunk_size"));
  KVTIER_RETURN_IF_ERROR(r.ReadInt32(&l.repr_topk, "repr_topk"));
  if (version == kStoreRecordQueryHeadsVersion) {
    uint8_t heads = 0;
    KVTIER_RETURN_IF_ERROR(r.ReadFixed8(&heads, "repr_heads"));
    if (heads != 1)
      return Corruption(r.what() + ": repr_heads " + std::to_string(heads) +
                        " in a version 2 record (it marks representatives per query head: 1)");
    l.repr_heads = ReprHeads::kQuery;
  }
  KVTIER_RETURN_IF_ERROR(r.ExpectEnd());
  return l;
}

std::string EncodeSequenceRecord(SeqState state, const std::vector<int64_t>& n_tokens) {
  std::string out;
  PutFixed32(&out, kSeqMagic);
  PutFixed32(&out, kRecordVersion);
  PutFixed8(&out, static_cast<uint8_t>(state));
  PutFixed32(&out, static_cast<uint32_t>(n_tokens.size()));
  for (int64_t n : n_tokens) PutInt64(&out, n);
  return out;
}

Result<SequenceRecord> DecodeSequenceRecord(std::string_view bytes, SequenceId seq, int layers) {
  RecordReader r(bytes, "cold tier: sequence " + std::to_string(seq) + " record is malformed");
  uint32_t magic = 0, version = 0, n_layers = 0;
  uint8_t state = 0;
  KVTIER_RETURN_IF_ERROR(r.ReadFixed32(&magic, "magic"));
  if (magic != kSeqMagic) return Corruption(r.what() + ": bad magic");
  KVTIER_RETURN_IF_ERROR(r.ReadFixed32(&version, "version"));
  if (version != kRecordVersion)
    return Corruption(r.what() + ": version " + std::to_string(version) + ", this build reads " +
                      std::to_string(kRecordVersion));
  KVTIER_RETURN_IF_ERROR(r.ReadFixed8(&state, "state"));
  if (state != static_cast<uint8_t>(SeqState::kOpen) && state != static_cast<uint8_t>(SeqState::kClosed))
    return Corruption(r.what() + ": state " + std::to_string(state) + " is neither open (0) nor closed (1)");
  KVTIER_RETURN_IF_ERROR(r.ReadFixed32(&n_layers, "layers"));
  if (n_layers != static_cast<uint32_t>(layers))
    return Corruption(r.what() + ": it holds " + std::to_string(n_layers) + " layers, the geometry has " +
                      std::to_string(layers));
  SequenceRecord rec;
  // An "open" sequence on disk is one that was open when the store stopped.
  rec.state = state == static_cast<uint8_t>(SeqState::kClosed) ? SeqState::kClosed : SeqState::kRecovered;
  rec.n_tokens.resize(layers);
  for (int64_t& n : rec.n_tokens) {
    KVTIER_RETURN_IF_ERROR(r.ReadInt64(&n, "n_tokens"));
    // Recovery sizes the sinks, window and chunk list from it (found by fuzz_cold_value).
    if (n < 0) return Corruption(r.what() + ": n_tokens " + std::to_string(n) + " is negative");
  }
  KVTIER_RETURN_IF_ERROR(r.ExpectEnd());
  return rec;
}

std::string EncodeChunkMeta(int64_t first_token, const uint8_t* repr, size_t repr_bytes, float score) {
  std::string out;
  out.reserve(4 + 4 + 8 + 4 + repr_bytes + 4);
  PutFixed32(&out, kMetaMagic);
  PutFixed32(&out, kRecordVersion);
  PutInt64(&out, first_token);
  PutFixed32(&out, static_cast<uint32_t>(repr_bytes));
  PutBytes(&out, repr, repr_bytes);
  PutFloat32(&out, score);
  return out;
}

Result<ChunkMeta> DecodeChunkMeta(std::string_view bytes, const ChunkKey& key, size_t repr_bytes) {
  RecordReader r(bytes, "cold tier: chunk " + key.ToString() + " meta record is malformed");
  uint32_t magic = 0, version = 0, rb = 0;
  ChunkMeta m;
  KVTIER_RETURN_IF_ERROR(r.ReadFixed32(&magic, "magic"));
  if (magic != kMetaMagic) return Corruption(r.what() + ": bad magic");
  KVTIER_RETURN_IF_ERROR(r.ReadFixed32(&version, "version"));
  if (version != kRecordVersion)
    return Corruption(r.what() + ": version " + std::to_string(version) + ", this build reads " +
                      std::to_string(kRecordVersion));
  KVTIER_RETURN_IF_ERROR(r.ReadInt64(&m.first_token, "first_token"));
  KVTIER_RETURN_IF_ERROR(r.ReadFixed32(&rb, "repr_bytes"));
  if (rb != repr_bytes)
    return Corruption(r.what() + ": " + std::to_string(rb) + " bytes of representatives, the layout needs " +
                      std::to_string(repr_bytes));
  m.repr.resize(rb);
  KVTIER_RETURN_IF_ERROR(r.ReadBytes(m.repr.data(), rb, "representatives"));
  KVTIER_RETURN_IF_ERROR(r.ReadFloat32(&m.score, "score"));
  KVTIER_RETURN_IF_ERROR(r.ExpectEnd());
  return m;
}

}  // namespace store_records
}  // namespace kvtier
