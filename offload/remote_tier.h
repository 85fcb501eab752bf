// RemoteTier: chunks in Redis (one server or a Redis Cluster), below or beside the
// RocksDB cold tier, and shared between processes on different nodes.
//
// ---- Keys --------------------------------------------------------------------------
//   chunk              kvt:<ns>:<seq>:<layer>:<index>
//   its meta record    kvt:<ns>:<seq>:<layer>:<index>:m  (read without the payload)
//   published sequence kvt:pub:{<name>}            (the manifest, written last)
//                      kvt:pub:{<name>}:<layer>    (the layer's chunk metas, sinks, window)
// <ns> is the writing store's namespace (StoreOptions::remote_namespace), so stores
// that number their sequences from 1 do not collide. Chunk keys carry no hash tag on
// purpose: one long sequence's chunks spread over every master (capacity and bandwidth
// grow with the cluster). A publication's records share the {<name>} tag, so they sit on
// one shard and are written, in order, on one connection: a reader that finds the
// manifest finds the records it names.
//
// ---- Values ------------------------------------------------------------------------
// Framed like the cold tier's (offload/cold_tier.h, value_framing::EncodeValue):
// magic, version, kind, body length, CRC-32C over header and body; the header's aux
// field holds the CRC-32C of the key, so a value copied under another key is caught
// too. A chunk's body is u32 meta length, the meta record (offload/store_records.h),
// then the payload. A read checks all of it: a missing key (never written, or evicted
// by Redis under maxmemory) is NotFound naming the chunk and the key; any mismatch is
// Corruption naming them. Nothing unverified reaches the caller. The meta record is also
// written under its own key (framed the same way, kind meta), in the same pipelined batch,
// so that the store can read a chunk's representative keys back without its payload
// (GetChunkMetas; offload/lower_tier.h, "Meta reads"): a put is acknowledged only when
// both keys are. Under maxmemory Redis may evict either key; a missing meta key is
// NotFound as a missing chunk is.
//
// ---- Acknowledgement -----------------------------------------------------------------
// A put is acknowledged when the master answered OK and, with wait_replicas > 0, WAIT
// reported that many replicas have it: a failover (a replica promoted after the master
// died) then keeps it. Redis replication is asynchronous otherwise, so without WAIT an
// acknowledged chunk can be lost with its master.
//
// Thread-safe.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "offload/lower_tier.h"
#include "offload/redis_client.h"
#include "store/chunk.h"
#include "store/status.h"

namespace kvtier {

namespace value_framing {
enum class ValueKind : uint8_t;  // offload/value_framing.h
}  // namespace value_framing

struct RemoteTierOptions {
  std::vector<RedisEndpoint> endpoints;  ///< seeds: one server, or any nodes of a cluster
  std::string ns = "kvtier";             ///< key namespace of the writing store (letters, digits, -_.)
  int connect_timeout_ms = 1000;         ///< per connect attempt (default 1 s)
  int command_timeout_ms = 2000;         ///< per reply (default 2 s)
  int retry_ms = 10000;                  ///< a node's retry window, then fail-at-once window (default 10 s)
  int pool_size = 4;                     ///< idle connections kept per node (default 4)
  int wait_replicas = 0;       ///< replicas WAIT must report before a put is acknowledged (default 0)
  int wait_timeout_ms = 1000;  ///< WAIT's limit (default 1 s); below command_timeout_ms
  std::string user;            ///< ACL user for AUTH; empty: the default user
  std::string password;        ///< AUTH on every connection when not empty
  Status Validate() const;     ///< names the bad field, never the password
};

/// Parses a remote spec into options (docs/cli.md, "Remote spec"):
///   redis://[USER[:PASSWORD]@ | :PASSWORD@]HOST:PORT[,HOST:PORT...][?KEY=VALUE&...]
/// HOST is a name, an IPv4 address or a bracketed IPv6 address ([::1]). Keys, each at most
/// once: wait (wait_replicas), wait_timeout_ms, timeout_ms (command_timeout_ms),
/// connect_timeout_ms, retry_ms, pool (1..RedisClientOptions::kMaxPoolSize), ns,
/// password_file (a file holding the password; one trailing newline is dropped).
/// Credentials: the password comes from the userinfo, else password_file, else the
/// environment variable KVTIER_REDIS_PASSWORD; the user from the userinfo, else
/// KVTIER_REDIS_USER. Userinfo ends at the last '@' before the first '?' and is
/// percent-decoded (a '?' or '%' in a password is written %3F, %25). A password in the
/// query (password=) is refused: query strings
/// end up in logs. InvalidArgument saying what is wrong otherwise, quoting the spec
/// through RedactRemoteSpec: no message holds the password.
Result<RemoteTierOptions> ParseRemoteSpec(std::string_view spec);

/// The spec with every secret replaced by "***": the userinfo's password
/// (redis://user:***@host:port, redis://:***@host:port) and the value of any query key
/// naming a password. Safe on any string, parsable or not; what every message, log line and
/// report prints instead of the spec.
std::string RedactRemoteSpec(std::string_view spec);

/// Where a chunk lives in the remote tier: the writer's namespace (null: this tier's own)
/// and its chunk key.
using RemoteChunkRef = LowerChunkRef;

/// Counters of one RemoteTier (monotonic).
struct RemoteTierCounters {
  uint64_t puts = 0, put_bytes = 0;  ///< chunks acknowledged, payload bytes
  uint64_t gets = 0, get_bytes = 0;  ///< chunks read and verified, payload bytes
  uint64_t not_found = 0;            ///< reads of a missing chunk (evicted or never written)
  uint64_t corrupt = 0;              ///< reads that failed verification
  uint64_t errors = 0;               ///< calls that got no usable answer (down, slow, refused)
};

class RemoteTier {
 public:
  /// Connects (RedisClient::Connect) with the options.
  static Result<std::unique_ptr<RemoteTier>> Open(const RemoteTierOptions& options);
  ~RemoteTier();

  /// One chunk of a batch put.
  struct Put {
    ChunkKey key;
    std::string_view meta;  ///< the chunk's meta record
    const void* payload = nullptr;
    size_t payload_bytes = 0;
    Status status;  ///< OK once acknowledged
  };
  /// Writes every chunk in one pipelined batch (per node); each put's status says whether
  /// it was acknowledged (see the header). Returns the first failure, OK when all were.
  Status PutChunks(std::vector<Put>* puts);
  Status PutChunk(const ChunkKey& key, std::string_view meta, const void* payload, size_t payload_bytes);

  /// One chunk of a batch get.
  struct Get {
    RemoteChunkRef ref;
    void* dst = nullptr;  ///< payload_bytes of room
    size_t payload_bytes = 0;
    Status status;  ///< NotFound / Corruption / Unavailable / TimedOut naming the chunk
  };
  /// Reads every chunk in one pipelined batch and verifies it. Returns the first failure.
  Status GetChunks(std::vector<Get>* gets);
  Status GetChunk(const RemoteChunkRef& ref, void* dst, size_t payload_bytes);

  /// One chunk of a batch meta read.
  struct MetaGet {
    RemoteChunkRef ref;
    std::string meta;  ///< the meta record, as PutChunks got it
    Status status;     ///< NotFound / Corruption / Unavailable / TimedOut naming the chunk
  };
  /// Reads the meta records of chunks (their own keys) in one pipelined batch, verified.
  /// Returns the first failure.
  Status GetChunkMetas(std::vector<MetaGet>* gets);

  /// Removes chunks of this namespace, both keys (missing ones are not an error).
  Status DeleteChunks(const std::vector<ChunkKey>& keys);

  /// Publication records (kvt:pub:{name}[:part]), framed and checked like chunks.
  /// Writes the parts in order and the manifest last, on one connection.
  Status PutPublication(std::string_view name, const std::vector<std::string>& parts,
                        std::string_view manifest);
  /// The manifest; NotFound when the name is not published (or not complete yet).
  Result<std::string> GetManifest(std::string_view name);
  /// Part `index` of a publication.
  Result<std::string> GetPublicationPart(std::string_view name, uint32_t index);

  /// The key of a chunk, and of its meta record (for tools and tests).
  std::string ChunkKeyString(const RemoteChunkRef& ref) const;
  std::string MetaKeyString(const RemoteChunkRef& ref) const { return ChunkKeyString(ref) + ":m"; }
  static std::string PublicationKey(std::string_view name);
  static std::string PublicationPartKey(std::string_view name, uint32_t index);

  const RemoteTierOptions& options() const { return options_; }
  const std::string& ns() const { return options_.ns; }
  RedisClient* client() const { return client_.get(); }
  RemoteTierCounters counters() const;

 private:
  explicit RemoteTier(const RemoteTierOptions& options) : options_(options) {}
  Result<std::string> GetRecord(const std::string& key, const std::string& what);
  // The framed body of the reply `c` to a GET (its argv[1] the key), of value kind `kind`,
  // checked: the call's outcome, a missing key (NotFound), an error reply, the frame and the key
  // tag (Corruption), each naming `what`. Counts errors, misses and corruption.
  Status ReplyBody(const RedisCall& c, value_framing::ValueKind kind, const std::string& what,
                   std::string_view* body);

  RemoteTierOptions options_;
  std::unique_ptr<RedisClient> client_;
  std::atomic<uint64_t> puts_{0}, put_bytes_{0}, gets_{0}, get_bytes_{0}, not_found_{0}, corrupt_{0},
      errors_{0};
};

}  // namespace kvtier
