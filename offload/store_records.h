// The records TieredStore keeps in the cold tier next to the chunk payloads,
// and their byte format. TieredStore writes them; recovery
// (offload/store_recovery.h) reads them back. The cold tier frames each one
// (header, CRC) and treats the body as opaque bytes; this file owns the body.
//
// Every record starts with a magic and a version, so a foreign or stale value
// is rejected with Corruption instead of being misread. Integers and floats
// are little-endian fixed width (store/coding.h), on any host.
//
//   store record   (blob "store" of sequence 0, layer 0): pins the layout, so
//                  that reopening with another geometry is refused
//     u32 magic "KVTS" (0x5354564b)  u32 version (1 or 2)
//     i32 layers, q_heads, kv_heads, head_dim   u8 dtype
//     i32 n_sink, n_local, chunk_size, repr_topk
//     version 2 only: u8 repr_heads (1 = query: representatives per query head). A store whose
//     representatives are per kv head writes version 1, byte for byte as before; one per query
//     head writes version 2, which a build that reads only version 1 refuses by its version.
//   sequence record (ColdTier::PutSequence)
//     u32 magic "KVSQ" (0x5153564b)  u32 version (1)  u8 state (0 open, 1 closed)
//     u32 layers, then i64 n_tokens per layer
//   chunk meta     (ColdTier::PutChunk's meta, written with the payload in one batch)
//     u32 magic "KVCM" (0x4d43564b)  u32 version (1)  i64 first_token
//     u32 repr_bytes, then the representative keys [repr_topk, repr heads, head_dim]
//     (kv_heads, or q_heads under store record version 2's repr_heads = query)
//     in the storage dtype, bit for bit   f32 score
//   blobs "sinks" / "local" per (sequence, layer), written by CloseSequence:
//     K then V of the sinks / of the local window's tokens, raw storage dtype
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "kvtier/options.h"
#include "store/chunk.h"
#include "store/geometry.h"
#include "store/status.h"

namespace kvtier {
namespace store_records {

inline constexpr uint32_t kStoreMagic = 0x5354564b;  // "KVTS"
inline constexpr uint32_t kSeqMagic = 0x5153564b;    // "KVSQ"
inline constexpr uint32_t kMetaMagic = 0x4d43564b;   // "KVCM"
inline constexpr uint32_t kRecordVersion = 1;
/// The store record of a store whose representatives are per query head (repr_heads byte).
inline constexpr uint32_t kStoreRecordQueryHeadsVersion = 2;
inline constexpr SequenceId kStoreRecordSeq = 0;  // sequence ids start at 1
inline constexpr const char* kStoreBlob = "store";
inline constexpr const char* kSinksBlob = "sinks";
inline constexpr const char* kLocalBlob = "local";

/// What the store record pins: everything that decides how bytes are laid out.
struct StoreLayout {
  Geometry geometry;
  int32_t n_sink = 0, n_local = 0, chunk_size = 0, repr_topk = 0;
  ReprHeads repr_heads = ReprHeads::kKv;  ///< whose heads the representatives are per
  /// "geometry 2,4,2,16:f16, n_sink 8, n_local 32, chunk_size 8, repr_topk 2, repr_heads kv"
  std::string ToString() const;
};
std::string EncodeStoreRecord(const StoreLayout& layout);
/// Corruption naming `where` when the bytes are not a store record.
Result<StoreLayout> DecodeStoreRecord(std::string_view bytes, const std::string& where);

/// State of a sequence as its record says. kRecovered never reaches disk: it is
/// what an open sequence becomes when the store is reopened (readable, not appendable).
enum class SeqState : uint8_t { kOpen = 0, kClosed = 1, kRecovered = 2 };
struct SequenceRecord {
  SeqState state = SeqState::kOpen;
  std::vector<int64_t> n_tokens;  ///< per layer
};
std::string EncodeSequenceRecord(SeqState state, const std::vector<int64_t>& n_tokens);
/// Corruption naming the sequence when malformed or when it does not hold `layers` layers.
Result<SequenceRecord> DecodeSequenceRecord(std::string_view bytes, SequenceId seq, int layers);

/// The fields of a chunk meta record. The encoder takes them by value so the
/// caller can snapshot mutable ones (the score) under its lock.
struct ChunkMeta {
  int64_t first_token = 0;
  std::vector<uint8_t> repr;
  float score = 0.0f;
};
std::string EncodeChunkMeta(int64_t first_token, const uint8_t* repr, size_t repr_bytes, float score);
/// Corruption naming the chunk when malformed or when its representatives are not
/// `repr_bytes` long (another layout).
Result<ChunkMeta> DecodeChunkMeta(std::string_view bytes, const ChunkKey& key, size_t repr_bytes);

}  // namespace store_records
}  // namespace kvtier
