// The engine API's store (include/kvtier/store.h): Store::Open gives the tiered store behind
// the abstract interface, a Session runs over it through a Store*, and a Store that
// Store::Open did not make is refused by name instead of being used.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <memory>
#include <string>
#include <vector>

#include "kvtier/kvtier.h"
#include "tests/test_util.h"

namespace kvtier {
namespace {

StoreOptions Small() {
  StoreOptions so;
  so.geometry = Geometry{2, 4, 2, 16, DType::kF32};
  so.n_sink = 4;
  so.n_local = 16;
  so.chunk_size = 4;
  so.hot_bytes = 64 * so.chunk_bytes();
  so.warm_bytes = 256 * so.chunk_bytes();
  return so;
}

TEST(StoreApi, OpenRunsASessionThroughTheInterface) {
  auto store = Store::Open(Small());
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  Store* s = store->get();
  EXPECT_EQ(s->options().chunk_size, 4);
  SessionOptions o;
  o.retrieval.budget_tokens = 8;
  auto session = Session::Open(s, o);
  ASSERT_TRUE(session.ok()) << session.status().ToString();
  std::vector<float> k(2 * 16, 0.5f), v(2 * 16, 0.25f), q(4 * 16, 0.1f), out(4 * 16);
  for (int64_t pos = 0; pos < 64; ++pos) {
    ASSERT_TRUE((*session)->BeginStep(StepKind::kDecode).ok());
    for (int layer = 0; layer < 2; ++layer) {
      ASSERT_TRUE((*session)->Append(layer, k.data(), v.data(), 1, DType::kF32).ok());
      ASSERT_TRUE((*session)->Attend(layer, q.data(), &pos, 1, out.data()).ok());
    }
  }
  const SequenceId seq = (*session)->sequence();
  EXPECT_EQ(s->ListSequences(), std::vector<SequenceId>{seq});
  auto length = s->SequenceLength(seq, 1);
  ASSERT_TRUE(length.ok());
  EXPECT_EQ(*length, 64);
  auto chunks = s->ChunkCount(seq, 0);
  ASSERT_TRUE(chunks.ok());
  EXPECT_EQ(*chunks, (64u - 4u - (16u + 4u)) / 4u);  // past the sinks and the ring (n_local + chunk_size)
  EXPECT_EQ(s->counters().chunks_sealed, 2 * *chunks);
  EXPECT_GT((*session)->counters().chunks_attended, 0u);
  ASSERT_TRUE(s->WaitForDurable().ok());
  // Attach over the interface too, to the sequence the first session made.
  auto again = Session::Attach(s, seq, o);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
}

TEST(StoreApi, OpenRefusesBadOptionsByName) {
  StoreOptions so = Small();
  so.chunk_size = 0;
  auto store = Store::Open(so);
  ASSERT_FALSE(store.ok());
  EXPECT_EQ(store.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(store.status().message().find("chunk_size"), std::string::npos) << store.status().ToString();
}

// A Store an engine wrote itself: Session cannot run over it and says so.
class ForeignStore final : public Store {
 public:
  const StoreOptions& options() const override { return options_; }
  std::vector<SequenceId> ListSequences() const override { return {}; }
  Result<int64_t> SequenceLength(SequenceId, int) const override { return int64_t{0}; }
  Result<uint64_t> ChunkCount(SequenceId, int) const override { return uint64_t{0}; }
  Status CloseSequence(SequenceId) override { return Status::Ok(); }
  Status DropSequence(SequenceId) override { return Status::Ok(); }
  Status WaitForDurable() override { return Status::Ok(); }
  StoreCounters counters() const override { return {}; }
  Status PublishSequence(SequenceId, std::string_view) override { return Status::Ok(); }
  Result<SequenceId> AttachPublished(std::string_view) override { return SequenceId{1}; }

 private:
  StoreOptions options_;
};

TEST(StoreApi, SessionRefusesAStoreThatOpenDidNotMake) {
  ForeignStore foreign;
  auto opened = Session::Open(&foreign, SessionOptions{});
  ASSERT_FALSE(opened.ok());
  EXPECT_EQ(opened.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(opened.status().message().find("Session::Open: the store was not opened by Store::Open"),
            std::string::npos)
      << opened.status().ToString();
  auto attached = Session::Attach(&foreign, 1, SessionOptions{});
  ASSERT_FALSE(attached.ok());
  EXPECT_NE(attached.status().message().find("Session::Attach"), std::string::npos);
  auto null = Session::Open(nullptr, SessionOptions{});
  ASSERT_FALSE(null.ok());
  EXPECT_NE(null.status().message().find("store is null"), std::string::npos);
}

// Store::Open never throws: a data_dir the OS will not stat is IOError naming the path and the
// OS error, whichever step (options check or cold tier) meets it first.
TEST(StoreApi, OpenNamesTheOsErrorOfAnUnusableDataDir) {
  TempDir dir;
  StoreOptions so = Small();
  so.data_dir = dir.path() + "/" + std::string(300, 'd') + "/kv";
  auto too_long = Store::Open(so);
  ASSERT_FALSE(too_long.ok());
  EXPECT_EQ(too_long.status().code(), StatusCode::kIOError) << too_long.status().ToString();
  EXPECT_NE(too_long.status().message().find("File name too long"), std::string::npos)
      << too_long.status().ToString();
  EXPECT_NE(too_long.status().message().find(so.data_dir), std::string::npos) << too_long.status().ToString();

  std::ofstream(dir.path() + "/file") << "x";
  so.data_dir = dir.path() + "/file/kv";
  auto below_a_file = Store::Open(so);
  ASSERT_FALSE(below_a_file.ok());
  EXPECT_EQ(below_a_file.status().code(), StatusCode::kIOError) << below_a_file.status().ToString();
  EXPECT_NE(below_a_file.status().message().find("Not a directory"), std::string::npos)
      << below_a_file.status().ToString();

  // A directory nobody may enter (EACCES), opened as nobody: "Permission denied", not "not a
  // directory", and nothing thrown.
  const std::string closed = dir.path() + "/closed";
  ASSERT_EQ(::mkdir(closed.c_str(), 0700), 0);
  ASSERT_EQ(::chmod(dir.path().c_str(), 0755), 0);
  so.data_dir = closed + "/kv";
  const std::string got = InChildAsNobody([&] {
    auto r = Store::Open(so);
    return r.ok() ? std::string("OK") : r.status().ToString();
  });
  EXPECT_NE(got.find("IOError"), std::string::npos) << got;
  EXPECT_NE(got.find("'" + so.data_dir + "': Permission denied"), std::string::npos) << got;
}

}  // namespace
}  // namespace kvtier
