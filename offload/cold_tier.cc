#include "offload/cold_tier.h"

#include <fcntl.h>
#include <rocksdb/cache.h>
#include <rocksdb/convenience.h>
#include <rocksdb/db.h>
#include <rocksdb/env.h>
#include <rocksdb/filter_policy.h>
#include <rocksdb/listener.h>
#include <rocksdb/options.h>
#include <rocksdb/slice.h>
#include <rocksdb/sst_file_reader.h>
#include <rocksdb/sst_file_writer.h>
#include <rocksdb/table.h>
#include <rocksdb/write_batch.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cinttypes>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <limits>
#include <map>
#include <mutex>
#include <set>
#include <shared_mutex>
#include <system_error>
#include <thread>
#include <vector>

#include "kernels/tbb_tsan.h"  // KVTIER_TSAN
#include "store/checksum.h"
#include "store/coding.h"

namespace kvtier {

// ---- names and options ------------------------------------------------------------

const char* CompressionName(Compression c) {
  switch (c) {
    case Compression::kNone:
      return "none";
    case Compression::kLZ4:
      return "lz4";
    case Compression::kZSTD:
      return "zstd";
  }
  return "unknown";
}

bool ParseCompression(const std::string& name, Compression* out) {
  std::string s(name);
  std::transform(s.begin(), s.end(), s.begin(),
                 [](unsigned char ch) { return static_cast<char>(std::tolower(ch)); });
  if (s == "none") {
    *out = Compression::kNone;
    return true;
  }
  if (s == "lz4") {
    *out = Compression::kLZ4;
    return true;
  }
  if (s == "zstd") {
    *out = Compression::kZSTD;
    return true;
  }
  return false;
}

namespace {
constexpr size_t kMinWriteBuffer = 64u << 10;
constexpr size_t kMaxWriteBuffer = size_t{4} << 30;
constexpr size_t kMaxBlobName = 1024;
const char* const kFormatMarkerKey = "F";
const char* const kFormatMarkerValue = "kvtier.cold_tier.v1";
}  // namespace

Status ColdTierOptions::Validate() const {
  if (path.empty()) return InvalidArgument("cold tier: path must not be empty");
  switch (compression) {
    case Compression::kNone:
    case Compression::kLZ4:
    case Compression::kZSTD:
      break;
    default:
      return InvalidArgument("cold tier: compression must be none|lz4|zstd (got " +
                             std::to_string(static_cast<int>(compression)) + ")");
  }
  if (read_only && accept_lost_chunks)
    return InvalidArgument("cold tier: accept_lost_chunks needs a read-write open (read_only is set)");
  if (list_missing && !read_only)
    return InvalidArgument("cold tier: list_missing is for read-only opens (set read_only)");
  if (write_buffer_bytes < kMinWriteBuffer || write_buffer_bytes > kMaxWriteBuffer)
    return InvalidArgument("cold tier: write_buffer_bytes must be in [64 KiB, 4 GiB] (got " +
                           std::to_string(write_buffer_bytes) + ")");
  return Status::Ok();
}

// ---- key and value encoding ----------------------------------------------------------

namespace {

using cold_tier_format::ValueKind;

// Keys are big-endian (bytewise order = numeric order); the value header is
// little-endian. Both come from store/coding.h, so the format is the same on any host.
std::string SeqPrefix(SequenceId seq) {
  std::string k(8, '\0');
  EncodeBigEndian64(k.data(), seq);
  return k;
}

std::string Hex(std::string_view s) {
  static const char* d = "0123456789abcdef";
  std::string out;
  for (unsigned char c : s) {
    out += d[c >> 4];
    out += d[c & 15];
  }
  return out;
}

using Header = std::array<char, cold_tier_format::kValueHeaderBytes>;

Header MakeHeader(ValueKind kind, const void* body, size_t n, uint64_t aux) {
  Header h{};
  value_framing::EncodeHeader(h.data(), kind, body, n, aux);
  return h;
}

struct Decoded {
  uint64_t aux = 0;
  std::string_view body;
};

}  // namespace

namespace {

Status DecodeValue(rocksdb::Slice v, ValueKind want, const std::string& what, Decoded* out) {
  return cold_tier_format::DecodeValue(std::string_view(v.data(), v.size()), want, what, &out->body,
                                       &out->aux);
}

Status FromRocks(const rocksdb::Status& s, const std::string& what) {
  std::string m = "cold tier: " + what + ": " + s.ToString();
  if (s.IsCorruption()) return Corruption(std::move(m));
  return IOError(std::move(m));
}

std::string ChunkWhat(const ChunkKey& k, const char* part) { return "chunk " + k.ToString() + " " + part; }
std::string BlobWhat(SequenceId seq, uint32_t layer, std::string_view name) {
  return "blob seq=" + std::to_string(seq) + "/layer=" + std::to_string(layer) + "/name=" + std::string(name);
}
std::string SeqWhat(SequenceId seq) { return "sequence " + std::to_string(seq) + " record"; }

rocksdb::CompressionType ToRocks(Compression c) {
  switch (c) {
    case Compression::kNone:
      return rocksdb::kNoCompression;
    case Compression::kLZ4:
      return rocksdb::kLZ4Compression;
    case Compression::kZSTD:
      return rocksdb::kZSTD;
  }
  return rocksdb::kNoCompression;
}

// The files of a data directory that only an existing store has: RocksDB's CURRENT,
// MANIFEST-*, write-ahead logs and tables, and the ack manifest. (LOCK, LOG and IDENTITY
// can be left by an open that failed before it created anything.)
struct StoreFiles {
  bool current = false;
  std::vector<std::string> manifests;  // MANIFEST-<number>, oldest first
  std::vector<std::string> data;       // *.log, *.sst, *.blob, the ack manifest
  bool holds_store() const { return current || !manifests.empty() || !data.empty(); }
  std::string Describe() const {
    std::vector<std::string> all = manifests;
    all.insert(all.end(), data.begin(), data.end());
    std::string s;
    for (size_t i = 0; i < all.size() && i < 8; ++i) s += (i ? ", " : "") + all[i];
    if (all.size() > 8) s += " and " + std::to_string(all.size() - 8) + " more";
    return s;
  }
};

// RocksDB's file names: <digits><suffix>, e.g. 000123.log, 000042.sst (an app.log is not one).
bool IsNumbered(const std::string& s, const char* suffix) {
  const size_t n = std::strlen(suffix);
  if (s.size() <= n || s.compare(s.size() - n, n, suffix) != 0) return false;
  return std::all_of(s.begin(), s.end() - static_cast<std::ptrdiff_t>(n),
                     [](char c) { return c >= '0' && c <= '9'; });
}

// Whether the data dir `path` exists (*exists). One that exists and is not a directory is
// InvalidArgument; an OS error other than "does not exist" (EACCES, ENAMETOOLONG, ...) is
// IOError naming the path and the error.
Status StatDataDir(const std::string& path, bool* exists) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (ec && ec != std::errc::no_such_file_or_directory)
    return IOError("cold tier: data dir '" + path + "': " + ec.message());
  *exists = fs::exists(st);
  if (*exists && fs::is_regular_file(st))
    return InvalidArgument("cold tier: data dir '" + path + "' is a file, not a directory");
  if (*exists && !fs::is_directory(st))
    return InvalidArgument("cold tier: data dir '" + path + "' exists and is not a directory");
  return Status::Ok();
}

Status ListStoreFiles(const std::string& dir, StoreFiles* out) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::directory_iterator it(dir, ec), end;
  for (; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name == "CURRENT")
      out->current = true;
    else if (name.size() > 9 && name.rfind("MANIFEST-", 0) == 0 &&
             std::all_of(name.begin() + 9, name.end(), [](char c) { return c >= '0' && c <= '9'; }))
      out->manifests.push_back(name);
    else if (IsNumbered(name, ".log") || IsNumbered(name, ".sst") || IsNumbered(name, ".blob") ||
             name == AckManifest::kFileName)
      out->data.push_back(name);
  }
  if (ec) return IOError("cold tier: cannot list data dir '" + dir + "': " + ec.message());
  auto number = [](const std::string& m) { return std::strtoull(m.c_str() + 9, nullptr, 10); };
  std::sort(out->manifests.begin(), out->manifests.end(),
            [&](const std::string& a, const std::string& b) { return number(a) < number(b); });
  std::sort(out->data.begin(), out->data.end());
  return Status::Ok();
}

Status WriteFileDurably(const std::string& dir, const std::string& name, const std::string& bytes) {
  const std::string path = dir + "/" + name, tmp = path + ".kvtier-tmp";
  auto fail = [&](const std::string& what) {
    const std::string msg = "cold tier: " + what + ": " + std::strerror(errno);
    ::unlink(tmp.c_str());
    return IOError(msg);
  };
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return fail("create '" + tmp + "'");
  const bool written = ::write(fd, bytes.data(), bytes.size()) == static_cast<ssize_t>(bytes.size());
  const bool synced = written && ::fsync(fd) == 0;
  ::close(fd);
  if (!synced) return fail("write '" + tmp + "'");
  if (::rename(tmp.c_str(), path.c_str()) != 0) return fail("rename '" + tmp + "' to '" + path + "'");
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0 || ::fsync(dfd) != 0) {
    const std::string msg = "cold tier: fsync of directory '" + dir + "': " + std::strerror(errno);
    if (dfd >= 0) ::close(dfd);
    return IOError(msg);
  }
  ::close(dfd);
  return Status::Ok();
}

// A directory that holds a store but lost its CURRENT file (which names the MANIFEST that
// describes the database): opened as it is, RocksDB would create a new, empty database
// there and later delete the old one's files as obsolete. With exactly one MANIFEST-* the
// answer is not in doubt, and CURRENT is written back (atomically) pointing at it; the
// MANIFEST's name is returned. Otherwise Corruption naming the missing CURRENT.
Result<std::string> RecoverCurrent(const std::string& dir, const StoreFiles& files) {
  const std::string what =
      "cold tier: '" + dir + "' holds a store (" + files.Describe() + ") but its CURRENT file is missing";
  if (files.manifests.empty())
    return Corruption(what +
                      ", and no MANIFEST-* file is left to recover it from; refusing to open it as a new "
                      "store, which would delete those files");
  if (files.manifests.size() > 1)
    return Corruption(what + ", and there are " + std::to_string(files.manifests.size()) +
                      " MANIFEST-* files, so which one is current is not known; refusing to guess (write the "
                      "right name into CURRENT, usually the newest: " +
                      files.manifests.back() + ")");
  KVTIER_RETURN_IF_ERROR(WriteFileDurably(dir, "CURRENT", files.manifests.back() + "\n"));
  return files.manifests.back();
}

// RocksDB's info log ("LOG" in the data directory), written with plain write(2). RocksDB's own
// logger keeps going after a line failed to write, and the next line then trips an assertion
// in its WritableFileWriter (AssertFalseAndGetStatusForPrevError: Debian's librocksdb keeps
// its assertions, so the process gets SIGABRT). On a full disk a LOG line is usually the first
// thing to fail, and every open of that directory logs: writers and reopens alike aborted.
// Here a line that cannot be written is dropped, and nothing else happens. Past 4 MiB the
// file moves to LOG.old (one generation kept).
class InfoLog : public rocksdb::Logger {
 public:
  explicit InfoLog(std::string dir)
      : rocksdb::Logger(rocksdb::InfoLogLevel::INFO_LEVEL), path_(std::move(dir) + "/LOG") {
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    struct stat st;
    if (fd_ >= 0 && ::fstat(fd_, &st) == 0) bytes_ = static_cast<uint64_t>(st.st_size);
  }
  ~InfoLog() override {
    if (fd_ >= 0) ::close(fd_);
  }

  using rocksdb::Logger::Logv;
  void Logv(const char* format, va_list ap) override {
    char line[2048];
    timeval tv;
    ::gettimeofday(&tv, nullptr);
    tm t;
    const time_t secs = tv.tv_sec;
    ::localtime_r(&secs, &t);
    int n =
        std::snprintf(line, sizeof line, "%04d/%02d/%02d-%02d:%02d:%02d.%06ld ", t.tm_year + 1900,
                      t.tm_mon + 1, t.tm_mday, t.tm_hour, t.tm_min, t.tm_sec, static_cast<long>(tv.tv_usec));
    if (n < 0) return;
    std::string text(line, static_cast<size_t>(n));
    va_list copy;
    va_copy(copy, ap);
    const int body = std::vsnprintf(line, sizeof line, format, copy);
    va_end(copy);
    if (body < 0) return;
    if (static_cast<size_t>(body) < sizeof line) {
      text.append(line, static_cast<size_t>(body));
    } else {
      std::string big(static_cast<size_t>(body) + 1, '\0');
      std::vsnprintf(big.data(), big.size(), format, ap);
      text.append(big.data(), static_cast<size_t>(body));
    }
    if (text.empty() || text.back() != '\n') text += '\n';
    std::lock_guard l(mu_);
    if (fd_ < 0) return;
    if (bytes_ > kRollBytes) Roll();
    // One write per line; a short or failed write loses (part of) this line only.
    const ssize_t w = ::write(fd_, text.data(), text.size());
    if (w > 0) bytes_ += static_cast<uint64_t>(w);
  }

 private:
  static constexpr uint64_t kRollBytes = 4u << 20;

  void Roll() {
    if (::rename(path_.c_str(), (path_ + ".old").c_str()) != 0) return;  // keep appending to the one we have
    const int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC, 0644);
    if (fd < 0) return;
    ::close(fd_);
    fd_ = fd;
    bytes_ = 0;
  }

  const std::string path_;
  std::mutex mu_;
  int fd_ = -1;
  uint64_t bytes_ = 0;
};

const char* BackgroundErrorName(rocksdb::BackgroundErrorReason r) {
  switch (r) {
    case rocksdb::BackgroundErrorReason::kFlush:
      return "a flush";
    case rocksdb::BackgroundErrorReason::kCompaction:
      return "a compaction";
    case rocksdb::BackgroundErrorReason::kWriteCallback:
      return "a write";
    case rocksdb::BackgroundErrorReason::kMemTable:
      return "a memtable insert";
    case rocksdb::BackgroundErrorReason::kManifestWrite:
      return "a MANIFEST write";
    case rocksdb::BackgroundErrorReason::kFlushNoWAL:
      return "a flush (no WAL)";
    case rocksdb::BackgroundErrorReason::kManifestWriteNoWAL:
      return "a MANIFEST write (no WAL)";
  }
  return "a background job";
}

// The first write error of a tier (see "A full disk" in cold_tier.h). Shared by the tier and
// the RocksDB listener below, which runs on RocksDB's threads.
class ColdTierWriteLatch {
 public:
  ColdTierWriteLatch(std::string path, bool read_only) : path_(std::move(path)), read_only_(read_only) {}

  /// OK while no write failed; else the IOError every later write returns. A read-only
  /// tier's writes are all FailedPrecondition.
  Status Check() const {
    if (read_only_)
      return FailedPrecondition("cold tier: '" + path_ + "' is open read-only; it takes no writes");
    if (!failed_.load(std::memory_order_acquire)) return Status::Ok();
    std::lock_guard l(mu_);
    return IOError(
        "cold tier: '" + path_ + "' takes no more writes after its first write error (" + first_ +
        "); what it acknowledged before still reads back, and a reopen once the disk has room writes "
        "again");
  }
  /// Records `st` as the first write error unless one is recorded already; returns `st`.
  Status Latch(Status st) {
    if (!st.ok()) Record(st.message());
    return st;
  }
  void Record(const std::string& what) {
    std::lock_guard l(mu_);
    if (failed_.load(std::memory_order_relaxed)) return;
    first_ = what;
    failed_.store(true, std::memory_order_release);
  }

 private:
  const std::string path_;
  const bool read_only_;
  mutable std::mutex mu_;
  std::atomic<bool> failed_{false};
  std::string first_;  // guarded by mu_
};

// RocksDB's background errors (a flush or compaction that failed) latch like a failed write, and RocksDB is
// told not to resume on its own: resuming writes (it flushes every memtable), and this tier writes nothing
// more to the database.
class BackgroundErrorListener : public rocksdb::EventListener {
 public:
  explicit BackgroundErrorListener(std::shared_ptr<ColdTierWriteLatch> latch) : latch_(std::move(latch)) {}
  const char* Name() const override { return "kvtier.ColdTier.BackgroundErrorListener"; }
  void OnBackgroundError(rocksdb::BackgroundErrorReason reason, rocksdb::Status* bg_error) override {
    // A failed write of ours latches itself, naming its key, when RocksDB returns.
    if (reason == rocksdb::BackgroundErrorReason::kWriteCallback ||
        reason == rocksdb::BackgroundErrorReason::kMemTable)
      return;
    if (bg_error != nullptr && !bg_error->ok())
      latch_->Record(std::string("RocksDB stopped writing after ") + BackgroundErrorName(reason) +
                     " failed: " + bg_error->ToString());
  }
  void OnErrorRecoveryBegin(rocksdb::BackgroundErrorReason, rocksdb::Status bg_error,
                            bool* auto_recovery) override {
    bg_error.PermitUncheckedError();
    if (auto_recovery != nullptr) *auto_recovery = false;
  }

 private:
  std::shared_ptr<ColdTierWriteLatch> latch_;
};

}  // namespace

namespace cold_tier_format {
std::string SequenceKey(SequenceId seq) {
  std::string k(9, '\0');
  k[0] = 'S';
  EncodeBigEndian64(k.data() + 1, seq);
  return k;
}
std::string ChunkKeyBytes(const ChunkKey& key) {
  std::string k(20, '\0');
  EncodeBigEndian64(k.data(), key.seq);
  EncodeBigEndian32(k.data() + 8, key.layer);
  EncodeBigEndian64(k.data() + 12, key.index);
  return k;
}
std::string BlobKey(SequenceId seq, uint32_t layer, std::string_view name) {
  std::string k(12, '\0');
  EncodeBigEndian64(k.data(), seq);
  EncodeBigEndian32(k.data() + 8, layer);
  k.append(name.data(), name.size());
  return k;
}
}  // namespace cold_tier_format

// ---- the tier ---------------------------------------------------------------------------

// What an open found in the database and the manifest, before it changes anything.
struct Findings {
  ChunkRangeSet present;                        // chunks whose meta record is there
  std::map<SequenceId, uint32_t> present_seqs;  // sequence records there, by CRC-32C
  std::set<SequenceId> damaged_seqs;            // there, failing their checks
  bool had_marker = false;                      // the manifest marker is in the database
  bool new_manifest = false;                    // no manifest and no marker: a new store
  std::string manifest_problem;                 // the manifest is missing or damaged: why
  std::vector<ChunkRange> missing;              // acknowledged, not there
  std::vector<SequenceId> missing_seqs;         // acknowledged records not there, or older
};

struct ColdTier::Impl {
  ColdTierOptions options;
  bool read_only = false;
  std::string manifest_problem;          // read-only with list_missing: why the manifest is unusable
  ChunkRangeSet acked_without_manifest;  // read-only without a manifest: what is there
  rocksdb::DB* db = nullptr;
  std::vector<rocksdb::ColumnFamilyHandle*> handles;
  rocksdb::ColumnFamilyHandle* seq_cf = nullptr;
  rocksdb::ColumnFamilyHandle* meta_cf = nullptr;
  rocksdb::ColumnFamilyHandle* payload_cf = nullptr;
  rocksdb::ColumnFamilyHandle* blob_cf = nullptr;
  rocksdb::WriteOptions write_options;
  // The first write error; once set, no write reaches the database or the manifest.
  std::shared_ptr<ColdTierWriteLatch> latch;

  std::atomic<uint64_t> payload_bytes{0};
  std::atomic<uint64_t> chunks{0};

  // What was acknowledged (offload/ack_manifest.h). Appends to it happen under the same
  // locks as the RocksDB write they describe, so its order is the database's order.
  std::unique_ptr<AckManifest> manifest;
  std::vector<ChunkRange> lost;                 // accepted at this open (accept_lost_chunks)
  std::vector<SequenceId> lost_sequences;       // same, for sequence records
  std::vector<ChunkRange> redropped;            // dropped chunks found present at this open, deleted again
  std::vector<SequenceId> redropped_sequences;  // same, for dropped sequences
  std::string recovered_current;                // the MANIFEST a missing CURRENT was pointed at

  // Keeps the byte/chunk counters exact under concurrency: Put/DeleteChunk take
  // `seq_mu` shared plus the key's stripe (read old meta, write, adjust);
  // DeleteSequence takes `seq_mu` exclusively while it sums and deletes.
  std::shared_mutex seq_mu;
  std::array<std::mutex, 64> stripes;

  std::mutex& StripeFor(const ChunkKey& k) { return stripes[ChunkKeyHash()(k) % stripes.size()]; }

  ~Impl() {
    if (db == nullptr) return;
    for (auto* h : handles) db->DestroyColumnFamilyHandle(h).PermitUncheckedError();
    db->Close().PermitUncheckedError();
    delete db;
  }

  // Size of the chunk currently stored under `key` (from its meta header).
  // *found is false when there is no (verifiable) meta record.
  Status StoredSize(const std::string& key, const ChunkKey& k, bool* found, uint64_t* bytes) {
    *found = false;
    *bytes = 0;
    rocksdb::PinnableSlice v;
    rocksdb::Status s = db->Get(rocksdb::ReadOptions(), meta_cf, key, &v);
    if (s.IsNotFound()) return Status::Ok();
    if (!s.ok()) return FromRocks(s, "reading " + ChunkWhat(k, "meta"));
    Decoded d;
    // A corrupt old meta was not counted on open either: treat it as absent.
    if (!DecodeValue(v, ValueKind::kMeta, ChunkWhat(k, "meta"), &d).ok()) return Status::Ok();
    *found = true;
    *bytes = d.aux;
    return Status::Ok();
  }

  // Open's steps (ColdTier::Open): the database, then what it holds against the manifest.
  rocksdb::DBOptions MakeDbOptions(bool create);
  std::vector<rocksdb::ColumnFamilyDescriptor> MakeColumnFamilies();
  Status OpenDb(bool create);
  Status Assess(Findings* f);
  Status Refusal(const Findings& f) const;
  static std::string DescribeMissing(const Findings& f);
  Status Inspected(Findings f);
  Status Settle(Findings f);

  // Rebuilds the counters from the meta records (small; payloads untouched), and notes
  // which chunks are there for the manifest check (a meta and its payload are one batch,
  // so the meta's key stands for both).
  Status ScanMetas(ChunkRangeSet* present) {
    rocksdb::ReadOptions ro;
    ro.fill_cache = false;
    std::unique_ptr<rocksdb::Iterator> it(db->NewIterator(ro, meta_cf));
    uint64_t bytes = 0, n = 0;
    for (it->SeekToFirst(); it->Valid(); it->Next()) {
      const rocksdb::Slice key = it->key();
      if (key.size() == 20)
        present->Insert(ChunkKey{DecodeBigEndian64(key.data()), DecodeBigEndian32(key.data() + 8),
                                 DecodeBigEndian64(key.data() + 12)});
      Decoded d;
      if (DecodeValue(it->value(), ValueKind::kMeta, "meta", &d).ok()) {
        bytes += d.aux;
        ++n;
      }
    }
    if (!it->status().ok()) return FromRocks(it->status(), "scanning chunk metas in '" + options.path + "'");
    payload_bytes = bytes;
    chunks = n;
    return Status::Ok();
  }

  // Deletes again what the manifest says was dropped or deleted and is present (its delete
  // was lost with the WAL), so that it is neither served nor adopted. *present loses it.
  // With apply false, only lists what it would delete again (a read-only open).
  Status RedoDrops(ChunkRangeSet* present, const std::map<SequenceId, uint32_t>& present_seqs,
                   const std::set<SequenceId>& damaged_seqs, bool apply);

  // Once the manifest holds this many tombstones (offload/ack_manifest.h), a drop flushes
  // RocksDB and prunes them.
  static constexpr uint64_t kPruneDropsAt = 4096;

  // Makes every delete written so far durable without the WAL (a flush of every family),
  // then lets the manifest forget its tombstones. The caller holds `seq_mu` exclusively,
  // or is Open: no drop is between its manifest record and its database write.
  Status FlushAndPruneDrops() {
    rocksdb::FlushOptions fo;
    fo.wait = true;
    fo.allow_write_stall = true;
    rocksdb::Status s = db->Flush(fo, handles);
    if (!s.ok()) return latch->Latch(FromRocks(s, "flushing '" + options.path + "' to make drops durable"));
    return latch->Latch(manifest->PruneDrops());
  }

  // Every write goes through these two. In a ThreadSanitizer build they let one thread
  // into RocksDB's write path at a time: RocksDB groups concurrent writes, and its leader
  // then copies the other writers' batches and reuses its merge buffer across leaders,
  // handing them over through atomics TSan cannot see in the uninstrumented library
  // (tests/tsan.supp). Everything kvtier does around the write stays concurrent. In every
  // other build they are the plain calls.
  rocksdb::Status Write(const rocksdb::WriteOptions& wo, rocksdb::WriteBatch* batch) {
#ifdef KVTIER_TSAN
    std::lock_guard l(tsan_write_mu);
#endif
    return db->Write(wo, batch);
  }
  rocksdb::Status Put(const rocksdb::WriteOptions& wo, rocksdb::ColumnFamilyHandle* cf,
                      const rocksdb::Slice& key, const rocksdb::Slice& value) {
#ifdef KVTIER_TSAN
    std::lock_guard l(tsan_write_mu);
#endif
    return db->Put(wo, cf, key, value);
  }
#ifdef KVTIER_TSAN
  std::mutex tsan_write_mu;
#endif

  void Subtract(uint64_t bytes, uint64_t n) {
    // Counters are exact under the locks; clamp anyway so a bug cannot wrap.
    uint64_t cur = payload_bytes.load();
    while (!payload_bytes.compare_exchange_weak(cur, cur >= bytes ? cur - bytes : 0)) {
    }
    cur = chunks.load();
    while (!chunks.compare_exchange_weak(cur, cur >= n ? cur - n : 0)) {
    }
  }

  // Adds deletes of every key of sequence `seq` (8-byte prefix) in `cf` to the batch.
  Status DeletePrefix(rocksdb::WriteBatch* b, rocksdb::ColumnFamilyHandle* cf, SequenceId seq,
                      const std::string& what) {
    std::string lo = SeqPrefix(seq);
    if (seq != std::numeric_limits<SequenceId>::max()) {
      rocksdb::Status s = b->DeleteRange(cf, lo, SeqPrefix(seq + 1));
      return s.ok() ? Status::Ok() : FromRocks(s, what);
    }
    // No 8-byte successor of 0xff..ff: delete the keys one by one.
    rocksdb::ReadOptions ro;
    ro.fill_cache = false;
    std::unique_ptr<rocksdb::Iterator> it(db->NewIterator(ro, cf));
    for (it->Seek(lo); it->Valid() && it->key().starts_with(lo); it->Next()) {
      rocksdb::Status s = b->Delete(cf, it->key());
      if (!s.ok()) return FromRocks(s, what);
    }
    if (!it->status().ok()) return FromRocks(it->status(), what);
    return Status::Ok();
  }
};

ColdTier::ColdTier(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ColdTier::~ColdTier() = default;

namespace {

// RocksDB's info log for a read-only open: a read-only open writes nothing into the directory,
// not even a LOG line.
class DiscardingLog : public rocksdb::Logger {
 public:
  DiscardingLog() : rocksdb::Logger(rocksdb::InfoLogLevel::HEADER_LEVEL) {}
  using rocksdb::Logger::Logv;
  void Logv(const char*, va_list) override {}
};

// Whether another process holds the store's LOCK (RocksDB takes a POSIX write lock on it
// for as long as a read-write open lasts). Asked with F_OFD_GETLK, which takes nothing, so
// the read-only open that asks leaves the directory as it was. OK when no LOCK file exists.
Status CheckNotLocked(const std::string& dir) {
  const std::string lock = dir + "/LOCK";
  const int fd = ::open(lock.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Status::Ok();
  struct flock fl {};
  fl.l_type = F_WRLCK;
  fl.l_whence = SEEK_SET;
  const int rc = ::fcntl(fd, F_OFD_GETLK, &fl);
  ::close(fd);
  if (rc == 0 && fl.l_type != F_UNLCK)
    return IOError("cold tier: '" + dir + "' is open in another process (pid " + std::to_string(fl.l_pid) +
                   " holds its LOCK); stop it before checking or repairing the store");
  return Status::Ok();
}

// Puts a CURRENT that this open wrote (RecoverCurrent) out of the way again unless the open
// kept the store: a refused or read-only open leaves the directory as it found it. Only a
// CURRENT that still holds what was written is removed.
class CurrentGuard {
 public:
  CurrentGuard(std::string dir, std::string manifest)
      : dir_(std::move(dir)), manifest_(std::move(manifest)) {}
  ~CurrentGuard() {
    if (keep_ || manifest_.empty()) return;
    const std::string current = dir_ + "/CURRENT";
    std::string now;
    if (FILE* f = std::fopen(current.c_str(), "rb")) {
      char buf[256];
      now.assign(buf, std::fread(buf, 1, sizeof buf, f));
      std::fclose(f);
    }
    if (now == manifest_ + "\n") ::unlink(current.c_str());
  }
  CurrentGuard(const CurrentGuard&) = delete;
  CurrentGuard& operator=(const CurrentGuard&) = delete;
  void Keep() { keep_ = true; }

 private:
  const std::string dir_, manifest_;
  bool keep_ = false;
};

}  // namespace

rocksdb::DBOptions ColdTier::Impl::MakeDbOptions(bool create) {
  rocksdb::DBOptions dbo;
  dbo.create_if_missing = create;
  dbo.create_missing_column_families = true;
  dbo.paranoid_checks = true;
  unsigned hw = std::max(2u, std::thread::hardware_concurrency());
  dbo.max_background_jobs = static_cast<int>(std::clamp(hw / 2, 2u, 8u));
  dbo.bytes_per_sync = 1 << 20;
  dbo.wal_bytes_per_sync = 0;  // sync_writes decides; no partial WAL syncs otherwise
  // Metas are small, so their memtable rarely fills; cap the WAL so old WAL
  // files (which pin every family's unflushed data) force flushes.
  dbo.max_total_wal_size = std::max<uint64_t>(64ull << 20, 4ull * options.write_buffer_bytes);
  // Replay the WAL up to the first damaged record and keep that consistent prefix; the
  // manifest check below names whatever acknowledged data the prefix lacks. Why not the
  // other modes: see "What was acknowledged" in cold_tier.h.
  dbo.wal_recovery_mode = rocksdb::WALRecoveryMode::kPointInTimeRecovery;
  return dbo;
}

std::vector<rocksdb::ColumnFamilyDescriptor> ColdTier::Impl::MakeColumnFamilies() {
  const rocksdb::CompressionType ctype = ToRocks(options.compression);
  std::shared_ptr<rocksdb::Cache> cache;
  if (options.block_cache_bytes > 0) cache = rocksdb::NewLRUCache(options.block_cache_bytes);
  std::shared_ptr<const rocksdb::FilterPolicy> bloom(rocksdb::NewBloomFilterPolicy(10));
  auto make_cf = [&](size_t write_buffer) {
    rocksdb::ColumnFamilyOptions c;
    c.write_buffer_size = write_buffer;
    c.max_write_buffer_number = 3;
    c.compression = ctype;
    c.level_compaction_dynamic_level_bytes = true;
    c.target_file_size_base = 64ull << 20;
    rocksdb::BlockBasedTableOptions t;
    t.block_cache = cache;
    t.no_block_cache = !cache;
    t.filter_policy = bloom;
    t.checksum = rocksdb::kXXH3;
    t.format_version = 5;
    // 4 KiB target: every payload (>= a few KiB) is a block of its own, so a
    // read decompresses exactly one value.
    t.block_size = 4 << 10;
    c.table_factory.reset(rocksdb::NewBlockBasedTableFactory(t));
    return c;
  };
  const size_t wb = options.write_buffer_bytes;
  const size_t small_wb = std::min<size_t>(wb, 8u << 20);
  return {
      {cold_tier_format::kSequenceColumn, make_cf(small_wb)},
      {cold_tier_format::kMetaColumn, make_cf(small_wb)},
      {cold_tier_format::kPayloadColumn, make_cf(wb)},
      {cold_tier_format::kBlobColumn, make_cf(wb)},
  };
}

Status ColdTier::Impl::OpenDb(bool create) {
  const std::string& path = options.path;
  rocksdb::DBOptions dbo = MakeDbOptions(create);
  std::vector<rocksdb::ColumnFamilyDescriptor> cfs = MakeColumnFamilies();
  rocksdb::Status s;
  latch = std::make_shared<ColdTierWriteLatch>(path, read_only);
  if (read_only) {
    KVTIER_RETURN_IF_ERROR(CheckNotLocked(path));
    dbo.info_log = std::make_shared<DiscardingLog>();
    // A read-only open cannot create a family its MANIFEST lacks (a MANIFEST truncated before
    // the families were recorded): that is damage, named here.
    std::vector<std::string> names;
    s = rocksdb::DB::ListColumnFamilies(dbo, path, &names);
    if (!s.ok()) return FromRocks(s, "reading the column families of '" + path + "'");
    for (const auto& cf : cfs)
      if (std::find(names.begin(), names.end(), cf.name) == names.end())
        return Corruption(
            "cold tier: '" + path + "': its MANIFEST lists no column family '" + cf.name +
            "' (a damaged or truncated MANIFEST); nothing was changed. RocksDB's repair rebuilds "
            "the MANIFEST from the tables and logs that are there: 'kvtier repair --data-dir " +
            path + " --into NEW' runs it on a copy");
    s = rocksdb::DB::OpenForReadOnly(dbo, path, cfs, &handles, &db);
  } else {
    dbo.listeners.push_back(std::make_shared<BackgroundErrorListener>(latch));
    // RocksDB's info log goes through InfoLog (above), which survives a full disk.
    dbo.info_log = std::make_shared<InfoLog>(path);
    s = rocksdb::DB::Open(dbo, path, cfs, &handles, &db);
  }
  if (!s.ok()) {
    std::string what = "open '" + path + "'" + (read_only ? " read-only" : "");
    if (!recovered_current.empty())
      what += " (its CURRENT file was missing; pointed at " + recovered_current +
              ", the only MANIFEST, it still does not open)";
    return FromRocks(s, what);
  }
  seq_cf = handles[0];
  meta_cf = handles[1];
  payload_cf = handles[2];
  blob_cf = handles[3];

  // Format marker: written on first open, checked afterwards.
  std::string marker;
  s = db->Get(rocksdb::ReadOptions(), seq_cf, kFormatMarkerKey, &marker);
  if (s.IsNotFound()) {
    if (read_only) return Status::Ok();  // written by the first read-write open
    rocksdb::WriteOptions wo;
    wo.sync = true;
    s = Put(wo, seq_cf, kFormatMarkerKey, kFormatMarkerValue);
    if (!s.ok()) return FromRocks(s, "writing the format marker in '" + path + "'");
  } else if (!s.ok()) {
    return FromRocks(s, "reading the format marker in '" + path + "'");
  } else if (marker != kFormatMarkerValue) {
    return FailedPrecondition("cold tier: '" + path + "' holds format '" + marker + "', this build reads '" +
                              kFormatMarkerValue + "'");
  }
  return Status::Ok();
}

Result<std::unique_ptr<ColdTier>> ColdTier::Open(const ColdTierOptions& options) {
  KVTIER_RETURN_IF_ERROR(options.Validate());
  namespace fs = std::filesystem;
  const std::string& path = options.path;
  std::error_code ec;
  bool exists = false;
  KVTIER_RETURN_IF_ERROR(StatDataDir(path, &exists));
  if (!exists && options.read_only)
    return NotFound("cold tier: data dir '" + path + "' does not exist (no store to open read-only)");
  if (!exists) {
    fs::create_directories(path, ec);
    if (ec) return IOError("cold tier: cannot create data dir '" + path + "': " + ec.message());
  }

  // A directory that holds a store is never opened as a new one (see RecoverCurrent).
  StoreFiles files;
  KVTIER_RETURN_IF_ERROR(ListStoreFiles(path, &files));
  if (options.read_only && !files.holds_store())
    return NotFound(
        "cold tier: '" + path +
        "' holds no kvtier store (no CURRENT, MANIFEST-*, write-ahead log, table or ack manifest)");

  const rocksdb::CompressionType ctype = ToRocks(options.compression);
  if (ctype != rocksdb::kNoCompression) {
    auto supported = rocksdb::GetSupportedCompressions();
    if (std::find(supported.begin(), supported.end(), ctype) == supported.end())
      return Unavailable(std::string("cold tier: this RocksDB was built without ") +
                         CompressionName(options.compression) + " compression");
  }

  std::string recovered_current;
  if (files.holds_store() && !files.current) {
    KVTIER_ASSIGN_OR_RETURN(recovered_current, RecoverCurrent(path, files));
  }
  CurrentGuard current_guard(path, recovered_current);

  // Opening never destroys evidence: a read-write open of a damaged store lets RocksDB
  // flush what it replayed and delete the logs and tables its MANIFEST does not list, so
  // every check that can refuse runs first on a read-only open, which replays the WAL in
  // memory and changes nothing. With accept_lost_chunks the loss is accepted anyway, and
  // the read-write open's own check lists it.
  if (files.holds_store() && !options.read_only && !options.accept_lost_chunks) {
    ColdTierOptions probe = options;
    probe.read_only = true;
    probe.fault_injector = nullptr;
    auto impl = std::make_unique<Impl>();
    impl->options = probe;
    impl->read_only = true;
    impl->recovered_current = recovered_current;
    KVTIER_RETURN_IF_ERROR(impl->OpenDb(/*create=*/false));
    Findings found;
    KVTIER_RETURN_IF_ERROR(impl->Assess(&found));
    KVTIER_RETURN_IF_ERROR(impl->Refusal(found));
  }

  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->read_only = options.read_only;
  impl->recovered_current = recovered_current;
  impl->write_options.sync = options.sync_writes;
  impl->write_options.disableWAL = false;
  KVTIER_RETURN_IF_ERROR(impl->OpenDb(/*create=*/!files.holds_store()));
  Findings found;
  KVTIER_RETURN_IF_ERROR(impl->Assess(&found));
  if (impl->read_only) {
    KVTIER_RETURN_IF_ERROR(impl->Inspected(std::move(found)));
  } else {
    if (!options.accept_lost_chunks) KVTIER_RETURN_IF_ERROR(impl->Refusal(found));
    KVTIER_RETURN_IF_ERROR(impl->Settle(std::move(found)));
    current_guard.Keep();
  }
  return std::unique_ptr<ColdTier>(new ColdTier(std::move(impl)));
}

namespace {

// A column family handle that only names a family: what SstFileWriter needs to stamp a table
// with the family's name and id (its table properties), so that RocksDB's repair files the
// table, and the log records of that id, under that family.
class NamedFamily final : public rocksdb::ColumnFamilyHandle {
 public:
  NamedFamily(std::string name, uint32_t id) : name_(std::move(name)), id_(id) {}
  const std::string& GetName() const override { return name_; }
  uint32_t GetID() const override { return id_; }
  rocksdb::Status GetDescriptor(rocksdb::ColumnFamilyDescriptor*) override {
    return rocksdb::Status::NotSupported("a family name only");
  }
  const rocksdb::Comparator* GetComparator() const override { return rocksdb::BytewiseComparator(); }

 private:
  const std::string name_;
  const uint32_t id_;
};

// The key the seed tables delete: kvtier never writes it (chunk keys are binary and fixed
// length, sequence keys start with 'S'), and a tombstone is invisible to every read.
const char* const kRepairSeedKey = "~kvtier-repair-seed";

// Gives every family of `families` that no table in `dir` names a table of its own (one
// tombstone, see ColdTier::Repair). `families` starts with RocksDB's default family (id 0,
// which the repair always has); a kvtier store creates the others in their order at its first
// open, so family i has id i. When a table says otherwise the ids are not kvtier's and nothing
// is seeded: the repair then keeps what the tables and RocksDB's rules reach.
Status SeedFamiliesWithoutTables(const std::string& dir,
                                 const std::vector<rocksdb::ColumnFamilyDescriptor>& families) {
  namespace fs = std::filesystem;
  std::map<std::string, uint32_t> tabled;  // family name -> id, from the tables present
  uint64_t next_number = 1;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    const size_t digits =
        std::find_if(name.begin(), name.end(), [](char c) { return c < '0' || c > '9'; }) - name.begin();
    if (digits > 0 && digits < 20)
      next_number = std::max<uint64_t>(next_number, std::stoull(name.substr(0, digits)) + 1);
    if (name.rfind("MANIFEST-", 0) == 0 && name.size() > 9 && name.size() < 29)
      next_number = std::max<uint64_t>(next_number, std::strtoull(name.c_str() + 9, nullptr, 10) + 1);
    if (!IsNumbered(name, ".sst")) continue;
    rocksdb::Options o;
    rocksdb::SstFileReader reader(o);
    if (!reader.Open(it->path().string()).ok()) continue;  // damaged: the repair sets it aside
    const auto props = reader.GetTableProperties();
    if (props != nullptr) tabled[props->column_family_name] = static_cast<uint32_t>(props->column_family_id);
  }
  if (ec) return IOError("cold tier: cannot list data dir '" + dir + "': " + ec.message());
  for (size_t i = 0; i < families.size(); ++i) {
    auto found = tabled.find(families[i].name);
    if (found != tabled.end() && found->second != i) return Status::Ok();
  }
  if (families.empty() || families[0].name != rocksdb::kDefaultColumnFamilyName) return Status::Ok();
  for (size_t i = 1; i < families.size(); ++i) {
    if (tabled.count(families[i].name)) continue;
    NamedFamily family(families[i].name, static_cast<uint32_t>(i));
    rocksdb::SstFileWriter writer(rocksdb::EnvOptions(),
                                  rocksdb::Options(rocksdb::DBOptions(), families[i].options), &family);
    char file[32];
    std::snprintf(file, sizeof file, "%06" PRIu64 ".sst", next_number++);
    const std::string path = dir + "/" + file;
    rocksdb::Status s = writer.Open(path);
    if (s.ok()) s = writer.Delete(kRepairSeedKey);
    if (s.ok()) s = writer.Finish();
    if (!s.ok()) {
      ::unlink(path.c_str());
      return FromRocks(s, "writing a table for column family '" + families[i].name + "' in '" + dir + "'");
    }
  }
  return Status::Ok();
}

}  // namespace

Status ColdTier::Repair(const ColdTierOptions& options) {
  KVTIER_RETURN_IF_ERROR(options.Validate());
  const std::string& path = options.path;
  bool exists = false;
  KVTIER_RETURN_IF_ERROR(StatDataDir(path, &exists));
  if (!exists) return NotFound("cold tier: data dir '" + path + "' does not exist (no store to repair)");
  StoreFiles files;
  KVTIER_RETURN_IF_ERROR(ListStoreFiles(path, &files));
  if (!files.holds_store())
    return NotFound(
        "cold tier: '" + path +
        "' holds no kvtier store (no CURRENT, MANIFEST-*, write-ahead log, table or ack manifest)");
  KVTIER_RETURN_IF_ERROR(CheckNotLocked(path));
  Impl impl;
  impl.options = options;
  rocksdb::DBOptions dbo = impl.MakeDbOptions(/*create=*/false);
  dbo.info_log = std::make_shared<InfoLog>(path);
  const std::vector<rocksdb::ColumnFamilyDescriptor> families = impl.MakeColumnFamilies();
  KVTIER_RETURN_IF_ERROR(SeedFamiliesWithoutTables(path, families));
  rocksdb::Status s = rocksdb::RepairDB(path, dbo, families, rocksdb::ColumnFamilyOptions());
  if (!s.ok()) return FromRocks(s, "RocksDB's repair of '" + path + "'");
  return Status::Ok();
}

// What Open found, before it changes anything (see "What was acknowledged" in cold_tier.h).
Status ColdTier::Impl::Assess(Findings* f) {
  const std::string& path = options.path;
  KVTIER_RETURN_IF_ERROR(ScanMetas(&f->present));
  // CRC of every sequence record present, to compare with the acknowledged ones. A record
  // that is there but fails its checksum is not reported here: reading it says Corruption.
  {
    rocksdb::ReadOptions ro;
    ro.fill_cache = false;
    std::unique_ptr<rocksdb::Iterator> it(db->NewIterator(ro, seq_cf));
    for (it->Seek("S"); it->Valid() && it->key().starts_with("S"); it->Next()) {
      const rocksdb::Slice key = it->key();
      if (key.size() != 9) continue;  // ForEachSequence reports malformed keys
      Decoded d;
      const SequenceId seq = DecodeBigEndian64(key.data() + 1);
      if (DecodeValue(it->value(), ValueKind::kSequence, "sequence record", &d).ok())
        f->present_seqs[seq] = Crc32c(d.body.data(), d.body.size());
      else
        f->damaged_seqs.insert(seq);
    }
    if (!it->status().ok()) return FromRocks(it->status(), "scanning sequence records in '" + path + "'");
  }
  std::string marker;
  rocksdb::Status s = db->Get(rocksdb::ReadOptions(), seq_cf, cold_tier_format::kManifestMarkerKey, &marker);
  if (!s.ok() && !s.IsNotFound()) return FromRocks(s, "reading the manifest marker in '" + path + "'");
  f->had_marker = s.ok();

  auto opened = read_only ? AckManifest::Read(path) : AckManifest::Open(path, options.sync_writes);
  if (opened.ok()) {
    manifest = std::move(*opened);
  } else if (opened.status().code() == StatusCode::kNotFound && !f->had_marker) {
    // A new directory, or a store from before manifests: what it holds is what was acknowledged.
    f->new_manifest = true;
    return Status::Ok();
  } else {
    f->manifest_problem = opened.status().code() == StatusCode::kNotFound
                              ? "the ack manifest '" + path + "/" + AckManifest::kFileName +
                                    "' is missing, but this store was created with one"
                              : opened.status().message();
    return Status::Ok();
  }
  const ChunkRangeSet acked = manifest->chunks();
  f->missing = acked.Minus(f->present);
  for (const auto& [seq, crc] : manifest->sequences()) {
    if (f->damaged_seqs.count(seq)) continue;
    auto it = f->present_seqs.find(seq);
    if (it == f->present_seqs.end() || it->second != crc) f->missing_seqs.push_back(seq);
  }
  return Status::Ok();
}

// The Corruption an open without accept_lost_chunks fails with, given what Assess found.
Status ColdTier::Impl::Refusal(const Findings& f) const {
  const std::string& path = options.path;
  const std::string untouched = " Nothing in the directory was changed.";
  if (!f.manifest_problem.empty())
    return Corruption(
        "cold tier: " + f.manifest_problem +
        "; which acknowledged chunks are still there cannot be checked." + untouched +
        " Open with accept_lost_chunks (kvtier check --accept-lost) to rebuild it from the chunks "
        "present.");
  if (f.missing.empty() && f.missing_seqs.empty()) return Status::Ok();
  return Corruption("cold tier: " + DescribeMissing(f) + " in '" + path +
                    "': RocksDB recovered only part of what was acknowledged (damage or a truncation of its "
                    "write-ahead log or MANIFEST)." +
                    untouched + " RocksDB's repair may salvage them: 'kvtier repair --data-dir " + path +
                    " --into NEW' runs it on a copy and names what is still missing; after that, "
                    "accept_lost_chunks (kvtier check --accept-lost, which lists them first) goes on "
                    "without them.");
}

std::string ColdTier::Impl::DescribeMissing(const Findings& f) {
  std::string what;
  if (!f.missing.empty())
    what = std::to_string(CountChunks(f.missing)) + " acknowledged chunks are missing (" +
           DescribeRanges(f.missing) + ")";
  if (!f.missing_seqs.empty()) {
    if (!what.empty()) what += " and ";
    what += std::to_string(f.missing_seqs.size()) +
            " acknowledged sequence records are missing or older (sequence";
    for (size_t i = 0; i < f.missing_seqs.size() && i < 50; ++i)
      what += " " + std::to_string(f.missing_seqs[i]);
    if (f.missing_seqs.size() > 50) what += " ...";
    what += ")";
  }
  return what;
}

// A read-only open keeps what it found: refused unless list_missing, else listed.
Status ColdTier::Impl::Inspected(Findings f) {
  if (!options.list_missing) KVTIER_RETURN_IF_ERROR(Refusal(f));
  manifest_problem = f.manifest_problem;
  if (manifest == nullptr) acked_without_manifest = f.present;
  lost = std::move(f.missing);
  lost_sequences = std::move(f.missing_seqs);
  if (manifest != nullptr) {
    ChunkRangeSet present = f.present;
    KVTIER_RETURN_IF_ERROR(RedoDrops(&present, f.present_seqs, f.damaged_seqs, /*apply=*/false));
  }
  return Status::Ok();
}

// The writes of a read-write open once Refusal passed (or the loss is accepted): the manifest
// created or rebuilt, the loss forgotten, lost drops done again, strays adopted.
Status ColdTier::Impl::Settle(Findings f) {
  const std::string& path = options.path;
  if (manifest == nullptr) {  // new, or (accepted) missing or damaged: restart from what is here
    KVTIER_ASSIGN_OR_RETURN(manifest,
                            AckManifest::Create(path, options.sync_writes, f.present, f.present_seqs));
  }
  if (!f.had_marker) {
    rocksdb::WriteOptions wo;
    wo.sync = true;
    rocksdb::Status s = Put(wo, seq_cf, cold_tier_format::kManifestMarkerKey, AckManifest::kFileName);
    if (!s.ok()) return FromRocks(s, "writing the manifest marker in '" + path + "'");
  }
  if (!f.missing.empty() || !f.missing_seqs.empty()) {
    KVTIER_RETURN_IF_ERROR(manifest->Forget(f.missing, f.missing_seqs));
    lost = std::move(f.missing);
    lost_sequences = std::move(f.missing_seqs);
  }
  // A drop or delete the manifest recorded, whose database write is gone: done again.
  ChunkRangeSet kept = f.present;
  std::map<SequenceId, uint32_t> kept_seqs = f.present_seqs;
  KVTIER_RETURN_IF_ERROR(RedoDrops(&kept, f.present_seqs, f.damaged_seqs, /*apply=*/true));
  for (SequenceId seq : redropped_sequences) kept_seqs.erase(seq);
  // Present, never acknowledged and never dropped (a write in flight when the process died
  // that landed anyway): the store brings it back, so from now on it counts as acknowledged.
  std::vector<ChunkRange> extra = kept.Minus(manifest->chunks());
  std::vector<std::pair<SequenceId, uint32_t>> extra_seqs;
  const std::map<SequenceId, uint32_t> now_seqs = manifest->sequences();
  for (const auto& [seq, crc] : kept_seqs) {
    auto it = now_seqs.find(seq);
    if (it == now_seqs.end() || it->second != crc) extra_seqs.emplace_back(seq, crc);
  }
  KVTIER_RETURN_IF_ERROR(manifest->Adopt(extra, extra_seqs));
  // Every delete is in a table after this flush, so losing a WAL can no longer undo one.
  if (manifest->drop_records() > 0) KVTIER_RETURN_IF_ERROR(FlushAndPruneDrops());
  return Status::Ok();
}

Status ColdTier::Impl::RedoDrops(ChunkRangeSet* present, const std::map<SequenceId, uint32_t>& present_seqs,
                                 const std::set<SequenceId>& damaged_seqs, bool apply) {
  const std::string& path = options.path;
  const std::string what = "deleting again what was dropped in '" + path + "'";
  const ChunkRangeSet acked = manifest->chunks();
  rocksdb::WriteBatch batch;
  rocksdb::Status s;
  std::set<SequenceId> whole;  // sequences deleted as a whole (a drop nothing was acknowledged in since)
  {
    rocksdb::ReadOptions ro;
    ro.fill_cache = false;
    std::unique_ptr<rocksdb::Iterator> blobs(db->NewIterator(ro, blob_cf));
    for (SequenceId seq : manifest->DroppedSequenceRecords()) {
      const bool record_back = present_seqs.count(seq) > 0 || damaged_seqs.count(seq) > 0;
      if (acked.HasSequence(seq)) {
        // Chunks acknowledged after the drop stay; the record and any other chunk go.
        if (record_back) {
          s = batch.Delete(seq_cf, cold_tier_format::SequenceKey(seq));
          if (!s.ok()) return FromRocks(s, what);
          redropped_sequences.push_back(seq);
        }
        continue;
      }
      const std::string prefix = SeqPrefix(seq);
      blobs->Seek(prefix);
      const bool blobs_back = blobs->Valid() && blobs->key().starts_with(prefix);
      if (!blobs->status().ok()) return FromRocks(blobs->status(), what);
      if (!record_back && !blobs_back && !present->HasSequence(seq)) continue;
      s = batch.Delete(seq_cf, cold_tier_format::SequenceKey(seq));
      if (!s.ok()) return FromRocks(s, what);
      for (rocksdb::ColumnFamilyHandle* cf : {meta_cf, payload_cf, blob_cf})
        KVTIER_RETURN_IF_ERROR(DeletePrefix(&batch, cf, seq, what));
      whole.insert(seq);
      redropped_sequences.push_back(seq);
    }
  }
  redropped = manifest->DroppedAmong(present->Minus(acked));
  for (const ChunkRange& r : redropped) {
    if (whole.count(r.seq)) continue;
    for (uint64_t i = r.first;; ++i) {  // present keys: as many as the database holds
      const std::string key = cold_tier_format::ChunkKeyBytes(ChunkKey{r.seq, r.layer, i});
      s = batch.Delete(meta_cf, key);
      if (s.ok()) s = batch.Delete(payload_cf, key);
      if (!s.ok()) return FromRocks(s, what);
      if (i == r.last) break;  // not i <= last: last may be UINT64_MAX
    }
  }
  if (batch.Count() == 0 || !apply) return Status::Ok();
  rocksdb::WriteOptions wo;
  wo.sync = true;
  s = Write(wo, &batch);
  if (!s.ok()) return FromRocks(s, what);
  for (const ChunkRange& r : redropped) present->EraseRange(r.seq, r.layer, r.first, r.last);
  for (SequenceId seq : whole) present->EraseSequence(seq);
  ChunkRangeSet recount;
  return ScanMetas(&recount);  // the counters counted what is gone now
}

Status ColdTier::PutChunk(const ChunkKey& k, std::string_view meta, const void* payload,
                          size_t payload_bytes) {
  if (payload_bytes == 0)
    return InvalidArgument("cold tier: chunk " + k.ToString() + " payload_bytes must be > 0");
  KVTIER_RETURN_IF_ERROR(impl_->latch->Check());
  if (impl_->options.fault_injector) KVTIER_RETURN_IF_ERROR(impl_->options.fault_injector("put", k));
  if (payload == nullptr) return InvalidArgument("cold tier: chunk " + k.ToString() + " payload is null");
  constexpr size_t kMaxValue = std::numeric_limits<uint32_t>::max() - cold_tier_format::kValueHeaderBytes;
  if (payload_bytes > kMaxValue || meta.size() > kMaxValue)
    return InvalidArgument("cold tier: chunk " + k.ToString() + " payload or meta exceeds 4 GiB");
  Impl& m = *impl_;
  const std::string key = cold_tier_format::ChunkKeyBytes(k);
  const Header meta_h = MakeHeader(ValueKind::kMeta, meta.data(), meta.size(), payload_bytes);
  const Header pay_h = MakeHeader(ValueKind::kPayload, payload, payload_bytes, 0);

  rocksdb::WriteBatch batch(payload_bytes + meta.size() + 2 * sizeof(Header) + 128);
  rocksdb::Slice key_slice(key);
  rocksdb::Slice meta_parts[2] = {rocksdb::Slice(meta_h.data(), meta_h.size()),
                                  rocksdb::Slice(meta.data(), meta.size())};
  rocksdb::Slice pay_parts[2] = {rocksdb::Slice(pay_h.data(), pay_h.size()),
                                 rocksdb::Slice(static_cast<const char*>(payload), payload_bytes)};
  rocksdb::Status s =
      batch.Put(m.meta_cf, rocksdb::SliceParts(&key_slice, 1), rocksdb::SliceParts(meta_parts, 2));
  if (s.ok())
    s = batch.Put(m.payload_cf, rocksdb::SliceParts(&key_slice, 1), rocksdb::SliceParts(pay_parts, 2));
  if (!s.ok()) return FromRocks(s, "writing " + ChunkWhat(k, "batch"));

  std::shared_lock seq_lock(m.seq_mu);
  std::lock_guard stripe_lock(m.StripeFor(k));
  bool had = false;
  uint64_t old_bytes = 0;
  KVTIER_RETURN_IF_ERROR(m.StoredSize(key, k, &had, &old_bytes));
  s = m.Write(m.write_options, &batch);
  if (!s.ok()) return m.latch->Latch(FromRocks(s, "writing chunk " + k.ToString()));
  if (had) m.Subtract(old_bytes, 1);
  m.payload_bytes += payload_bytes;
  m.chunks += 1;
  // Acknowledged only once the manifest lists it: a reopen then checks it came back.
  Status ack = m.manifest->AckChunk(k);
  if (!ack.ok())
    return m.latch->Latch(Status(
        ack.code(), "cold tier: chunk " + k.ToString() +
                        " is written but its acknowledgement could not be recorded: " + ack.message()));
  return Status::Ok();
}

Status ColdTier::GetChunk(const ChunkKey& k, void* dst, size_t payload_bytes) {
  if (dst == nullptr && payload_bytes > 0)
    return InvalidArgument("cold tier: chunk " + k.ToString() + " destination is null");
  if (impl_->options.fault_injector) KVTIER_RETURN_IF_ERROR(impl_->options.fault_injector("get", k));
  Impl& m = *impl_;
  const std::string key = cold_tier_format::ChunkKeyBytes(k);
  rocksdb::ReadOptions ro;
  ro.verify_checksums = true;
  ro.fill_cache = false;  // the warm tier is the payload cache
  rocksdb::PinnableSlice v;
  rocksdb::Status s = m.db->Get(ro, m.payload_cf, key, &v);
  const std::string what = ChunkWhat(k, "payload");
  if (s.IsNotFound()) return NotFound("cold tier: " + what + " not found");
  if (!s.ok()) return FromRocks(s, "reading " + what);
  Decoded d;
  KVTIER_RETURN_IF_ERROR(DecodeValue(v, ValueKind::kPayload, what, &d));
  if (d.body.size() != payload_bytes)
    return InvalidArgument("cold tier: " + what + " holds " + std::to_string(d.body.size()) +
                           " bytes, caller asked for " + std::to_string(payload_bytes));
  std::memcpy(dst, d.body.data(), payload_bytes);
  return Status::Ok();
}

void ColdTier::GetChunkMetas(const std::vector<ChunkKey>& keys, std::vector<std::string>* metas,
                             std::vector<Status>* statuses) {
  Impl& m = *impl_;
  const size_t n = keys.size();
  metas->assign(n, std::string());
  statuses->assign(n, Status::Ok());
  std::vector<std::string> key_bytes;
  std::vector<rocksdb::Slice> slices;
  std::vector<size_t> asked;  // positions in `keys` that go to RocksDB
  key_bytes.reserve(n);
  slices.reserve(n);
  asked.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    if (impl_->options.fault_injector) {
      Status f = impl_->options.fault_injector("meta", keys[i]);
      if (!f.ok()) {
        (*statuses)[i] = std::move(f);
        continue;
      }
    }
    key_bytes.push_back(cold_tier_format::ChunkKeyBytes(keys[i]));
    asked.push_back(i);
  }
  for (const std::string& k : key_bytes) slices.emplace_back(k);
  if (asked.empty()) return;
  rocksdb::ReadOptions ro;
  ro.verify_checksums = true;
  std::vector<rocksdb::PinnableSlice> values(asked.size());
  std::vector<rocksdb::Status> rs(asked.size());
  m.db->MultiGet(ro, m.meta_cf, asked.size(), slices.data(), values.data(), rs.data());
  for (size_t j = 0; j < asked.size(); ++j) {
    const size_t i = asked[j];
    const std::string what = ChunkWhat(keys[i], "meta");
    if (rs[j].IsNotFound()) {
      (*statuses)[i] = NotFound("cold tier: " + what + " not found");
      continue;
    }
    if (!rs[j].ok()) {
      (*statuses)[i] = FromRocks(rs[j], "reading " + what);
      continue;
    }
    Decoded d;
    Status st = DecodeValue(values[j], ValueKind::kMeta, what, &d);
    if (!st.ok()) {
      (*statuses)[i] = std::move(st);
      continue;
    }
    (*metas)[i].assign(d.body.data(), d.body.size());
  }
}

Status ColdTier::DeleteChunk(const ChunkKey& k) {
  Impl& m = *impl_;
  KVTIER_RETURN_IF_ERROR(m.latch->Check());
  const std::string key = cold_tier_format::ChunkKeyBytes(k);
  rocksdb::WriteBatch batch;
  rocksdb::Status s = batch.Delete(m.meta_cf, key);
  if (s.ok()) s = batch.Delete(m.payload_cf, key);
  if (!s.ok()) return FromRocks(s, "deleting chunk " + k.ToString());

  {
    std::shared_lock seq_lock(m.seq_mu);
    std::lock_guard stripe_lock(m.StripeFor(k));
    bool had = false;
    uint64_t old_bytes = 0;
    KVTIER_RETURN_IF_ERROR(m.StoredSize(key, k, &had, &old_bytes));
    // Off the manifest (a tombstone) before the delete is written: a crash in between leaves
    // a chunk nobody vouches for, which the next open deletes, never a vouched-for chunk
    // that is gone.
    KVTIER_RETURN_IF_ERROR(m.latch->Latch(m.manifest->DeleteChunk(k)));
    s = m.Write(m.write_options, &batch);
    if (!s.ok()) return m.latch->Latch(FromRocks(s, "deleting chunk " + k.ToString()));
    if (had) m.Subtract(old_bytes, 1);
  }
  if (m.manifest->drop_records() >= Impl::kPruneDropsAt) {
    std::unique_lock seq_lock(m.seq_mu);
    if (m.manifest->drop_records() >= Impl::kPruneDropsAt) KVTIER_RETURN_IF_ERROR(m.FlushAndPruneDrops());
  }
  return Status::Ok();
}

Status ColdTier::PutSequence(SequenceId seq, std::string_view record) {
  if (record.size() > std::numeric_limits<uint32_t>::max() - cold_tier_format::kValueHeaderBytes)
    return InvalidArgument("cold tier: " + SeqWhat(seq) + " exceeds 4 GiB");
  Impl& m = *impl_;
  KVTIER_RETURN_IF_ERROR(m.latch->Check());
  const Header h = MakeHeader(ValueKind::kSequence, record.data(), record.size(), 0);
  std::string value;
  value.reserve(h.size() + record.size());
  value.append(h.data(), h.size());
  value.append(record.data(), record.size());
  std::shared_lock seq_lock(m.seq_mu);  // ordered with DeleteSequence, as in the manifest
  rocksdb::Status s = m.Put(m.write_options, m.seq_cf, cold_tier_format::SequenceKey(seq), value);
  if (!s.ok()) return m.latch->Latch(FromRocks(s, "writing " + SeqWhat(seq)));
  Status ack = m.manifest->AckSequenceRecord(seq, Crc32c(record.data(), record.size()));
  if (!ack.ok())
    return m.latch->Latch(Status(
        ack.code(), "cold tier: " + SeqWhat(seq) +
                        " is written but its acknowledgement could not be recorded: " + ack.message()));
  return Status::Ok();
}

Status ColdTier::DeleteSequence(SequenceId seq) {
  Impl& m = *impl_;
  const std::string what = "deleting sequence " + std::to_string(seq);
  KVTIER_RETURN_IF_ERROR(m.latch->Check());
  std::unique_lock seq_lock(m.seq_mu);  // no chunk put/delete runs meanwhile

  // Sum what the counters hold for this sequence.
  uint64_t bytes = 0, n = 0;
  {
    const std::string lo = SeqPrefix(seq);
    rocksdb::ReadOptions ro;
    ro.fill_cache = false;
    std::unique_ptr<rocksdb::Iterator> it(m.db->NewIterator(ro, m.meta_cf));
    for (it->Seek(lo); it->Valid() && it->key().starts_with(lo); it->Next()) {
      Decoded d;
      if (DecodeValue(it->value(), ValueKind::kMeta, "meta", &d).ok()) {
        bytes += d.aux;
        ++n;
      }
    }
    if (!it->status().ok()) return FromRocks(it->status(), what);
  }

  rocksdb::WriteBatch batch;
  rocksdb::Status s = batch.Delete(m.seq_cf, cold_tier_format::SequenceKey(seq));
  if (!s.ok()) return FromRocks(s, what);
  KVTIER_RETURN_IF_ERROR(m.DeletePrefix(&batch, m.meta_cf, seq, what));
  KVTIER_RETURN_IF_ERROR(m.DeletePrefix(&batch, m.payload_cf, seq, what));
  KVTIER_RETURN_IF_ERROR(m.DeletePrefix(&batch, m.blob_cf, seq, what));
  KVTIER_RETURN_IF_ERROR(m.latch->Latch(m.manifest->DropSequence(seq)));  // before the write, as DeleteChunk
  s = m.Write(m.write_options, &batch);
  if (!s.ok()) return m.latch->Latch(FromRocks(s, what));
  m.Subtract(bytes, n);
  if (m.manifest->drop_records() >= Impl::kPruneDropsAt) KVTIER_RETURN_IF_ERROR(m.FlushAndPruneDrops());
  return Status::Ok();
}

Status ColdTier::ForEachSequence(const std::function<Status(SequenceId, std::string_view)>& fn) {
  Impl& m = *impl_;
  rocksdb::ReadOptions ro;
  const std::string upper_key = "T";  // 'S' + 1: every sequence key is below it
  rocksdb::Slice upper(upper_key);
  ro.iterate_upper_bound = &upper;
  std::unique_ptr<rocksdb::Iterator> it(m.db->NewIterator(ro, m.seq_cf));
  for (it->Seek("S"); it->Valid(); it->Next()) {
    rocksdb::Slice key = it->key();
    if (key.size() != 9 || key[0] != 'S')
      return Corruption("cold tier: malformed sequence key 0x" +
                        Hex(std::string_view(key.data(), key.size())));
    SequenceId seq = DecodeBigEndian64(key.data() + 1);
    Decoded d;
    KVTIER_RETURN_IF_ERROR(DecodeValue(it->value(), ValueKind::kSequence, SeqWhat(seq), &d));
    KVTIER_RETURN_IF_ERROR(fn(seq, d.body));
  }
  if (!it->status().ok()) return FromRocks(it->status(), "iterating sequence records");
  return Status::Ok();
}

Status ColdTier::ForEachChunkMeta(SequenceId seq,
                                  const std::function<Status(const ChunkKey&, std::string_view)>& fn) {
  Impl& m = *impl_;
  const std::string lo = SeqPrefix(seq);
  std::string hi;
  rocksdb::Slice upper;
  rocksdb::ReadOptions ro;
  if (seq != std::numeric_limits<SequenceId>::max()) {
    hi = SeqPrefix(seq + 1);
    upper = rocksdb::Slice(hi);
    ro.iterate_upper_bound = &upper;
  }
  std::unique_ptr<rocksdb::Iterator> it(m.db->NewIterator(ro, m.meta_cf));
  for (it->Seek(lo); it->Valid() && it->key().starts_with(lo); it->Next()) {
    rocksdb::Slice key = it->key();
    if (key.size() != 20)
      return Corruption("cold tier: malformed chunk meta key 0x" +
                        Hex(std::string_view(key.data(), key.size())));
    ChunkKey ck{DecodeBigEndian64(key.data()), DecodeBigEndian32(key.data() + 8),
                DecodeBigEndian64(key.data() + 12)};
    Decoded d;
    KVTIER_RETURN_IF_ERROR(DecodeValue(it->value(), ValueKind::kMeta, ChunkWhat(ck, "meta"), &d));
    KVTIER_RETURN_IF_ERROR(fn(ck, d.body));
  }
  if (!it->status().ok())
    return FromRocks(it->status(), "iterating chunk metas of sequence " + std::to_string(seq));
  return Status::Ok();
}

Status ColdTier::PutBlob(SequenceId seq, uint32_t layer, std::string_view name, const void* data,
                         size_t bytes) {
  if (name.empty() || name.size() > kMaxBlobName)
    return InvalidArgument("cold tier: blob name must be 1.." + std::to_string(kMaxBlobName) +
                           " bytes (got " + std::to_string(name.size()) + ")");
  if (data == nullptr && bytes > 0)
    return InvalidArgument("cold tier: " + BlobWhat(seq, layer, name) + " data is null");
  if (bytes > std::numeric_limits<uint32_t>::max() - cold_tier_format::kValueHeaderBytes)
    return InvalidArgument("cold tier: " + BlobWhat(seq, layer, name) + " exceeds 4 GiB");
  Impl& m = *impl_;
  KVTIER_RETURN_IF_ERROR(m.latch->Check());
  static const char kEmpty = 0;
  if (data == nullptr) data = &kEmpty;
  const Header h = MakeHeader(ValueKind::kBlob, data, bytes, 0);
  const std::string key = cold_tier_format::BlobKey(seq, layer, name);
  rocksdb::Slice key_slice(key);
  rocksdb::Slice parts[2] = {rocksdb::Slice(h.data(), h.size()),
                             rocksdb::Slice(static_cast<const char*>(data), bytes)};
  rocksdb::WriteBatch batch(bytes + key.size() + h.size() + 64);
  rocksdb::Status s = batch.Put(m.blob_cf, rocksdb::SliceParts(&key_slice, 1), rocksdb::SliceParts(parts, 2));
  if (!s.ok()) return FromRocks(s, "writing " + BlobWhat(seq, layer, name));
  s = m.Write(m.write_options, &batch);
  if (!s.ok()) return m.latch->Latch(FromRocks(s, "writing " + BlobWhat(seq, layer, name)));
  return Status::Ok();
}

Result<std::string> ColdTier::GetBlob(SequenceId seq, uint32_t layer, std::string_view name) {
  Impl& m = *impl_;
  const std::string what = BlobWhat(seq, layer, name);
  rocksdb::ReadOptions ro;
  ro.fill_cache = false;
  rocksdb::PinnableSlice v;
  rocksdb::Status s = m.db->Get(ro, m.blob_cf, cold_tier_format::BlobKey(seq, layer, name), &v);
  if (s.IsNotFound()) return NotFound("cold tier: " + what + " not found");
  if (!s.ok()) return FromRocks(s, "reading " + what);
  Decoded d;
  KVTIER_RETURN_IF_ERROR(DecodeValue(v, ValueKind::kBlob, what, &d));
  return std::string(d.body);
}

std::vector<ChunkRange> ColdTier::AcknowledgedChunks() const {
  if (impl_->manifest == nullptr) return impl_->acked_without_manifest.Ranges();
  return impl_->manifest->chunks().Ranges();
}
const std::string& ColdTier::manifest_problem() const { return impl_->manifest_problem; }
bool ColdTier::read_only() const { return impl_->read_only; }
const std::vector<ChunkRange>& ColdTier::lost_chunks() const { return impl_->lost; }
const std::vector<SequenceId>& ColdTier::lost_sequence_records() const { return impl_->lost_sequences; }
const std::vector<ChunkRange>& ColdTier::redropped_chunks() const { return impl_->redropped; }
const std::vector<SequenceId>& ColdTier::redropped_sequences() const { return impl_->redropped_sequences; }
const std::string& ColdTier::recovered_current() const { return impl_->recovered_current; }

uint64_t ColdTier::stored_payload_bytes() const { return impl_->payload_bytes.load(); }
uint64_t ColdTier::stored_chunks() const { return impl_->chunks.load(); }
std::string ColdTier::path() const { return impl_->options.path; }

uint64_t ColdTier::memory_bytes() const {
  uint64_t memtables = 0, readers = 0, cache = 0;
  rocksdb::DB* db = impl_->db;
  db->GetAggregatedIntProperty(rocksdb::DB::Properties::kSizeAllMemTables, &memtables);
  db->GetAggregatedIntProperty(rocksdb::DB::Properties::kEstimateTableReadersMem, &readers);
  // One cache serves every family: asked once, not summed over them.
  db->GetIntProperty(impl_->seq_cf, rocksdb::DB::Properties::kBlockCacheUsage, &cache);
  return memtables + readers + cache;
}

}  // namespace kvtier
