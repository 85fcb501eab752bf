#include "offload/remote_tier.h"

#include <cctype>
#include <cstring>

#include "offload/cold_tier.h"
#include "store/checksum.h"
#include "store/coding.h"

namespace kvtier {

namespace {

using cold_tier_format::ValueKind;

bool ValidNamespace(std::string_view ns) {
  if (ns.empty() || ns.size() > 128) return false;
  for (char c : ns)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.')) return false;
  return true;
}

Result<int> ParseInt(std::string_view spec, std::string_view field, std::string_view text) {
  int v = 0;
  if (text.empty() || text.size() > 9) goto bad;
  for (char c : text) {
    if (c < '0' || c > '9') goto bad;
    v = v * 10 + (c - '0');
  }
  return v;
bad:
  return InvalidArgument("remote spec '" + std::string(spec) + "': " + std::string(field) + " '" +
                         std::string(text) + "' is not a non-negative integer");
}

// The framed value's `what` and its messages say "remote tier", not the cold tier's words.
Status Reword(Status st) {
  if (st.ok()) return st;
  std::string m = st.message();
  if (m.rfind("cold tier: ", 0) == 0) m = "remote tier: " + m.substr(11);
  return Status(st.code(), m);
}

uint64_t KeyTag(std::string_view key) { return Crc32c(key.data(), key.size()); }

// The framed value of a chunk (cold_tier_format::EncodeValue's layout, body = u32 meta
// length, meta, payload) built in one buffer: the payload is copied once, not three times
// (body, value, argv), which is most of a put's CPU next to the socket write.
std::string FrameChunk(const std::string& key, std::string_view meta, const void* payload,
                       size_t payload_bytes) {
  constexpr size_t H = cold_tier_format::kValueHeaderBytes;
  const size_t body = 4 + meta.size() + payload_bytes;
  std::string v(H + body, '\0');
  char* p = v.data();
  EncodeFixed32(p, cold_tier_format::kMagic);
  p[4] = static_cast<char>(cold_tier_format::kFormatVersion);
  p[5] = static_cast<char>(ValueKind::kPayload);
  EncodeFixed64(p + 8, body);
  EncodeFixed64(p + 16, KeyTag(key));
  EncodeFixed32(p + H, static_cast<uint32_t>(meta.size()));
  std::memcpy(p + H + 4, meta.data(), meta.size());
  std::memcpy(p + H + 4 + meta.size(), payload, payload_bytes);
  EncodeFixed32(p + 24, Crc32c(p + H, body, Crc32c(p, 24)));
  return v;
}

std::string ChunkWhat(const RemoteChunkRef& ref, const std::string& key) {
  return "chunk " + ref.key.ToString() + " (key '" + key + "')";
}

}  // namespace

Status RemoteTierOptions::Validate() const {
  if (endpoints.empty()) return InvalidArgument("remote tier: endpoints must name at least one host:port");
  if (!ValidNamespace(ns))
    return InvalidArgument("remote tier: ns '" + ns + "' must be 1..128 letters, digits, '-', '_' or '.'");
  if (wait_replicas < 0)
    return InvalidArgument("remote tier: wait_replicas must be >= 0 (got " + std::to_string(wait_replicas) +
                           ")");
  if (wait_timeout_ms <= 0)
    return InvalidArgument("remote tier: wait_timeout_ms must be > 0 (got " +
                           std::to_string(wait_timeout_ms) + ")");
  // WAIT blocks up to its own limit: a socket timeout shorter than that would cut every
  // slow WAIT off as a dead connection.
  if (wait_replicas > 0 && wait_timeout_ms >= command_timeout_ms)
    return InvalidArgument("remote tier: wait_timeout_ms (" + std::to_string(wait_timeout_ms) +
                           ") must be below command_timeout_ms (" + std::to_string(command_timeout_ms) + ")");
  RedisClientOptions co;
  co.seeds = endpoints;
  co.connect_timeout_ms = connect_timeout_ms;
  co.command_timeout_ms = command_timeout_ms;
  co.retry_ms = retry_ms;
  co.pool_size = pool_size;
  Status st = co.Validate();
  if (!st.ok()) return Status(st.code(), "remote tier: " + st.message());
  return Status::Ok();
}

Result<RemoteTierOptions> ParseRemoteSpec(std::string_view spec) {
  const std::string_view scheme = "redis://";
  auto bad = [&](const std::string& why) {
    return InvalidArgument("remote spec '" + std::string(spec) + "': " + why +
                           " (expected redis://host:port[,host:port...][?wait=N&timeout_ms=N&...])");
  };
  if (spec.substr(0, scheme.size()) != scheme) return bad("must start with redis://");
  std::string_view rest = spec.substr(scheme.size());
  std::string_view query;
  if (const size_t q = rest.find('?'); q != std::string_view::npos) {
    query = rest.substr(q + 1);
    rest = rest.substr(0, q);
  }
  RemoteTierOptions o;
  while (!rest.empty()) {
    const size_t comma = rest.find(',');
    const std::string_view item = rest.substr(0, comma);
    rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
    if (comma != std::string_view::npos && rest.empty()) return bad("trailing ','");
    const size_t colon = item.rfind(':');
    if (item.empty()) return bad("empty host:port");
    if (colon == std::string_view::npos || colon == 0)
      return bad("'" + std::string(item) + "' is not host:port");
    KVTIER_ASSIGN_OR_RETURN(int port, ParseInt(spec, "port", item.substr(colon + 1)));
    if (port < 1 || port > 65535) return bad("port " + std::to_string(port) + " is outside 1..65535");
    o.endpoints.push_back(RedisEndpoint{std::string(item.substr(0, colon)), port});
  }
  if (o.endpoints.empty()) return bad("no host:port");
  while (!query.empty()) {
    const size_t amp = query.find('&');
    const std::string_view kv = query.substr(0, amp);
    query = amp == std::string_view::npos ? std::string_view() : query.substr(amp + 1);
    const size_t eq = kv.find('=');
    if (eq == std::string_view::npos) return bad("option '" + std::string(kv) + "' is not key=value");
    const std::string_view k = kv.substr(0, eq), v = kv.substr(eq + 1);
    if (k == "ns") {
      o.ns = std::string(v);
      continue;
    }
    int* field = k == "wait"                 ? &o.wait_replicas
                 : k == "wait_timeout_ms"    ? &o.wait_timeout_ms
                 : k == "timeout_ms"         ? &o.command_timeout_ms
                 : k == "connect_timeout_ms" ? &o.connect_timeout_ms
                 : k == "retry_ms"           ? &o.retry_ms
                 : k == "pool"               ? &o.pool_size
                                             : nullptr;
    if (field == nullptr)
      return bad("unknown option '" + std::string(k) +
                 "' (known: wait, wait_timeout_ms, timeout_ms, connect_timeout_ms, retry_ms, pool, ns)");
    KVTIER_ASSIGN_OR_RETURN(*field, ParseInt(spec, k, v));
  }
  Status st = o.Validate();
  if (!st.ok()) return bad(st.message());
  return o;
}

Result<std::unique_ptr<RemoteTier>> RemoteTier::Open(const RemoteTierOptions& options) {
  KVTIER_RETURN_IF_ERROR(options.Validate());
  auto tier = std::unique_ptr<RemoteTier>(new RemoteTier(options));
  RedisClientOptions co;
  co.seeds = options.endpoints;
  co.connect_timeout_ms = options.connect_timeout_ms;
  co.command_timeout_ms = options.command_timeout_ms;
  co.retry_ms = options.retry_ms;
  co.pool_size = options.pool_size;
  auto client = RedisClient::Connect(co);
  if (!client.ok()) return Status(client.status().code(), "remote tier: " + client.status().message());
  tier->client_ = std::move(*client);
  return tier;
}

RemoteTier::~RemoteTier() = default;

std::string RemoteTier::ChunkKeyString(const RemoteChunkRef& ref) const {
  const std::string& ns = ref.ns ? *ref.ns : options_.ns;
  return "kvt:" + ns + ":" + std::to_string(ref.key.seq) + ":" + std::to_string(ref.key.layer) + ":" +
         std::to_string(ref.key.index);
}

std::string RemoteTier::PublicationKey(std::string_view name) {
  return "kvt:pub:{" + std::string(name) + "}";
}
std::string RemoteTier::PublicationPartKey(std::string_view name, uint32_t index) {
  return PublicationKey(name) + ":" + std::to_string(index);
}

RemoteTierCounters RemoteTier::counters() const {
  RemoteTierCounters c;
  c.puts = puts_.load();
  c.put_bytes = put_bytes_.load();
  c.gets = gets_.load();
  c.get_bytes = get_bytes_.load();
  c.not_found = not_found_.load();
  c.corrupt = corrupt_.load();
  c.errors = errors_.load();
  return c;
}

Status RemoteTier::PutChunks(std::vector<Put>* puts) {
  // Two calls a chunk, in one batch: the framed chunk (2i) and its meta record (2i + 1).
  std::vector<RedisCall> calls(2 * puts->size());
  for (size_t i = 0; i < puts->size(); ++i) {
    const Put& p = (*puts)[i];
    const RemoteChunkRef ref{nullptr, p.key};
    std::string key = ChunkKeyString(ref);
    std::string value = FrameChunk(key, p.meta, p.payload, p.payload_bytes);
    RedisCall& chunk = calls[2 * i];
    chunk.argv.reserve(3);
    chunk.argv.emplace_back("SET");
    chunk.argv.push_back(std::move(key));
    chunk.argv.push_back(std::move(value));  // moved, not copied: an initializer list would copy
    chunk.key = chunk.argv[1];
    std::string meta_key = MetaKeyString(ref);
    std::string meta = cold_tier_format::EncodeValue(ValueKind::kMeta, p.meta, KeyTag(meta_key));
    RedisCall& m = calls[2 * i + 1];
    m.argv.reserve(3);
    m.argv.emplace_back("SET");
    m.argv.push_back(std::move(meta_key));
    m.argv.push_back(std::move(meta));
    m.key = m.argv[1];
  }
  client_->Execute(&calls, options_.wait_replicas, options_.wait_timeout_ms);
  Status first;
  for (size_t i = 0; i < puts->size(); ++i) {
    Put& p = (*puts)[i];
    p.status = Status::Ok();
    for (const RedisCall* c : {&calls[2 * i], &calls[2 * i + 1]}) {
      const std::string what =
          "remote tier: writing chunk " + p.key.ToString() + " (key '" + c->argv[1] + "')";
      if (!c->status.ok()) {
        p.status = Status(c->status.code(), what + ": " + c->status.message());
      } else if (c->reply->type == REDIS_REPLY_ERROR) {
        const std::string e(c->reply->str, c->reply->len);
        // -OOM: maxmemory with a no-eviction policy; the chunk stays in the local tiers.
        p.status = e.rfind("OOM", 0) == 0 ? ResourceExhausted(what + ": " + e) : IOError(what + ": " + e);
      }
      if (!p.status.ok()) break;
    }
    if (p.status.ok()) {
      puts_++;
      put_bytes_ += p.payload_bytes;
    } else {
      errors_++;
      if (first.ok()) first = p.status;
    }
  }
  return first;
}

Status RemoteTier::PutChunk(const ChunkKey& key, std::string_view meta, const void* payload,
                            size_t payload_bytes) {
  std::vector<Put> puts(1);
  puts[0].key = key;
  puts[0].meta = meta;
  puts[0].payload = payload;
  puts[0].payload_bytes = payload_bytes;
  return PutChunks(&puts);
}

Status RemoteTier::ReplyBody(const RedisCall& c, cold_tier_format::ValueKind kind, const std::string& what,
                             std::string_view* body) {
  const std::string& key = c.argv[1];
  if (!c.status.ok()) {
    errors_++;
    return Status(c.status.code(), "remote tier: reading " + what + ": " + c.status.message());
  }
  if (c.reply->type == REDIS_REPLY_NIL) {
    not_found_++;
    return NotFound("remote tier: " + what +
                    " is missing: evicted by the server (maxmemory) or never written");
  }
  if (c.reply->type == REDIS_REPLY_ERROR) {
    errors_++;
    return IOError("remote tier: reading " + what + ": " + std::string(c.reply->str, c.reply->len));
  }
  uint64_t aux = 0;
  Status st = c.reply->type == REDIS_REPLY_STRING
                  ? Reword(cold_tier_format::DecodeValue(std::string_view(c.reply->str, c.reply->len), kind,
                                                         what, body, &aux))
                  : Corruption("remote tier: " + what + " holds no string value");
  if (st.ok() && aux != KeyTag(key))
    st = Corruption("remote tier: " + what + " holds a value written under another key");
  if (!st.ok()) corrupt_++;
  return st;
}

Status RemoteTier::GetChunks(std::vector<Get>* gets) {
  std::vector<RedisCall> calls(gets->size());
  for (size_t i = 0; i < gets->size(); ++i) {
    calls[i].argv = {"GET", ChunkKeyString((*gets)[i].ref)};
    calls[i].key = calls[i].argv[1];
  }
  client_->Execute(&calls);
  Status first;
  for (size_t i = 0; i < gets->size(); ++i) {
    Get& g = (*gets)[i];
    const std::string what = ChunkWhat(g.ref, calls[i].argv[1]);
    std::string_view body;
    g.status = ReplyBody(calls[i], ValueKind::kPayload, what, &body);
    if (g.status.ok()) {
      RecordReader rr(body, "remote tier: " + what);
      uint32_t meta_len = 0;
      std::string_view meta;
      g.status = rr.ReadFixed32(&meta_len, "meta length");
      if (g.status.ok()) g.status = rr.ReadView(meta_len, &meta, "meta");
      if (g.status.ok() && rr.remaining() != g.payload_bytes)
        g.status = Corruption("remote tier: " + what + " payload is " + std::to_string(rr.remaining()) +
                              " bytes, expected " + std::to_string(g.payload_bytes) + " (another layout?)");
      if (g.status.ok()) g.status = rr.ReadBytes(g.dst, g.payload_bytes, "payload");
      if (g.status.ok()) {
        gets_++;
        get_bytes_ += g.payload_bytes;
      } else {
        corrupt_++;
      }
    }
    if (!g.status.ok() && first.ok()) first = g.status;
  }
  return first;
}

Status RemoteTier::GetChunk(const RemoteChunkRef& ref, void* dst, size_t payload_bytes) {
  std::vector<Get> gets(1);
  gets[0].ref = ref;
  gets[0].dst = dst;
  gets[0].payload_bytes = payload_bytes;
  return GetChunks(&gets);
}

Status RemoteTier::GetChunkMetas(std::vector<MetaGet>* gets) {
  std::vector<RedisCall> calls(gets->size());
  for (size_t i = 0; i < gets->size(); ++i) {
    calls[i].argv = {"GET", MetaKeyString((*gets)[i].ref)};
    calls[i].key = calls[i].argv[1];
  }
  client_->Execute(&calls);
  Status first;
  for (size_t i = 0; i < gets->size(); ++i) {
    MetaGet& g = (*gets)[i];
    std::string_view body;
    g.status =
        ReplyBody(calls[i], ValueKind::kMeta, "meta record of " + ChunkWhat(g.ref, calls[i].argv[1]), &body);
    if (g.status.ok()) g.meta.assign(body.data(), body.size());
    if (!g.status.ok() && first.ok()) first = g.status;
  }
  return first;
}

Status RemoteTier::DeleteChunks(const std::vector<ChunkKey>& keys) {
  // One DEL a key: a chunk's two keys may live on different cluster nodes.
  std::vector<RedisCall> calls(2 * keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    const RemoteChunkRef ref{nullptr, keys[i]};
    calls[2 * i].argv = {"DEL", ChunkKeyString(ref)};
    calls[2 * i + 1].argv = {"DEL", MetaKeyString(ref)};
  }
  for (RedisCall& c : calls) c.key = c.argv[1];
  client_->Execute(&calls);
  for (size_t i = 0; i < calls.size(); ++i) {
    const RedisCall& c = calls[i];
    const ChunkKey& k = keys[i / 2];
    if (!c.status.ok())
      return Status(c.status.code(),
                    "remote tier: deleting chunk " + k.ToString() + ": " + c.status.message());
    if (c.reply->type == REDIS_REPLY_ERROR)
      return IOError("remote tier: deleting chunk " + k.ToString() + ": " +
                     std::string(c.reply->str, c.reply->len));
  }
  return Status::Ok();
}

Status RemoteTier::PutPublication(std::string_view name, const std::vector<std::string>& parts,
                                  std::string_view manifest) {
  if (!ValidNamespace(name))
    return InvalidArgument("remote tier: publication name '" + std::string(name) +
                           "' must be 1..128 letters, digits, '-', '_' or '.'");
  // One slot ({name}), so one connection: Redis runs them in order and the manifest,
  // last, becomes visible only after every part it names.
  std::vector<RedisCall> calls(parts.size() + 1);
  for (size_t i = 0; i <= parts.size(); ++i) {
    const std::string key =
        i < parts.size() ? PublicationPartKey(name, static_cast<uint32_t>(i)) : PublicationKey(name);
    const std::string_view body = i < parts.size() ? std::string_view(parts[i]) : manifest;
    calls[i].argv = {"SET", key, cold_tier_format::EncodeValue(ValueKind::kBlob, body, KeyTag(key))};
    calls[i].key = calls[i].argv[1];
  }
  client_->Execute(&calls, options_.wait_replicas, options_.wait_timeout_ms);
  for (const RedisCall& c : calls) {
    const std::string what = "remote tier: publishing '" + std::string(name) + "' (key '" + c.argv[1] + "')";
    if (!c.status.ok()) return Status(c.status.code(), what + ": " + c.status.message());
    if (c.reply->type == REDIS_REPLY_ERROR)
      return IOError(what + ": " + std::string(c.reply->str, c.reply->len));
  }
  return Status::Ok();
}

Result<std::string> RemoteTier::GetRecord(const std::string& key, const std::string& what) {
  std::vector<RedisCall> calls(1);
  calls[0].argv = {"GET", key};
  calls[0].key = calls[0].argv[1];
  client_->Execute(&calls);
  const RedisCall& c = calls[0];
  if (!c.status.ok())
    return Status(c.status.code(), "remote tier: reading " + what + ": " + c.status.message());
  if (c.reply->type == REDIS_REPLY_NIL) return NotFound("remote tier: " + what + " does not exist");
  if (c.reply->type != REDIS_REPLY_STRING)
    return IOError("remote tier: reading " + what + ": unexpected reply type " +
                   std::to_string(c.reply->type));
  std::string_view body;
  uint64_t aux = 0;
  KVTIER_RETURN_IF_ERROR(Reword(cold_tier_format::DecodeValue(std::string_view(c.reply->str, c.reply->len),
                                                              ValueKind::kBlob, what, &body, &aux)));
  if (aux != KeyTag(key))
    return Corruption("remote tier: " + what + " holds a value written under another key");
  return std::string(body);
}

Result<std::string> RemoteTier::GetManifest(std::string_view name) {
  const std::string key = PublicationKey(name);
  auto r = GetRecord(key, "publication '" + std::string(name) + "' (key '" + key + "')");
  if (!r.ok() && r.status().code() == StatusCode::kNotFound)
    return NotFound(r.status().message() + ": not published, or its publication is not complete yet");
  return r;
}

Result<std::string> RemoteTier::GetPublicationPart(std::string_view name, uint32_t index) {
  const std::string key = PublicationPartKey(name, index);
  return GetRecord(
      key, "publication '" + std::string(name) + "' part " + std::to_string(index) + " (key '" + key + "')");
}

}  // namespace kvtier
