// `kvtier check` (see check.h).
#include "integration/cli/check.h"

#include <cstdio>
#include <filesystem>
#include <map>
#include <string>
#include <system_error>
#include <vector>

#include "integration/cli/flags.h"
#include "offload/cold_tier.h"
#include "offload/hot_tier.h"
#include "offload/store_records.h"
#include "offload/store_recovery.h"
#include "offload/tiered_store.h"

namespace kvtier {
namespace {

namespace fs = std::filesystem;

const char* kCheckUsage =
    "usage: kvtier check --data-dir DIR [--verify] [--accept-lost]\n\n"
    "Checks that a store's data directory holds every chunk its cold tier acknowledged\n"
    "(a damaged or truncated RocksDB write-ahead log or MANIFEST can lose them): a missing chunk\n"
    "is an error naming its sequence, layer and index. Prints each sequence's state and its\n"
    "acknowledged chunks. Reads only: nothing in DIR is written, created or deleted, unless\n"
    "--accept-lost is given (it lists what it forgets before it forgets it). Before accepting a\n"
    "loss, 'kvtier repair --data-dir DIR --into NEW' salvages what RocksDB's repair can reach.";

const char* kRepairUsage =
    "usage: kvtier repair --data-dir DIR (--into NEW | --in-place)\n\n"
    "Runs RocksDB's repair on a store that 'kvtier check' refuses: it rebuilds the MANIFEST from\n"
    "the tables and write-ahead logs present and replays every log past a damaged record, then\n"
    "checks the result as 'kvtier check' does and prints what was salvaged and what is still\n"
    "missing. --into NEW repairs a copy made in NEW (which must not exist) and leaves DIR as it\n"
    "was; --in-place repairs DIR itself (files the repair cannot use go to DIR/lost/). Nothing is\n"
    "forgotten: 'kvtier check --data-dir NEW --accept-lost' goes on without what is still missing.";

const char* StateName(store_records::SeqState s) {
  switch (s) {
    case store_records::SeqState::kOpen:
      return "open when the store stopped (recovered read-only)";
    case store_records::SeqState::kClosed:
      return "closed";
    case store_records::SeqState::kRecovered:
      return "recovered";
  }
  return "unknown";
}

// A directory to check: it must exist and be a directory. An OS error other than
// "does not exist" (EACCES, ENAMETOOLONG, ...) is IOError naming the path and the error.
Status CheckDirectory(const std::string& cmd, const std::string& dir) {
  std::error_code ec;
  const fs::file_status st = fs::status(dir, ec);
  if (ec && ec != std::errc::no_such_file_or_directory)
    return IOError(cmd + ": '" + dir + "': " + ec.message());
  if (!fs::exists(st)) return NotFound(cmd + ": '" + dir + "' does not exist (no store to " + cmd + ")");
  if (!fs::is_directory(st)) return InvalidArgument(cmd + ": '" + dir + "' is not a directory");
  return Status::Ok();
}

// The options that open the store in `dir` as its store record describes it.
StoreOptions StoreOptionsFor(const store_records::StoreLayout& layout, const std::string& dir) {
  StoreOptions o;
  o.geometry = layout.geometry;
  o.n_sink = layout.n_sink;
  o.n_local = layout.n_local;
  o.chunk_size = layout.chunk_size;
  o.repr_topk = layout.repr_topk;
  o.repr_heads = layout.repr_heads;
  o.data_dir = dir;
  return o;
}

// Everything check prints, read from the cold tier opened read-only.
struct ColdReport {
  bool has_store_record = false;
  store_records::StoreLayout layout;
  std::map<SequenceId, store_records::SequenceRecord> sequences;
  std::vector<ChunkRange> acked, missing, redropped;
  std::vector<SequenceId> missing_sequences, redropped_sequences;
  std::string manifest_problem;
  std::string missing_current;  // CURRENT was missing; the only MANIFEST is this one
  uint64_t verified = 0;
};

// Opens `dir` read-only. With list_missing, missing chunks and a damaged manifest are listed
// in the report instead of failing. With whole_store, also rebuilds the store's state from its
// records on a host hot tier of its own (what an embedding program's open checks).
Result<ColdReport> InspectCold(const std::string& dir, bool list_missing, bool verify, bool whole_store) {
  ColdTierOptions co;
  co.path = dir;
  co.read_only = true;
  co.list_missing = list_missing;
  KVTIER_ASSIGN_OR_RETURN(auto cold, ColdTier::Open(co));
  ColdReport rep;
  rep.missing = cold->lost_chunks();
  rep.missing_sequences = cold->lost_sequence_records();
  rep.manifest_problem = cold->manifest_problem();
  rep.redropped = cold->redropped_chunks();
  rep.redropped_sequences = cold->redropped_sequences();
  rep.missing_current = cold->recovered_current();
  rep.acked = cold->AcknowledgedChunks();
  auto layout_bytes = cold->GetBlob(store_records::kStoreRecordSeq, 0, store_records::kStoreBlob);
  if (!layout_bytes.ok()) {
    if (layout_bytes.status().code() == StatusCode::kNotFound) return rep;
    return layout_bytes.status();
  }
  rep.has_store_record = true;
  KVTIER_ASSIGN_OR_RETURN(rep.layout,
                          store_records::DecodeStoreRecord(*layout_bytes, "data_dir '" + dir + "'"));
  KVTIER_RETURN_IF_ERROR(cold->ForEachSequence([&](SequenceId id, std::string_view rec) -> Status {
    if (id == store_records::kStoreRecordSeq) return Status::Ok();
    KVTIER_ASSIGN_OR_RETURN(rep.sequences[id],
                            store_records::DecodeSequenceRecord(rec, id, rep.layout.geometry.layers));
    return Status::Ok();
  }));
  if (whole_store) {
    StoreOptions o = StoreOptionsFor(rep.layout, dir);
    KVTIER_ASSIGN_OR_RETURN(auto hot, MakeHotTier(Device::kCpu, o.chunk_bytes(), o.chunk_bytes()));
    RecoveredStore rec;
    Status st = RecoverStore(o, cold.get(), hot.get(), &rec);
    FreeRecoveredStore(hot.get(), &rec);
    KVTIER_RETURN_IF_ERROR(st);
  }
  if (verify) {
    const size_t chunk_bytes =
        static_cast<size_t>(rep.layout.chunk_size) * rep.layout.geometry.token_kv_bytes();
    std::vector<uint8_t> buf(chunk_bytes);
    for (const ChunkRange& r : rep.acked)
      for (uint64_t i = r.first;; ++i) {
        KVTIER_RETURN_IF_ERROR(cold->GetChunk(ChunkKey{r.seq, r.layer, i}, buf.data(), buf.size()));
        ++rep.verified;
        if (i == r.last) break;  // not i <= last: last may be UINT64_MAX
      }
  }
  return rep;
}

Status NoStoreRecord(const std::string& dir) {
  return NotFound("'" + dir + "' holds no kvtier store (no store record)");
}

// "N chunks (ranges), sequence records of a b c"
std::string DescribeLoss(const std::vector<ChunkRange>& chunks, const std::vector<SequenceId>& seqs) {
  std::string s = std::to_string(CountChunks(chunks)) + " chunks (" +
                  (chunks.empty() ? std::string("none") : DescribeRanges(chunks)) + ")";
  if (!seqs.empty()) {
    s += ", sequence records of";
    for (SequenceId q : seqs) {
      s += ' ';
      s += std::to_string(q);
    }
  }
  return s;
}

void PrintReport(const std::string& dir, const ColdReport& rep, bool verify) {
  std::printf("kvtier check: '%s': %s\n", dir.c_str(), rep.layout.ToString().c_str());
  if (!rep.missing_current.empty())
    std::printf(
        "  CURRENT is missing: %s is the only MANIFEST; the next read-write open writes "
        "CURRENT back pointing at it\n",
        rep.missing_current.c_str());
  if (!rep.redropped.empty() || !rep.redropped_sequences.empty()) {
    std::printf(
        "  dropped before and present again (their deletes were lost with the WAL); the next read-write "
        "open deletes them again: %llu chunks (%s)",
        static_cast<unsigned long long>(CountChunks(rep.redropped)),
        rep.redropped.empty() ? "none" : DescribeRanges(rep.redropped).c_str());
    if (!rep.redropped_sequences.empty()) {
      std::printf(", sequences");
      for (SequenceId s : rep.redropped_sequences) std::printf(" %llu", static_cast<unsigned long long>(s));
    }
    std::printf("\n");
  }
  std::map<SequenceId, std::vector<ChunkRange>> by_seq;
  for (const ChunkRange& r : rep.acked) by_seq[r.seq].push_back(r);
  for (const auto& [id, rec] : rep.sequences) {
    // A sequence dropped whose record came back is not the store's any more.
    if (std::find(rep.redropped_sequences.begin(), rep.redropped_sequences.end(), id) !=
        rep.redropped_sequences.end())
      continue;
    std::printf("  sequence %llu: %s, tokens per layer", static_cast<unsigned long long>(id),
                StateName(rec.state));
    for (int64_t n : rec.n_tokens) std::printf(" %lld", static_cast<long long>(n));
    const auto& ranges = by_seq[id];
    std::printf("; acknowledged chunks: %s\n", ranges.empty() ? "none" : DescribeRanges(ranges, 64).c_str());
  }
  std::printf("  %llu acknowledged chunks in %zu ranges, all present",
              static_cast<unsigned long long>(CountChunks(rep.acked)), rep.acked.size());
  if (verify) std::printf("; %llu read back and verified", static_cast<unsigned long long>(rep.verified));
  std::printf("\n");
}

// check --accept-lost: lists what it forgets (read-only), then forgets it (read-write).
// Returns OK with *lost filled, or the refusal; nothing is changed on a refusal.
Status AcceptLoss(const std::string& dir, ColdReport* lost) {
  auto pre = InspectCold(dir, /*list_missing=*/true, /*verify=*/false, /*whole_store=*/false);
  if (!pre.ok())
    return Status(
        pre.status().code(),
        "check --accept-lost: cannot list what it would forget, so it forgets nothing (the directory "
        "was not changed): " +
            pre.status().message());
  if (!pre->has_store_record)
    return NotFound(
        "check --accept-lost: '" + dir +
        "' holds no kvtier store record (its write-ahead log held it, or it never was a store), so "
        "there is nothing to go on with; the directory and its ack manifest were not changed" +
        (pre->missing.empty()
             ? std::string()
             : " (" + std::to_string(CountChunks(pre->missing)) + " acknowledged chunks are missing)"));
  if (pre->missing.empty() && pre->missing_sequences.empty() && pre->manifest_problem.empty()) {
    *lost = std::move(*pre);
    return Status::Ok();
  }
  if (!pre->manifest_problem.empty())
    std::printf(
        "kvtier check: '%s': %s; --accept-lost rebuilds the ack manifest from the %llu chunks present "
        "(what it listed beyond them cannot be known)\n",
        dir.c_str(), pre->manifest_problem.c_str(), static_cast<unsigned long long>(CountChunks(pre->acked)));
  if (!pre->missing.empty() || !pre->missing_sequences.empty())
    std::printf("kvtier check: '%s': forgetting for good %s\n", dir.c_str(),
                DescribeLoss(pre->missing, pre->missing_sequences).c_str());
  std::fflush(stdout);
  StoreOptions o = StoreOptionsFor(pre->layout, dir);
  o.hot_bytes = o.chunk_bytes();
  o.warm_bytes = o.chunk_bytes();
  o.transfer_threads = 1;
  o.accept_lost_chunks = true;
  auto store = TieredStore::Open(o);
  if (!store.ok()) return store.status();
  *lost = std::move(*pre);
  return Status::Ok();
}

// Copies the store in `from` into `to`, a directory that must not exist yet (its parent must).
Status CopyStore(const std::string& from, const std::string& to) {
  std::error_code ec;
  const fs::file_status st = fs::status(to, ec);
  if (ec && ec != std::errc::no_such_file_or_directory)
    return IOError("repair: --into '" + to + "': " + ec.message());
  if (fs::exists(st))
    return InvalidArgument("repair: --into '" + to +
                           "' exists; name a directory that does not (the copy is made there)");
  if (!fs::create_directory(to, ec) || ec)
    return IOError("repair: cannot create --into '" + to +
                   "': " + (ec ? ec.message() : std::string("exists")));
  fs::copy(from, to, fs::copy_options::recursive | fs::copy_options::copy_symlinks, ec);
  if (ec) return IOError("repair: copying '" + from + "' to '" + to + "': " + ec.message());
  return Status::Ok();
}

bool IsWhole(const ColdReport& r) {
  return r.missing.empty() && r.missing_sequences.empty() && r.manifest_problem.empty();
}

}  // namespace

int RunRepair(int argc, char** argv) {
  std::string dir, into;
  bool in_place = false;
  cli::FlagSet f;
  f.Add("data-dir", "the damaged store's data directory (required)", cli::PathFlag(&dir));
  f.Add("into", "repair a copy of the store made in this directory (must not exist); DIR is left as it was",
        cli::PathFlag(&into));
  f.Add(
      "in-place", "repair DIR itself (files the repair cannot use go to DIR/lost/)",
      [&](const std::string& s) {
        in_place = s != "0";
        return Status::Ok();
      },
      true);
  Status st = f.Parse("repair", argc, argv);
  if (!st.ok()) return cli::Fail(st);
  if (f.help()) {
    f.PrintHelp(kRepairUsage);
    return 0;
  }
  if (dir.empty()) return cli::Fail(InvalidArgument("repair: --data-dir is required"));
  if (into.empty() == !in_place)
    return cli::Fail(
        InvalidArgument("repair: say where to repair, with exactly one of --into NEW (a copy; '" + dir +
                        "' is left as it was) and --in-place (the directory itself)"));
  st = CheckDirectory("repair", dir);
  if (!st.ok()) return cli::Fail(st);

  // What is missing before the repair, read-only; a store too damaged to open read-only is
  // what the repair is for.
  uint64_t missing_before = 0;
  bool before_known = false;
  auto before = InspectCold(dir, /*list_missing=*/true, /*verify=*/false, /*whole_store=*/false);
  if (before.ok()) {
    if (IsWhole(*before) && before->has_store_record) {
      std::printf(
          "kvtier repair: '%s' is whole (%llu acknowledged chunks, all present); nothing to repair, "
          "nothing was changed\n",
          dir.c_str(), static_cast<unsigned long long>(CountChunks(before->acked)));
      return 0;
    }
    before_known = before->manifest_problem.empty();
    missing_before = CountChunks(before->missing);
    if (!before->manifest_problem.empty())
      std::printf("kvtier repair: '%s' before the repair: %s\n", dir.c_str(),
                  before->manifest_problem.c_str());
    else
      std::printf(
          "kvtier repair: '%s' before the repair: %llu of %llu acknowledged chunks present; missing %s\n",
          dir.c_str(), static_cast<unsigned long long>(CountChunks(before->acked) - missing_before),
          static_cast<unsigned long long>(CountChunks(before->acked)),
          DescribeLoss(before->missing, before->missing_sequences).c_str());
  } else if (before.status().code() == StatusCode::kCorruption) {
    std::printf("kvtier repair: '%s' before the repair: does not open read-only: %s\n", dir.c_str(),
                before.status().message().c_str());
  } else {
    return cli::Fail(before.status());
  }

  const std::string target = in_place ? dir : into;
  if (!in_place) {
    st = CopyStore(dir, into);
    if (!st.ok()) return cli::Fail(st);
    std::printf("kvtier repair: copied '%s' to '%s'; repairing the copy ('%s' is left as it was)\n",
                dir.c_str(), into.c_str(), dir.c_str());
  }
  std::fflush(stdout);
  ColdTierOptions co;
  co.path = target;
  st = ColdTier::Repair(co);
  if (!st.ok()) return cli::Fail(st);
  std::printf("kvtier repair: RocksDB's repair rebuilt '%s' (files it could not use are in %s/lost/)\n",
              target.c_str(), target.c_str());

  auto after = InspectCold(target, /*list_missing=*/true, /*verify=*/false, /*whole_store=*/false);
  if (!after.ok())
    return cli::Fail(
        Status(after.status().code(),
               "repair: the repaired store still does not open read-only: " + after.status().message()));
  if (!after->has_store_record)
    return cli::Fail(
        NotFound("repair: '" + target +
                 "' holds no kvtier store record after the repair (the logs that held it are lost); "
                 "nothing to go on with"));
  const uint64_t missing_after = CountChunks(after->missing);
  const std::string salvaged =
      before_known ? std::to_string(missing_before > missing_after ? missing_before - missing_after : 0) +
                         " of the " + std::to_string(missing_before) + " missing before"
                   : std::string("what was missing before could not be counted");
  if (IsWhole(*after)) {
    auto rep = InspectCold(target, /*list_missing=*/false, /*verify=*/false, /*whole_store=*/true);
    if (!rep.ok()) return cli::Fail(rep.status());
    PrintReport(target, *rep, /*verify=*/false);
    std::printf("kvtier repair: '%s' is whole: every acknowledged chunk is present (salvaged %s)\n",
                target.c_str(), salvaged.c_str());
    return 0;
  }
  if (!after->manifest_problem.empty())
    std::printf("kvtier repair: '%s' after the repair: %s\n", target.c_str(),
                after->manifest_problem.c_str());
  std::printf(
      "kvtier repair: '%s' after the repair: %llu of %llu acknowledged chunks present (salvaged %s); still "
      "missing "
      "%s. 'kvtier check --data-dir %s --accept-lost' lists them and goes on without them for good\n",
      target.c_str(), static_cast<unsigned long long>(CountChunks(after->acked) - missing_after),
      static_cast<unsigned long long>(CountChunks(after->acked)), salvaged.c_str(),
      DescribeLoss(after->missing, after->missing_sequences).c_str(), target.c_str());
  return 1;
}

int RunCheck(int argc, char** argv) {
  std::string dir;
  bool verify = false, accept = false;
  cli::FlagSet f;
  f.Add("data-dir", "the store's data directory (required)", cli::PathFlag(&dir));
  f.Add(
      "verify", "also read every acknowledged chunk back and check its checksums",
      [&](const std::string& s) {
        verify = s != "0";
        return Status::Ok();
      },
      true);
  f.Add(
      "accept-lost",
      "open a store whose acknowledged chunks are missing anyway: list them, then forget them for good",
      [&](const std::string& s) {
        accept = s != "0";
        return Status::Ok();
      },
      true);
  Status st = f.Parse("check", argc, argv);
  if (!st.ok()) return cli::Fail(st);
  if (f.help()) {
    f.PrintHelp(kCheckUsage);
    return 0;
  }
  if (dir.empty()) return cli::Fail(InvalidArgument("check: --data-dir is required"));
  st = CheckDirectory("check", dir);
  if (!st.ok()) return cli::Fail(st);

  ColdReport lost;
  if (accept) {
    st = AcceptLoss(dir, &lost);
    if (!st.ok()) return cli::Fail(st);
  }
  auto rep = InspectCold(dir, /*list_missing=*/false, verify, /*whole_store=*/true);
  if (!rep.ok()) return cli::Fail(rep.status());
  if (!rep->has_store_record) return cli::Fail(NoStoreRecord(dir));
  PrintReport(dir, *rep, verify);
  if (!lost.missing.empty() || !lost.missing_sequences.empty())
    std::printf("  lost and accepted: %s\n", DescribeLoss(lost.missing, lost.missing_sequences).c_str());
  return 0;
}

}  // namespace kvtier
