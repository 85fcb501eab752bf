// LowerWriter: see offload/store/lower_writer.h.

#include "offload/store/lower_writer.h"

#include <string>

#include "offload/store_records.h"
#include "offload/transfer_engine.h"

namespace kvtier {

using store_internal::Chunk;
using store_records::EncodeChunkMeta;

Status LowerWriter::WriteDown(std::unique_lock<CountingMutex>& lock, Chunk* c, const uint8_t* payload) {
  // Pinned and marked while the lock is dropped: nobody frees or reuses the slot.
  c->lower_writing = true;
  c->warm_pins++;
  const float score = c->score;  // snapshot under the lock (see Chunk::score)
  lock.unlock();
  Status st = Write(c, payload, score);
  lock.lock();
  c->lower_writing = false;
  c->warm_pins--;
  sync_->cv.notify_all();
  return st;
}

Status LowerWriter::Write(Chunk* c, const uint8_t* payload, float score) {
  // first_token and repr never change once the chunk is sealed, so encoding them here,
  // without the lock, is safe; the score is the caller's snapshot.
  const std::string meta = EncodeChunkMeta(c->first_token, c->repr.data(), c->repr.size(), score);
  TransferEngine::WriteAcks acks = 0;
  const Status st = engine_->WriteChunk(c->key, meta, payload, &acks);
  // A later tier refused what an earlier one acknowledged (Redis after RocksDB): durable all
  // the same (see WaitForDurable), and the refusal is still the caller's error.
  if (!st.ok() && acks == 0) return st;
  LowerTiers::AckListener listener;
  {
    std::lock_guard<CountingMutex> l(sync_->mu);
    listener = lower_->AckLocked(c, acks, chunk_bytes_, counters_);
  }
  // The chunk is still pinned (lower_writing) by the caller: its key stays valid.
  if (listener) listener(c->key);
  return st;
}

void LowerWriter::Submit(Chunk* c, const uint8_t* payload, float score) {
  // Encoded here, on the appending thread: the transfer thread then reads no chunk field
  // the store mutex guards (SetChunkScores may change the score meanwhile; that change is
  // persisted by the chunk's next lower-tier write, as SetChunkScores documents).
  TransferEngine::LowerWrite w;
  w.key = c->key;
  w.meta = EncodeChunkMeta(c->first_token, c->repr.data(), c->repr.size(), score);
  w.payload = payload;
  engine_->SubmitLowerWrite(std::move(w), [this, c](Status st, TransferEngine::WriteAcks acks) {
    LowerTiers::AckListener listener;
    if (st.ok() || acks != 0) {
      // What an earlier tier acknowledged is durable even if a later one refused it.
      std::lock_guard<CountingMutex> l(sync_->mu);
      listener = lower_->AckLocked(c, acks, chunk_bytes_, counters_);
    }
    // Still pinned (lower_writing): nobody frees the chunk while the listener runs.
    if (listener) listener(c->key);
    std::lock_guard<CountingMutex> l(sync_->mu);
    c->lower_writing = false;
    c->warm_pins--;
    if (!st.ok()) lower_->RecordWriteFailureLocked(st);
    sync_->cv.notify_all();  // CloseSequence, DropChunks and MakeRoom wait for lower_writing to clear
  });
}

}  // namespace kvtier
