// Real redis-server processes for the remote-tier tests: one server, or a Redis Cluster
// (3 masters, 3 replicas) built with `redis-cli --cluster create`, on loopback ports in
// a temporary directory, SIGKILLed when the object goes away. No mock: the tests exercise
// the protocol, redirections, eviction and failover of the real server.
#pragma once

#include <arpa/inet.h>
#include <hiredis/hiredis.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "test_util.h"

extern char** environ;

namespace kvtier {

/// Path of an executable on PATH, or "".
inline std::string FindOnPath(const std::string& name) {
  const char* path = std::getenv("PATH");
  std::string p = path ? path : "/usr/bin:/bin";
  for (size_t start = 0; start <= p.size();) {
    size_t end = p.find(':', start);
    if (end == std::string::npos) end = p.size();
    const std::string cand = p.substr(start, end - start) + "/" + name;
    if (access(cand.c_str(), X_OK) == 0) return cand;
    start = end + 1;
  }
  return "";
}

/// Skips the test when redis-server or redis-cli is missing (.ci/run installs them).
#define KVTIER_SKIP_WITHOUT_REDIS()                                                                      \
  do {                                                                                                   \
    if (::kvtier::FindOnPath("redis-server").empty() || ::kvtier::FindOnPath("redis-cli").empty())       \
      GTEST_SKIP() << "redis-server/redis-cli not installed (apt-get install redis-server redis-tools; " \
                      "scripts/deps.sh installs them)";                                                  \
  } while (0)

/// A free TCP port on 127.0.0.1 whose cluster bus port (+10000) is free too.
inline int FreeRedisPort() {
  for (int attempt = 0; attempt < 100; ++attempt) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = 0;
    bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
    socklen_t len = sizeof(a);
    getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
    const int port = ntohs(a.sin_port);
    close(fd);
    if (port + 10000 > 65535) continue;
    int fd2 = socket(AF_INET, SOCK_STREAM, 0);
    a.sin_port = htons(static_cast<uint16_t>(port + 10000));
    const bool bus_free = bind(fd2, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
    close(fd2);
    if (bus_free) return port;
  }
  return 0;
}

/// Runs one command on 127.0.0.1:port with hiredis; the reply as text ("" on failure).
/// `auth` (e.g. {"AUTH", "pw"} or {"AUTH", "user", "pw"}) is sent first when not empty.
inline std::string RedisCommandText(int port, const std::vector<std::string>& argv,
                                    const std::vector<std::string>& auth = {}) {
  redisContext* c = redisConnectWithTimeout("127.0.0.1", port, timeval{2, 0});
  if (c == nullptr || c->err) {
    if (c) redisFree(c);
    return "";
  }
  auto run = [c](const std::vector<std::string>& words) {
    std::vector<const char*> a;
    std::vector<size_t> l;
    for (const auto& s : words) {
      a.push_back(s.data());
      l.push_back(s.size());
    }
    return static_cast<redisReply*>(redisCommandArgv(c, static_cast<int>(a.size()), a.data(), l.data()));
  };
  if (!auth.empty()) {
    redisReply* ar = run(auth);
    if (ar) freeReplyObject(ar);
  }
  auto* r = run(argv);
  std::string out;
  if (r) {
    if (r->type == REDIS_REPLY_INTEGER)
      out = std::to_string(r->integer);
    else if (r->str)
      out.assign(r->str, r->len);
    freeReplyObject(r);
  }
  redisFree(c);
  return out;
}

class RedisServers {
 public:
  RedisServers() = default;
  ~RedisServers() {
    for (auto& s : servers_)
      if (s.pid > 0) {
        kill(s.pid, SIGCONT);
        kill(s.pid, SIGKILL);
        waitpid(s.pid, nullptr, 0);
      }
  }
  RedisServers(const RedisServers&) = delete;
  RedisServers& operator=(const RedisServers&) = delete;

  struct Server {
    int port = 0;
    pid_t pid = -1;
  };

  /// Every server started from now on wants credentials: with `user` empty a password
  /// (requirepass), else an ACL user `user` with password `password` and every right, the
  /// default user off. Replicas authenticate to their masters the same way; the fixture's
  /// own commands (PING, CLUSTER INFO, Cli, Command) send AUTH.
  void RequireAuth(const std::string& user, const std::string& password) {
    user_ = user;
    password_ = password;
  }
  /// AUTH's words for the credentials set by RequireAuth (empty when none).
  std::vector<std::string> Auth() const {
    if (password_.empty()) return {};
    if (user_.empty()) return {"AUTH", password_};
    return {"AUTH", user_, password_};
  }
  /// One command on server `index`, with the fixture's credentials.
  std::string Command(int index, const std::vector<std::string>& argv) const {
    return RedisCommandText(servers_[index].port, argv, Auth());
  }

  /// Starts one redis-server with extra arguments (e.g. {"--maxmemory", "2mb"}); returns
  /// its index, or -1 (with a gtest failure) when it did not answer PING within 10 s.
  int Start(const std::vector<std::string>& extra = {}) {
    const int port = FreeRedisPort();
    const std::string exe = FindOnPath("redis-server");
    std::vector<std::string> args = {exe,
                                     "--port",
                                     std::to_string(port),
                                     "--bind",
                                     "127.0.0.1",
                                     "--dir",
                                     dir_.path(),
                                     "--save",
                                     "",
                                     "--appendonly",
                                     "no",
                                     "--logfile",
                                     dir_.path() + "/redis-" + std::to_string(port) + ".log"};
    if (!password_.empty() && user_.empty()) {
      args.insert(args.end(), {"--requirepass", password_, "--masterauth", password_});
    } else if (!password_.empty()) {
      args.insert(args.end(), {"--user", "default", "off", "--user", user_, "on", ">" + password_, "~*", "&*",
                               "+@all", "--masteruser", user_, "--masterauth", password_});
    }
    args.insert(args.end(), extra.begin(), extra.end());
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_t pid = -1;
    if (posix_spawn(&pid, exe.c_str(), nullptr, nullptr, argv.data(), environ) != 0) {
      ADD_FAILURE() << "cannot start " << exe;
      return -1;
    }
    servers_.push_back(Server{port, pid});
    for (int i = 0; i < 200; ++i) {
      if (RedisCommandText(port, {"PING"}, Auth()) == "PONG") return static_cast<int>(servers_.size() - 1);
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    ADD_FAILURE() << "redis-server on port " << port << " did not answer PING";
    return -1;
  }

  /// `nodes` (>= 6) cluster-enabled servers joined by `redis-cli --cluster create
  /// --cluster-replicas 1`: 3 masters, each with at least one replica (a seventh node is a
  /// second replica of one master). Waits for cluster_state:ok everywhere and for every
  /// replica's link to be up. node_timeout_ms decides how fast a dead master is replaced.
  /// replicas = 0 (with nodes = 3): masters only, so a dead master takes the cluster to
  /// cluster_state:fail (every node answers CLUSTERDOWN) after node_timeout_ms.
  bool StartCluster(int node_timeout_ms = 1000, int nodes = 6, int replicas = 1) {
    std::string hosts;
    for (int i = 0; i < nodes; ++i) {
      const int idx = Start({"--cluster-enabled", "yes", "--cluster-config-file",
                             dir_.path() + "/nodes-" + std::to_string(i) + ".conf", "--cluster-node-timeout",
                             std::to_string(node_timeout_ms)});
      if (idx < 0) return false;
      hosts += " 127.0.0.1:" + std::to_string(servers_[idx].port);
    }
    const std::string cmd = FindOnPath("redis-cli") + CliAuth() + " --cluster create" + hosts +
                            " --cluster-replicas " + std::to_string(replicas) + " --cluster-yes > " +
                            dir_.path() + "/create.log 2>&1";
    if (std::system(cmd.c_str()) != 0) {
      ADD_FAILURE() << "redis-cli --cluster create failed; see " << dir_.path() << "/create.log";
      return false;
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (std::chrono::steady_clock::now() < deadline) {
      bool ok = true;
      for (const Server& s : servers_) {
        const std::string info = RedisCommandText(s.port, {"CLUSTER", "INFO"}, Auth());
        const std::string repl = RedisCommandText(s.port, {"INFO", "replication"}, Auth());
        ok = ok && info.find("cluster_state:ok") != std::string::npos &&
             (repl.find("role:master") != std::string::npos ||
              repl.find("master_link_status:up") != std::string::npos);
      }
      if (ok) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    ADD_FAILURE() << "the cluster did not reach cluster_state:ok with replicas in sync within 30 s";
    return false;
  }

  /// "redis://127.0.0.1:p1,127.0.0.1:p2..." over every server started (plus a query).
  std::string Spec(const std::string& query = "") const {
    std::string s = "redis://";
    for (size_t i = 0; i < servers_.size(); ++i)
      s += (i ? "," : "") + std::string("127.0.0.1:") + std::to_string(servers_[i].port);
    return query.empty() ? s : s + "?" + query;
  }
  std::string Spec(int index, const std::string& query = "") const {
    const std::string s = "redis://127.0.0.1:" + std::to_string(servers_[index].port);
    return query.empty() ? s : s + "?" + query;
  }

  /// The server index listening on `port`, or -1.
  int IndexOfPort(int port) const {
    for (size_t i = 0; i < servers_.size(); ++i)
      if (servers_[i].port == port) return static_cast<int>(i);
    return -1;
  }
  void Kill(int index) {
    Server& s = servers_[index];
    if (s.pid <= 0) return;
    kill(s.pid, SIGKILL);
    waitpid(s.pid, nullptr, 0);
    s.pid = -1;
  }
  void Pause(int index) { kill(servers_[index].pid, SIGSTOP); }
  void Resume(int index) { kill(servers_[index].pid, SIGCONT); }
  const Server& server(int index) const { return servers_[index]; }
  size_t size() const { return servers_.size(); }
  const std::string& dir() const { return dir_.path(); }

  /// Runs redis-cli against one server with the arguments (shell words); its exit status.
  int Cli(int index, const std::string& args) const {
    const std::string cmd = FindOnPath("redis-cli") + CliAuth() + " -p " +
                            std::to_string(servers_[index].port) + " " + args + " > /dev/null 2>&1";
    return std::system(cmd.c_str());
  }

 private:
  // redis-cli's credential flags (the password through its environment variable would be
  // tidier, but these are test passwords and the command line stays in this process).
  std::string CliAuth() const {
    if (password_.empty()) return "";
    return (user_.empty() ? "" : " --user '" + user_ + "'") + " -a '" + password_ + "' --no-auth-warning";
  }

  TempDir dir_;
  std::vector<Server> servers_;
  std::string user_, password_;
};

}  // namespace kvtier
