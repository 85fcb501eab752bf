// AckManifest: the cold tier's durable list of what it acknowledged, kept
// outside RocksDB so that damage to RocksDB's write-ahead log cannot take the
// list down with the data.
//
// Why it exists: RocksDB replays its WAL at open and, when a record is damaged
// (bit flips, a zeroed block) or the file is truncated, it keeps what came
// before the damage and drops the rest, writing only a line to its own LOG. A
// chunk PutChunk had acknowledged (durable across SIGKILL) would then be gone
// without an error. The manifest says what must be there: at open the cold tier
// compares it with the chunks present and fails with Corruption naming every
// (sequence, layer, index) that is missing (offload/cold_tier.h).
//
// What it records, in order (each record is appended before or after the
// RocksDB write it describes, so that the list is never ahead of the data on a
// crash, and never behind it for an acknowledged write):
//   ack    chunk index range of one (sequence, layer)  after its batch is in the WAL
//   del    chunk index range of one (sequence, layer)  before the delete is written
//   drop   a whole sequence                            before the range deletes are written
//   seq    (sequence, CRC-32C of its record)           after PutSequence's write
// A chunk written again (a rewrite with a new score) appends nothing: the
// manifest holds sets of index ranges, and a chunk already in them is a no-op,
// so the file grows with new chunks only (48 bytes per chunk sealed, against a
// chunk's kilobytes). Compact() rewrites it as one `drop` per dropped sequence,
// one `del` per contiguous deleted range, one `ack` per contiguous acknowledged
// range and one `seq` per record; the cold tier does that at open and whenever
// the log is four times the snapshot.
//
// Drops and deletes are kept (as tombstones) until PruneDrops(): the database's
// delete of a dropped sequence or chunk sits in RocksDB's WAL until a flush, and
// losing that WAL would bring the data back. At open the cold tier deletes again
// whatever a tombstone covers and was not acknowledged since (DroppedAmong,
// DroppedSequenceRecord, DroppedSequence), flushes, then prunes; at run time it
// flushes and prunes when the tombstones pass a bound, so a long-lived store
// that creates and drops sequences stays small.
//
// ---- File format: <data_dir>/kvtier-acked, 48-byte records, little-endian ----
//   [0,4)   magic 0x4B41564B ("KVAK" in file order)
//   [4]     type: 1 header, 2 ack, 3 del, 4 drop, 5 seq
//   [5,8)   0
//   [8,16)  sequence id
//   [16,20) layer
//   [20,24) 0
//   [24,32) a: first index (ack/del), record CRC (seq), format version (header)
//   [32,40) b: last index, inclusive (ack/del)
//   [40,44) CRC-32C of bytes [0,40)
//   [44,48) 0
// The first record is a header (version 1). A partial record at the end is a
// write the process died in (its acknowledgement was never returned): it is
// cut off. Any whole record that fails its checks is Corruption naming its byte
// offset: the list can no longer be trusted.
//
// Durability: with `sync` every append is fdatasync'ed (as the cold tier's
// sync_writes does for the WAL); otherwise an append is one write(2), which
// survives SIGKILL like the WAL does. Compaction writes a temporary file,
// fsyncs it, renames it over the manifest and fsyncs the directory.
//
// Thread-safe (one mutex; an append is a 48-byte write).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "store/chunk.h"
#include "store/status.h"

namespace kvtier {

/// Chunk indices first..last (inclusive: any index, UINT64_MAX too) of one (sequence, layer).
struct ChunkRange {
  SequenceId seq = 0;
  uint32_t layer = 0;
  uint64_t first = 0, last = 0;  ///< first <= last
  uint64_t size() const { return last - first + 1; }
  bool operator==(const ChunkRange&) const = default;
  /// "seq=3/layer=1/chunk=17" for one chunk, "seq=3/layer=1/chunk=17..40" (inclusive) for more.
  std::string ToString() const;
};

/// Sets of chunk indices per (sequence, layer), kept as disjoint, coalesced ranges.
class ChunkRangeSet {
 public:
  void Insert(const ChunkKey& k) { InsertRange(k.seq, k.layer, k.index, k.index); }
  /// Indices first..last, inclusive (first <= last).
  void InsertRange(SequenceId seq, uint32_t layer, uint64_t first, uint64_t last);
  void EraseRange(SequenceId seq, uint32_t layer, uint64_t first, uint64_t last);
  void EraseSequence(SequenceId seq);
  bool Contains(const ChunkKey& k) const;
  /// Whether any chunk of the sequence is in the set.
  bool HasSequence(SequenceId seq) const;
  /// Every range, in (sequence, layer, index) order.
  std::vector<ChunkRange> Ranges() const;
  /// The ranges of `this` not covered by `other`, in order.
  std::vector<ChunkRange> Minus(const ChunkRangeSet& other) const;
  uint64_t chunks() const { return chunks_; }
  size_t range_count() const { return ranges_; }
  bool empty() const { return chunks_ == 0; }

 private:
  // (seq, layer) -> {first -> last}, disjoint and not adjacent
  std::map<std::pair<SequenceId, uint32_t>, std::map<uint64_t, uint64_t>> sets_;
  uint64_t chunks_ = 0;
  size_t ranges_ = 0;
};

/// Total chunks in a list of ranges.
uint64_t CountChunks(const std::vector<ChunkRange>& ranges);
/// "seq=1/layer=0/chunk=3..9, seq=1/layer=1/chunk=4" with at most `max_ranges` ranges,
/// then "and N more ranges".
std::string DescribeRanges(const std::vector<ChunkRange>& ranges, size_t max_ranges = 200);

class AckManifest {
 public:
  static constexpr const char* kFileName = "kvtier-acked";
  static constexpr size_t kRecordBytes = 48;
  static constexpr uint32_t kMagic = 0x4B41564Bu;
  static constexpr uint64_t kVersion = 1;

  /// Reads <dir>/kvtier-acked. A missing file is NotFound (the caller decides whether
  /// that is a new store or a lost manifest); a damaged one is Corruption naming the
  /// byte offset of the first bad record. A partial last record is cut off.
  static Result<std::unique_ptr<AckManifest>> Open(const std::string& dir, bool sync);
  /// Reads <dir>/kvtier-acked as Open does, but writes nothing: a partial last record is
  /// ignored, not cut off, and every call that would write returns FailedPrecondition.
  static Result<std::unique_ptr<AckManifest>> Read(const std::string& dir);
  /// Creates <dir>/kvtier-acked holding exactly `chunks` and `sequences` (replacing any
  /// file there), durably (temporary file, fsync, rename, fsync of the directory).
  static Result<std::unique_ptr<AckManifest>> Create(const std::string& dir, bool sync,
                                                     const ChunkRangeSet& chunks,
                                                     const std::map<SequenceId, uint32_t>& sequences);
  ~AckManifest();
  AckManifest(const AckManifest&) = delete;
  AckManifest& operator=(const AckManifest&) = delete;

  /// Records that the cold tier acknowledged the chunk (no-op when it already is).
  Status AckChunk(const ChunkKey& key);
  /// Records that the chunk is being deleted (no-op when it is not acknowledged); it
  /// stays deleted (a tombstone) until acknowledged again or PruneDrops().
  Status DeleteChunk(const ChunkKey& key);
  /// Records that the sequence (its chunks, record and blobs) is being deleted; everything
  /// of it not acknowledged again afterwards stays dropped until PruneDrops().
  Status DropSequence(SequenceId seq);
  /// Records the CRC-32C of the sequence record just acknowledged (no-op when unchanged).
  Status AckSequenceRecord(SequenceId seq, uint32_t record_crc);
  /// Forgets chunk ranges and sequence records that were found lost and accepted as such,
  /// then compacts.
  Status Forget(const std::vector<ChunkRange>& chunks, const std::vector<SequenceId>& sequences);
  /// Adds chunk ranges and sequence records that are present without having been
  /// recorded (found at open), then compacts when anything changed or the log has
  /// outgrown its snapshot.
  Status Adopt(const std::vector<ChunkRange>& chunks,
               const std::vector<std::pair<SequenceId, uint32_t>>& sequences);
  /// Rewrites the file as one record per range (see the top of the file).
  Status Compact();

  /// The parts of `candidates` (chunks that are not acknowledged) that a drop or delete
  /// removed, in order: chunks of a dropped sequence, or in a deleted range.
  std::vector<ChunkRange> DroppedAmong(const std::vector<ChunkRange>& candidates) const;
  /// Sequences dropped whose record was not acknowledged again since.
  std::vector<SequenceId> DroppedSequenceRecords() const;
  /// Tombstones held (dropped sequences plus deleted ranges); each is a record of a snapshot.
  uint64_t drop_records() const;
  /// Forgets every tombstone and compacts. Only for a caller that knows every drop and
  /// delete recorded so far is durable in the database without its write-ahead log (the
  /// cold tier flushes RocksDB first). On failure the tombstones stay.
  Status PruneDrops();

  ChunkRangeSet chunks() const;
  std::map<SequenceId, uint32_t> sequences() const;
  std::string path() const { return path_; }
  /// Records in the file now (header included).
  uint64_t file_records() const;

 private:
  AckManifest(std::string dir, bool sync);
  static Result<std::unique_ptr<AckManifest>> Load(const std::string& dir, bool sync, bool writable);
  Status CheckWritableLocked() const;
  Status AppendLocked(uint8_t type, SequenceId seq, uint32_t layer, uint64_t a, uint64_t b);
  Status CompactLocked();
  Status MaybeCompactLocked();
  uint64_t SnapshotRecordsLocked() const;

  const std::string dir_, path_;
  const bool sync_;
  mutable std::mutex mu_;
  int fd_ = -1;
  bool writable_ = true;  // false: opened by Read
  ChunkRangeSet chunks_;
  std::map<SequenceId, uint32_t> sequences_;
  // Tombstones: disjoint from chunks_ (an ack takes a chunk out of deleted_).
  ChunkRangeSet deleted_;
  std::set<SequenceId> dropped_;
  uint64_t file_records_ = 0;
};

}  // namespace kvtier
