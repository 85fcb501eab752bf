#include "offload/remote_tier.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>

#include "offload/value_framing.h"
#include "store/checksum.h"
#include "store/coding.h"

namespace kvtier {

namespace {

using value_framing::ValueKind;

bool ValidNamespace(std::string_view ns) {
  if (ns.empty() || ns.size() > 128) return false;
  for (char c : ns)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.')) return false;
  return true;
}

// Where the userinfo of a spec ends (its '@'), or npos: the last '@' before the first '?'.
// `lenient` also takes the first '@' past a '?' (a password holding a raw '?'), so that
// redaction hides too much rather than too little.
size_t UserinfoEnd(std::string_view spec, size_t start, bool lenient) {
  const size_t q = spec.find('?', start);
  const std::string_view before = spec.substr(0, q);
  const size_t at = before.rfind('@');
  if (at != std::string_view::npos && at >= start) return at;
  if (!lenient || q == std::string_view::npos) return std::string_view::npos;
  return spec.find('@', q);
}

size_t AuthorityStart(std::string_view spec) {
  const size_t s = spec.find("://");
  return s == std::string_view::npos ? 0 : s + 3;
}

// A query key whose value is a secret (the parser refuses them; redaction hides them anyway).
bool SecretKey(std::string_view k) {
  std::string l(k);
  for (char& c : l) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return l != "password_file" &&
         (l.find("pass") != std::string::npos || l.find("secret") != std::string::npos ||
          l.find("token") != std::string::npos);
}

// True when `piece` (a view into `spec`) overlaps what RedactRemoteSpec hides: a misparsed
// password (a raw '?' in it) must not come back quoted as a host or an option.
bool TouchesSecret(std::string_view spec, std::string_view piece) {
  if (piece.data() < spec.data() || piece.data() + piece.size() > spec.data() + spec.size()) return false;
  const size_t start = AuthorityStart(spec);
  const size_t at = UserinfoEnd(spec, start, true);
  if (at == std::string_view::npos) return false;
  const size_t colon = spec.find(':', start);
  if (colon >= at) return false;
  const size_t p0 = static_cast<size_t>(piece.data() - spec.data()), p1 = p0 + piece.size();
  return p0 < at && p1 > colon + 1;
}

// A piece of the spec for a message: quoted, or not shown when it may hold the password.
std::string Quote(std::string_view spec, std::string_view piece) {
  if (TouchesSecret(spec, piece)) return "(not shown: it may hold the password; a '?' in one is written %3F)";
  return "'" + std::string(piece) + "'";
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
  return InvalidArgument("remote spec '" + RedactRemoteSpec(spec) + "': " + std::string(field) + " " +
                         Quote(spec, text) + " is not a non-negative integer");
}

// %XX-decoding of a userinfo part; false on a malformed escape.
bool PercentDecode(std::string_view in, std::string* out) {
  out->clear();
  for (size_t i = 0; i < in.size(); ++i) {
    if (in[i] != '%') {
      out->push_back(in[i]);
      continue;
    }
    if (i + 2 >= in.size() || !std::isxdigit(static_cast<unsigned char>(in[i + 1])) ||
        !std::isxdigit(static_cast<unsigned char>(in[i + 2])))
      return false;
    out->push_back(static_cast<char>(std::stoi(std::string(in.substr(i + 1, 2)), nullptr, 16)));
    i += 2;
  }
  return true;
}

// The framed value's `what` and its messages say "remote tier", not the cold tier's words.
Status Reword(Status st) {
  if (st.ok()) return st;
  std::string m = st.message();
  if (m.rfind("cold tier: ", 0) == 0) m = "remote tier: " + m.substr(11);
  return Status(st.code(), m);
}

uint64_t KeyTag(std::string_view key) { return Crc32c(key.data(), key.size()); }

// The framed value of a chunk (offload/value_framing.h, body = u32 meta
// length, meta, payload) built in one buffer: the payload is copied once, not three times
// (body, value, argv), which is most of a put's CPU next to the socket write.
std::string FrameChunk(const std::string& key, std::string_view meta, const void* payload,
                       size_t payload_bytes) {
  constexpr size_t H = value_framing::kValueHeaderBytes;
  const size_t body = 4 + meta.size() + payload_bytes;
  std::string v(H + body, '\0');
  char* p = v.data();
  EncodeFixed32(p + H, static_cast<uint32_t>(meta.size()));
  std::memcpy(p + H + 4, meta.data(), meta.size());
  std::memcpy(p + H + 4 + meta.size(), payload, payload_bytes);
  value_framing::EncodeHeader(p, ValueKind::kPayload, p + H, body, KeyTag(key));
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
  co.user = user;
  co.password = password;
  Status st = co.Validate();
  if (!st.ok()) return Status(st.code(), "remote tier: " + st.message());
  return Status::Ok();
}

std::string RedactRemoteSpec(std::string_view spec) {
  // First the values of secret-looking query keys, wherever a '?' or '&' starts one (also
  // past an '@' that a misparse might take for the userinfo's end).
  std::string s;
  for (size_t i = 0; i < spec.size();) {
    s += spec[i];
    if (spec[i] == '?' || spec[i] == '&') {
      const size_t eq = spec.find('=', i + 1), end = spec.find('&', i + 1);
      if (eq != std::string_view::npos && eq < end && SecretKey(spec.substr(i + 1, eq - i - 1))) {
        s += std::string(spec.substr(i + 1, eq - i)) + "***";
        i = end == std::string_view::npos ? spec.size() : end;
        continue;
      }
    }
    ++i;
  }
  // Then the userinfo's password.
  const size_t start = AuthorityStart(s);
  if (const size_t at = UserinfoEnd(s, start, true); at != std::string::npos) {
    const size_t colon = s.find(':', start);
    if (colon < at) s = s.substr(0, colon + 1) + "***" + s.substr(at);
  }
  return s;
}

Result<RemoteTierOptions> ParseRemoteSpec(std::string_view spec) {
  const std::string_view scheme = "redis://";
  auto bad = [&](const std::string& why) {
    return InvalidArgument(
        "remote spec '" + RedactRemoteSpec(spec) + "': " + why +
        " (expected redis://[USER:PASSWORD@]host:port[,host:port...][?wait=N&timeout_ms=N&...])");
  };
  if (spec.substr(0, scheme.size()) != scheme) return bad("must start with redis://");
  std::string_view rest = spec.substr(scheme.size());
  RemoteTierOptions o;
  bool userinfo_password = false;
  if (const size_t at = UserinfoEnd(rest, 0, false); at != std::string_view::npos) {
    const std::string_view info = rest.substr(0, at);
    rest = rest.substr(at + 1);
    const size_t colon = info.find(':');
    if (!PercentDecode(info.substr(0, colon), &o.user)) return bad("the user name has a malformed %-escape");
    if (colon != std::string_view::npos) {
      if (!PercentDecode(info.substr(colon + 1), &o.password))
        return bad("the password has a malformed %-escape");
      if (o.password.empty()) return bad("the userinfo's password is empty");
      userinfo_password = true;
    }
  }
  std::string_view query;
  if (const size_t q = rest.find('?'); q != std::string_view::npos) {
    query = rest.substr(q + 1);
    rest = rest.substr(0, q);
  }
  while (!rest.empty()) {
    const size_t comma = rest.find(',');
    const std::string_view item = rest.substr(0, comma);
    rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
    if (comma != std::string_view::npos && rest.empty()) return bad("trailing ','");
    if (item.empty()) return bad("empty host:port");
    std::string_view host, port_text;
    if (item.front() == '[') {
      // [IPv6 address]:port
      const size_t close = item.find(']');
      if (close == std::string_view::npos || close == 1 || close + 1 >= item.size() || item[close + 1] != ':')
        return bad(Quote(spec, item) + " is not [IPv6 address]:port");
      host = item.substr(1, close - 1);
      port_text = item.substr(close + 2);
    } else {
      const size_t colon = item.rfind(':');
      if (colon == std::string_view::npos || colon == 0) return bad(Quote(spec, item) + " is not host:port");
      host = item.substr(0, colon);
      if (host.find(':') != std::string_view::npos)
        return bad(Quote(spec, item) + " is not host:port (an IPv6 address goes in brackets: [::1]:6379)");
      port_text = item.substr(colon + 1);
    }
    KVTIER_ASSIGN_OR_RETURN(int port, ParseInt(spec, "port", port_text));
    if (port < 1 || port > 65535) return bad("port " + std::to_string(port) + " is outside 1..65535");
    o.endpoints.push_back(RedisEndpoint{std::string(host), port});
  }
  if (o.endpoints.empty()) return bad("no host:port");
  std::vector<std::string> seen;
  std::string password_file;
  while (!query.empty()) {
    const size_t amp = query.find('&');
    const std::string_view kv = query.substr(0, amp);
    query = amp == std::string_view::npos ? std::string_view() : query.substr(amp + 1);
    const size_t eq = kv.find('=');
    if (eq == std::string_view::npos) return bad("option " + Quote(spec, kv) + " is not key=value");
    const std::string_view k = kv.substr(0, eq), v = kv.substr(eq + 1);
    if (SecretKey(k))
      return bad("option " + Quote(spec, k) +
                 ": a password is not taken from the query (query strings end up in logs); give it in the "
                 "userinfo (redis://:PASSWORD@host:port), in password_file=PATH or in KVTIER_REDIS_PASSWORD");
    if (std::find(seen.begin(), seen.end(), k) != seen.end())
      return bad("option " + Quote(spec, k) + " is given twice");
    seen.emplace_back(k);
    if (k == "ns") {
      o.ns = std::string(v);
      continue;
    }
    if (k == "password_file") {
      if (v.empty()) return bad("password_file is empty");
      password_file = std::string(v);
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
      return bad("unknown option " + Quote(spec, k) +
                 " (known: wait, wait_timeout_ms, timeout_ms, connect_timeout_ms, retry_ms, pool, ns, "
                 "password_file)");
    KVTIER_ASSIGN_OR_RETURN(*field, ParseInt(spec, k, v));
    if (k == "pool" && (o.pool_size < 1 || o.pool_size > RedisClientOptions::kMaxPoolSize))
      return bad("option 'pool' is " + std::to_string(o.pool_size) + ", outside 1.." +
                 std::to_string(RedisClientOptions::kMaxPoolSize) + " (idle connections kept per node)");
  }
  if (!password_file.empty()) {
    if (userinfo_password) return bad("a password in the userinfo and a password_file: give one");
    std::ifstream f(password_file, std::ios::binary);
    if (!f) return bad("password_file '" + password_file + "' cannot be read: " + std::strerror(errno));
    std::string pw((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    if (f.bad()) return bad("password_file '" + password_file + "' cannot be read: " + std::strerror(errno));
    if (!pw.empty() && pw.back() == '\n') pw.pop_back();
    if (!pw.empty() && pw.back() == '\r') pw.pop_back();
    if (pw.empty()) return bad("password_file '" + password_file + "' holds no password");
    if (pw.find('\n') != std::string::npos)
      return bad("password_file '" + password_file + "' holds more than one line");
    o.password = std::move(pw);
  } else if (!userinfo_password) {
    if (const char* env = std::getenv("KVTIER_REDIS_PASSWORD"); env != nullptr && env[0] != '\0')
      o.password = env;
  }
  if (o.user.empty())
    if (const char* env = std::getenv("KVTIER_REDIS_USER"); env != nullptr && env[0] != '\0') o.user = env;
  if (!o.user.empty() && o.password.empty())
    return bad("user '" + o.user +
               "' has no password (give it in the userinfo, password_file=PATH or KVTIER_REDIS_PASSWORD)");
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
  co.user = options.user;
  co.password = options.password;
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
    std::string meta = value_framing::EncodeValue(ValueKind::kMeta, p.meta, KeyTag(meta_key));
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

Status RemoteTier::ReplyBody(const RedisCall& c, value_framing::ValueKind kind, const std::string& what,
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
                  ? Reword(value_framing::DecodeValue(std::string_view(c.reply->str, c.reply->len), kind,
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
    calls[i].argv = {"SET", key, value_framing::EncodeValue(ValueKind::kBlob, body, KeyTag(key))};
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
  KVTIER_RETURN_IF_ERROR(Reword(value_framing::DecodeValue(std::string_view(c.reply->str, c.reply->len),
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
