// The CUDA hot tier's host-side parts, on any machine: SlotBook (its slot bookkeeping), the
// cuda device and --device cuda answering Unavailable with the reason instead of
// crashing. With a device (never so far: docs/gpu.md), CudaHotTier's copies round-trip.
#include "offload/cuda_hot_tier.h"

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "kernels/dtype.h"
#include "offload/hot_tier.h"
#include "offload/observe_queries.h"
#include "offload/scrambled_hot_tier.h"
#include "offload/slot_book.h"
#include "offload/tiered_store.h"

#if KVTIER_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/cuda/kernels.h"
#include "tests/device_test_util.h"
#endif

namespace kvtier {
namespace {

TEST(SlotBook, HandsOutEverySlotOnceAndTakesThemBack) {
  SlotBook book(5);
  EXPECT_EQ(book.capacity(), 5);
  std::set<int32_t> got;
  for (int i = 0; i < 5; ++i) {
    const int32_t s = book.Acquire();
    ASSERT_GE(s, 0);
    ASSERT_LT(s, 5);
    EXPECT_TRUE(got.insert(s).second) << "slot " << s << " handed out twice";
  }
  EXPECT_EQ(book.Acquire(), -1);  // full
  EXPECT_EQ(book.used(), 5);
  ASSERT_TRUE(book.Release(3).ok());
  EXPECT_EQ(book.used(), 4);
  EXPECT_EQ(book.Acquire(), 3);  // the freed one comes back
}

TEST(SlotBook, RefusesReleasesThatWouldHandOutOneSlotTwice) {
  SlotBook book(2);
  const int32_t a = book.Acquire();
  ASSERT_TRUE(book.Release(a).ok());
  const Status again = book.Release(a);
  EXPECT_EQ(again.code(), StatusCode::kFailedPrecondition) << again.ToString();
  EXPECT_EQ(book.Release(2).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(book.Release(-1).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(book.used(), 0);
  // Nothing changed: both slots are handed out exactly once more.
  const int32_t x = book.Acquire(), y = book.Acquire();
  EXPECT_NE(x, y);
  EXPECT_EQ(book.Acquire(), -1);
  EXPECT_EQ(SlotBook(0).Acquire(), -1);
}

TEST(HotTierUploadBatch, HostTierCopiesEveryOp) {
  auto made = MakeHotTier(Device::kCpu, 4 * 256, 256);
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  HotTier& t = **made;
  std::vector<uint8_t> a(256, 0x11), b(100, 0x22);
  const int32_t s0 = t.AcquireSlot(), s1 = t.AcquireSlot();
  const HotTier::UploadOp ops[] = {{t.slot_data(s1), a.data(), a.size()},
                                   {t.slot_data(s0), b.data(), b.size()}};
  ASSERT_TRUE(t.UploadBatch(ops, 2).ok());
  EXPECT_EQ(0, std::memcmp(t.slot_data(s1), a.data(), a.size()));
  EXPECT_EQ(0, std::memcmp(t.slot_data(s0), b.data(), b.size()));
  EXPECT_TRUE(t.UploadBatch(nullptr, 0).ok());
}

// The default UploadBatch stops at the first failing copy and returns its status.
class FailsSecondUpload final : public HotTier {
 public:
  Device device() const override { return Device::kCpu; }
  int32_t slot_capacity() const override { return 1; }
  int32_t slots_used() const override { return 0; }
  size_t slot_bytes() const override { return 1; }
  int32_t AcquireSlot() override { return -1; }
  void ReleaseSlot(int32_t) override {}
  uint8_t* slot_data(int32_t) override { return nullptr; }
  Result<uint8_t*> AllocateRegion(size_t) override { return Internal("unused"); }
  void FreeRegion(uint8_t*, size_t) override {}
  Status Upload(uint8_t*, const void*, size_t) override {
    return ++uploads == 2 ? IOError("second upload fails") : Status::Ok();
  }
  Status Download(void*, const uint8_t*, size_t) override { return Internal("unused"); }
  int uploads = 0;
};

TEST(HotTierUploadBatch, DefaultStopsAtTheFirstError) {
  FailsSecondUpload t;
  uint8_t byte = 0;
  const HotTier::UploadOp ops[] = {{&byte, &byte, 1}, {&byte, &byte, 1}, {&byte, &byte, 1}};
  const Status st = t.UploadBatch(ops, 3);
  EXPECT_EQ(st.code(), StatusCode::kIOError) << st.ToString();
  EXPECT_EQ(t.uploads, 2);
}

TEST(HotTierCopyWithin, DefaultRefusesNamingTheTierAndHostTierCopies) {
  // A tier that does not say how to copy within its memory refuses device K/V by name.
  FailsSecondUpload t;
  uint8_t a = 1, b = 2;
  const Status st = t.CopyWithin(&a, &b, 1);
  EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st.ToString();
  EXPECT_NE(st.message().find("MemorySpace::kHost"), std::string::npos) << st.ToString();
  EXPECT_EQ(a, 1);
  auto made = MakeHotTier(Device::kCpu, 2 * 64, 64);
  ASSERT_TRUE(made.ok());
  HotTier& host = **made;
  std::vector<uint8_t> src(64, 0x3C);
  const int32_t slot = host.AcquireSlot();
  ASSERT_TRUE(host.CopyWithin(host.slot_data(slot), src.data(), src.size()).ok());
  EXPECT_EQ(0, std::memcmp(host.slot_data(slot), src.data(), src.size()));
}

TEST(XorScrambledHotTier, StoresScrambledBytesAndTranslatesEveryCopyAcrossTheHostBoundary) {
  auto made = MakeHotTier(Device::kCpu, 2 * 64, 64);
  ASSERT_TRUE(made.ok());
  XorScrambledHotTier t(std::move(*made), Device::kCuda, 0x0F);
  EXPECT_EQ(t.device(), Device::kCuda);
  EXPECT_EQ(t.slot_capacity(), 2);  // the rest is the inner tier's
  std::vector<uint8_t> in(64), out(64, 0);
  for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<uint8_t>(i);
  const int32_t a = t.AcquireSlot(), b = t.AcquireSlot();
  const HotTier::UploadOp up[] = {{t.slot_data(a), in.data(), in.size()}};
  ASSERT_TRUE(t.UploadBatch(up, 1).ok());
  for (size_t i = 0; i < in.size(); ++i)
    ASSERT_EQ(t.slot_data(a)[i], in[i] ^ 0x0F) << i;  // at rest: scrambled
  // Within the tier the bytes move as they are at rest; out of it they are translated back.
  ASSERT_TRUE(t.CopyWithin(t.slot_data(b), t.slot_data(a), in.size()).ok());
  const HotTier::DownloadOp down[] = {{out.data(), t.slot_data(b), out.size()}};
  auto ticket = t.DownloadBatchAsync(down, 1);
  ASSERT_TRUE(ticket.ok());
  EXPECT_EQ(*ticket, kCompletedTransfer);
  ASSERT_TRUE(t.WaitTransfer(*ticket).ok());
  EXPECT_EQ(out, in);
  EXPECT_EQ(t.WaitTransfer(7).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(t.uploads(), 1u);
  EXPECT_EQ(t.downloads(), 1u);
}

bool HaveDevice() {
#if KVTIER_HAVE_CUDA
  return device_test::HaveDevice();
#else
  return false;
#endif
}

TEST(CudaHotTier, SpecIsUnavailableWithTheReasonWithoutADevice) {
  if (HaveDevice()) GTEST_SKIP() << "a CUDA device is present: covered by CopiesRoundTripThroughDeviceMemory";
  const size_t slot = 4096;
  const Status check = CheckDevice(Device::kCuda);
  EXPECT_EQ(check.code(), StatusCode::kUnavailable) << check.ToString();
#if KVTIER_HAVE_CUDA
  EXPECT_NE(check.message().find("no CUDA device"), std::string::npos) << check.ToString();
#else
  EXPECT_NE(check.message().find("no CUDA"), std::string::npos) << check.ToString();
#endif
  auto tier = MakeHotTier(Device::kCuda, 4 * slot, slot);
  ASSERT_FALSE(tier.ok());
  EXPECT_EQ(tier.status().code(), StatusCode::kUnavailable);
}

#if KVTIER_HAVE_CUDA
TEST(CudaHotTier, CopiesRoundTripThroughDeviceMemory) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device: " << kernels::cuda::LastCudaErrorString();
  const size_t slot = 8192;
  auto made = CudaHotTier::Create(3 * slot + 100, slot);
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  CudaHotTier& t = **made;
  EXPECT_EQ(t.device(), Device::kCuda);
  EXPECT_EQ(t.slot_capacity(), 3);
  std::vector<uint8_t> in(slot), out(slot, 0);
  for (size_t i = 0; i < slot; ++i) in[i] = static_cast<uint8_t>(i * 7 + 1);
  const int32_t s = t.AcquireSlot();
  ASSERT_GE(s, 0);
  ASSERT_TRUE(t.Upload(t.slot_data(s), in.data(), slot).ok());
  ASSERT_TRUE(t.Download(out.data(), t.slot_data(s), slot).ok());
  EXPECT_EQ(in, out);
  auto region = t.AllocateRegion(1000);
  ASSERT_TRUE(region.ok()) << region.status().ToString();
  std::fill(out.begin(), out.end(), 0);
  ASSERT_TRUE(t.Upload(*region, in.data(), 1000).ok());
  ASSERT_TRUE(t.Download(out.data(), *region, 1000).ok());
  EXPECT_EQ(0, std::memcmp(in.data(), out.data(), 1000));
  // Device K/V (Append's MemorySpace::kDevice): region -> slot on the device, then back.
  const int32_t s2 = t.AcquireSlot();
  ASSERT_GE(s2, 0);
  ASSERT_TRUE(t.CopyWithin(t.slot_data(s2), *region, 1000).ok());
  std::fill(out.begin(), out.end(), 0);
  ASSERT_TRUE(t.Download(out.data(), t.slot_data(s2), 1000).ok());
  EXPECT_EQ(0, std::memcmp(in.data(), out.data(), 1000));
  // Asynchronous download into pinned memory (how the store seals a chunk): a ticket, polled
  // then waited; an Upload submitted after it into the same bytes does not change what it read.
  void* pinned = nullptr;
  ASSERT_EQ(cudaMallocHost(&pinned, 1000), cudaSuccess);
  std::memset(pinned, 0, 1000);
  const HotTier::DownloadOp down[] = {{pinned, t.slot_data(s2), 600},
                                      {static_cast<uint8_t*>(pinned) + 600, t.slot_data(s2) + 600, 400}};
  auto ticket = t.DownloadBatchAsync(down, 2);
  ASSERT_TRUE(ticket.ok()) << ticket.status().ToString();
  std::vector<uint8_t> other(1000, 0xAB);
  ASSERT_TRUE(t.Upload(t.slot_data(s2), other.data(), 1000).ok());  // ordered after the download
  auto done = t.TransferDone(*ticket);
  ASSERT_TRUE(done.ok()) << done.status().ToString();
  ASSERT_TRUE(t.WaitTransfer(*ticket).ok());
  EXPECT_EQ(0, std::memcmp(in.data(), pinned, 1000));
  EXPECT_EQ(t.WaitTransfer(*ticket).code(), StatusCode::kInvalidArgument);  // waited once
  cudaFreeHost(pinned);
  t.ReleaseSlot(s2);
  t.FreeRegion(*region, 1000);
  t.ReleaseSlot(s);
  t.ReleaseSlot(s);  // a double release is counted, not obeyed
  EXPECT_EQ(t.bad_releases(), 1u);
  EXPECT_EQ(t.slots_used(), 0);
}
#endif

TEST(CudaHotTier, StoreTakesTheCudaTierOnlyWithADevice) {
  // The store accepts device cuda (nothing in it dereferences hot memory on the host);
  // without a CUDA build or a device, Open answers Unavailable naming the device and why,
  // never crashes.
  StoreOptions o;
  o.geometry.layers = 1;
  o.geometry.q_heads = 2;
  o.geometry.kv_heads = 1;
  o.geometry.head_dim = 8;
  o.chunk_size = 4;
  o.n_sink = 4;
  o.n_local = 8;
  o.repr_topk = 1;
  o.hot_bytes = 8 * o.chunk_bytes();
  o.warm_bytes = 16 * o.chunk_bytes();
  o.data_dir = "";
  o.device = Device::kCuda;
  auto s = TieredStore::Open(o);
  if (HaveDevice()) {
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    EXPECT_EQ((*s)->hot_tier()->device(), Device::kCuda);
    return;
  }
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kUnavailable) << s.status().ToString();
  EXPECT_NE(s.status().message().find("device"), std::string::npos) << s.status().ToString();
  EXPECT_NE(s.status().message().find("no CUDA"), std::string::npos) << s.status().ToString();
}

// "Device" memory the host cannot read directly (XorScrambledHotTier, reporting "cuda"):
// bytes are stored scrambled and only the tier's copies translate. A store reader that
// dereferenced hot memory on the host instead of going through the tier would see garbage,
// so equality with a host store proves the store's host readers (ObserveQueries' attention,
// representative choice, ReadTokens, retrieval's scoring) never read device memory.
TEST(CudaHotTier, StoreOverDeviceMemoryReadsItOnlyThroughTheTier) {
  StoreOptions o;
  o.geometry = Geometry{2, 4, 2, 16, DType::kF16};
  o.chunk_size = 4;
  o.n_sink = 4;
  o.n_local = 8;
  o.repr_topk = 2;
  o.hot_bytes = 16 * o.chunk_bytes();
  o.warm_bytes = 256 * o.chunk_bytes();
  o.data_dir = "";
  auto host = TieredStore::Open(o);
  ASSERT_TRUE(host.ok()) << host.status().ToString();
  XorScrambledHotTier* dev_tier = nullptr;
  StoreHooks hooks;
  hooks.hot_tier_factory = [&dev_tier](size_t pool, size_t slot) -> Result<std::unique_ptr<HotTier>> {
    KVTIER_ASSIGN_OR_RETURN(auto inner, MakeHotTier(Device::kCpu, pool, slot));
    auto t = std::make_unique<XorScrambledHotTier>(std::move(inner), Device::kCuda);
    dev_tier = t.get();
    return std::unique_ptr<HotTier>(std::move(t));
  };
  auto dev = TieredStore::Open(o, hooks);
  ASSERT_TRUE(dev.ok()) << dev.status().ToString();
  auto sh = (*host)->CreateSequence();
  auto sd = (*dev)->CreateSequence();
  ASSERT_TRUE(sh.ok() && sd.ok());
  const Geometry& g = o.geometry;
  const size_t tok = g.token_elems();
  std::mt19937 rng(11);
  std::normal_distribution<float> n(0.0f, 1.0f);
  const int kWindow = 6, kTokens = 96;
  for (int64_t p0 = 0; p0 < kTokens; p0 += kWindow) {
    for (int l = 0; l < g.layers; ++l) {
      std::vector<float> kf(kWindow * tok), vf(kWindow * tok), q(kWindow * g.q_heads * g.head_dim);
      for (float& x : kf) x = n(rng);
      for (float& x : vf) x = n(rng);
      for (float& x : q) x = n(rng);
      std::vector<uint16_t> k(kf.size()), v(vf.size());
      FromFloat(DType::kF16, kf.data(), k.data(), k.size());
      FromFloat(DType::kF16, vf.data(), v.data(), v.size());
      std::vector<int64_t> pos(kWindow);
      for (int t = 0; t < kWindow; ++t) pos[t] = p0 + t;
      ASSERT_TRUE((*host)->Append(*sh, l, k.data(), v.data(), kWindow, DType::kF16).ok());
      ASSERT_TRUE((*dev)->Append(*sd, l, k.data(), v.data(), kWindow, DType::kF16).ok());
      // The window's queries feed the representative-key statistics (attention on the host).
      ASSERT_TRUE(ObserveQueries(**host, *sh, l, q.data(), pos.data(), kWindow).ok());
      Status st = ObserveQueries(**dev, *sd, l, q.data(), pos.data(), kWindow);
      ASSERT_TRUE(st.ok()) << st.ToString();
    }
  }
  const size_t repr = static_cast<size_t>(o.repr_topk) * tok;
  for (int l = 0; l < g.layers; ++l) {
    auto ch = (*host)->ListChunks(*sh, l);
    auto cd = (*dev)->ListChunks(*sd, l);
    ASSERT_TRUE(ch.ok() && cd.ok());
    ASSERT_EQ(ch->size(), cd->size());
    ASSERT_GT(ch->size(), 10u);
    for (size_t i = 0; i < ch->size(); ++i) {
      std::vector<float> rh(repr), rd(repr, -1.0f);
      ASSERT_TRUE((*host)->GetRepresentatives((*ch)[i].key, rh.data()).ok());
      ASSERT_TRUE((*dev)->GetRepresentatives((*cd)[i].key, rd.data()).ok());
      EXPECT_EQ(std::memcmp(rh.data(), rd.data(), repr * sizeof(float)), 0)
          << "layer " << l << " chunk " << i;
    }
    // Every token back, from slots, the warm tier and the local ring.
    std::vector<uint16_t> kh(kTokens * tok), vh(kh.size()), kd(kh.size(), 1), vd(kh.size(), 1);
    ASSERT_TRUE((*host)->ReadTokens(*sh, l, 0, kTokens, kh.data(), vh.data()).ok());
    ASSERT_TRUE((*dev)->ReadTokens(*sd, l, 0, kTokens, kd.data(), vd.data()).ok());
    EXPECT_EQ(kh, kd) << "layer " << l;
    EXPECT_EQ(vh, vd) << "layer " << l;
    // Fetched chunks land in slots through the tier: their scrambled bytes read back right.
    auto fh = (*dev)->FetchChunks(*sd, l, {0, 3, 5});
    ASSERT_TRUE(fh.ok() && fh->Wait().ok());
    std::vector<uint16_t> chunk(o.chunk_size * tok);
    for (size_t i = 0; i < fh->spans().size(); ++i) {
      const kernels::KvSpan& sp = fh->spans()[i];
      ASSERT_TRUE(dev_tier->Download(chunk.data(), static_cast<const uint8_t*>(sp.k), chunk.size() * 2).ok());
      EXPECT_EQ(std::memcmp(chunk.data(), kh.data() + (sp.first_position) * tok, chunk.size() * 2), 0) << i;
    }
    fh->Release();
  }
  EXPECT_GT(dev_tier->downloads(), 0u);
}

// `--device` on the three commands that open a store: cuda is refused with the reason (here:
// no CUDA build, or no device) and an exit code, never a crash; a bad name is a usage error.
std::string RunKvtier(const std::string& args, int* code) {
  const std::string cmd = std::string(KVTIER_BINARY_DIR) + "/kvtier " + args + " 2>&1";
  std::string out;
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  const int st = pclose(p);
  *code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return out;
}

TEST(CudaHotTier, DeviceFlagOfRunAndStressSaysWhyCudaIsUnavailable) {
  if (HaveDevice())
    GTEST_SKIP() << "a CUDA device is present: the store's refusal is checked by StoreRefuses*";
  const std::string dir = std::string(KVTIER_BINARY_DIR) + "/cuda_hot_tier_test_data";
  for (const std::string cmd : {"run --context 4096 --decode-steps 1", "stress --sequences 1 --tokens 64"}) {
    int code = -1;
    const std::string out = RunKvtier(cmd + " --device cuda --data-dir " + dir, &code);
    EXPECT_NE(code, 0) << cmd << ": " << out;
    EXPECT_NE(out.find("Unavailable"), std::string::npos) << cmd << ": " << out;
    EXPECT_NE(out.find("hot tier \"cuda\""), std::string::npos) << cmd << ": " << out;
  }
  int code = -1;
  const std::string out = RunKvtier("run --device gpu", &code);
  EXPECT_EQ(code, 2) << out;
  EXPECT_NE(out.find("unknown device 'gpu' (cpu|cuda)"), std::string::npos) << out;
}

}  // namespace
}  // namespace kvtier
