#include "offload/lower_tier.h"

#include "offload/cold_tier.h"
#include "offload/remote_tier.h"

namespace kvtier {

void LowerTier::GetChunks(std::vector<Get>* gets, size_t payload_bytes) {
  for (Get& g : *gets) g.status = GetChunk(g.ref, g.dst, payload_bytes);
}

void LowerTier::GetChunkMetas(std::vector<MetaGet>* gets) {
  for (MetaGet& g : *gets)
    g.status = FailedPrecondition(std::string(name()) + " cannot read the meta record of chunk " +
                                  g.ref.key.ToString() + " without its payload");
}

namespace {

class ColdLowerTier final : public LowerTier {
 public:
  explicit ColdLowerTier(std::unique_ptr<ColdTier> cold) : cold_(std::move(cold)) {}
  std::string_view name() const override { return "cold tier"; }
  uint8_t tier_bit() const override { return kTierCold; }
  bool serves_published() const override { return false; }
  bool parallel_reads() const override { return true; }
  std::chrono::milliseconds error_window() const override { return std::chrono::milliseconds::max(); }
  Status PutChunk(const ChunkKey& key, std::string_view meta, const void* payload,
                  size_t payload_bytes) override {
    Status st = cold_->PutChunk(key, meta, payload, payload_bytes);
    if (!st.ok())
      return Status(st.code(), "writing chunk " + key.ToString() + " to the cold tier: " + st.message());
    return st;
  }
  Status GetChunk(const LowerChunkRef& ref, void* dst, size_t payload_bytes) override {
    return cold_->GetChunk(ref.key, dst, payload_bytes);
  }
  bool reads_chunk_meta() const override { return true; }
  void GetChunkMetas(std::vector<MetaGet>* gets) override {
    std::vector<ChunkKey> keys;
    keys.reserve(gets->size());
    for (const MetaGet& g : *gets) keys.push_back(g.ref.key);
    std::vector<std::string> metas;
    std::vector<Status> statuses;
    cold_->GetChunkMetas(keys, &metas, &statuses);
    for (size_t i = 0; i < gets->size(); ++i) {
      (*gets)[i].meta = std::move(metas[i]);
      (*gets)[i].status = std::move(statuses[i]);
    }
  }
  Status RemoveChunks(const std::vector<ChunkKey>& keys) override {
    for (const ChunkKey& k : keys) KVTIER_RETURN_IF_ERROR(cold_->DeleteChunk(k));
    return Status::Ok();
  }
  Status RemoveSequence(SequenceId seq, const std::vector<ChunkKey>& keys) override {
    (void)keys;  // DeleteSequence removes its record, chunks and blobs at once
    return cold_->DeleteSequence(seq);
  }
  void CountLoad(StoreCounters* c) const override { c->cold_loads++; }
  uint64_t memory_bytes() const override { return cold_->memory_bytes(); }

 private:
  std::unique_ptr<ColdTier> cold_;
};

class RemoteLowerTier final : public LowerTier {
 public:
  explicit RemoteLowerTier(std::unique_ptr<RemoteTier> remote) : remote_(std::move(remote)) {}
  std::string_view name() const override { return "remote tier"; }
  uint8_t tier_bit() const override { return kTierRemote; }
  bool serves_published() const override { return true; }
  bool parallel_reads() const override { return false; }
  std::chrono::milliseconds error_window() const override {
    // Its node fails every command at once for that long (offload/redis_client.h).
    return std::chrono::milliseconds(remote_->options().retry_ms);
  }
  Status PutChunk(const ChunkKey& key, std::string_view meta, const void* payload,
                  size_t payload_bytes) override {
    return remote_->PutChunk(key, meta, payload, payload_bytes);  // names the chunk and the node
  }
  Status GetChunk(const LowerChunkRef& ref, void* dst, size_t payload_bytes) override {
    return remote_->GetChunk(ref, dst, payload_bytes);
  }
  void GetChunks(std::vector<Get>* gets, size_t payload_bytes) override {
    // One pipelined batch for the whole fetch.
    std::vector<RemoteTier::Get> rg(gets->size());
    for (size_t i = 0; i < gets->size(); ++i) {
      rg[i].ref = (*gets)[i].ref;
      rg[i].dst = (*gets)[i].dst;
      rg[i].payload_bytes = payload_bytes;
    }
    remote_->GetChunks(&rg).IgnoreError();  // per-chunk statuses below
    for (size_t i = 0; i < gets->size(); ++i) (*gets)[i].status = std::move(rg[i].status);
  }
  Status RemoveChunks(const std::vector<ChunkKey>& keys) override {
    return keys.empty() ? Status::Ok() : remote_->DeleteChunks(keys);
  }
  Status RemoveSequence(SequenceId seq, const std::vector<ChunkKey>& keys) override {
    (void)seq;  // chunks only: the remote tier keeps no per-sequence record of this store
    return RemoveChunks(keys);
  }
  bool reads_chunk_meta() const override { return true; }
  void GetChunkMetas(std::vector<MetaGet>* gets) override {
    std::vector<RemoteTier::MetaGet> rg(gets->size());
    for (size_t i = 0; i < gets->size(); ++i) rg[i].ref = (*gets)[i].ref;
    remote_->GetChunkMetas(&rg).IgnoreError();  // per-chunk statuses below
    for (size_t i = 0; i < gets->size(); ++i) {
      (*gets)[i].meta = std::move(rg[i].meta);
      (*gets)[i].status = std::move(rg[i].status);
    }
  }
  void CountLoad(StoreCounters* c) const override { c->remote_loads++; }
  void AddCounters(StoreCounters* c) const override {
    const RemoteTierCounters r = remote_->counters();
    c->remote_puts = r.puts;
    c->remote_put_bytes = r.put_bytes;
    c->remote_gets = r.gets;
    c->remote_get_bytes = r.get_bytes;
    c->remote_not_found = r.not_found;
    c->remote_corrupt = r.corrupt;
    c->remote_errors = r.errors;
  }

 private:
  std::unique_ptr<RemoteTier> remote_;
};

}  // namespace

std::unique_ptr<LowerTier> MakeColdLowerTier(std::unique_ptr<ColdTier> cold) {
  return std::make_unique<ColdLowerTier>(std::move(cold));
}

std::unique_ptr<LowerTier> MakeRemoteLowerTier(std::unique_ptr<RemoteTier> remote) {
  return std::make_unique<RemoteLowerTier>(std::move(remote));
}

}  // namespace kvtier
