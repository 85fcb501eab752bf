#include "offload/ack_manifest.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>

#include "store/checksum.h"
#include "store/coding.h"

namespace kvtier {

// ---- ranges ------------------------------------------------------------------------------

std::string ChunkRange::ToString() const {
  std::string s =
      "seq=" + std::to_string(seq) + "/layer=" + std::to_string(layer) + "/chunk=" + std::to_string(first);
  if (last > first) s += ".." + std::to_string(last);
  return s;
}

namespace {
// Whether a range ending at `last` and one starting at `first` (first > the other's first)
// overlap or touch, so that they coalesce. No overflow: with last == UINT64_MAX the first
// clause holds.
bool Touch(uint64_t last, uint64_t first) { return first <= last || first == last + 1; }
}  // namespace

void ChunkRangeSet::InsertRange(SequenceId seq, uint32_t layer, uint64_t first, uint64_t last) {
  if (first > last) return;
  auto& m = sets_[{seq, layer}];
  // Absorb the range that starts at or before `first` and reaches it, then every range
  // that starts inside or right after [first, last]: what is left is one coalesced range.
  auto it = m.upper_bound(first);
  if (it != m.begin()) {
    auto p = std::prev(it);
    if (Touch(p->second, first)) {
      first = p->first;
      last = std::max(last, p->second);
      chunks_ -= p->second - p->first + 1;
      --ranges_;
      m.erase(p);
    }
  }
  it = m.lower_bound(first);
  while (it != m.end() && Touch(last, it->first)) {
    last = std::max(last, it->second);
    chunks_ -= it->second - it->first + 1;
    --ranges_;
    it = m.erase(it);
  }
  m[first] = last;
  chunks_ += last - first + 1;
  ++ranges_;
}

void ChunkRangeSet::EraseRange(SequenceId seq, uint32_t layer, uint64_t first, uint64_t last) {
  if (first > last) return;
  auto sit = sets_.find({seq, layer});
  if (sit == sets_.end()) return;
  auto& m = sit->second;
  auto it = m.upper_bound(first);
  if (it != m.begin()) --it;
  while (it != m.end() && it->first <= last) {
    const uint64_t b = it->first, e = it->second;
    if (e < first) {
      ++it;
      continue;
    }
    it = m.erase(it);
    chunks_ -= e - b + 1;
    --ranges_;
    // What sticks out on either side stays (b < first means first > 0; e > last means last < max).
    if (b < first) {
      m[b] = first - 1;
      chunks_ += first - b;
      ++ranges_;
    }
    if (e > last) {
      m[last + 1] = e;
      chunks_ += e - last;
      ++ranges_;
      break;
    }
  }
  if (m.empty()) sets_.erase(sit);
}

void ChunkRangeSet::EraseSequence(SequenceId seq) {
  auto it = sets_.lower_bound({seq, 0});
  while (it != sets_.end() && it->first.first == seq) {
    for (const auto& [b, e] : it->second) chunks_ -= e - b + 1;
    ranges_ -= it->second.size();
    it = sets_.erase(it);
  }
}

bool ChunkRangeSet::Contains(const ChunkKey& k) const {
  auto sit = sets_.find({k.seq, k.layer});
  if (sit == sets_.end()) return false;
  auto it = sit->second.upper_bound(k.index);
  if (it == sit->second.begin()) return false;
  return k.index <= std::prev(it)->second;
}

bool ChunkRangeSet::HasSequence(SequenceId seq) const {
  auto it = sets_.lower_bound({seq, 0});
  return it != sets_.end() && it->first.first == seq;
}

std::vector<ChunkRange> ChunkRangeSet::Ranges() const {
  std::vector<ChunkRange> out;
  out.reserve(ranges_);
  for (const auto& [key, m] : sets_)
    for (const auto& [b, e] : m) out.push_back(ChunkRange{key.first, key.second, b, e});
  return out;
}

std::vector<ChunkRange> ChunkRangeSet::Minus(const ChunkRangeSet& other) const {
  std::vector<ChunkRange> out;
  for (const auto& [key, m] : sets_) {
    auto oit = other.sets_.find(key);
    for (const auto& [b, e] : m) {
      uint64_t at = b;  // first index of [b, e] not yet accounted for
      bool covered_to_end = false;
      if (oit != other.sets_.end()) {
        const auto& om = oit->second;
        auto it = om.upper_bound(at);
        if (it != om.begin()) --it;
        for (; it != om.end() && it->first <= e; ++it) {
          if (it->second < at) continue;
          if (it->first > at) out.push_back(ChunkRange{key.first, key.second, at, it->first - 1});
          if (it->second >= e) {
            covered_to_end = true;
            break;
          }
          at = it->second + 1;  // <= e, no overflow
        }
      }
      if (!covered_to_end) out.push_back(ChunkRange{key.first, key.second, at, e});
    }
  }
  return out;
}

uint64_t CountChunks(const std::vector<ChunkRange>& ranges) {
  uint64_t n = 0;
  for (const ChunkRange& r : ranges) n += r.size();
  return n;
}

std::string DescribeRanges(const std::vector<ChunkRange>& ranges, size_t max_ranges) {
  std::string s;
  for (size_t i = 0; i < ranges.size() && i < max_ranges; ++i) {
    if (i > 0) s += ", ";
    s += ranges[i].ToString();
  }
  if (ranges.size() > max_ranges) s += ", and " + std::to_string(ranges.size() - max_ranges) + " more ranges";
  return s;
}

// ---- the file -----------------------------------------------------------------------------

namespace {

enum RecordType : uint8_t { kHeader = 1, kAck = 2, kDel = 3, kDrop = 4, kSeq = 5 };

using Record = std::array<char, AckManifest::kRecordBytes>;

Record MakeRecord(uint8_t type, SequenceId seq, uint32_t layer, uint64_t a, uint64_t b) {
  Record r{};
  EncodeFixed32(r.data(), AckManifest::kMagic);
  r[4] = static_cast<char>(type);
  EncodeFixed64(r.data() + 8, seq);
  EncodeFixed32(r.data() + 16, layer);
  EncodeFixed64(r.data() + 24, a);
  EncodeFixed64(r.data() + 32, b);
  EncodeFixed32(r.data() + 40, Crc32c(r.data(), 40));
  return r;
}

std::string Errno(const std::string& what, int err) { return what + ": " + std::strerror(err); }

Status WriteAll(int fd, const char* p, size_t n, const std::string& path) {
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) return IOError(Errno("ack manifest: write to '" + path + "'", errno));
    p += w;
    n -= static_cast<size_t>(w);
  }
  return Status::Ok();
}

// fsync of the directory, so that a rename into it survives power loss.
Status SyncDir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return IOError(Errno("ack manifest: open directory '" + dir + "' to sync it", errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) return IOError(Errno("ack manifest: fsync of directory '" + dir + "'", err));
  return Status::Ok();
}

Result<int> OpenForAppend(const std::string& path) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
  if (fd < 0) return IOError(Errno("ack manifest: open '" + path + "' for appending", errno));
  return fd;
}

// Writes the snapshot to <path>.tmp, fsyncs it and renames it over <path>.
// Replaying it gives back the same state: drops first (they clear their sequence), then
// deleted ranges, then what is acknowledged (disjoint from the deleted ranges).
Status WriteSnapshot(const std::string& dir, const std::string& path, const ChunkRangeSet& chunks,
                     const std::map<SequenceId, uint32_t>& sequences, const std::set<SequenceId>& dropped,
                     const ChunkRangeSet& deleted, uint64_t* records) {
  std::string bytes;
  auto add = [&](const Record& r) { bytes.append(r.data(), r.size()); };
  add(MakeRecord(kHeader, 0, 0, AckManifest::kVersion, 0));
  for (SequenceId seq : dropped) add(MakeRecord(kDrop, seq, 0, 0, 0));
  for (const ChunkRange& r : deleted.Ranges()) add(MakeRecord(kDel, r.seq, r.layer, r.first, r.last));
  for (const ChunkRange& r : chunks.Ranges()) add(MakeRecord(kAck, r.seq, r.layer, r.first, r.last));
  for (const auto& [seq, crc] : sequences) add(MakeRecord(kSeq, seq, 0, crc, 0));
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return IOError(Errno("ack manifest: create '" + tmp + "'", errno));
  Status st = WriteAll(fd, bytes.data(), bytes.size(), tmp);
  if (st.ok() && ::fsync(fd) != 0) st = IOError(Errno("ack manifest: fsync of '" + tmp + "'", errno));
  ::close(fd);
  if (st.ok() && ::rename(tmp.c_str(), path.c_str()) != 0)
    st = IOError(Errno("ack manifest: rename '" + tmp + "' to '" + path + "'", errno));
  if (!st.ok()) {
    ::unlink(tmp.c_str());
    return st;
  }
  KVTIER_RETURN_IF_ERROR(SyncDir(dir));
  *records = bytes.size() / AckManifest::kRecordBytes;
  return Status::Ok();
}

}  // namespace

AckManifest::AckManifest(std::string dir, bool sync)
    : dir_(std::move(dir)), path_(dir_ + "/" + kFileName), sync_(sync) {}

AckManifest::~AckManifest() {
  if (fd_ >= 0) ::close(fd_);
}

Result<std::unique_ptr<AckManifest>> AckManifest::Open(const std::string& dir, bool sync) {
  return Load(dir, sync, /*writable=*/true);
}

Result<std::unique_ptr<AckManifest>> AckManifest::Read(const std::string& dir) {
  return Load(dir, /*sync=*/false, /*writable=*/false);
}

Result<std::unique_ptr<AckManifest>> AckManifest::Load(const std::string& dir, bool sync, bool writable) {
  auto m = std::unique_ptr<AckManifest>(new AckManifest(dir, sync));
  const std::string& path = m->path_;
  const int fd = ::open(path.c_str(), (writable ? O_RDWR : O_RDONLY) | O_CLOEXEC);
  if (fd < 0 && errno == ENOENT) return NotFound("ack manifest '" + path + "' does not exist");
  if (fd < 0) return IOError(Errno("ack manifest: open '" + path + "'", errno));
  std::string bytes;
  Status st;
  for (;;) {
    char buf[1 << 16];
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      st = IOError(Errno("ack manifest: read '" + path + "'", errno));
      break;
    }
    if (n == 0) break;
    bytes.append(buf, static_cast<size_t>(n));
  }
  const size_t whole = bytes.size() / kRecordBytes * kRecordBytes;
  // A partial last record is an append the process died in; its acknowledgement was
  // never returned, so dropping it loses nothing that was promised.
  if (writable && st.ok() && whole != bytes.size() && whole > 0 &&
      ::ftruncate(fd, static_cast<off_t>(whole)) != 0)
    st = IOError(Errno("ack manifest: cut the partial last record of '" + path + "'", errno));
  ::close(fd);
  KVTIER_RETURN_IF_ERROR(st);
  if (whole == 0)
    return Corruption("ack manifest '" + path + "' holds no header (" + std::to_string(bytes.size()) +
                      " bytes)");
  for (size_t off = 0; off < whole; off += kRecordBytes) {
    const char* p = bytes.data() + off;
    auto bad = [&](const std::string& why) {
      return Corruption("ack manifest '" + path + "': record at byte " + std::to_string(off) +
                        " is damaged (" + why + "); the list of acknowledged chunks cannot be trusted");
    };
    if (DecodeFixed32(p) != kMagic) return bad("bad magic");
    if (DecodeFixed32(p + 40) != Crc32c(p, 40)) return bad("checksum mismatch");
    const uint8_t type = static_cast<uint8_t>(p[4]);
    const SequenceId seq = DecodeFixed64(p + 8);
    const uint32_t layer = DecodeFixed32(p + 16);
    const uint64_t a = DecodeFixed64(p + 24), b = DecodeFixed64(p + 32);
    if ((off == 0) != (type == kHeader))
      return bad(off == 0 ? "the first record is not a header" : "a second header");
    switch (type) {
      case kHeader:
        if (a != kVersion)
          return Corruption("ack manifest '" + path + "' has format version " + std::to_string(a) +
                            ", this build reads " + std::to_string(kVersion));
        break;
      case kAck:
      case kDel:
        if (a > b) return bad("chunk range " + std::to_string(a) + ".." + std::to_string(b) + " is reversed");
        if (type == kAck) {
          m->chunks_.InsertRange(seq, layer, a, b);
          m->deleted_.EraseRange(seq, layer, a, b);
        } else {
          m->chunks_.EraseRange(seq, layer, a, b);
          m->deleted_.InsertRange(seq, layer, a, b);
        }
        break;
      case kDrop:
        m->chunks_.EraseSequence(seq);
        m->sequences_.erase(seq);
        m->deleted_.EraseSequence(seq);
        m->dropped_.insert(seq);
        break;
      case kSeq:
        if (a > UINT32_MAX) return bad("sequence record CRC out of range");
        m->sequences_[seq] = static_cast<uint32_t>(a);
        break;
      default:
        return bad("unknown record type " + std::to_string(type));
    }
  }
  m->file_records_ = whole / kRecordBytes;
  if (writable) {
    KVTIER_ASSIGN_OR_RETURN(m->fd_, OpenForAppend(path));
  }
  m->writable_ = writable;
  return m;
}

Result<std::unique_ptr<AckManifest>> AckManifest::Create(const std::string& dir, bool sync,
                                                         const ChunkRangeSet& chunks,
                                                         const std::map<SequenceId, uint32_t>& sequences) {
  auto m = std::unique_ptr<AckManifest>(new AckManifest(dir, sync));
  m->chunks_ = chunks;
  m->sequences_ = sequences;
  KVTIER_RETURN_IF_ERROR(WriteSnapshot(m->dir_, m->path_, m->chunks_, m->sequences_, m->dropped_, m->deleted_,
                                       &m->file_records_));
  KVTIER_ASSIGN_OR_RETURN(m->fd_, OpenForAppend(m->path_));
  return m;
}

Status AckManifest::AppendLocked(uint8_t type, SequenceId seq, uint32_t layer, uint64_t a, uint64_t b) {
  KVTIER_RETURN_IF_ERROR(CheckWritableLocked());
  const Record r = MakeRecord(type, seq, layer, a, b);
  KVTIER_RETURN_IF_ERROR(WriteAll(fd_, r.data(), r.size(), path_));
  if (sync_ && ::fdatasync(fd_) != 0)
    return IOError(Errno("ack manifest: fdatasync of '" + path_ + "'", errno));
  ++file_records_;
  return Status::Ok();
}

uint64_t AckManifest::SnapshotRecordsLocked() const {
  return 1 + chunks_.range_count() + sequences_.size() + dropped_.size() + deleted_.range_count();
}

Status AckManifest::MaybeCompactLocked() {
  // Amortised: a rewrite costs the snapshot's size and happens only after the log has grown
  // by three times that, so appends stay O(1) on average and the file O(live ranges).
  if (file_records_ <= 4 * SnapshotRecordsLocked() + 1024) return Status::Ok();
  return CompactLocked();
}

Status AckManifest::AckChunk(const ChunkKey& k) {
  std::lock_guard l(mu_);
  if (chunks_.Contains(k)) return Status::Ok();
  KVTIER_RETURN_IF_ERROR(AppendLocked(kAck, k.seq, k.layer, k.index, k.index));
  chunks_.Insert(k);
  deleted_.EraseRange(k.seq, k.layer, k.index, k.index);
  return MaybeCompactLocked();
}

Status AckManifest::DeleteChunk(const ChunkKey& k) {
  std::lock_guard l(mu_);
  if (!chunks_.Contains(k)) return Status::Ok();
  KVTIER_RETURN_IF_ERROR(AppendLocked(kDel, k.seq, k.layer, k.index, k.index));
  chunks_.EraseRange(k.seq, k.layer, k.index, k.index);
  deleted_.Insert(k);
  return MaybeCompactLocked();
}

Status AckManifest::DropSequence(SequenceId seq) {
  std::lock_guard l(mu_);
  KVTIER_RETURN_IF_ERROR(AppendLocked(kDrop, seq, 0, 0, 0));
  chunks_.EraseSequence(seq);
  sequences_.erase(seq);
  deleted_.EraseSequence(seq);
  dropped_.insert(seq);
  return MaybeCompactLocked();
}

Status AckManifest::AckSequenceRecord(SequenceId seq, uint32_t crc) {
  std::lock_guard l(mu_);
  auto it = sequences_.find(seq);
  if (it != sequences_.end() && it->second == crc) return Status::Ok();
  KVTIER_RETURN_IF_ERROR(AppendLocked(kSeq, seq, 0, crc, 0));
  sequences_[seq] = crc;
  return MaybeCompactLocked();
}

Status AckManifest::Forget(const std::vector<ChunkRange>& chunks, const std::vector<SequenceId>& sequences) {
  std::lock_guard l(mu_);
  KVTIER_RETURN_IF_ERROR(CheckWritableLocked());
  for (const ChunkRange& r : chunks) chunks_.EraseRange(r.seq, r.layer, r.first, r.last);
  for (SequenceId s : sequences) sequences_.erase(s);
  return CompactLocked();
}

Status AckManifest::Adopt(const std::vector<ChunkRange>& chunks,
                          const std::vector<std::pair<SequenceId, uint32_t>>& sequences) {
  std::lock_guard l(mu_);
  KVTIER_RETURN_IF_ERROR(CheckWritableLocked());
  for (const ChunkRange& r : chunks) {
    chunks_.InsertRange(r.seq, r.layer, r.first, r.last);
    deleted_.EraseRange(r.seq, r.layer, r.first, r.last);
  }
  for (const auto& [seq, crc] : sequences) sequences_[seq] = crc;
  if (chunks.empty() && sequences.empty() && file_records_ <= 2 * SnapshotRecordsLocked() + 64)
    return Status::Ok();
  return CompactLocked();
}

Status AckManifest::Compact() {
  std::lock_guard l(mu_);
  return CompactLocked();
}

std::vector<ChunkRange> AckManifest::DroppedAmong(const std::vector<ChunkRange>& candidates) const {
  std::lock_guard l(mu_);
  std::vector<ChunkRange> out;
  for (const ChunkRange& r : candidates) {
    if (dropped_.count(r.seq)) {
      out.push_back(r);
      continue;
    }
    ChunkRangeSet one, kept;
    one.InsertRange(r.seq, r.layer, r.first, r.last);
    for (const ChunkRange& k : one.Minus(deleted_)) kept.InsertRange(k.seq, k.layer, k.first, k.last);
    for (const ChunkRange& d : one.Minus(kept)) out.push_back(d);
  }
  return out;
}

std::vector<SequenceId> AckManifest::DroppedSequenceRecords() const {
  std::lock_guard l(mu_);
  std::vector<SequenceId> out;
  for (SequenceId seq : dropped_)
    if (!sequences_.count(seq)) out.push_back(seq);
  return out;
}

uint64_t AckManifest::drop_records() const {
  std::lock_guard l(mu_);
  return dropped_.size() + deleted_.range_count();
}

Status AckManifest::PruneDrops() {
  std::lock_guard l(mu_);
  KVTIER_RETURN_IF_ERROR(CheckWritableLocked());
  if (dropped_.empty() && deleted_.empty()) return Status::Ok();
  std::set<SequenceId> dropped;
  ChunkRangeSet deleted;
  std::swap(dropped, dropped_);
  std::swap(deleted, deleted_);
  Status st = CompactLocked();
  if (!st.ok()) {
    // Kept: the next compaction writes them again.
    dropped_ = std::move(dropped);
    deleted_ = std::move(deleted);
  }
  return st;
}

Status AckManifest::CheckWritableLocked() const {
  if (writable_) return Status::Ok();
  return FailedPrecondition("ack manifest '" + path_ + "' was opened read-only (AckManifest::Read)");
}

Status AckManifest::CompactLocked() {
  KVTIER_RETURN_IF_ERROR(CheckWritableLocked());
  uint64_t records = 0;
  KVTIER_RETURN_IF_ERROR(WriteSnapshot(dir_, path_, chunks_, sequences_, dropped_, deleted_, &records));
  // The old descriptor points at the replaced file: appends must go to the new one.
  // When it cannot be reopened, later appends fail (EBADF) instead of going to the old file.
  Result<int> fd = OpenForAppend(path_);
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd.ok() ? *fd : -1;
  if (!fd.ok()) return fd.status();
  file_records_ = records;
  return Status::Ok();
}

ChunkRangeSet AckManifest::chunks() const {
  std::lock_guard l(mu_);
  return chunks_;
}

std::map<SequenceId, uint32_t> AckManifest::sequences() const {
  std::lock_guard l(mu_);
  return sequences_;
}

uint64_t AckManifest::file_records() const {
  std::lock_guard l(mu_);
  return file_records_;
}

}  // namespace kvtier
