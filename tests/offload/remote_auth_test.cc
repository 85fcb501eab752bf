// The remote tier against Redis servers that want credentials (tests/redis_fixture.h,
// RequireAuth): a password (requirepass) and an ACL user, one server and a cluster. The
// promises: AUTH goes out on every connection (each cluster node, a node that took over
// after a failover, a connection reopened after the server dropped it); a refusal (no
// password, a wrong one, a disabled user) is PermissionDenied at once, never retried as
// an outage; and no message holds the password. Also the spec grammar the credentials
// came with: userinfo, password_file=, the environment, duplicate keys, pool sizes, IPv6.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include "offload/remote_tier.h"
#include "offload/tiered_store.h"
#include "tests/redis_fixture.h"
#include "tests/remote_share.h"

namespace kvtier {
namespace {

using Time = std::chrono::steady_clock;
double MsSince(Time::time_point t0) {
  return std::chrono::duration<double, std::milli>(Time::now() - t0).count();
}

constexpr char kSecret[] = "Zq9-s3cret-pw";  // what no message may hold
constexpr char kUser[] = "kvt-app";

// Keeps the credential variables out of (and, at the end, back out of) the environment.
class EnvGuard {
 public:
  EnvGuard() { Clear(); }
  ~EnvGuard() { Clear(); }
  static void Clear() {
    unsetenv("KVTIER_REDIS_PASSWORD");
    unsetenv("KVTIER_REDIS_USER");
  }
};

// "redis://127.0.0.1:p..." with `userinfo` ("user:pw" or ":pw") put in front of the hosts.
std::string WithUserinfo(const std::string& spec, const std::string& userinfo) {
  return "redis://" + userinfo + "@" + spec.substr(8);
}

void ExpectNoSecret(const std::string& text, const std::string& secret = kSecret) {
  EXPECT_EQ(text.find(secret), std::string::npos) << "the secret leaked: " << text;
}

std::vector<uint8_t> Bytes(uint64_t i, size_t n = 2048) {
  std::vector<uint8_t> b(n);
  for (size_t j = 0; j < n; ++j) b[j] = static_cast<uint8_t>(i * 131 + j * 7);
  return b;
}

// Puts chunks [from, to) of seq 1 layer 0 and reads them back; the first error.
Status RoundTrip(RemoteTier* t, uint64_t from, uint64_t to) {
  std::vector<std::vector<uint8_t>> data;
  std::vector<RemoteTier::Put> puts;
  for (uint64_t i = from; i < to; ++i) data.push_back(Bytes(i));
  for (uint64_t i = from; i < to; ++i) {
    RemoteTier::Put p;
    p.key = ChunkKey{1, 0, i};
    p.meta = "meta";
    p.payload = data[i - from].data();
    p.payload_bytes = data[i - from].size();
    puts.push_back(p);
  }
  KVTIER_RETURN_IF_ERROR(t->PutChunks(&puts));
  std::vector<uint8_t> buf(2048);
  for (uint64_t i = from; i < to; ++i) {
    KVTIER_RETURN_IF_ERROR(t->GetChunk({nullptr, {1, 0, i}}, buf.data(), buf.size()));
    if (buf != data[i - from]) return Corruption("chunk " + std::to_string(i) + " came back different");
  }
  return Status::Ok();
}

// Opening with `spec` fails PermissionDenied well inside one retry window, without the secret.
void ExpectRefusedAtOnce(const std::string& spec, const std::string& why) {
  const auto t0 = Time::now();
  auto o = ParseRemoteSpec(spec);
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  auto tier = RemoteTier::Open(*o);
  const double ms = MsSince(t0);
  ASSERT_FALSE(tier.ok()) << why;
  EXPECT_EQ(tier.status().code(), StatusCode::kPermissionDenied) << why << ": " << tier.status().ToString();
  EXPECT_LT(ms, 1000) << why << ": a refusal is not retried (retry_ms is " << o->retry_ms << ")";
  ExpectNoSecret(tier.status().message());
  std::printf("[ auth ] %s: refused in %.0f ms: %s\n", why.c_str(), ms, tier.status().ToString().c_str());
}

// ---- the spec, no server -----------------------------------------------------------------

TEST(RemoteSpec, CredentialsComeFromTheUserinfoAFileOrTheEnvironment) {
  EnvGuard env;
  auto o = ParseRemoteSpec("redis://:s3cr%40t%3F@h:1");
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->user, "");
  EXPECT_EQ(o->password, "s3cr@t?") << "percent-decoded";
  o = ParseRemoteSpec("redis://alice:pw:with:colons@h:1,h2:2?wait=0");
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->user, "alice");
  EXPECT_EQ(o->password, "pw:with:colons");
  EXPECT_EQ(o->endpoints.size(), 2u);
  TempDir dir;
  const std::string file = dir.path() + "/pw";
  std::ofstream(file) << "from-file\n";
  o = ParseRemoteSpec("redis://alice@h:1?password_file=" + file);
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->user, "alice");
  EXPECT_EQ(o->password, "from-file") << "one trailing newline dropped";
  setenv("KVTIER_REDIS_PASSWORD", "from-env", 1);
  setenv("KVTIER_REDIS_USER", "bob", 1);
  o = ParseRemoteSpec("redis://h:1");
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->user, "bob");
  EXPECT_EQ(o->password, "from-env");
  o = ParseRemoteSpec("redis://carol:given@h:1");
  ASSERT_TRUE(o.ok());
  EXPECT_EQ(o->user, "carol") << "the spec wins over the environment";
  EXPECT_EQ(o->password, "given");
  o = ParseRemoteSpec("redis://h:1?password_file=" + file);
  ASSERT_TRUE(o.ok());
  EXPECT_EQ(o->password, "from-file") << "the file wins over the environment";
  EnvGuard::Clear();
  o = ParseRemoteSpec("redis://h:1");
  ASSERT_TRUE(o.ok());
  EXPECT_TRUE(o->password.empty() && o->user.empty());

  const std::vector<std::pair<std::string, std::string>> bad = {
      {"redis://:" + std::string(kSecret) + "@h:1?password_file=" + file, "give one"},
      {"redis://alice@h:1", "user 'alice' has no password"},
      {"redis://:" + std::string(kSecret) + "@h:1?password=" + kSecret, "not taken from the query"},
      {"redis://h:1?password=" + std::string(kSecret), "not taken from the query"},
      {"redis://h:1?password_file=" + dir.path() + "/missing", dir.path() + "/missing' cannot be read"},
      {"redis://:@h:1", "password is empty"},
      {"redis://:a%zz@h:1", "malformed %-escape"},
  };
  for (const auto& [spec, why] : bad) {
    auto r = ParseRemoteSpec(spec);
    ASSERT_FALSE(r.ok()) << spec;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << spec;
    EXPECT_NE(r.status().message().find(why), std::string::npos) << spec << ": " << r.status().message();
    ExpectNoSecret(r.status().message());
  }
}

// Every way a spec with a password can be wrong: the message quotes the spec redacted.
TEST(RemoteSpec, NoErrorMessageHoldsThePassword) {
  EnvGuard env;
  const std::string s = kSecret;
  const std::vector<std::string> specs = {"redis://u:" + s + "@h",
                                          "redis://u:" + s + "@h:0",
                                          "redis://u:" + s + "@h:1?color=red",
                                          "redis://:" + s + "@h:1?pool=0",
                                          "redis://:" + s + "@h:1,",
                                          "redis://u:" + s + "@h:1?wait=x",
                                          "redis://u:Zq9?-s3cret-pw@h:1",
                                          "redis://u:Zq9-s3?cret-pw@h:1?wait=1",
                                          "http://u:" + s + "@h:1",
                                          "redis://h:1?password=" + s,
                                          "redis://u:" + s + "@[::1:1",
                                          "redis://u:" + s + "@h:1?wait=1&wait=1"};
  for (const std::string& spec : specs) {
    auto r = ParseRemoteSpec(spec);
    ASSERT_FALSE(r.ok()) << "(spec " << RedactRemoteSpec(spec) << ")";
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    ExpectNoSecret(r.status().message());
    ExpectNoSecret(r.status().message(), "s3cret");
    ExpectNoSecret(r.status().message(), "Zq9");  // no fragment of a misparsed password either
    StoreOptions so = remote_share::Options(spec);
    const Status st = so.Validate();
    EXPECT_FALSE(st.ok());
    ExpectNoSecret(st.message());
    ExpectNoSecret(st.message(), "s3cret");
    ExpectNoSecret(st.message(), "Zq9");
  }
}

TEST(RemoteSpec, RedactReplacesTheSecretAndNothingElse) {
  EXPECT_EQ(RedactRemoteSpec("redis://user:pw@h:1,h:2?wait=1"), "redis://user:***@h:1,h:2?wait=1");
  EXPECT_EQ(RedactRemoteSpec("redis://:p%40w@[::1]:6379"), "redis://:***@[::1]:6379");
  EXPECT_EQ(RedactRemoteSpec("redis://h:1?ns=a&pool=2"), "redis://h:1?ns=a&pool=2");
  EXPECT_EQ(RedactRemoteSpec("redis://alice@h:1"), "redis://alice@h:1") << "a user name is no secret";
  EXPECT_EQ(RedactRemoteSpec("redis://h:1?wait=1&password=x&requirepass=y"),
            "redis://h:1?wait=1&password=***&requirepass=***");
  EXPECT_EQ(RedactRemoteSpec("redis://h:1?password_file=/run/secrets/redis"),
            "redis://h:1?password_file=/run/secrets/redis")
      << "the file's path is no secret";
  EXPECT_EQ(RedactRemoteSpec("redis://u:a?b@h:1"), "redis://u:***@h:1") << "a raw '?' in the password";
  EXPECT_EQ(RedactRemoteSpec("redis://h:1?password_file=/a@b&password=x9").find("x9"), std::string::npos)
      << "a query secret past an '@' in a path";
  EXPECT_EQ(RedactRemoteSpec("redis://h:1?password=a@b:c&wait=1"), "redis://h:1?password=***&wait=1");
  EXPECT_EQ(RedactRemoteSpec(""), "");
  EXPECT_EQ(RedactRemoteSpec("garbage:pw@x"), "garbage:***@x");
}

TEST(RemoteSpec, DuplicateKeysAndAbsurdPoolSizesAreRefusedNamingTheKey) {
  for (const std::string q :
       {"wait=1&wait=2", "ns=a&ns=b", "pool=2&timeout_ms=900&pool=2", "password_file=/a&password_file=/b"}) {
    auto r = ParseRemoteSpec("redis://h:1?" + q);
    ASSERT_FALSE(r.ok()) << q;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    const std::string key = q.substr(0, q.find('='));
    EXPECT_NE(r.status().message().find("option '" + key + "' is given twice"), std::string::npos)
        << r.status().message();
  }
  for (const std::string n : {"0", "257", "100000", "999999999"}) {
    auto r = ParseRemoteSpec("redis://h:1?pool=" + n);
    ASSERT_FALSE(r.ok()) << n;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find("option 'pool' is " + n + ", outside 1..256"), std::string::npos)
        << r.status().message();
  }
  auto r = ParseRemoteSpec("redis://h:1?pool=256");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->pool_size, 256);
  RemoteTierOptions o;
  o.endpoints = {RedisEndpoint{"h", 1}};
  o.pool_size = 1000;
  EXPECT_NE(o.Validate().message().find("pool_size must be in 1..256 (got 1000)"), std::string::npos)
      << o.Validate().message();
}

TEST(RemoteSpec, ParsesBracketedIPv6Addresses) {
  auto o = ParseRemoteSpec("redis://:pw@[::1]:6379,[fe80::1%25eth0]:7000,127.0.0.1:7001?wait=0");
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  ASSERT_EQ(o->endpoints.size(), 3u);
  EXPECT_EQ(o->endpoints[0].host, "::1");
  EXPECT_EQ(o->endpoints[0].port, 6379);
  EXPECT_EQ(o->endpoints[0].ToString(), "[::1]:6379");
  EXPECT_EQ(o->endpoints[1].host, "fe80::1%25eth0");
  EXPECT_EQ(o->endpoints[2].ToString(), "127.0.0.1:7001");
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"redis://[::1]", "is not [IPv6 address]:port"},
      {"redis://[::1]6379", "is not [IPv6 address]:port"},
      {"redis://[]:6379", "is not [IPv6 address]:port"},
      {"redis://[::1]:0", "outside 1..65535"},
      {"redis://::1:6379", "an IPv6 address goes in brackets"}};
  for (const auto& [spec, why] : bad) {
    auto r = ParseRemoteSpec(spec);
    ASSERT_FALSE(r.ok()) << spec;
    EXPECT_NE(r.status().message().find(why), std::string::npos) << spec << ": " << r.status().message();
  }
}

// A redis-server bound to ::1 only, reached through a bracketed spec.
TEST(RemoteAuth, IPv6LoopbackServerIsReachable) {
  KVTIER_SKIP_WITHOUT_REDIS();
  const int fd = socket(AF_INET6, SOCK_STREAM, 0);
  sockaddr_in6 a{};
  a.sin6_family = AF_INET6;
  a.sin6_addr = in6addr_loopback;
  const bool v6 = fd >= 0 && bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  if (fd >= 0) close(fd);
  if (!v6)
    GTEST_SKIP() << "no IPv6 loopback on this machine (::1 cannot be bound); the parse test covers [::1]";
  RedisServers redis;
  redis.RequireAuth("", kSecret);
  // Bound to both: the fixture's PING goes to 127.0.0.1; the tier is given only [::1].
  const int i = redis.Start({"--bind", "127.0.0.1", "::1"});
  ASSERT_GE(i, 0);
  const std::string spec =
      "redis://:" + std::string(kSecret) + "@[::1]:" + std::to_string(redis.server(i).port) + "?ns=v6";
  auto tier = RemoteTier::Open(*ParseRemoteSpec(spec));
  ASSERT_TRUE(tier.ok()) << tier.status().ToString();
  EXPECT_TRUE(RoundTrip(tier->get(), 0, 8).ok());
  const std::string clients = redis.Command(i, {"CLIENT", "LIST"});
  EXPECT_NE(clients.find("addr=[::1]:"), std::string::npos)
      << "the tier's connections come over ::1: " << clients;
}

// ---- one server -----------------------------------------------------------------------------

TEST(RemoteAuth, PasswordServerWorksAndRefusalsArePermissionDeniedAtOnce) {
  KVTIER_SKIP_WITHOUT_REDIS();
  EnvGuard env;
  RedisServers redis;
  redis.RequireAuth("", kSecret);
  ASSERT_GE(redis.Start(), 0);
  const std::string plain = redis.Spec(0, "ns=pw&retry_ms=5000&timeout_ms=1000");
  {
    auto tier = RemoteTier::Open(*ParseRemoteSpec(WithUserinfo(plain, ":" + std::string(kSecret))));
    ASSERT_TRUE(tier.ok()) << tier.status().ToString();
    ASSERT_TRUE(RoundTrip(tier->get(), 0, 16).ok());
  }
  {
    setenv("KVTIER_REDIS_PASSWORD", kSecret, 1);
    auto tier = RemoteTier::Open(*ParseRemoteSpec(plain));
    EnvGuard::Clear();
    ASSERT_TRUE(tier.ok()) << "from KVTIER_REDIS_PASSWORD: " << tier.status().ToString();
    ASSERT_TRUE(RoundTrip(tier->get(), 16, 24).ok());
  }
  {
    TempDir dir;
    std::ofstream(dir.path() + "/pw") << kSecret << "\n";
    auto tier = RemoteTier::Open(*ParseRemoteSpec(plain + "&password_file=" + dir.path() + "/pw"));
    ASSERT_TRUE(tier.ok()) << "from password_file: " << tier.status().ToString();
    ASSERT_TRUE(RoundTrip(tier->get(), 24, 32).ok());
  }
  ExpectRefusedAtOnce(plain, "no password");
  ExpectRefusedAtOnce(WithUserinfo(plain, ":wrong-" + std::string(kSecret)), "a wrong password");
  ExpectRefusedAtOnce(WithUserinfo(plain, "nobody:" + std::string(kSecret)), "an unknown user");
}

TEST(RemoteAuth, AclUserServerWorksAndRefusalsArePermissionDeniedAtOnce) {
  KVTIER_SKIP_WITHOUT_REDIS();
  EnvGuard env;
  RedisServers redis;
  redis.RequireAuth(kUser, kSecret);
  ASSERT_GE(redis.Start(), 0);
  const std::string plain = redis.Spec(0, "ns=acl&retry_ms=5000&timeout_ms=1000");
  {
    auto tier = RemoteTier::Open(*ParseRemoteSpec(WithUserinfo(plain, std::string(kUser) + ":" + kSecret)));
    ASSERT_TRUE(tier.ok()) << tier.status().ToString();
    ASSERT_TRUE(RoundTrip(tier->get(), 0, 16).ok());
  }
  {
    setenv("KVTIER_REDIS_USER", kUser, 1);
    setenv("KVTIER_REDIS_PASSWORD", kSecret, 1);
    auto tier = RemoteTier::Open(*ParseRemoteSpec(plain));
    EnvGuard::Clear();
    ASSERT_TRUE(tier.ok()) << "from the environment: " << tier.status().ToString();
    ASSERT_TRUE(RoundTrip(tier->get(), 16, 24).ok());
  }
  ExpectRefusedAtOnce(plain, "no credentials (the default user is off)");
  ExpectRefusedAtOnce(WithUserinfo(plain, ":" + std::string(kSecret)), "the password for the default user");
  ExpectRefusedAtOnce(WithUserinfo(plain, std::string(kUser) + ":wrong"), "the user with a wrong password");
  // A user without the rights the tier needs: NOPERM, also final.
  ASSERT_EQ(redis.Command(0, {"ACL", "SETUSER", "reader", "on", ">r-pw", "~*", "+@all", "-set"}), "OK");
  auto tier = RemoteTier::Open(*ParseRemoteSpec(WithUserinfo(plain, "reader:r-pw")));
  ASSERT_TRUE(tier.ok()) << tier.status().ToString();
  const auto t0 = Time::now();
  const Status st = RoundTrip(tier->get(), 0, 4);
  EXPECT_EQ(st.code(), StatusCode::kPermissionDenied) << st.ToString();
  EXPECT_NE(st.message().find("NOPERM"), std::string::npos) << st.ToString();
  EXPECT_LT(MsSince(t0), 1000) << "an ACL denial is not retried";
}

// The server drops every connection and changes its password: the pooled connection fails,
// the reconnect sends AUTH with the old password, and the refusal is final at once instead
// of a retry window spent reconnecting.
TEST(RemoteAuth, ReconnectAuthenticatesAndAChangedPasswordIsNotRetried) {
  KVTIER_SKIP_WITHOUT_REDIS();
  RedisServers redis;
  redis.RequireAuth("", kSecret);
  ASSERT_GE(redis.Start(), 0);
  auto tier = RemoteTier::Open(*ParseRemoteSpec(
      WithUserinfo(redis.Spec(0, "ns=re&retry_ms=5000&timeout_ms=1000"), ":" + std::string(kSecret))));
  ASSERT_TRUE(tier.ok()) << tier.status().ToString();
  ASSERT_TRUE(RoundTrip(tier->get(), 0, 8).ok());
  // Dropped connections: the next batch reconnects, authenticates and succeeds.
  redis.Command(0, {"CLIENT", "KILL", "TYPE", "normal"});
  ASSERT_TRUE(RoundTrip(tier->get(), 8, 16).ok()) << "reconnected with AUTH";
  ASSERT_EQ(redis.Command(0, {"CONFIG", "SET", "requirepass", "another-one"}), "OK");
  redis.RequireAuth("", "another-one");
  redis.Command(0, {"CLIENT", "KILL", "TYPE", "normal"});
  const auto t0 = Time::now();
  const Status st = RoundTrip(tier->get(), 16, 24);
  const double ms = MsSince(t0);
  EXPECT_EQ(st.code(), StatusCode::kPermissionDenied) << st.ToString();
  EXPECT_LT(ms, 1000) << "not retried for retry_ms (5 s)";
  ExpectNoSecret(st.message());
  std::printf("[ auth ] changed password refused in %.0f ms: %s\n", ms, st.ToString().c_str());
}

// ---- a cluster ------------------------------------------------------------------------------

// A store over a 3-master cluster with credentials writes and reads on every master, rides
// through a failover (the promoted replica is a node it has never connected to: AUTH on the
// new connection), and a wrong password is refused at once.
void ClusterWithCredentials(const std::string& user) {
  EnvGuard env;
  RedisServers redis;
  redis.RequireAuth(user, kSecret);
  ASSERT_TRUE(redis.StartCluster(1000, 6));
  const std::string userinfo = user + ":" + kSecret;
  const std::string spec = WithUserinfo(redis.Spec("ns=cl&retry_ms=20000&timeout_ms=1500"), userinfo);
  auto tier = RemoteTier::Open(*ParseRemoteSpec(spec));
  ASSERT_TRUE(tier.ok()) << tier.status().ToString();
  ASSERT_TRUE((*tier)->client()->cluster());
  ASSERT_EQ((*tier)->client()->Masters().size(), 3u);
  ASSERT_TRUE(RoundTrip(tier->get(), 0, 96).ok()) << "keys on every master";
  for (const RedisEndpoint& m : (*tier)->client()->Masters())
    EXPECT_NE(redis.Command(redis.IndexOfPort(m.port), {"DBSIZE"}), "0") << m.ToString() << " holds keys";
  const int victim = redis.IndexOfPort((*tier)->client()->Masters()[0].port);
  redis.Kill(victim);
  const Status st = RoundTrip(tier->get(), 96, 192);
  ASSERT_TRUE(st.ok()) << "through the failover: " << st.ToString();
  bool replaced = true;
  for (const RedisEndpoint& m : (*tier)->client()->Masters()) replaced &= m.port != redis.server(victim).port;
  EXPECT_TRUE(replaced) << "a replica took over";
  // Redis itself (the store on top) and a wrong password against the cluster.
  StoreOptions so = remote_share::Options(spec);
  so.remote_namespace = "clstore";
  auto store = TieredStore::Open(so);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  const SequenceId seq = *(*store)->CreateSequence();
  ASSERT_TRUE(remote_share::Write(store->get(), seq).ok());
  ASSERT_TRUE((*store)->WaitForDurable().ok());
  EXPECT_GT((*store)->counters().remote_puts, 0u);
  store->reset();
  ExpectRefusedAtOnce(WithUserinfo(redis.Spec("retry_ms=5000"), user + ":wrong-" + kSecret),
                      "cluster, wrong password");
  ExpectRefusedAtOnce(redis.Spec("retry_ms=5000"), "cluster, no credentials");
}

TEST(RemoteAuth, ClusterWithPassword) {
  KVTIER_SKIP_WITHOUT_REDIS();
  ClusterWithCredentials("");
}

TEST(RemoteAuth, ClusterWithAclUser) {
  KVTIER_SKIP_WITHOUT_REDIS();
  ClusterWithCredentials(kUser);
}

// ---- the CLI --------------------------------------------------------------------------------

// Runs the built kvtier with arguments and extra environment; its exit status, stdout and
// stderr apart.
int RunCli(const std::string& env, const std::string& args, const std::string& dir, std::string* out,
           std::string* err) {
  const std::string o = dir + "/cli.out", e = dir + "/cli.err";
  const std::string cmd =
      env + " '" + std::string(KVTIER_BINARY_DIR) + "/kvtier' " + args + " > '" + o + "' 2> '" + e + "'";
  const int rc = std::system(cmd.c_str());
  auto slurp = [](const std::string& path) {
    std::ifstream f(path, std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  };
  *out = slurp(o);
  *err = slurp(e);
  return rc;
}

// Every file under `dir` (the JSON report, the data dir, the captured output): none holds
// `secret`; returns how many files were read.
int ExpectNoFileHolds(const std::string& dir, const std::string& secret) {
  int files = 0;
  for (const auto& f : std::filesystem::recursive_directory_iterator(dir)) {
    if (!f.is_regular_file()) continue;
    std::ifstream in(f.path(), std::ios::binary);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_EQ(text.find(secret), std::string::npos) << f.path() << " holds the secret";
    ++files;
  }
  return files;
}

// kvtier run, stress and --help with a password in the spec (and in the environment): the
// run uses Redis, the report keeps the spec redacted, and no output or file holds the
// secret. A wrong password fails promptly, PermissionDenied, without it.
void CliWithCredentials(RedisServers* redis, const std::string& user, const std::string& spec) {
  TempDir dir;
  std::string out, err;
  const std::string remote = WithUserinfo(spec, user + ":" + kSecret);
  ASSERT_EQ(RunCli("",
                   "run --context 8192 --warm-bytes 4M --decode-steps 4 --data-dir none --remote '" + remote +
                       "' --json " + dir.path() + "/run.json",
                   dir.path(), &out, &err),
            0)
      << out << err;
  EXPECT_NE(out.find("remote tier: "), std::string::npos) << out;
  EXPECT_NE(out.find(" 0 errors"), std::string::npos) << out;
  std::ifstream json(dir.path() + "/run.json");
  const std::string j((std::istreambuf_iterator<char>(json)), std::istreambuf_iterator<char>());
  EXPECT_NE(j.find("\"remote\": \"redis://" + user + ":***@"), std::string::npos)
      << "redacted, not dropped: " << j;
  // Through the environment, with a cold tier and a kept data dir.
  ASSERT_EQ(
      RunCli("KVTIER_REDIS_PASSWORD='" + std::string(kSecret) + "'" +
                 (user.empty() ? "" : " KVTIER_REDIS_USER='" + user + "'"),
             "stress --sequences 2 --tokens 600 --data-dir " + dir.path() + "/stress --remote '" + spec + "'",
             dir.path(), &out, &err),
      0)
      << out << err;
  EXPECT_NE(out.find("errors: 0"), std::string::npos) << out;
  ExpectNoSecret(out + err);
  // --help with the spec given: the flag list echoes no value.
  RunCli("", "run --remote '" + remote + "' --help", dir.path(), &out, &err);
  EXPECT_NE(out.find("--remote"), std::string::npos) << out;
  ExpectNoSecret(out + err);
  // A bad spec holding the password: refused, redacted.
  EXPECT_NE(RunCli("", "run --context 4096 --remote '" + remote + "&color=red'", dir.path(), &out, &err), 0);
  EXPECT_NE((out + err).find("unknown option 'color'"), std::string::npos) << out << err;
  EXPECT_NE((out + err).find(":***@"), std::string::npos) << out << err;
  ExpectNoSecret(out + err);
  // A wrong password: refused at open, promptly (retry_ms is 10 s by default), without the secret.
  const std::string wrong = std::string("Wx7-") + kSecret;
  const auto t0 = Time::now();
  EXPECT_NE(RunCli("",
                   "run --quiet --context 4096 --data-dir none --remote '" +
                       WithUserinfo(spec, user + ":" + wrong) + "'",
                   dir.path(), &out, &err),
            0);
  const double ms = MsSince(t0);
  EXPECT_NE((out + err).find("PermissionDenied"), std::string::npos) << out << err;
  EXPECT_EQ((out + err).find("Wx7-"), std::string::npos) << out << err;
  EXPECT_LT(ms, 5000) << "refused at open, not after retry_ms";
  std::printf("[ auth ] kvtier run with a wrong password exited after %.0f ms: %s", ms, (out + err).c_str());
  EXPECT_GE(ExpectNoFileHolds(dir.path(), kSecret), 3);
  ExpectNoFileHolds(redis->dir(), kSecret);  // the servers' logs (and cluster configs)
}

TEST(RemoteCli, PasswordAndAclUserAreUsedAndNeverPrintedSingleServer) {
  KVTIER_SKIP_WITHOUT_REDIS();
  for (const std::string user : {"", kUser}) {
    SCOPED_TRACE(user.empty() ? "requirepass" : "ACL user");
    RedisServers redis;
    redis.RequireAuth(user, kSecret);
    ASSERT_GE(redis.Start(), 0);
    CliWithCredentials(&redis, user, redis.Spec(0, "ns=cli"));
  }
}

TEST(RemoteCli, PasswordAndAclUserAreUsedAndNeverPrintedCluster) {
  KVTIER_SKIP_WITHOUT_REDIS();
  for (const std::string user : {"", kUser}) {
    SCOPED_TRACE(user.empty() ? "requirepass" : "ACL user");
    RedisServers redis;
    redis.RequireAuth(user, kSecret);
    ASSERT_TRUE(redis.StartCluster(1000, 3, 0));
    CliWithCredentials(&redis, user, redis.Spec("ns=cli"));
  }
}

}  // namespace
}  // namespace kvtier
