// libFuzzer target: the cold tier's value decoder (cold_tier_format::DecodeValue) and the
// store records behind it (offload/store_records.h: store record, sequence record, chunk
// meta), on any bytes. The first byte picks the kind and whether the input gets a valid
// header and CRC (so the fuzzer reaches the record decoders), the second the layer count
// and representative size the records are read with.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "offload/cold_tier.h"
#include "offload/store_records.h"

using namespace kvtier;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const auto kind = static_cast<cold_tier_format::ValueKind>(1 + (data[0] & 3));
  const bool frame = (data[0] & 4) != 0;
  const int layers = 1 + (data[1] & 15);
  const size_t repr_bytes = static_cast<size_t>(data[1] >> 4) * 8;
  std::string_view in(reinterpret_cast<const char*>(data + 2), size - 2);
  std::string value = frame ? cold_tier_format::EncodeValue(kind, in, data[0] >> 3) : std::string(in);
  std::string_view body;
  uint64_t aux = 0;
  Status st = cold_tier_format::DecodeValue(value, kind, "fuzz value", &body, &aux);
  if (frame && (!st.ok() || body != in || aux != static_cast<uint64_t>(data[0] >> 3))) __builtin_trap();
  if (!st.ok()) return 0;
  switch (kind) {
    case cold_tier_format::ValueKind::kSequence: {
      auto r = store_records::DecodeSequenceRecord(body, 3, layers);
      // A record read back encodes to the same bytes ("open" on disk reads as kRecovered).
      const auto state = r.ok() && r->state == store_records::SeqState::kClosed
                             ? store_records::SeqState::kClosed
                             : store_records::SeqState::kOpen;
      if (r.ok() && store_records::EncodeSequenceRecord(state, r->n_tokens) != body) __builtin_trap();
      break;
    }
    case cold_tier_format::ValueKind::kMeta: {
      auto m = store_records::DecodeChunkMeta(body, ChunkKey{3, 1, 17}, repr_bytes);
      if (m.ok() && m->repr.size() != repr_bytes) __builtin_trap();
      break;
    }
    case cold_tier_format::ValueKind::kBlob: {
      auto s = store_records::DecodeStoreRecord(body, "fuzz");
      if (s.ok()) (void)s->ToString();
      break;
    }
    case cold_tier_format::ValueKind::kPayload:
      break;
  }
  return 0;
}
