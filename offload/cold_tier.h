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
//   "default"       "A"                                          manifest marker (raw; see "What was
//   acknowledged") "default"       'S' seq:u64be                      (9 B)     header + caller's sequence
//   record "chunk_meta"    seq:u64be layer:u32be index:u64be  (20 B)    header (aux = payload bytes) +
//   caller's meta "chunk_payload" seq:u64be layer:u32be index:u64be  (20 B)    header + payload bytes "blob"
//   seq:u64be layer:u32be name bytes   (12+ B)   header + blob bytes
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
// ---- What was acknowledged, and the check at open ------------------------------------
// The chunks PutChunk acknowledged and the sequence records PutSequence wrote are
// listed in an append-only manifest next to the database, outside RocksDB
// (offload/ack_manifest.h, file "kvtier-acked"). Open compares it with what the
// database holds after RocksDB replayed its WAL, and an acknowledged chunk or
// sequence record that did not come back is Corruption naming each (sequence,
// layer, index) range, e.g. "cold tier: 1833 acknowledged chunks are missing
// (seq=1/layer=0/chunk=40..999, seq=1/layer=1/chunk=38..999, ...) in '/data': RocksDB
// recovered only part of what was acknowledged ...". Until the loss is accepted
// (ColdTierOptions::accept_lost_chunks) every open fails the same way: a later run
// does not quietly build on a store with holes.
//
// The check runs before anything is written. A read-write open of a damaged store would let
// RocksDB flush what it replayed, delete the write-ahead logs, and delete every table its
// (possibly truncated) MANIFEST does not list: exactly the files RocksDB's repair recovers
// the lost chunks from. So an open of a directory that holds a store first opens it
// read-only (the WAL replayed in memory, nothing created, written or deleted, not even a
// LOG line) and runs the check there; a refused open leaves every file as it was. Only
// accept_lost_chunks skips that step: the loss is accepted, and lost_chunks() lists it.
//
// ---- Drops ---------------------------------------------------------------------------------
// A DeleteChunk or DeleteSequence that returned OK stays deleted through any recovery. The
// manifest records each before its database write and keeps it (a tombstone) until a flush
// has put every delete into a table. At open, a chunk, sequence record or blob that a
// tombstone covers and that was not acknowledged again since is deleted again (its delete
// was lost with the WAL), listed in redropped_chunks() / redropped_sequences(), and never
// adopted as acknowledged, with or without accept_lost_chunks. Then the open flushes and
// the manifest forgets its tombstones; at run time a drop does the same once they pass
// 4096.
//
// ---- A directory that holds a store -------------------------------------------------------
// Open creates a database only in a directory that holds none of CURRENT, MANIFEST-*, a
// WAL (<number>.log), a table (<number>.sst, <number>.blob) or the ack manifest; other
// files (an app.log, say) do not make a directory a store. A store's directory is opened
// as that store or not at all: without CURRENT, RocksDB would start a new, empty database
// there and later delete the old one's files as obsolete. A missing CURRENT is written back
// (atomically) pointing at the MANIFEST-* when there is exactly one (recovered_current()
// names it; when the open still fails, that CURRENT is removed again); with none or several
// the open fails with Corruption naming the missing CURRENT and touches nothing. No open
// deletes a file of the store it refuses.
//
// WAL recovery mode: kPointInTimeRecovery. RocksDB replays the WAL up to the first
// damaged record and keeps that consistent prefix (or refuses to open when a flushed
// table already holds data from past the damage); the manifest then names what the
// prefix lacks. The alternatives do worse here:
//  * kAbsoluteConsistency refuses any incomplete record, including the torn last
//    record of a write the process was SIGKILLed in, which was never acknowledged:
//    every crash at the wrong moment would make the store unopenable;
//  * kTolerateCorruptedTailRecords drops a truncated tail silently (only the manifest
//    could tell) and fails on damage in the middle with RocksDB's message, before
//    anything can say which chunks are gone;
//  * kSkipAnyCorruptedRecords replays records after the damage too, so a later write
//    can come back without an earlier one (a "closed" sequence record without the
//    sinks written before it): the prefix property recovery relies on is lost.
// A damaged record is found by RocksDB's per-record CRC; a zeroed block or a
// truncation leaves no damaged record at all, which is why the manifest is needed.
//
// ---- A full disk, or any write error ---------------------------------------------------
// The first write that fails (a chunk, sequence record, blob or delete that RocksDB or the
// ack manifest could not write, a flush, or a RocksDB background error such as a failed
// flush or compaction) latches: from then on this ColdTier issues no write to the database
// or the manifest, and every write returns IOError "cold tier: '<dir>' takes no more writes
// after its first write error (<that error>); ...". Nothing it failed to write counts as
// acknowledged, so the tiered store keeps those chunks in the warm tier; reads of what was
// acknowledged before keep working. RocksDB is told not to resume by itself. A reopen
// writes again, and on a disk that is still full it fails with IOError instead of opening.
// RocksDB's info log ("LOG") is written by kvtier so that a log line the disk refused is
// dropped: RocksDB 7.8's own logger hits an assertion (SIGABRT) on the line after one that
// failed, which would abort writers and every reopen of a full directory.
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
#include <vector>

#include "kvtier/options.h"
#include "offload/ack_manifest.h"
#include "offload/value_framing.h"
#include "store/chunk.h"
#include "store/status.h"

namespace kvtier {

// Compression (the block compression of the column families) is in kvtier/options.h.
/// "none", "lz4", "zstd".
const char* CompressionName(Compression c);
/// Parses "none|lz4|zstd" (case-insensitive); false when unknown.
bool ParseCompression(const std::string& name, Compression* out);

struct ColdTierOptions {
  std::string path;                             ///< database directory (created if missing; see Open)
  Compression compression = Compression::kLZ4;  ///< block compression of the chunk column
  bool sync_writes = false;  ///< fsync the WAL on each write: survives power loss, not just process death
  size_t block_cache_bytes = 32 << 20;   ///< RocksDB block cache (default 32 MiB; 0 = no block cache)
  size_t write_buffer_bytes = 32 << 20;  ///< memtable size (default 32 MiB; 64 KiB .. 4 GiB)
  /// Fault injection for tests (RocksDB's FaultInjectionEnv in miniature): when
  /// set, PutChunk, GetChunk and GetChunkMetas call it first ("put" / "get" / "meta", the
  /// last per key) and fail with its status, touching nothing, when it is not OK. Unset
  /// (the default) in production.
  std::function<Status(std::string_view op, const ChunkKey& key)> fault_injector;
  /// When acknowledged chunks or sequence records are missing at open (see "What was
  /// acknowledged" above), or the manifest itself is missing or damaged: false (the
  /// default) fails Open with Corruption naming them; true opens anyway, accepts the
  /// loss for good (the manifest is rebuilt without them) and lists it in lost_chunks().
  bool accept_lost_chunks = false;
  /// Opens the database read-only (kvtier check): nothing in the
  /// directory is written, created or deleted (RocksDB replays its WAL in memory only; a
  /// CURRENT written back for the check is removed again); every write returns
  /// FailedPrecondition. The directory must hold a store (else NotFound), and no other
  /// process may have it open (else IOError naming the pid holding its LOCK).
  bool read_only = false;
  /// Read-only opens only: missing acknowledged chunks or sequence records, or a missing or
  /// damaged ack manifest, do not fail the open; they are listed in lost_chunks(),
  /// lost_sequence_records() and manifest_problem() instead (nothing is forgotten).
  bool list_missing = false;
  Status Validate() const;  ///< names the bad field
};

class ColdTier {
 public:
  /// Opens the database at options.path, creating it only where the directory holds no
  /// store (see "A directory that holds a store"), then checks every acknowledged chunk
  /// and sequence record came back (see "What was acknowledged") and that nothing dropped
  /// did (see "Drops").
  /// A path that is an existing regular file -> InvalidArgument
  /// "cold tier: data dir '...' is a file, not a directory"; a compression this
  /// RocksDB was built without -> Unavailable; RocksDB errors -> IOError or
  /// Corruption with RocksDB's message appended.
  static Result<std::unique_ptr<ColdTier>> Open(const ColdTierOptions& options);

  /// Runs RocksDB's repair (RepairDB) on the store in options.path, in place. It rebuilds the
  /// MANIFEST from the tables and write-ahead logs present, replays every log past a damaged
  /// record (where an open stops at the first), and moves what it cannot use into `lost/`:
  /// it changes the directory, so callers repair a copy unless the user consented
  /// (`kvtier repair`). RocksDB's repair keeps a log's records only for the column families
  /// some table names; a family with no table yet (a store whose data is all in its logs) is
  /// first given a table holding one tombstone of a key kvtier never writes, stamped with the
  /// family's name and the id a kvtier store gives it, so that its records are kept. The ack
  /// manifest is not touched: a read-only open afterwards names what is still missing.
  /// Not a directory holding a store -> NotFound; open in another process -> IOError naming
  /// the pid; RocksDB's errors -> IOError or Corruption with its message.
  static Status Repair(const ColdTierOptions& options);

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

  /// Reads the meta records of `keys` (the caller's bytes, as PutChunk stored them), one
  /// batch (RocksDB MultiGet), verified as every read: (*metas)[i] and (*statuses)[i] per key,
  /// NotFound or Corruption naming the chunk. Reads meta blocks only, never a payload, and lets
  /// them fill the block cache. With a fault injector set, it is asked first with "meta" per key.
  void GetChunkMetas(const std::vector<ChunkKey>& keys, std::vector<std::string>* metas,
                     std::vector<Status>* statuses);

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

  /// Every chunk acknowledged and not deleted since, as index ranges in (sequence,
  /// layer, index) order: what a reopen must bring back (from the manifest, not from
  /// the database).
  std::vector<ChunkRange> AcknowledgedChunks() const;
  /// The acknowledged chunks found missing at this open and accepted as lost
  /// (accept_lost_chunks), or only listed (read_only with list_missing); empty otherwise.
  const std::vector<ChunkRange>& lost_chunks() const;
  /// Sequences whose acknowledged record was missing or older at this open and was
  /// accepted as lost (accept_lost_chunks), or only listed (read_only with list_missing).
  const std::vector<SequenceId>& lost_sequence_records() const;
  /// Read-only with list_missing: why the ack manifest could not be used (missing or
  /// damaged); AcknowledgedChunks() is then what the database holds. Else empty.
  const std::string& manifest_problem() const;
  /// Opened with read_only.
  bool read_only() const;
  /// Chunks that DeleteChunk or DeleteSequence had removed, found present at this open (the
  /// delete was lost with the WAL) and deleted again (see "Drops" above); a read-only open
  /// only lists them (the next read-write open deletes them again).
  const std::vector<ChunkRange>& redropped_chunks() const;
  /// Sequences that DeleteSequence had removed whose record, chunks or blobs were found
  /// present at this open and were deleted again (read-only: would be).
  const std::vector<SequenceId>& redropped_sequences() const;
  /// When this open found CURRENT missing and pointed it at the only MANIFEST-* (see "A
  /// directory that holds a store" above): that MANIFEST's name; else empty. A read-only
  /// open removes that CURRENT again once the database is open.
  const std::string& recovered_current() const;

  /// Approximate bytes of chunk payloads currently stored (uncompressed),
  /// maintained by Put/Delete and rebuilt on Open from the meta records.
  uint64_t stored_payload_bytes() const;
  /// Number of chunks currently stored (same bookkeeping).
  uint64_t stored_chunks() const;
  /// Host memory RocksDB holds now, by its own accounting: the memtables of every column
  /// family (active, immutable and pinned), the table readers' index and filter blocks, and
  /// the block cache's usage. What grows with the data is the table readers' share.
  uint64_t memory_bytes() const;
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
/// Key in "default" written (synced) when the manifest is created: with it present, a
/// missing manifest file is Corruption rather than a store from before manifests.
inline constexpr const char* kManifestMarkerKey = "A";
// The value framing (offload/value_framing.h), which the remote tier shares.
using value_framing::kFormatVersion;
using value_framing::kMagic;
using value_framing::kValueHeaderBytes;
/// 'S' seq:u64be.
std::string SequenceKey(SequenceId seq);
/// seq:u64be layer:u32be index:u64be (the key in both chunk families).
std::string ChunkKeyBytes(const ChunkKey& key);
/// seq:u64be layer:u32be name.
std::string BlobKey(SequenceId seq, uint32_t layer, std::string_view name);
using value_framing::DecodeValue;
using value_framing::EncodeValue;
using value_framing::ValueKind;
}  // namespace cold_tier_format

}  // namespace kvtier
