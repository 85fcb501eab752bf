// store/coding.h (byte order and bounded reads) and the tiered store's records
// built on it (offload/store_records.h).
#include "store/coding.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "offload/store_records.h"

namespace kvtier {
namespace {

std::string Bytes(std::initializer_list<int> b) {
  std::string s;
  for (int x : b) s.push_back(static_cast<char>(x));
  return s;
}

TEST(StoreCoding, FixedWidthIsLittleEndianOnAnyHost) {
  std::string s;
  PutFixed8(&s, 0xab);
  PutFixed16(&s, 0x0102);
  PutFixed32(&s, 0x01020304u);
  PutFixed64(&s, 0x0102030405060708ull);
  EXPECT_EQ(
      s, Bytes({0xab, 0x02, 0x01, 0x04, 0x03, 0x02, 0x01, 0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0x01}));
  s.clear();
  PutInt32(&s, -2);
  PutInt64(&s, -3);
  EXPECT_EQ(s, Bytes({0xfe, 0xff, 0xff, 0xff, 0xfd, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}));
  s.clear();
  PutFloat32(&s, 1.0f);  // 0x3f800000
  EXPECT_EQ(s, Bytes({0x00, 0x00, 0x80, 0x3f}));
  // Keys: big-endian, so bytewise order is numeric order.
  char be[8];
  EncodeBigEndian64(be, 0x0102030405060708ull);
  EXPECT_EQ(std::string(be, 8), Bytes({1, 2, 3, 4, 5, 6, 7, 8}));
  EXPECT_EQ(DecodeBigEndian64(be), 0x0102030405060708ull);
  EncodeBigEndian32(be, 0xa0b0c0d0u);
  EXPECT_EQ(DecodeBigEndian32(be), 0xa0b0c0d0u);
  char a[4], b[4];
  EncodeBigEndian32(a, 255);
  EncodeBigEndian32(b, 256);
  EXPECT_LT(std::memcmp(a, b, 4), 0);
}

TEST(StoreCoding, RoundTrips) {
  std::string s;
  const float nan_payload = std::bit_cast<float>(0x7fc12345u);
  PutFixed8(&s, 7);
  PutFixed16(&s, 0xfffe);
  PutFixed32(&s, 0xdeadbeefu);
  PutFixed64(&s, std::numeric_limits<uint64_t>::max() - 1);
  PutInt32(&s, std::numeric_limits<int32_t>::min());
  PutInt64(&s, -1234567890123ll);
  PutFloat32(&s, -0.0f);
  PutFloat32(&s, nan_payload);
  PutFloat32(&s, std::numeric_limits<float>::denorm_min());
  PutLengthPrefixed(&s, std::string("abc\0def", 7));
  PutLengthPrefixed(&s, "");
  const std::vector<float> fa{1.5f, -2.0f, 3.25e-20f};
  const std::vector<int32_t> ia{-1, 0, 1 << 30};
  PutFloat32Array(&s, fa.data(), fa.size());
  PutInt32Array(&s, ia.data(), ia.size());
  PutBytes(&s, "xy", 2);

  RecordReader r(s, "test record");
  uint8_t u8 = 0;
  uint16_t u16 = 0;
  uint32_t u32 = 0;
  uint64_t u64 = 0;
  int32_t i32 = 0;
  int64_t i64 = 0;
  float f0 = 1, f1 = 0, f2 = 0;
  std::string t0, t1;
  std::vector<float> fb(3);
  std::vector<int32_t> ib(3);
  char raw[2];
  ASSERT_TRUE(r.ReadFixed8(&u8, "u8").ok());
  ASSERT_TRUE(r.ReadFixed16(&u16, "u16").ok());
  ASSERT_TRUE(r.ReadFixed32(&u32, "u32").ok());
  ASSERT_TRUE(r.ReadFixed64(&u64, "u64").ok());
  ASSERT_TRUE(r.ReadInt32(&i32, "i32").ok());
  ASSERT_TRUE(r.ReadInt64(&i64, "i64").ok());
  ASSERT_TRUE(r.ReadFloat32(&f0, "f0").ok());
  ASSERT_TRUE(r.ReadFloat32(&f1, "f1").ok());
  ASSERT_TRUE(r.ReadFloat32(&f2, "f2").ok());
  ASSERT_TRUE(r.ReadLengthPrefixed(&t0, "t0").ok());
  ASSERT_TRUE(r.ReadLengthPrefixed(&t1, "t1").ok());
  ASSERT_TRUE(r.ReadFloat32Array(fb.data(), fb.size(), "fa").ok());
  ASSERT_TRUE(r.ReadInt32Array(ib.data(), ib.size(), "ia").ok());
  ASSERT_TRUE(r.ReadBytes(raw, 2, "raw").ok());
  EXPECT_TRUE(r.done());
  EXPECT_TRUE(r.ExpectEnd().ok());
  EXPECT_EQ(u8, 7);
  EXPECT_EQ(u16, 0xfffe);
  EXPECT_EQ(u32, 0xdeadbeefu);
  EXPECT_EQ(u64, std::numeric_limits<uint64_t>::max() - 1);
  EXPECT_EQ(i32, std::numeric_limits<int32_t>::min());
  EXPECT_EQ(i64, -1234567890123ll);
  EXPECT_TRUE(f0 == 0.0f && std::signbit(f0));
  EXPECT_EQ(std::bit_cast<uint32_t>(f1), 0x7fc12345u) << "NaN payload kept";
  EXPECT_EQ(f2, std::numeric_limits<float>::denorm_min());
  EXPECT_EQ(t0, std::string("abc\0def", 7));
  EXPECT_EQ(t1, "");
  EXPECT_EQ(fb, fa);
  EXPECT_EQ(ib, ia);
  EXPECT_EQ(std::string(raw, 2), "xy");
}

// Every read on short input is Corruption naming the record and the field, and leaves
// the cursor where it was.
TEST(StoreCoding, ShortInputIsCorruption) {
  const std::string three = Bytes({1, 2, 3});
  auto expect_short = [](Status st, const char* field) {
    EXPECT_EQ(st.code(), StatusCode::kCorruption) << st.ToString();
    EXPECT_NE(st.message().find("rec 9"), std::string::npos) << st.ToString();
    EXPECT_NE(st.message().find(field), std::string::npos) << st.ToString();
  };
  RecordReader r(three, "rec 9");
  uint32_t u32 = 0;
  uint64_t u64 = 0;
  int32_t i32 = 0;
  int64_t i64 = 0;
  float f = 0;
  std::string str;
  std::vector<float> fa(1);
  std::vector<int32_t> ia(1);
  char buf[4];
  expect_short(r.ReadFixed32(&u32, "the_u32"), "the_u32");
  expect_short(r.ReadFixed64(&u64, "the_u64"), "the_u64");
  expect_short(r.ReadInt32(&i32, "the_i32"), "the_i32");
  expect_short(r.ReadInt64(&i64, "the_i64"), "the_i64");
  expect_short(r.ReadFloat32(&f, "the_f32"), "the_f32");
  expect_short(r.ReadBytes(buf, 4, "the_bytes"), "the_bytes");
  expect_short(r.ReadLengthPrefixed(&str, "the_string"), "the_string");
  expect_short(r.ReadFloat32Array(fa.data(), 1, "the_floats"), "the_floats");
  expect_short(r.ReadInt32Array(ia.data(), 1, "the_ints"), "the_ints");
  EXPECT_EQ(r.position(), 0u) << "failed reads do not move the cursor";
  uint16_t u16 = 0;
  ASSERT_TRUE(r.ReadFixed16(&u16, "u16").ok());
  EXPECT_EQ(u16, 0x0201);
  uint8_t u8 = 0;
  expect_short(r.ExpectEnd(), "past the end");
  ASSERT_TRUE(r.ReadFixed8(&u8, "u8").ok());
  expect_short(r.ReadFixed8(&u8, "the_u8"), "the_u8");
  EXPECT_TRUE(r.ExpectEnd().ok());

  // A length prefix that promises more bytes than are left.
  std::string s;
  PutFixed32(&s, 100);
  s += "abc";
  RecordReader r2(s, "rec 9");
  Status st = r2.ReadLengthPrefixed(&str, "name");
  expect_short(st, "name");
  EXPECT_NE(st.message().find("100"), std::string::npos) << st.ToString();
  EXPECT_EQ(r2.position(), 0u);
  RecordReader empty("", "rec 9");
  expect_short(empty.ReadFixed8(&u8, "first"), "first");
}

// The chunk meta record is byte-for-byte what earlier builds wrote on x86 (so existing
// data dirs still open), and decodes back; a short or foreign one is Corruption naming the chunk.
TEST(StoreCoding, ChunkMetaRecordFormat) {
  using namespace store_records;
  const std::vector<uint8_t> repr{1, 2, 3, 4, 5, 6};
  const std::string meta = EncodeChunkMeta(0x0102030405060708ll, repr.data(), repr.size(), 1.0f);
  const std::string want = Bytes({0x4b, 0x56, 0x43, 0x4d,              // "KVCM"
                                  1,    0,    0,    0,                 // version
                                  8,    7,    6,    5,    4, 3, 2, 1,  // first_token
                                  6,    0,    0,    0,    1, 2, 3, 4, 5, 6, 0, 0, 0x80, 0x3f});  // score 1.0f
  EXPECT_EQ(meta, want);
  const ChunkKey key{3, 1, 17};
  auto back = DecodeChunkMeta(meta, key, repr.size());
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->first_token, 0x0102030405060708ll);
  EXPECT_EQ(back->repr, repr);
  EXPECT_EQ(back->score, 1.0f);
  for (size_t cut : {size_t{0}, size_t{3}, size_t{12}, meta.size() - 1}) {
    auto bad = DecodeChunkMeta(meta.substr(0, cut), key, repr.size());
    ASSERT_FALSE(bad.ok()) << cut;
    EXPECT_EQ(bad.status().code(), StatusCode::kCorruption);
    EXPECT_NE(bad.status().message().find("seq=3/layer=1/chunk=17"), std::string::npos)
        << bad.status().ToString();
  }
  EXPECT_EQ(DecodeChunkMeta(meta + "x", key, repr.size()).status().code(), StatusCode::kCorruption);
  EXPECT_EQ(DecodeChunkMeta(meta, key, repr.size() + 2).status().code(), StatusCode::kCorruption);
  std::string foreign = meta;
  foreign[0] = 'X';
  EXPECT_NE(DecodeChunkMeta(foreign, key, repr.size()).status().message().find("magic"), std::string::npos);
}

TEST(StoreCoding, SequenceAndStoreRecords) {
  using namespace store_records;
  const std::string rec = EncodeSequenceRecord(SeqState::kClosed, {5, 0, 1ll << 40});
  auto back = DecodeSequenceRecord(rec, 4, 3);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->state, SeqState::kClosed);
  EXPECT_EQ(back->n_tokens, (std::vector<int64_t>{5, 0, 1ll << 40}));
  // What fuzz_cold_value found the decoder accepting: a negative token count (recovery sizes
  // the layer from it), bytes after the record, an unknown state or version.
  auto expect_bad = [](const std::string& bytes, const std::string& what) {
    auto r = DecodeSequenceRecord(bytes, 4, 3);
    ASSERT_FALSE(r.ok()) << what;
    EXPECT_EQ(r.status().code(), StatusCode::kCorruption);
    EXPECT_NE(r.status().message().find(what), std::string::npos) << r.status().ToString();
  };
  expect_bad(EncodeSequenceRecord(SeqState::kClosed, {5, -1, 7}), "n_tokens -1 is negative");
  expect_bad(rec + "x", "1 bytes past the end of the record");
  std::string odd = rec;
  odd[8] = 7;  // state
  expect_bad(odd, "state 7 is neither open (0) nor closed (1)");
  odd = rec;
  odd[4] = 9;  // version
  expect_bad(odd, "version 9");
  // An open sequence comes back as recovered (read-only).
  EXPECT_EQ(DecodeSequenceRecord(EncodeSequenceRecord(SeqState::kOpen, {0}), 4, 1)->state,
            SeqState::kRecovered);
  auto wrong_layers = DecodeSequenceRecord(rec, 4, 2);
  EXPECT_EQ(wrong_layers.status().code(), StatusCode::kCorruption);
  EXPECT_NE(wrong_layers.status().message().find("sequence 4"), std::string::npos);
  auto short_rec = DecodeSequenceRecord(rec.substr(0, rec.size() - 3), 4, 3);
  EXPECT_EQ(short_rec.status().code(), StatusCode::kCorruption);
  EXPECT_NE(short_rec.status().message().find("n_tokens"), std::string::npos)
      << short_rec.status().ToString();

  StoreLayout l{Geometry{2, 4, 2, 16, DType::kBF16}, 8, 32, 8, 2};
  const std::string sr = EncodeStoreRecord(l);
  auto lb = DecodeStoreRecord(sr, "data_dir 'x'");
  ASSERT_TRUE(lb.ok()) << lb.status().ToString();
  EXPECT_EQ(lb->ToString(), l.ToString());
  auto bad = DecodeStoreRecord(sr.substr(0, 20), "data_dir 'x'");
  EXPECT_EQ(bad.status().code(), StatusCode::kCorruption);
  EXPECT_NE(bad.status().message().find("data_dir 'x'"), std::string::npos);
  EXPECT_EQ(DecodeStoreRecord(sr + "x", "data_dir 'x'").status().code(), StatusCode::kCorruption);
  std::string odd_dtype = sr;
  odd_dtype[24] = 9;  // after magic, version and four i32 of geometry
  auto dt = DecodeStoreRecord(odd_dtype, "data_dir 'x'");
  EXPECT_NE(dt.status().message().find("dtype 9 is not a storage dtype"), std::string::npos)
      << dt.status().ToString();
}

}  // namespace
}  // namespace kvtier
