// `kvtier check` (see check.h).
#include "integration/cli/check.h"

#include <cstdio>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "integration/cli/flags.h"
#include "offload/cold_tier.h"
#include "offload/store_records.h"
#include "offload/tiered_store.h"

namespace kvtier {
namespace {

const char* kUsage =
    "usage: kvtier check --data-dir DIR [--verify] [--accept-lost]\n\n"
    "Checks that a store's data directory holds every chunk its cold tier acknowledged\n"
    "(a damaged or truncated RocksDB write-ahead log can lose them): a missing chunk is an\n"
    "error naming its sequence, layer and index. Prints each sequence's state and its\n"
    "acknowledged chunks.";

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

// Everything check prints, gathered from the cold tier alone.
struct ColdReport {
  store_records::StoreLayout layout;
  std::map<SequenceId, store_records::SequenceRecord> sequences;
  std::vector<ChunkRange> acked, lost, redropped;
  std::vector<SequenceId> lost_sequences, redropped_sequences;
  std::string recovered_current;
  uint64_t verified = 0;
};

Result<ColdReport> InspectCold(const std::string& dir, bool accept, bool verify) {
  ColdTierOptions co;
  co.path = dir;
  co.accept_lost_chunks = accept;
  KVTIER_ASSIGN_OR_RETURN(auto cold, ColdTier::Open(co));
  ColdReport rep;
  rep.lost = cold->lost_chunks();
  rep.lost_sequences = cold->lost_sequence_records();
  rep.redropped = cold->redropped_chunks();
  rep.redropped_sequences = cold->redropped_sequences();
  rep.recovered_current = cold->recovered_current();
  auto layout_bytes = cold->GetBlob(store_records::kStoreRecordSeq, 0, store_records::kStoreBlob);
  if (!layout_bytes.ok())
    return layout_bytes.status().code() == StatusCode::kNotFound
               ? NotFound("'" + dir + "' holds no kvtier store (no store record)")
               : layout_bytes.status();
  KVTIER_ASSIGN_OR_RETURN(rep.layout,
                          store_records::DecodeStoreRecord(*layout_bytes, "data_dir '" + dir + "'"));
  KVTIER_RETURN_IF_ERROR(cold->ForEachSequence([&](SequenceId id, std::string_view rec) -> Status {
    if (id == store_records::kStoreRecordSeq) return Status::Ok();
    KVTIER_ASSIGN_OR_RETURN(rep.sequences[id],
                            store_records::DecodeSequenceRecord(rec, id, rep.layout.geometry.layers));
    return Status::Ok();
  }));
  rep.acked = cold->AcknowledgedChunks();
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

}  // namespace

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
      "open a store whose acknowledged chunks are missing anyway: forget them for good and print them",
      [&](const std::string& s) {
        accept = s != "0";
        return Status::Ok();
      },
      true);
  Status st = f.Parse("check", argc, argv);
  if (!st.ok()) return cli::Fail(st);
  if (f.help()) {
    f.PrintHelp(kUsage);
    return 0;
  }
  if (dir.empty()) return cli::Fail(InvalidArgument("check: --data-dir is required"));
  // Opening would create an empty store there: a mistyped path is an error, not a new store.
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec))
    return cli::Fail(NotFound("check: '" + dir + "' is not a directory (no store to check)"));

  auto rep = InspectCold(dir, accept, verify);
  if (!rep.ok()) return cli::Fail(rep.status());
  // Then the whole store, as a program embedding kvtier opens it (sinks, windows, layout).
  StoreOptions o;
  o.geometry = rep->layout.geometry;
  o.n_sink = rep->layout.n_sink;
  o.n_local = rep->layout.n_local;
  o.chunk_size = rep->layout.chunk_size;
  o.repr_topk = rep->layout.repr_topk;
  o.hot_bytes = o.chunk_bytes();
  o.warm_bytes = o.chunk_bytes();
  o.transfer_threads = 1;
  o.data_dir = dir;
  auto store = TieredStore::Open(o);
  if (!store.ok()) return cli::Fail(store.status());

  std::printf("kvtier check: '%s': %s\n", dir.c_str(), rep->layout.ToString().c_str());
  if (!rep->recovered_current.empty())
    std::printf("  CURRENT was missing: pointed it at %s, the only MANIFEST\n",
                rep->recovered_current.c_str());
  if (!rep->redropped.empty() || !rep->redropped_sequences.empty()) {
    std::printf(
        "  dropped before and present again (their deletes were lost with the WAL), deleted again: "
        "%llu chunks (%s)",
        static_cast<unsigned long long>(CountChunks(rep->redropped)),
        rep->redropped.empty() ? "none" : DescribeRanges(rep->redropped).c_str());
    if (!rep->redropped_sequences.empty()) {
      std::printf(", sequences");
      for (SequenceId s : rep->redropped_sequences) std::printf(" %llu", static_cast<unsigned long long>(s));
    }
    std::printf("\n");
  }
  std::map<SequenceId, std::vector<ChunkRange>> by_seq;
  for (const ChunkRange& r : rep->acked) by_seq[r.seq].push_back(r);
  for (const auto& [id, rec] : rep->sequences) {
    std::printf("  sequence %llu: %s, tokens per layer", static_cast<unsigned long long>(id),
                StateName(rec.state));
    for (int64_t n : rec.n_tokens) std::printf(" %lld", static_cast<long long>(n));
    const auto& ranges = by_seq[id];
    std::printf("; acknowledged chunks: %s\n", ranges.empty() ? "none" : DescribeRanges(ranges, 64).c_str());
  }
  std::printf("  %llu acknowledged chunks in %zu ranges, all present",
              static_cast<unsigned long long>(CountChunks(rep->acked)), rep->acked.size());
  if (verify) std::printf("; %llu read back and verified", static_cast<unsigned long long>(rep->verified));
  std::printf("\n");
  if (!rep->lost.empty() || !rep->lost_sequences.empty()) {
    std::printf("  lost and accepted: %llu chunks (%s)",
                static_cast<unsigned long long>(CountChunks(rep->lost)),
                rep->lost.empty() ? "none" : DescribeRanges(rep->lost).c_str());
    if (!rep->lost_sequences.empty()) {
      std::printf(", sequence records of");
      for (SequenceId s : rep->lost_sequences) std::printf(" %llu", static_cast<unsigned long long>(s));
    }
    std::printf("\n");
  }
  return 0;
}

}  // namespace kvtier
