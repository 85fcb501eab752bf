// The cold tier: chunks, their meta records, sequence records and named blobs
// in an embedded RocksDB database on local disk.
//
// ---- Key layout ---------------------------------------------------------------
// Four column families; every integer in a key is big-endian fixed width, so
// RocksDB's bytewise order is (seq, layer, index) order and everything of one
// sequence is one contiguous key range (an 8-byte prefix) in each family.
//
//   column family   key                                          value
//   "default"       "F"                                          format marker "kvtier.cold_tier.v1" (raw)
//   "default"       'S' seq:u64be                      (9 B)     header + caller's sequence record
//   "chunk_meta"    seq:u64be layer:u32be index:u64be  (20 B)    header (aux = payload bytes) + caller's meta
//   "chunk_payload" seq:u64be layer:u32be index:u64be  (20 B)    header + payload bytes
//   "blob"          seq:u64be layer:u32be name bytes   (12+ B)   header + blob bytes
//
// Metas and payloads live in separate families, so recovery (ForEachChunkMeta,
// and the byte count rebuilt on Open) reads only the small meta SST blocks and
// never touches a payload block. The chosen block compression applies to every
// family (it only matters for payloads and blobs; metas are tiny).
//
// ---- Value header (28 bytes, little-endian fields) --------------------------------
//   [0,4)   magic   0x5443564B ("KVCT" in file order)
//   [4]     format version (1)
//   [5]     kind: 1 sequence record, 2 chunk meta, 3 chunk payload, 4 blob
//   [6,8)   reserved, 0
//   [8,16)  body length in bytes
//   [16,24) aux: for a chunk meta, the payload's length in bytes; else 0
//   [24,28) CRC-32C of header bytes [0,24) followed by the body
//   [28,..) body
// Every read checks all of it; a value that is short, has a bad magic, version,
// kind or length, or a CRC mismatch yields Corruption naming the key, e.g.
// "cold tier: chunk seq=3/layer=1/chunk=17 payload checksum mismatch (...)".
// RocksDB's own block checksums (XXH3) and paranoid checks are on as well.
//
// ---- Durability --------------------------------------------------------------------
// Every write goes through the WAL as one WriteBatch. When PutChunk returns OK
// the chunk survives SIGKILL of the process (the WAL record is in the OS page
// cache); with sync_writes it also survives power loss (the WAL is fsynced).
//
// ---- Caching -------------------------------------------------------------------------
// Payload and blob reads do not fill the block cache: the warm tier above is the
// cache for payloads, so the block cache keeps meta blocks, index and filter
// blocks hot instead of being flushed by streaming payload reads.
//
// All methods are thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "store/chunk.h"
#include "store/status.h"

namespace kvtier {

/// Block compression of the cold tier's column families.
enum class Compression : uint8_t { kNone, kLZ4, kZSTD };

/// "none", "lz4", "zstd".
const char* CompressionName(Compression c);
/// Parses "none|lz4|zstd" (case-insensitive); false when unknown.
bool ParseCompression(const std::string& name, Compression* out);

struct ColdTierOptions {
  std::string path;                             ///< database directory (created if missing)
  Compression compression = Compression::kLZ4;  ///< block compression of the chunk column
  bool sync_writes = false;                     ///< fsync the WAL on each write: survives power loss, not just process death
  size_t block_cache_bytes = 32 << 20;          ///< RocksDB block cache (default 32 MiB; 0 = no block cache)
  size_t write_buffer_bytes = 32 << 20;         ///< memtable size (default 32 MiB; 64 KiB .. 4 GiB)
  /// Fault injection for tests (RocksDB's FaultInjectionEnv in miniature): when
  /// set, PutChunk and GetChunk call it first ("put" / "get") and fail with its
  /// status, touching nothing, when it is not OK. Unset (the default) in production.
  std::function<Status(std::string_view op, const ChunkKey& key)> fault_injector;
  Status Validate() const;                      ///< names the bad field
};

class ColdTier {
 public:
  /// Opens (creating if missing) the database at options.path.
  /// A path that is an existing regular file -> InvalidArgument
  /// "cold tier: data dir '...' is a file, not a directory"; a compression this
  /// RocksDB was built without -> Unavailable; RocksDB errors -> IOError or
  /// Corruption with RocksDB's message appended.
  static Result<std::unique_ptr<ColdTier>> Open(const ColdTierOptions& options);

  ~ColdTier();
  ColdTier(const ColdTier&) = delete;
  ColdTier& operator=(const ColdTier&) = delete;

  /// Writes the chunk's meta record (opaque bytes from the caller) and its
  /// payload atomically (one WriteBatch, WAL on), replacing any earlier
  /// version. When it returns OK the chunk is acknowledged: it survives SIGKILL
  /// of the process. payload_bytes must be > 0.
  Status PutChunk(const ChunkKey& key, std::string_view meta, const void* payload, size_t payload_bytes);

  /// Reads the payload into dst (exactly payload_bytes, which must match the
  /// stored length, else InvalidArgument) and verifies its checksum: mismatch
  /// -> Corruption naming the chunk key; missing -> NotFound naming it.
  /// On error the contents of dst are unspecified.
  Status GetChunk(const ChunkKey& key, void* dst, size_t payload_bytes);

  /// Removes the chunk's meta and payload atomically. Deleting a chunk that is
  /// not stored is not an error.
  Status DeleteChunk(const ChunkKey& key);

  /// Stores the opaque sequence record (caller's format), replacing any earlier one.
  Status PutSequence(SequenceId seq, std::string_view record);

  /// Removes the sequence record and all chunks (metas and payloads) and blobs
  /// of the sequence in one atomic batch (range deletes). Removing a sequence
  /// that is not stored is not an error.
  Status DeleteSequence(SequenceId seq);

  /// Calls fn for every stored sequence record, in sequence-id order. A non-OK
  /// status from fn stops the iteration and is returned.
  Status ForEachSequence(const std::function<Status(SequenceId, std::string_view record)>& fn);

  /// Calls fn for every chunk meta record of `seq`, in (layer, index) order.
  /// Reads meta records only, never payloads: recovery must be cheap. A record
  /// that fails verification -> Corruption naming its key; a non-OK status from
  /// fn stops the iteration and is returned.
  Status ForEachChunkMeta(SequenceId seq,
                          const std::function<Status(const ChunkKey& key, std::string_view meta)>& fn);

  /// Named per-(sequence, layer) blobs, e.g. the sinks or the local window at
  /// close; checksummed like payloads. name must be 1..1024 bytes.
  Status PutBlob(SequenceId seq, uint32_t layer, std::string_view name, const void* data, size_t bytes);
  /// Missing -> NotFound naming (seq, layer, name); verification failure -> Corruption.
  Result<std::string> GetBlob(SequenceId seq, uint32_t layer, std::string_view name);

  /// Approximate bytes of chunk payloads currently stored (uncompressed),
  /// maintained by Put/Delete and rebuilt on Open from the meta records.
  uint64_t stored_payload_bytes() const;
  /// Number of chunks currently stored (same bookkeeping).
  uint64_t stored_chunks() const;
  /// The database directory.
  std::string path() const;

 private:
  struct Impl;
  explicit ColdTier(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

/// The on-disk layout described at the top of this file, for tools and tests
/// that open the directory with RocksDB directly.
namespace cold_tier_format {
inline constexpr const char* kSequenceColumn = "default";
inline constexpr const char* kMetaColumn = "chunk_meta";
inline constexpr const char* kPayloadColumn = "chunk_payload";
inline constexpr const char* kBlobColumn = "blob";
inline constexpr size_t kValueHeaderBytes = 28;
inline constexpr uint32_t kMagic = 0x5443564Bu;
inline constexpr uint8_t kFormatVersion = 1;
/// 'S' seq:u64be.
std::string SequenceKey(SequenceId seq);
/// seq:u64be layer:u32be index:u64be (the key in both chunk families).
std::string ChunkKeyBytes(const ChunkKey& key);
/// seq:u64be layer:u32be name.
std::string BlobKey(SequenceId seq, uint32_t layer, std::string_view name);
}  // namespace cold_tier_format

}  // namespace kvtier
