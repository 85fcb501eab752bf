// The remote tier on real redis-server processes (tests/redis_fixture.h): one server, a
// 3-master/3-replica cluster, maxmemory eviction, corrupted values, a node down or slow,
// a master SIGKILLed mid-run, and two processes sharing a sequence.
#include "offload/remote_tier.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <thread>

#include "include/kvtier/session.h"
#include "offload/tiered_store.h"
#include "tests/redis_fixture.h"
#include "tests/remote_share.h"

namespace kvtier {
namespace {

constexpr size_t kChunkBytes = 4096;

std::vector<uint8_t> ChunkBytes(const ChunkKey& k, size_t n = kChunkBytes) {
  std::vector<uint8_t> b(n);
  FillPattern(99, k.seq, k.layer, 0, static_cast<int64_t>(k.index) * 64, 1, n, b.data());
  return b;
}

RemoteTierOptions OptionsFor(const std::string& spec) {
  auto o = ParseRemoteSpec(spec);
  EXPECT_TRUE(o.ok()) << o.status().ToString();
  return o.ok() ? *o : RemoteTierOptions{};
}

// Puts chunks (seq 1, layer 0, index 0..n-1) in batches of `batch`; returns OK or the first error.
Status PutRange(RemoteTier* t, uint64_t from, uint64_t to, size_t batch = 32, size_t bytes = kChunkBytes) {
  for (uint64_t i = from; i < to; i += batch) {
    std::vector<std::vector<uint8_t>> data;
    std::vector<RemoteTier::Put> puts;
    for (uint64_t j = i; j < std::min<uint64_t>(to, i + batch); ++j)
      data.push_back(ChunkBytes({1, 0, j}, bytes));
    for (uint64_t j = i; j < std::min<uint64_t>(to, i + batch); ++j) {
      RemoteTier::Put p;
      p.key = ChunkKey{1, 0, j};
      p.meta = "meta";
      p.payload = data[j - i].data();
      p.payload_bytes = bytes;
      puts.push_back(p);
    }
    KVTIER_RETURN_IF_ERROR(t->PutChunks(&puts));
  }
  return Status::Ok();
}

// ---- no server needed --------------------------------------------------------------

TEST(RemoteSpec, ParsesHostsAndOptionsAndRejectsNonsense) {
  auto o = ParseRemoteSpec("redis://127.0.0.1:7000,node-b:7001?wait=1&timeout_ms=2500&ns=run-1");
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  ASSERT_EQ(o->endpoints.size(), 2u);
  EXPECT_EQ(o->endpoints[0].ToString(), "127.0.0.1:7000");
  EXPECT_EQ(o->endpoints[1].ToString(), "node-b:7001");
  EXPECT_EQ(o->wait_replicas, 1);
  EXPECT_EQ(o->command_timeout_ms, 2500);
  EXPECT_EQ(o->ns, "run-1");
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"http://h:1", "must start with redis://"},
      {"redis://", "no host:port"},
      {"redis://h", "is not host:port"},
      {"redis://h:0", "outside 1..65535"},
      {"redis://h:99999", "outside 1..65535"},
      {"redis://h:12ab", "not a non-negative integer"},
      {"redis://h:1,", "trailing ','"},
      {"redis://h:1?wait", "not key=value"},
      {"redis://h:1?color=red", "unknown option 'color'"},
      {"redis://h:1?pool=0", "option 'pool' is 0, outside 1..256"},
      {"redis://h:1?wait=1&wait_timeout_ms=3000", "must be below command_timeout_ms"},
      {"redis://h:1?ns=a:b", "ns 'a:b'"}};
  for (const auto& [spec, why] : bad) {
    auto r = ParseRemoteSpec(spec);
    ASSERT_FALSE(r.ok()) << spec;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << spec;
    EXPECT_NE(r.status().message().find(why), std::string::npos) << spec << ": " << r.status().message();
    EXPECT_NE(r.status().message().find(spec), std::string::npos) << "the message quotes the spec";
  }
  StoreOptions so = remote_share::Options("redis://h:1?retry_ms=-1");
  EXPECT_EQ(so.Validate().code(), StatusCode::kInvalidArgument);
}

TEST(RemoteSpec, KeySlotIsRedisCrc16WithHashTags) {
  // Values from the Redis Cluster specification / CLUSTER KEYSLOT.
  EXPECT_EQ(RedisKeySlot("foo"), 12182);
  EXPECT_EQ(RedisKeySlot("123456789"), 0x31C3 % 16384);
  EXPECT_EQ(RedisKeySlot("{user1000}.following"), RedisKeySlot("{user1000}.followers"));
  EXPECT_EQ(RedisKeySlot("{user1000}.following"), RedisKeySlot("user1000"));
  EXPECT_EQ(RedisKeySlot("foo{}{bar}"), RedisKeySlot("foo{}{bar}"));  // empty tag: the whole key
  EXPECT_NE(RedisKeySlot("foo{}{bar}"), RedisKeySlot("bar"));
}

// ---- one server ---------------------------------------------------------------------

TEST(RemoteTier, SingleServerRoundTripMissingAndCorruptValues) {
  KVTIER_SKIP_WITHOUT_REDIS();
  RedisServers redis;
  ASSERT_GE(redis.Start(), 0);
  auto tier = RemoteTier::Open(OptionsFor(redis.Spec(0, "ns=t1")));
  ASSERT_TRUE(tier.ok()) << tier.status().ToString();
  EXPECT_FALSE((*tier)->client()->cluster());
  ASSERT_TRUE(PutRange(tier->get(), 0, 100).ok());

  std::vector<std::vector<uint8_t>> out(100, std::vector<uint8_t>(kChunkBytes));
  std::vector<RemoteTier::Get> gets(100);
  for (uint64_t i = 0; i < 100; ++i) {
    gets[i].ref.key = ChunkKey{1, 0, i};
    gets[i].dst = out[i].data();
    gets[i].payload_bytes = kChunkBytes;
  }
  ASSERT_TRUE((*tier)->GetChunks(&gets).ok());
  for (uint64_t i = 0; i < 100; ++i) ASSERT_EQ(out[i], ChunkBytes({1, 0, i})) << i;

  std::vector<uint8_t> buf(kChunkBytes);
  // Never written: NotFound naming the chunk and its key.
  Status st = (*tier)->GetChunk({nullptr, {1, 0, 500}}, buf.data(), kChunkBytes);
  EXPECT_EQ(st.code(), StatusCode::kNotFound);
  EXPECT_NE(st.message().find("seq=1/layer=0/chunk=500"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("kvt:t1:1:0:500"), std::string::npos) << st.message();

  // Overwritten by hand with redis-cli: Corruption naming the chunk.
  ASSERT_EQ(redis.Cli(0, "SET kvt:t1:1:0:7 garbage-bytes"), 0);
  st = (*tier)->GetChunk({nullptr, {1, 0, 7}}, buf.data(), kChunkBytes);
  EXPECT_EQ(st.code(), StatusCode::kCorruption) << st.ToString();
  EXPECT_NE(st.message().find("seq=1/layer=0/chunk=7"), std::string::npos) << st.message();
  // One payload byte flipped in place: the CRC catches it.
  ASSERT_EQ(redis.Cli(0, "SETRANGE kvt:t1:1:0:8 100 Z"), 0);
  st = (*tier)->GetChunk({nullptr, {1, 0, 8}}, buf.data(), kChunkBytes);
  EXPECT_EQ(st.code(), StatusCode::kCorruption) << st.ToString();
  EXPECT_NE(st.message().find("checksum mismatch"), std::string::npos) << st.message();
  // A valid value of another chunk copied under this key: caught by the key tag.
  ASSERT_EQ(redis.Cli(0, "COPY kvt:t1:1:0:10 kvt:t1:1:0:9 REPLACE"), 0);
  st = (*tier)->GetChunk({nullptr, {1, 0, 9}}, buf.data(), kChunkBytes);
  EXPECT_EQ(st.code(), StatusCode::kCorruption) << st.ToString();
  EXPECT_NE(st.message().find("another key"), std::string::npos) << st.message();
  // The rest still reads back exactly; wrong size is refused, not truncated.
  ASSERT_TRUE((*tier)->GetChunk({nullptr, {1, 0, 11}}, buf.data(), kChunkBytes).ok());
  EXPECT_EQ(buf, ChunkBytes({1, 0, 11}));
  std::vector<uint8_t> small(kChunkBytes / 2);
  EXPECT_EQ((*tier)->GetChunk({nullptr, {1, 0, 11}}, small.data(), small.size()).code(),
            StatusCode::kCorruption);
  const RemoteTierCounters c = (*tier)->counters();
  EXPECT_EQ(c.not_found, 1u);
  EXPECT_EQ(c.corrupt, 4u);

  ASSERT_TRUE((*tier)->DeleteChunks({{1, 0, 11}}).ok());
  EXPECT_EQ((*tier)->GetChunk({nullptr, {1, 0, 11}}, buf.data(), kChunkBytes).code(), StatusCode::kNotFound);
}

TEST(RemoteTier, MaxmemoryEvictionIsNotFoundNeverGarbage) {
  KVTIER_SKIP_WITHOUT_REDIS();
  RedisServers redis;
  ASSERT_GE(redis.Start({"--maxmemory", "3mb", "--maxmemory-policy", "allkeys-lru"}), 0);
  auto tier = RemoteTier::Open(OptionsFor(redis.Spec(0)));
  ASSERT_TRUE(tier.ok()) << tier.status().ToString();
  constexpr uint64_t kN = 400;  // 400 x 16 KiB = 6.4 MB into 3 MB
  ASSERT_TRUE(PutRange(tier->get(), 0, kN, 16, 16384).ok());
  size_t ok = 0, missing = 0;
  std::vector<uint8_t> buf(16384);
  for (uint64_t i = 0; i < kN; ++i) {
    Status st = (*tier)->GetChunk({nullptr, {1, 0, i}}, buf.data(), buf.size());
    if (st.ok()) {
      ++ok;
      ASSERT_EQ(buf, ChunkBytes({1, 0, i}, 16384)) << i;
    } else {
      ASSERT_EQ(st.code(), StatusCode::kNotFound) << st.ToString();
      ASSERT_NE(st.message().find("evicted"), std::string::npos) << st.message();
      ++missing;
    }
  }
  EXPECT_GT(ok, 0u);
  EXPECT_GT(missing, kN / 4) << "maxmemory 3mb must have evicted a good part of 6.4 MB";
  EXPECT_EQ((*tier)->counters().not_found, missing);
}

TEST(RemoteTier, DownOrSlowServerIsANamedErrorAndReconnects) {
  KVTIER_SKIP_WITHOUT_REDIS();
  RedisServers redis;
  ASSERT_GE(redis.Start(), 0);
  const std::string port = std::to_string(redis.server(0).port);
  auto tier =
      RemoteTier::Open(OptionsFor(redis.Spec(0, "timeout_ms=200&connect_timeout_ms=200&retry_ms=500")));
  ASSERT_TRUE(tier.ok()) << tier.status().ToString();
  ASSERT_TRUE(PutRange(tier->get(), 0, 4).ok());
  std::vector<uint8_t> buf(kChunkBytes);

  redis.Pause(0);  // SIGSTOP: the server accepts nothing and answers nothing
  const auto t0 = std::chrono::steady_clock::now();
  Status st = (*tier)->GetChunk({nullptr, {1, 0, 1}}, buf.data(), kChunkBytes);
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(st.code(), StatusCode::kTimedOut) << st.ToString();
  EXPECT_NE(st.message().find("127.0.0.1:" + port), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("seq=1/layer=0/chunk=1"), std::string::npos) << st.message();
  EXPECT_LT(ms, 3000) << "retry_ms bounds the wait";
  redis.Resume(0);
  // The node failed for a whole retry window: for the next one every command fails at once,
  // naming the node and its first error, even though it answers again.
  const auto t1 = std::chrono::steady_clock::now();
  st = (*tier)->GetChunk({nullptr, {1, 0, 1}}, buf.data(), kChunkBytes);
  const double fast_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t1).count();
  EXPECT_LT(fast_ms, 100) << "fails at once, no retrying";
  EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st.ToString();
  EXPECT_NE(st.message().find("127.0.0.1:" + port + ": down"), std::string::npos) << st.message();
  std::this_thread::sleep_for(std::chrono::milliseconds(600));  // past the window: tried again
  ASSERT_TRUE((*tier)->GetChunk({nullptr, {1, 0, 1}}, buf.data(), kChunkBytes).ok()) << "reconnects";
  EXPECT_EQ(buf, ChunkBytes({1, 0, 1}));

  redis.Kill(0);
  st = (*tier)->GetChunk({nullptr, {1, 0, 2}}, buf.data(), kChunkBytes);
  EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st.ToString();
  EXPECT_NE(st.message().find("127.0.0.1:" + port), std::string::npos) << st.message();
  st = PutRange(tier->get(), 10, 11);
  EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st.ToString();
  EXPECT_GE((*tier)->counters().errors, 2u);
}

TEST(RemoteTier, ConcurrentCallersShareThePool) {
  KVTIER_SKIP_WITHOUT_REDIS();
  RedisServers redis;
  ASSERT_GE(redis.Start(), 0);
  auto tier = RemoteTier::Open(OptionsFor(redis.Spec(0, "pool=2")));
  ASSERT_TRUE(tier.ok()) << tier.status().ToString();
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      for (uint64_t i = 0; i < 50; ++i) {
        const ChunkKey k{static_cast<SequenceId>(10 + t), 0, i};
        const auto data = ChunkBytes(k);
        std::vector<uint8_t> back(kChunkBytes);
        if (!(*tier)->PutChunk(k, "m", data.data(), data.size()).ok() ||
            !(*tier)->GetChunk({nullptr, k}, back.data(), back.size()).ok() || back != data)
          failures++;
      }
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ((*tier)->counters().puts, 200u);
}

// A store whose only lower tier is Redis: what leaves warm comes back exact, from Redis.
TEST(RemoteTier, StoreDemotesToRedisAndFetchesBack) {
  KVTIER_SKIP_WITHOUT_REDIS();
  RedisServers redis;
  ASSERT_GE(redis.Start(), 0);
  const StoreOptions o = remote_share::Options(redis.Spec(0));
  auto store = TieredStore::Open(o);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  TieredStore* s = store->get();
  auto seq = s->CreateSequence();
  ASSERT_TRUE(seq.ok());
  ASSERT_TRUE(remote_share::Write(s, *seq).ok());
  ASSERT_TRUE(s->WaitForDurable().ok());
  auto n = s->ChunkCount(*seq, 0);
  ASSERT_TRUE(n.ok());
  ASSERT_GT(*n, 40u);
  for (int l = 0; l < o.geometry.layers; ++l) {
    // Fetch every chunk (most only in Redis) and compare the hot spans with what was appended.
    for (uint64_t i = 0; i < *n; i += 32) {
      std::vector<uint64_t> idx;
      for (uint64_t j = i; j < std::min<uint64_t>(*n, i + 32); ++j) idx.push_back(j);
      auto h = s->FetchChunks(*seq, l, idx);
      ASSERT_TRUE(h.ok()) << h.status().ToString();
      ASSERT_TRUE(h->Wait().ok());
      for (size_t j = 0; j < idx.size(); ++j) {
        const kernels::KvSpan& sp = h->spans()[j];
        const auto k = remote_share::Tokens(o, l, 0, sp.first_position, sp.first_position + o.chunk_size);
        const auto v = remote_share::Tokens(o, l, 1, sp.first_position, sp.first_position + o.chunk_size);
        ASSERT_EQ(std::memcmp(sp.k, k.data(), k.size()), 0) << "layer " << l << " chunk " << idx[j];
        ASSERT_EQ(std::memcmp(sp.v, v.data(), v.size()), 0) << "layer " << l << " chunk " << idx[j];
      }
    }
    // ReadTokens of the whole layer, without promoting.
    std::vector<uint8_t> k(remote_share::kTokens * remote_share::TokenBytes(o)), v(k.size());
    ASSERT_TRUE(s->ReadTokens(*seq, l, 0, remote_share::kTokens, k.data(), v.data()).ok());
    EXPECT_EQ(k, remote_share::Tokens(o, l, 0, 0, remote_share::kTokens));
    EXPECT_EQ(v, remote_share::Tokens(o, l, 1, 0, remote_share::kTokens));
  }
  const StoreCounters c = s->counters();
  EXPECT_EQ(c.remote_puts, 2 * *n);
  EXPECT_GT(c.remote_loads, *n) << "most chunks left warm for Redis";
  EXPECT_GT(c.remote_get_bytes, 0u);
  EXPECT_EQ(c.warm_loads + c.cold_loads + c.remote_loads + c.hits, c.hits + c.misses);
  EXPECT_NE(RedisCommandText(redis.server(0).port, {"DBSIZE"}), "0");
  // Dropping the sequence removes its chunks from Redis too.
  ASSERT_TRUE(s->DropSequence(*seq).ok());
  EXPECT_EQ(RedisCommandText(redis.server(0).port, {"DBSIZE"}), "0");
}

// A chunk Redis evicted or that was damaged is a named fetch error; the local copy, when the
// store also has a cold tier, serves it instead. Never wrong bytes.
TEST(RemoteTier, StoreFetchOfEvictedOrCorruptChunkFailsOrFallsBack) {
  KVTIER_SKIP_WITHOUT_REDIS();
  RedisServers redis;
  ASSERT_GE(redis.Start(), 0);
  TempDir dir;
  for (bool with_cold : {false, true}) {
    StoreOptions o = remote_share::Options(redis.Spec(0));
    o.remote_namespace = with_cold ? "cold" : "nocold";
    if (with_cold) o.data_dir = dir.path();
    auto store = TieredStore::Open(o);
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    TieredStore* s = store->get();
    auto seq = s->CreateSequence();
    ASSERT_TRUE(seq.ok());
    ASSERT_TRUE(remote_share::Write(s, *seq).ok());
    ASSERT_TRUE(s->WaitForDurable().ok());
    const std::string key1 = "kvt:" + o.remote_namespace + ":" + std::to_string(*seq) + ":0:1";
    const std::string key2 = "kvt:" + o.remote_namespace + ":" + std::to_string(*seq) + ":0:2";
    ASSERT_EQ(RedisCommandText(redis.server(0).port, {"DEL", key1}), "1");
    ASSERT_EQ(RedisCommandText(redis.server(0).port, {"SET", key2, "not a chunk"}), "OK");
    for (uint64_t idx : {1, 2}) {
      auto h = s->FetchChunks(*seq, 0, {idx});
      ASSERT_TRUE(h.ok());
      Status st = h->Wait();
      if (with_cold) {
        ASSERT_TRUE(st.ok()) << st.ToString();
        const auto k = remote_share::Tokens(o, 0, 0, h->spans()[0].first_position,
                                            h->spans()[0].first_position + o.chunk_size);
        EXPECT_EQ(std::memcmp(h->spans()[0].k, k.data(), k.size()), 0);
      } else {
        EXPECT_EQ(st.code(), idx == 1 ? StatusCode::kNotFound : StatusCode::kCorruption) << st.ToString();
        EXPECT_NE(st.message().find("chunk=" + std::to_string(idx)), std::string::npos) << st.message();
      }
    }
  }
}

// ---- a cluster ------------------------------------------------------------------------

// Runs the child publisher (process A) and returns its exit status.
int RunPublisher(const std::string& spec, const std::string& name, std::string* out) {
  const std::string exe = std::string(KVTIER_BINARY_DIR) + "/kvtier_child_remote_publisher";
  const std::string cmd = "'" + exe + "' '" + spec + "' " + name + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return -1;
  char buf[512];
  while (fgets(buf, sizeof(buf), p)) *out += buf;
  return pclose(p);
}

TEST(RemoteTier, ClusterRoutesRedirectsAndSharesASequenceBetweenProcesses) {
  KVTIER_SKIP_WITHOUT_REDIS();
  RedisServers redis;
  ASSERT_TRUE(redis.StartCluster());
  // Seeded with one node only: the rest is discovered from CLUSTER SLOTS.
  auto tier = RemoteTier::Open(OptionsFor(redis.Spec(0, "ns=c1&wait=1")));
  ASSERT_TRUE(tier.ok()) << tier.status().ToString();
  ASSERT_TRUE((*tier)->client()->cluster());
  const std::vector<RedisEndpoint> masters = (*tier)->client()->Masters();
  ASSERT_EQ(masters.size(), 3u);
  for (const std::string key : {"kvt:c1:1:0:0", "kvt:pub:{doc}", "x{abc}y"})
    EXPECT_EQ(std::to_string(RedisKeySlot(key)),
              RedisCommandText(masters[0].port, {"CLUSTER", "KEYSLOT", key}));
  ASSERT_TRUE(PutRange(tier->get(), 0, 300).ok());
  for (const RedisEndpoint& m : masters)
    EXPECT_GT(std::stoi(RedisCommandText(m.port, {"DBSIZE"})), 50)
        << m.ToString() << ": chunks spread over masters";

  // A manual failover moves a master's slots to its replica: the client's next requests
  // there get MOVED (or a refused connection) and follow the new slot map.
  const std::string nodes = RedisCommandText(masters[1].port, {"CLUSTER", "NODES"});
  const std::string myid = RedisCommandText(masters[1].port, {"CLUSTER", "MYID"});
  int replica = -1;
  for (size_t i = 0; i < redis.size(); ++i) {
    const std::string info = RedisCommandText(redis.server(static_cast<int>(i)).port, {"CLUSTER", "NODES"});
    const size_t myself = info.find("myself,slave " + myid);
    if (myself != std::string::npos) replica = static_cast<int>(i);
  }
  ASSERT_GE(replica, 0) << nodes;
  ASSERT_EQ(RedisCommandText(redis.server(replica).port, {"CLUSTER", "FAILOVER"}), "OK");
  // Wait until both sides have switched: the replica reports role:master only a moment
  // before the old master hears of the new configuration and demotes itself, and until it
  // does it still answers reads for its slots without MOVED, so the client would have no
  // reason to learn the new map (a race this test lost once on a loaded machine).
  auto role_is = [&](int port, const std::string& role) {
    return RedisCommandText(port, {"INFO", "replication"}).find("role:" + role) != std::string::npos;
  };
  for (int i = 0;
       i < 200 && !(role_is(redis.server(replica).port, "master") && role_is(masters[1].port, "slave")); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  ASSERT_TRUE(role_is(redis.server(replica).port, "master")) << "the replica took over within 20 s";
  ASSERT_TRUE(role_is(masters[1].port, "slave")) << "the old master demoted itself within 20 s";
  std::vector<uint8_t> buf(kChunkBytes);
  for (uint64_t i = 0; i < 300; ++i) {
    Status st = (*tier)->GetChunk({nullptr, {1, 0, i}}, buf.data(), kChunkBytes);
    ASSERT_TRUE(st.ok()) << i << ": " << st.ToString();
    ASSERT_EQ(buf, ChunkBytes({1, 0, i})) << i;
  }
  bool new_master_known = false;
  for (const RedisEndpoint& m : (*tier)->client()->Masters())
    new_master_known |= m.port == redis.server(replica).port;
  EXPECT_TRUE(new_master_known) << "the slot map follows the failover";

  // Two processes: A (a child) prefills and publishes; B (this process) attaches and decodes.
  const std::string spec = redis.Spec("wait=1");
  auto reader = TieredStore::Open(remote_share::Options(spec));
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  TieredStore* s = reader->get();
  auto before = s->AttachPublished("doc-1");
  ASSERT_FALSE(before.ok());
  EXPECT_EQ(before.status().code(), StatusCode::kNotFound) << "not visible before it is complete";
  std::string out;
  ASSERT_EQ(RunPublisher(spec, "doc-1", &out), 0) << out;
  ASSERT_NE(out.find("PUBLISHED doc-1"), std::string::npos) << out;
  auto seq = s->AttachPublished("doc-1");
  ASSERT_TRUE(seq.ok()) << seq.status().ToString();
  const StoreOptions& o = s->options();
  for (int l = 0; l < o.geometry.layers; ++l) {
    std::vector<uint8_t> k(remote_share::kTokens * remote_share::TokenBytes(o)), v(k.size());
    ASSERT_TRUE(s->ReadTokens(*seq, l, 0, remote_share::kTokens, k.data(), v.data()).ok());
    EXPECT_EQ(k, remote_share::Tokens(o, l, 0, 0, remote_share::kTokens)) << "layer " << l;
    EXPECT_EQ(v, remote_share::Tokens(o, l, 1, 0, remote_share::kTokens)) << "layer " << l;
  }
  // Decode with retrieval over the shared prefix, against the same decode over a local copy.
  StoreOptions local_o = remote_share::Options("");
  local_o.warm_bytes = 512 * local_o.chunk_bytes();
  auto local = TieredStore::Open(local_o);
  ASSERT_TRUE(local.ok());
  auto local_seq = (*local)->CreateSequence();
  ASSERT_TRUE(local_seq.ok());
  ASSERT_TRUE(remote_share::Write(local->get(), *local_seq).ok());
  SessionOptions so;
  so.retrieval.budget_tokens =
      static_cast<int>(o.hot_bytes / o.chunk_bytes()) * o.chunk_size;  // the whole hot pool
  auto shared_session = Session::Attach(s, *seq, so);
  auto local_session = Session::Attach(local->get(), *local_seq, so);
  ASSERT_TRUE(shared_session.ok()) << shared_session.status().ToString();
  ASSERT_TRUE(local_session.ok());
  const Geometry& g = o.geometry;
  const uint64_t remote_before = s->counters().remote_loads;
  for (int step = 0; step < 4; ++step) {
    const int64_t pos = remote_share::kTokens + step;
    ASSERT_TRUE((*shared_session)->BeginStep(StepKind::kDecode).ok());
    ASSERT_TRUE((*local_session)->BeginStep(StepKind::kDecode).ok());
    for (int l = 0; l < g.layers; ++l) {
      const auto k = remote_share::Tokens(o, l, 0, pos, pos + 1),
                 v = remote_share::Tokens(o, l, 1, pos, pos + 1);
      ASSERT_TRUE((*shared_session)->Append(l, k.data(), v.data(), 1, g.dtype).ok());
      ASSERT_TRUE((*local_session)->Append(l, k.data(), v.data(), 1, g.dtype).ok());
      std::vector<float> q(static_cast<size_t>(g.q_heads) * g.head_dim);
      for (size_t i = 0; i < q.size(); ++i)
        q[i] = std::sin(0.37f * static_cast<float>(i + 13 * step + 101 * l));
      std::vector<float> a(q.size()), b(q.size());
      AttendStats st;
      Status sa = (*shared_session)->Attend(l, q.data(), &pos, 1, a.data(), &st);
      ASSERT_TRUE(sa.ok()) << sa.ToString();
      ASSERT_TRUE((*local_session)->Attend(l, q.data(), &pos, 1, b.data()).ok());
      EXPECT_GT(st.chunks, 0u) << "retrieval chose chunks";
      for (size_t i = 0; i < a.size(); ++i)
        ASSERT_NEAR(a[i], b[i], 1e-5) << "layer " << l << " step " << step;
    }
  }
  EXPECT_GT(s->counters().remote_loads, remote_before) << "retrieved chunks came from Redis";
}

// Publishing a sequence whose representatives left memory: chunks recovered from the cold
// tier (written before the store had a remote tier, so copied up at publish) hold none, and
// the publication carries the same representatives a store that kept them all would publish.
TEST(RemoteTier, PublishingReadsBackRepresentativesThatLeftMemory) {
  KVTIER_SKIP_WITHOUT_REDIS();
  RedisServers redis;
  ASSERT_GE(redis.Start(), 0);
  TempDir dir;
  StoreOptions cold_only = remote_share::Options("");
  cold_only.data_dir = dir.path();
  SequenceId seq = 0;
  {
    auto writer = TieredStore::Open(cold_only);
    ASSERT_TRUE(writer.ok()) << writer.status().ToString();
    seq = *(*writer)->CreateSequence();
    ASSERT_TRUE(remote_share::Write(writer->get(), seq).ok());
    ASSERT_TRUE((*writer)->CloseSequence(seq).ok());
  }
  StoreOptions both = cold_only;
  both.remote = redis.Spec(0);
  auto publisher = TieredStore::Open(both);
  ASSERT_TRUE(publisher.ok()) << publisher.status().ToString();
  StoreOptions local_o = remote_share::Options("");
  local_o.warm_bytes = 512 * local_o.chunk_bytes();
  auto local = TieredStore::Open(local_o);
  ASSERT_TRUE(local.ok());
  const SequenceId local_seq = *(*local)->CreateSequence();
  ASSERT_TRUE(remote_share::Write(local->get(), local_seq).ok());
  ASSERT_LT((*publisher)->metadata_bytes(), (*local)->metadata_bytes()) << "recovered chunks hold none";
  Status pub = (*publisher)->PublishSequence(seq, "paged-doc");
  ASSERT_TRUE(pub.ok()) << pub.ToString();
  auto reader = TieredStore::Open(remote_share::Options(redis.Spec(0)));
  ASSERT_TRUE(reader.ok());
  auto attached = (*reader)->AttachPublished("paged-doc");
  ASSERT_TRUE(attached.ok()) << attached.status().ToString();
  const StoreOptions& o = local_o;
  std::vector<float> a(static_cast<size_t>(o.repr_topk) * o.geometry.token_elems()), b(a.size());
  for (int l = 0; l < o.geometry.layers; ++l) {
    auto n = (*local)->ChunkCount(local_seq, l);
    ASSERT_TRUE(n.ok());
    ASSERT_GT(*n, 40u);
    ASSERT_EQ(*(*reader)->ChunkCount(*attached, l), *n);
    for (uint64_t c = 0; c < *n; ++c) {
      ASSERT_TRUE(
          (*reader)->GetRepresentatives(ChunkKey{*attached, static_cast<uint32_t>(l), c}, a.data()).ok());
      ASSERT_TRUE(
          (*local)->GetRepresentatives(ChunkKey{local_seq, static_cast<uint32_t>(l), c}, b.data()).ok());
      ASSERT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)))
          << "layer " << l << " chunk " << c;
    }
    // The copied-up chunks are served by Redis as well.
    std::vector<uint8_t> k(remote_share::kTokens * remote_share::TokenBytes(o)), v(k.size());
    ASSERT_TRUE((*reader)->ReadTokens(*attached, l, 0, remote_share::kTokens, k.data(), v.data()).ok());
    EXPECT_EQ(k, remote_share::Tokens(o, l, 0, 0, remote_share::kTokens)) << "layer " << l;
  }
}

// A store whose only lower tier is Redis releases the representatives of the chunks that
// left warm, as it does over RocksDB: metadata_bytes falls by exactly their bytes, readers get
// them back bit for bit from the chunks' meta keys, and a meta key that is damaged or gone is
// a named error for that chunk alone.
TEST(RemoteTier, RepresentativesOfRedisOnlyChunksLeaveMemoryAndComeBack) {
  KVTIER_SKIP_WITHOUT_REDIS();
  RedisServers redis;
  ASSERT_GE(redis.Start(), 0);
  StoreOptions o = remote_share::Options(redis.Spec(0));
  o.remote_namespace = "reps";
  ASSERT_TRUE(o.data_dir.empty()) << "Redis is the only lower tier";
  auto store = TieredStore::Open(o);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  TieredStore* s = store->get();
  const SequenceId seq = *s->CreateSequence();
  ASSERT_TRUE(remote_share::Write(s, seq).ok());
  ASSERT_TRUE(s->WaitForDurable().ok());
  StoreOptions resident_o = remote_share::Options("");
  resident_o.warm_bytes = 512 * resident_o.chunk_bytes();
  auto resident = TieredStore::Open(resident_o);
  ASSERT_TRUE(resident.ok());
  const SequenceId rseq = *(*resident)->CreateSequence();
  ASSERT_TRUE(remote_share::Write(resident->get(), rseq).ok());

  const size_t repr_bytes = static_cast<size_t>(o.repr_topk) * remote_share::TokenBytes(o);
  uint64_t left_warm = 0;
  for (int l = 0; l < o.geometry.layers; ++l) {
    auto list = s->ListChunks(seq, l);
    ASSERT_TRUE(list.ok());
    for (const ChunkInfo& c : *list) left_warm += (c.tiers & kTierWarm) == 0;
  }
  ASSERT_GT(left_warm, 60u);
  EXPECT_EQ((*resident)->metadata_bytes() - s->metadata_bytes(), left_warm * repr_bytes)
      << "the representatives of every chunk that left warm left memory";

  const size_t e = static_cast<size_t>(o.repr_topk) * o.geometry.token_elems();
  std::vector<float> a(e), b(e);
  for (int l = 0; l < o.geometry.layers; ++l) {
    const uint64_t n = *s->ChunkCount(seq, l);
    ASSERT_EQ(n, *(*resident)->ChunkCount(rseq, l));
    for (uint64_t c = 0; c < n; ++c) {
      Status got = s->GetRepresentatives(ChunkKey{seq, static_cast<uint32_t>(l), c}, a.data());
      ASSERT_TRUE(got.ok()) << "layer " << l << " chunk " << c << ": " << got.ToString();
      ASSERT_TRUE(
          (*resident)->GetRepresentatives(ChunkKey{rseq, static_cast<uint32_t>(l), c}, b.data()).ok());
      ASSERT_EQ(0, std::memcmp(a.data(), b.data(), e * sizeof(float))) << "layer " << l << " chunk " << c;
    }
    // An index built now gets them in one batch.
    ChunkUpdate u, r;
    ASSERT_TRUE(s->ChunkUpdatesSince(seq, l, ChunkCursor{}, &u).ok());
    ASSERT_TRUE((*resident)->ChunkUpdatesSince(rseq, l, ChunkCursor{}, &r).ok());
    EXPECT_EQ(u.added, r.added);
    ASSERT_EQ(u.repr.size(), r.repr.size());
    EXPECT_EQ(0, std::memcmp(u.repr.data(), r.repr.data(), u.repr.size() * sizeof(float))) << "layer " << l;
  }

  // Damage one released chunk's meta key, and remove another's.
  ChunkKey damaged{}, gone{};
  int found = 0;
  auto list = s->ListChunks(seq, 1);
  ASSERT_TRUE(list.ok());
  for (const ChunkInfo& c : *list)
    if ((c.tiers & kTierWarm) == 0 && found < 2) (found++ == 0 ? damaged : gone) = c.key;
  ASSERT_EQ(found, 2);
  const std::string damaged_key =
      "kvt:reps:" + std::to_string(seq) + ":1:" + std::to_string(damaged.index) + ":m";
  const std::string gone_key = "kvt:reps:" + std::to_string(seq) + ":1:" + std::to_string(gone.index) + ":m";
  ASSERT_EQ(redis.Cli(0, "SETRANGE " + damaged_key + " 40 Z"), 0);
  ASSERT_EQ(redis.Cli(0, "DEL " + gone_key), 0);
  Status st = s->GetRepresentatives(damaged, a.data());
  EXPECT_EQ(st.code(), StatusCode::kCorruption) << st.ToString();
  EXPECT_NE(st.message().find("representatives of chunk " + damaged.ToString()), std::string::npos)
      << st.ToString();
  EXPECT_NE(st.message().find(damaged_key), std::string::npos) << st.ToString();
  st = s->GetRepresentatives(gone, a.data());
  EXPECT_EQ(st.code(), StatusCode::kNotFound) << st.ToString();
  EXPECT_NE(st.message().find(gone_key), std::string::npos) << st.ToString();
  ChunkUpdate u;
  EXPECT_FALSE(s->ChunkUpdatesSince(seq, 1, ChunkCursor{}, &u).ok())
      << "an index cannot be built without them";
  EXPECT_TRUE(s->ChunkUpdatesSince(seq, 0, ChunkCursor{}, &u).ok()) << "layer 0 is untouched";
  // The payloads are untouched: the chunks still fetch.
  auto h = s->FetchChunks(seq, 1, {damaged.index, gone.index});
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  EXPECT_TRUE(h->Wait().ok());
  // Dropping the sequence removes both keys of every chunk.
  ASSERT_TRUE(s->DropSequence(seq).ok());
  EXPECT_EQ(RedisCommandText(redis.server(0).port, {"DBSIZE"}), "0");
}

// A master SIGKILLed while chunks are being written: every put acknowledged (after WAIT 1)
// is still readable after its replica took over. The killed master is the one with two
// replicas (7 nodes), so the promoted replica has a replica of its own at once and WAIT 1
// can succeed on that shard again; with a single replica, puts to the orphaned shard would
// (rightly) fail as unacknowledged until an operator adds one.
TEST(RemoteTier, FailoverLosesNoAcknowledgedChunk) {
  KVTIER_SKIP_WITHOUT_REDIS();
  RedisServers redis;
  ASSERT_TRUE(redis.StartCluster(1000, 7));
  auto tier = RemoteTier::Open(
      OptionsFor(redis.Spec("ns=f1&wait=1&retry_ms=20000&timeout_ms=1500&wait_timeout_ms=1000")));
  ASSERT_TRUE(tier.ok()) << tier.status().ToString();
  int victim = -1;
  for (const RedisEndpoint& m : (*tier)->client()->Masters())
    if (RedisCommandText(m.port, {"INFO", "replication"}).find("connected_slaves:2") != std::string::npos)
      victim = redis.IndexOfPort(m.port);
  ASSERT_GE(victim, 0) << "no master with two replicas";
  std::atomic<uint64_t> acked{0};
  std::atomic<bool> killed{false};
  uint64_t acked_after_kill = 0;
  Status writer_status;
  std::thread writer([&] {
    for (uint64_t i = 0; i < 1200; i += 8) {
      Status st = PutRange(tier->get(), i, i + 8, 8);
      if (!st.ok()) {
        writer_status = st;
        return;
      }
      acked = i + 8;
      if (killed) acked_after_kill += 8;
    }
  });
  while (acked < 240) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  redis.Kill(victim);  // mid-run: a batch is in flight
  killed = true;
  writer.join();
  ASSERT_TRUE(writer_status.ok()) << writer_status.ToString();
  EXPECT_GT(acked_after_kill, 0u) << "the writer rode through the failover";
  std::vector<uint8_t> buf(kChunkBytes);
  for (uint64_t i = 0; i < acked; ++i) {
    Status st = (*tier)->GetChunk({nullptr, {1, 0, i}}, buf.data(), kChunkBytes);
    ASSERT_TRUE(st.ok()) << "acknowledged chunk " << i << " lost: " << st.ToString();
    ASSERT_EQ(buf, ChunkBytes({1, 0, i})) << i;
  }
  bool replaced = true;
  for (const RedisEndpoint& m : (*tier)->client()->Masters()) replaced &= m.port != redis.server(victim).port;
  EXPECT_TRUE(replaced) << "a replica took over the killed master's slots";
}

// ---- the CLI ---------------------------------------------------------------------------

// Runs the built kvtier with arguments; its exit status and output.
int RunCli(const std::string& args, std::string* out) {
  const std::string cmd = "'" + std::string(KVTIER_BINARY_DIR) + "/kvtier' " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return -1;
  char buf[1024];
  while (fgets(buf, sizeof(buf), p)) *out += buf;
  return pclose(p);
}

// The share of fetched chunks a report line gives a tier ("... remote 17.6% (of 4608)").
double TierShare(const std::string& out, const std::string& tier) {
  const size_t line = out.find("fetched chunks by tier:");
  if (line == std::string::npos) return -1;
  const size_t at = out.find(" " + tier + " ", line);
  return at == std::string::npos ? -1 : std::atof(out.c_str() + at + tier.size() + 2);
}

TEST(RemoteCli, RunStressAndInfiniteUseTheRemoteTierAndReportIt) {
  KVTIER_SKIP_WITHOUT_REDIS();
  RedisServers redis;
  ASSERT_GE(redis.Start(), 0);
  TempDir dir;
  std::string out;
  // No cold tier: three quarters of the chunks leave warm for Redis and come back from it.
  ASSERT_EQ(RunCli("run --quiet --context 8192 --warm-bytes 4M --decode-steps 4 --data-dir none --remote " +
                       redis.Spec(0) + " --json " + dir.path() + "/run.json",
                   &out),
            0)
      << out;
  EXPECT_GT(TierShare(out, "remote"), 0.0) << out;
  EXPECT_EQ(TierShare(out, "cold"), 0.0) << out;
  EXPECT_NE(out.find("remote tier: "), std::string::npos) << out;
  EXPECT_NE(out.find(" 0 not found (evicted), 0 corrupt, 0 errors"), std::string::npos) << out;
  std::ifstream json(dir.path() + "/run.json");
  const std::string j((std::istreambuf_iterator<char>(json)), std::istreambuf_iterator<char>());
  EXPECT_NE(j.find("\"hit_rate\""), std::string::npos);
  EXPECT_NE(j.find("\"remote_get\""), std::string::npos);
  out.clear();
  ASSERT_EQ(RunCli("stress --sequences 4 --tokens 600 --data-dir " + dir.path() + "/stress --remote " +
                       redis.Spec(0),
                   &out),
            0)
      << out;
  EXPECT_NE(out.find("errors: 0"), std::string::npos) << out;
  EXPECT_NE(out.find("remote tier: "), std::string::npos) << out;
  out.clear();
  // infinite: the shipped model with a tiny warm tier, so retrieval fetches chunks from Redis.
  const std::string weights = std::string(KVTIER_SOURCE_DIR) + "/models/kvtier-tiny.safetensors";
  ASSERT_EQ(RunCli("infinite --quiet --weights " + weights + " --task passkey --contexts 4096 --samples 1 " +
                       "--warm-bytes 64K --remote " + redis.Spec(0),
                   &out),
            0)
      << out;
  EXPECT_GT(TierShare(out, "remote"), 0.0) << out;
  EXPECT_NE(out.find("remote tier: "), std::string::npos) << out;
  out.clear();
  EXPECT_NE(RunCli("run --context 4096 --remote http://nowhere:1", &out), 0);
  EXPECT_NE(out.find("must start with redis://"), std::string::npos) << out;
  out.clear();
  // A server that is not there: a named error at open, not a silent local run.
  EXPECT_NE(RunCli("run --quiet --context 4096 --data-dir none --remote redis://127.0.0.1:1", &out), 0);
  EXPECT_NE(out.find("127.0.0.1:1"), std::string::npos) << out;
}

}  // namespace
}  // namespace kvtier
