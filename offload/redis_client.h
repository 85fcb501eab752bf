// RedisClient: the connection layer of the remote tier (offload/remote_tier.h) over
// hiredis 0.14, for one Redis server or a Redis Cluster.
//
// hiredis 0.14 has no cluster client, so this file routes commands itself: each key's
// slot is CRC16(key) mod 16384 (only the part inside the first non-empty {hash tag} when
// there is one, as Redis does), the slot map comes from CLUSTER SLOTS, a MOVED reply
// refreshes it and retries on the named node, an ASK reply retries once there after
// ASKING. A seed that answers CLUSTER SLOTS with "cluster support disabled" is a single
// server: every key goes to it.
//
// Batches are pipelined per node: Execute appends every command of a node on one pooled
// connection, flushes all nodes, then reads the replies, so the nodes work in parallel
// and a batch costs about one round trip per node, not one per command.
//
// Failures: a connection that fails (refused, reset, or a reply slower than
// command_timeout_ms), a CLUSTERDOWN-like reply or a short WAIT is closed and the
// command retried, with the slot map refreshed from any reachable node: that rides out
// a cluster failover (a replica promoted after cluster-node-timeout). The retry window
// belongs to the node, not to the batch: it opens at the node's first failure and every
// batch sent to the node meanwhile shares it, so a queue of batches behind a dead node
// waits one retry_ms in all, not one each; a CLUSTERDOWN reply (cluster_state:fail, the
// whole remote failing) opens every node's window at once, as of the first failure of the
// outage (the earliest open window); and a node the slot-map refresh cannot reach opens
// its window then, not when a batch first reaches it, so masters that died together are
// named one retry_ms after the first failure. When the window ends (or a
// batch has retried retry_ms), the node is down for the next retry_ms: every queued and
// later command to it fails at once with Unavailable naming the node and its first
// error. After that the next command tries the node again (a restarted server is used
// again); if that attempt fails the node is down again at once for another retry_ms,
// without a second window of waiting, so an outage costs one window in all however many
// nodes and batches wait on it. The command that ran out of retries keeps its own
// error: Unavailable (refused or reset) or TimedOut (no reply in time), naming the
// node. Retrying is safe because every command the remote tier sends is idempotent (SET
// of the same value, GET, DEL, WAIT).
//
// Credentials: with a password (and optionally an ACL user) every connection the client
// opens, to a seed, a cluster node or a node reconnected after a failure, sends AUTH before
// anything else. A refused AUTH (WRONGPASS, or a server with no password set), a NOAUTH
// reply (the server wants a password and none was given) and an ACL denial (NOPERM) are
// PermissionDenied naming the node and the server's words, never the password; they are
// final: not retried, and the node's retry window does not open (the node is up, it said
// no).
//
// Thread-safe: any number of threads may call Execute; each takes its own connections
// from the per-node pool.
#pragma once

#include <hiredis/hiredis.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "store/status.h"

namespace kvtier {

struct RedisEndpoint {
  std::string host;  ///< name or address
  int port = 0;      ///< TCP port
  /// "host:port", "[::1]:port" for an IPv6 address.
  std::string ToString() const {
    return (host.find(':') != std::string::npos ? "[" + host + "]" : host) + ":" + std::to_string(port);
  }
  bool operator==(const RedisEndpoint& o) const { return host == o.host && port == o.port; }
};

/// The slot of a key (0..16383): CRC16-XMODEM of the key, or of its hash tag.
uint16_t RedisKeySlot(std::string_view key);

struct RedisClientOptions {
  std::vector<RedisEndpoint> seeds;  ///< servers to discover the deployment from (at least one)
  int connect_timeout_ms = 1000;     ///< TCP connect limit per attempt (default 1 s)
  int command_timeout_ms = 2000;     ///< limit on one reply (default 2 s); slower is a failed attempt
  int retry_ms = 10000;              ///< a node's retry window, then its fail-at-once window (default 10 s)
  int pool_size = 4;                 ///< idle connections kept per node (default 4), 1..kMaxPoolSize
  std::string user;                  ///< ACL user AUTH names; empty: the default user
  std::string password;              ///< AUTH's password; empty: no AUTH (user must then be empty)
  static constexpr int kMaxPoolSize = 256;
  Status Validate() const;  ///< names the bad field
};

/// A hiredis reply, freed on destruction.
struct RedisReplyDeleter {
  void operator()(redisReply* r) const {
    if (r) freeReplyObject(r);
  }
};
using RedisReplyPtr = std::unique_ptr<redisReply, RedisReplyDeleter>;

/// One command of a batch. key routes it (a keyless command such as WAIT is sent with
/// the command before it in the batch, by the client itself: see Execute).
struct RedisCall {
  std::vector<std::string> argv;  ///< binary-safe arguments, argv[0] is the command
  std::string_view key;           ///< the key that picks the node (points into argv)
  RedisReplyPtr reply;            ///< set when the node answered (possibly with an error reply)
  Status status;                  ///< not OK when no answer came (Unavailable / TimedOut naming the node)
};

class RedisClient {
 public:
  /// Connects to the first reachable seed and learns whether it is a cluster (and its
  /// slot map). Unavailable naming every seed when none answers; PermissionDenied at once
  /// when a seed refuses the credentials (or wants some and none were given).
  static Result<std::unique_ptr<RedisClient>> Connect(const RedisClientOptions& options);
  ~RedisClient();
  RedisClient(const RedisClient&) = delete;
  RedisClient& operator=(const RedisClient&) = delete;

  /// Runs every call (pipelined per node) and fills its reply or status. With
  /// wait_replicas > 0, each node's pipeline ends with WAIT wait_replicas wait_timeout_ms
  /// and a call whose node reports fewer replicas gets Unavailable ("acknowledged by k
  /// of n replicas"): its write may not survive a failover. Returns OK; per-call
  /// outcomes are in the calls.
  void Execute(std::vector<RedisCall>* calls, int wait_replicas = 0, int wait_timeout_ms = 0);

  bool cluster() const { return cluster_; }
  /// The masters currently in the slot map (the server itself for a single server).
  std::vector<RedisEndpoint> Masters() const;
  const RedisClientOptions& options() const { return options_; }

 private:
  struct Node;
  explicit RedisClient(const RedisClientOptions& options);
  Result<redisContext*> Dial(const RedisEndpoint& ep) const;
  /// Re-reads CLUSTER SLOTS from any node that answers; false when none did.
  bool RefreshSlots();
  int NodeIndexLocked(const RedisEndpoint& ep);
  using Clock = std::chrono::steady_clock;
  /// A failed attempt on the node: opens its retry window unless one is open, as of
  /// `since` (default now).
  void NodeFailedLocked(int node, const Status& error, std::optional<Clock::time_point> since = std::nullopt);
  /// When the outage in progress began: the earliest window start of a failing (or still
  /// down) node; now when none is.
  Clock::time_point OutageStartLocked() const;
  /// The node answered as it should: its retry window closes.
  void NodeAnsweredLocked(int node);
  /// Not OK while the node is down (its window ran out): the status every command gets.
  /// Also declares it down when its window has just run out.
  Status NodeDownLocked(int node);
  void MarkDownLocked(int node);
  redisContext* TakeConnection(int node, Status* error);
  void GiveBack(int node, redisContext* c);

  RedisClientOptions options_;
  bool cluster_ = false;
  mutable std::mutex mu_;  // guards nodes_' pools and endpoints, slots_
  std::vector<std::unique_ptr<Node>> nodes_;
  std::vector<int> slots_;  // [16384] node index of the slot's master; -1 = unknown
  std::mutex refresh_mu_;   // one slot-map refresh at a time
};

}  // namespace kvtier
