#include "offload/redis_client.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <set>
#include <thread>

namespace kvtier {

namespace {

constexpr int kSlots = 16384;

uint16_t Crc16Xmodem(const char* p, size_t n) {
  uint16_t crc = 0;
  for (size_t i = 0; i < n; ++i) {
    crc ^= static_cast<uint16_t>(static_cast<uint8_t>(p[i])) << 8;
    for (int b = 0; b < 8; ++b)
      crc = (crc & 0x8000) ? static_cast<uint16_t>((crc << 1) ^ 0x1021) : static_cast<uint16_t>(crc << 1);
  }
  return crc;
}

timeval Millis(int ms) {
  timeval tv;
  tv.tv_sec = ms / 1000;
  tv.tv_usec = (ms % 1000) * 1000;
  return tv;
}

// hiredis reports a socket timeout as an I/O error with errno's text; keep the two apart,
// since a slow node and a dead one call for different reactions from an operator.
bool IsTimeout(const redisContext* c) {
  return c->err == REDIS_ERR_IO && (std::strstr(c->errstr, "temporarily unavailable") != nullptr ||
                                    std::strstr(c->errstr, "timed out") != nullptr);
}

Status ConnectionError(const redisContext* c, const RedisEndpoint& ep, const char* during) {
  const std::string msg = std::string("redis ") + ep.ToString() + ": " + during + ": " +
                          (c->errstr[0] ? c->errstr : "connection closed");
  return IsTimeout(c) ? TimedOut(msg) : Unavailable(msg);
}

bool StartsWith(std::string_view s, std::string_view p) { return s.substr(0, p.size()) == p; }

// A reply that refuses the credentials or the user's rights: final, retrying cannot help.
bool IsAuthError(std::string_view e) {
  return StartsWith(e, "NOAUTH") || StartsWith(e, "WRONGPASS") || StartsWith(e, "NOPERM") ||
         StartsWith(e, "ERR AUTH") || StartsWith(e, "ERR invalid password") ||
         StartsWith(e, "ERR Client sent AUTH");
}

// The server's words only: they never hold the password.
Status AuthError(const RedisEndpoint& ep, std::string_view e) {
  std::string m = "redis " + ep.ToString() + ": " + std::string(e);
  if (e.find("NOAUTH") != std::string_view::npos)
    m += " (the server wants a password: give one in the remote spec's userinfo, password_file= or "
         "KVTIER_REDIS_PASSWORD)";
  return PermissionDenied(std::move(m));
}

// "MOVED 3999 127.0.0.1:6381" / "ASK 3999 127.0.0.1:6381" -> slot, endpoint.
bool ParseRedirect(std::string_view e, int* slot, RedisEndpoint* ep) {
  const size_t a = e.find(' ');
  const size_t b = e.find(' ', a + 1);
  if (a == std::string_view::npos || b == std::string_view::npos) return false;
  const std::string slot_s(e.substr(a + 1, b - a - 1));
  const std::string addr(e.substr(b + 1));
  const size_t colon = addr.rfind(':');
  if (colon == std::string::npos) return false;
  try {
    *slot = std::stoi(slot_s);
    ep->port = std::stoi(addr.substr(colon + 1));
  } catch (...) {
    return false;
  }
  ep->host = addr.substr(0, colon);
  return *slot >= 0 && *slot < kSlots;
}

}  // namespace

uint16_t RedisKeySlot(std::string_view key) {
  // Redis hashes only the part between the first '{' and the next '}' when it is not empty.
  const size_t open = key.find('{');
  if (open != std::string_view::npos) {
    const size_t close = key.find('}', open + 1);
    if (close != std::string_view::npos && close > open + 1) key = key.substr(open + 1, close - open - 1);
  }
  return Crc16Xmodem(key.data(), key.size()) % kSlots;
}

Status RedisClientOptions::Validate() const {
  if (seeds.empty()) return InvalidArgument("redis: seeds must name at least one host:port");
  for (const RedisEndpoint& ep : seeds) {
    if (ep.host.empty()) return InvalidArgument("redis: seed host must not be empty");
    if (ep.port <= 0 || ep.port > 65535)
      return InvalidArgument("redis: seed port must be in 1..65535 (got " + std::to_string(ep.port) + ")");
  }
  if (connect_timeout_ms <= 0)
    return InvalidArgument("redis: connect_timeout_ms must be > 0 (got " +
                           std::to_string(connect_timeout_ms) + ")");
  if (command_timeout_ms <= 0)
    return InvalidArgument("redis: command_timeout_ms must be > 0 (got " +
                           std::to_string(command_timeout_ms) + ")");
  if (retry_ms < 0)
    return InvalidArgument("redis: retry_ms must be >= 0 (got " + std::to_string(retry_ms) + ")");
  if (pool_size < 1 || pool_size > kMaxPoolSize)
    return InvalidArgument("redis: pool_size must be in 1.." + std::to_string(kMaxPoolSize) + " (got " +
                           std::to_string(pool_size) + ")");
  if (password.empty() && !user.empty()) return InvalidArgument("redis: user '" + user + "' has no password");
  return Status::Ok();
}

struct RedisClient::Node {
  using Clock = RedisClient::Clock;
  RedisEndpoint endpoint;
  std::vector<redisContext*> idle;  // pooled connections, guarded by RedisClient::mu_
  // The node's retry window, guarded by RedisClient::mu_ (see the header): open from the
  // first failed attempt until an answer or retry_ms later, then down until down_until.
  bool failing = false;
  Clock::time_point failing_since;
  Status first_error;  // of the open window
  bool down = false;
  Clock::time_point down_until;
  Status down_status;    // what every command gets while down
  bool probing = false;  // out of its down window, not answered yet: one failure and it is down again
};

RedisClient::RedisClient(const RedisClientOptions& options) : options_(options) {}

RedisClient::~RedisClient() {
  for (auto& n : nodes_)
    for (redisContext* c : n->idle) redisFree(c);
}

Result<redisContext*> RedisClient::Dial(const RedisEndpoint& ep) const {
  redisContext* c = redisConnectWithTimeout(ep.host.c_str(), ep.port, Millis(options_.connect_timeout_ms));
  if (c == nullptr) return ResourceExhausted("redis " + ep.ToString() + ": cannot allocate a connection");
  if (c->err) {
    Status st = ConnectionError(c, ep, "connect");
    redisFree(c);
    return st;
  }
  if (redisSetTimeout(c, Millis(options_.command_timeout_ms)) != REDIS_OK) {
    Status st = ConnectionError(c, ep, "setting the command timeout");
    redisFree(c);
    return st;
  }
  if (!options_.password.empty()) {
    const std::string& u = options_.user;
    const std::string& p = options_.password;
    RedisReplyPtr r(static_cast<redisReply*>(
        u.empty() ? redisCommand(c, "AUTH %b", p.data(), p.size())
                  : redisCommand(c, "AUTH %b %b", u.data(), u.size(), p.data(), p.size())));
    Status st;
    if (!r)
      st = ConnectionError(c, ep, "AUTH");
    else if (r->type == REDIS_REPLY_ERROR)
      st = AuthError(ep, (u.empty() ? "AUTH refused: " : "AUTH as user '" + u + "' refused: ") +
                             std::string(r->str, r->len));
    if (!st.ok()) {
      redisFree(c);
      return st;
    }
  }
  return c;
}

int RedisClient::NodeIndexLocked(const RedisEndpoint& ep) {
  for (size_t i = 0; i < nodes_.size(); ++i)
    if (nodes_[i]->endpoint == ep) return static_cast<int>(i);
  auto n = std::make_unique<Node>();
  n->endpoint = ep;
  nodes_.push_back(std::move(n));
  return static_cast<int>(nodes_.size() - 1);
}

RedisClient::Clock::time_point RedisClient::OutageStartLocked() const {
  const auto now = Clock::now();
  auto start = now;
  for (const auto& n : nodes_)
    if (n->failing || (n->down && now < n->down_until)) start = std::min(start, n->failing_since);
  return start;
}

void RedisClient::NodeFailedLocked(int node, const Status& error, std::optional<Clock::time_point> since) {
  Node& n = *nodes_[node];
  if (n.failing || n.down) return;
  n.failing = true;
  n.failing_since = since ? *since : Node::Clock::now();
  n.first_error = error;
  // A node tried again after its down window waited its one window already: down again at
  // once, or a queue spread over several dead nodes would wait a window per node and retry.
  if (n.probing) MarkDownLocked(node);
}

void RedisClient::NodeAnsweredLocked(int node) {
  Node& n = *nodes_[node];
  n.failing = false;
  n.down = false;
  n.probing = false;
}

void RedisClient::MarkDownLocked(int node) {
  Node& n = *nodes_[node];
  if (n.down || !n.failing) return;
  const std::string r = std::to_string(options_.retry_ms);
  n.down = true;
  n.down_until = Node::Clock::now() + std::chrono::milliseconds(options_.retry_ms);
  n.down_status = Unavailable("redis " + n.endpoint.ToString() + ": down, no answer for retry_ms (" + r +
                              " ms) since its first error (" + n.first_error.message() +
                              "); every command to it fails at once for the next " + r + " ms");
  n.failing = false;
  n.probing = false;
}

Status RedisClient::NodeDownLocked(int node) {
  Node& n = *nodes_[node];
  const auto now = Node::Clock::now();
  if (n.failing && now >= n.failing_since + std::chrono::milliseconds(options_.retry_ms))
    MarkDownLocked(node);
  if (!n.down) return Status::Ok();
  if (now < n.down_until) return n.down_status;
  // The down window is over: the next attempt may reconnect. It does not wait another retry
  // window if it fails: one failed attempt and the node is down again.
  n.down = false;
  n.probing = true;
  return Status::Ok();
}

namespace {
// Parses a CLUSTER SLOTS reply into (start, end, master endpoint) ranges. `asked` fills in
// an empty host (a node that does not know its own address answers "").
bool ParseClusterSlots(const redisReply* r, const RedisEndpoint& asked,
                       std::vector<std::tuple<int, int, RedisEndpoint>>* out) {
  if (r->type != REDIS_REPLY_ARRAY) return false;
  for (size_t i = 0; i < r->elements; ++i) {
    const redisReply* e = r->element[i];
    if (e->type != REDIS_REPLY_ARRAY || e->elements < 3 || e->element[0]->type != REDIS_REPLY_INTEGER ||
        e->element[1]->type != REDIS_REPLY_INTEGER || e->element[2]->type != REDIS_REPLY_ARRAY ||
        e->element[2]->elements < 2)
      return false;
    const redisReply* m = e->element[2];
    if (m->element[0]->type != REDIS_REPLY_STRING || m->element[1]->type != REDIS_REPLY_INTEGER) return false;
    RedisEndpoint ep{std::string(m->element[0]->str, m->element[0]->len),
                     static_cast<int>(m->element[1]->integer)};
    if (ep.host.empty() || ep.host == "?") ep.host = asked.host;
    const int lo = static_cast<int>(e->element[0]->integer), hi = static_cast<int>(e->element[1]->integer);
    if (lo < 0 || hi >= kSlots || lo > hi) return false;
    out->emplace_back(lo, hi, ep);
  }
  return true;
}
}  // namespace

Result<std::unique_ptr<RedisClient>> RedisClient::Connect(const RedisClientOptions& options) {
  KVTIER_RETURN_IF_ERROR(options.Validate());
  auto client = std::unique_ptr<RedisClient>(new RedisClient(options));
  client->slots_.assign(kSlots, -1);
  std::string tried;
  for (const RedisEndpoint& seed : options.seeds) {
    auto dial = client->Dial(seed);
    if (!dial.ok()) {
      // Every seed has the same credentials: a refusal is the answer, not a dead seed.
      if (dial.status().code() == StatusCode::kPermissionDenied) return dial.status();
      tried += (tried.empty() ? "" : "; ") + dial.status().message();
      continue;
    }
    redisContext* c = *dial;
    RedisReplyPtr r(static_cast<redisReply*>(redisCommand(c, "CLUSTER SLOTS")));
    if (!r) {
      tried += (tried.empty() ? "" : "; ") + ConnectionError(c, seed, "CLUSTER SLOTS").message();
      redisFree(c);
      continue;
    }
    if (r->type == REDIS_REPLY_ERROR) {
      const std::string e(r->str, r->len);
      if (IsAuthError(e)) {
        redisFree(c);
        return AuthError(seed, "CLUSTER SLOTS refused: " + e);
      }
      if (e.find("cluster support disabled") == std::string::npos) {
        redisFree(c);
        return Unavailable("redis " + seed.ToString() + ": CLUSTER SLOTS failed: " + e);
      }
      // A single server: every key lives on it.
      client->cluster_ = false;
      std::lock_guard<std::mutex> l(client->mu_);
      const int idx = client->NodeIndexLocked(seed);
      client->slots_.assign(kSlots, idx);
      client->nodes_[idx]->idle.push_back(c);
      return client;
    }
    std::vector<std::tuple<int, int, RedisEndpoint>> ranges;
    const bool parsed = ParseClusterSlots(r.get(), seed, &ranges);
    redisFree(c);
    if (!parsed) return Unavailable("redis " + seed.ToString() + ": unexpected CLUSTER SLOTS reply");
    if (ranges.empty())
      return Unavailable("redis " + seed.ToString() +
                         ": the cluster has no slots assigned (not created yet?)");
    client->cluster_ = true;
    std::lock_guard<std::mutex> l(client->mu_);
    for (auto& [lo, hi, ep] : ranges) {
      const int idx = client->NodeIndexLocked(ep);
      for (int s = lo; s <= hi; ++s) client->slots_[s] = idx;
    }
    return client;
  }
  return Unavailable("redis: no seed answered (" + tried + ")");
}

bool RedisClient::RefreshSlots() {
  if (!cluster_) return true;
  std::lock_guard<std::mutex> refresh(refresh_mu_);
  std::vector<RedisEndpoint> candidates;
  {
    std::lock_guard<std::mutex> l(mu_);
    for (auto& n : nodes_) candidates.push_back(n->endpoint);
  }
  const size_t known = candidates.size();  // candidates[i] is nodes_[i] for i < known
  for (const RedisEndpoint& s : options_.seeds)
    if (std::find(candidates.begin(), candidates.end(), s) == candidates.end()) candidates.push_back(s);
  for (size_t i = 0; i < candidates.size(); ++i) {
    const RedisEndpoint& ep = candidates[i];
    auto dial = Dial(ep);
    if (!dial.ok()) {
      // A node that cannot be reached now has failed an attempt: its window opens now, not
      // when a batch first reaches it, so masters that died together (the whole cluster
      // down for good) are named one retry window after the first failure, not one each.
      if (i < known && dial.status().code() != StatusCode::kPermissionDenied) {
        std::lock_guard<std::mutex> l(mu_);
        NodeFailedLocked(static_cast<int>(i), dial.status());
      }
      continue;
    }
    RedisReplyPtr r(static_cast<redisReply*>(redisCommand(*dial, "CLUSTER SLOTS")));
    redisFree(*dial);
    std::vector<std::tuple<int, int, RedisEndpoint>> ranges;
    if (!r || !ParseClusterSlots(r.get(), ep, &ranges) || ranges.empty()) continue;
    std::lock_guard<std::mutex> l(mu_);
    for (auto& [lo, hi, mep] : ranges) {
      const int idx = NodeIndexLocked(mep);
      for (int s = lo; s <= hi; ++s) slots_[s] = idx;
    }
    return true;
  }
  return false;
}

std::vector<RedisEndpoint> RedisClient::Masters() const {
  std::lock_guard<std::mutex> l(mu_);
  std::set<int> used(slots_.begin(), slots_.end());
  std::vector<RedisEndpoint> out;
  for (int i : used)
    if (i >= 0) out.push_back(nodes_[i]->endpoint);
  return out;
}

redisContext* RedisClient::TakeConnection(int node, Status* error) {
  RedisEndpoint ep;
  {
    std::lock_guard<std::mutex> l(mu_);
    Node& n = *nodes_[node];
    if (!n.idle.empty()) {
      redisContext* c = n.idle.back();
      n.idle.pop_back();
      return c;
    }
    ep = n.endpoint;
  }
  auto dial = Dial(ep);  // outside the lock: a connect may take connect_timeout_ms
  if (!dial.ok()) {
    *error = dial.status();
    return nullptr;
  }
  return *dial;
}

void RedisClient::GiveBack(int node, redisContext* c) {
  {
    std::lock_guard<std::mutex> l(mu_);
    Node& n = *nodes_[node];
    if (static_cast<int>(n.idle.size()) < options_.pool_size) {
      n.idle.push_back(c);
      return;
    }
  }
  redisFree(c);
}

void RedisClient::Execute(std::vector<RedisCall>* calls, int wait_replicas, int wait_timeout_ms) {
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + std::chrono::milliseconds(options_.retry_ms);
  std::vector<size_t> pending(calls->size());
  for (size_t i = 0; i < calls->size(); ++i) {
    pending[i] = i;
    (*calls)[i].reply.reset();
    (*calls)[i].status = Status::Ok();
  }
  std::vector<int> ask_node(calls->size(), -1);  // the node an ASK redirect named, for one retry
  const std::string wait_n = std::to_string(wait_replicas), wait_ms = std::to_string(wait_timeout_ms);
  int backoff_ms = 20;
  while (!pending.empty()) {
    struct Batch {
      int node = -1;
      RedisEndpoint endpoint;
      redisContext* ctx = nullptr;
      std::vector<size_t> calls;
    };
    std::vector<Batch> batches;
    std::vector<size_t> retry;
    std::vector<int> failed_nodes;  // nodes that failed an attempt in this round
    Status cluster_down;            // a CLUSTERDOWN reply in this round: the whole cluster failed
    bool need_refresh = false, need_pause = false;
    {
      std::lock_guard<std::mutex> l(mu_);
      std::map<int, size_t> batch_of;
      for (size_t i : pending) {
        RedisCall& call = (*calls)[i];
        const int node = ask_node[i] >= 0 ? ask_node[i] : slots_[RedisKeySlot(call.key)];
        if (node < 0) {
          call.status = Unavailable("redis: no master serves slot " + std::to_string(RedisKeySlot(call.key)));
          retry.push_back(i);
          need_refresh = need_pause = true;
          continue;
        }
        if (Status down = NodeDownLocked(node); !down.ok()) {
          call.status = std::move(down);  // final: no retry, no I/O
          ask_node[i] = -1;
          continue;
        }
        auto [it, fresh] = batch_of.emplace(node, batches.size());
        if (fresh) {
          batches.emplace_back();
          batches.back().node = node;
          batches.back().endpoint = nodes_[node]->endpoint;
        }
        batches[it->second].calls.push_back(i);
      }
    }
    // Send every node's pipeline before reading any reply: the nodes work in parallel.
    for (Batch& b : batches) {
      Status err;
      b.ctx = TakeConnection(b.node, &err);
      if (b.ctx != nullptr) {
        for (size_t i : b.calls) {
          const RedisCall& call = (*calls)[i];
          if (ask_node[i] >= 0) redisAppendCommand(b.ctx, "ASKING");
          std::vector<const char*> argv;
          std::vector<size_t> lens;
          for (const std::string& a : call.argv) {
            argv.push_back(a.data());
            lens.push_back(a.size());
          }
          redisAppendCommandArgv(b.ctx, static_cast<int>(argv.size()), argv.data(), lens.data());
        }
        if (wait_replicas > 0) redisAppendCommand(b.ctx, "WAIT %s %s", wait_n.c_str(), wait_ms.c_str());
        int done = 0;
        while (!done && b.ctx != nullptr) {
          if (redisBufferWrite(b.ctx, &done) == REDIS_ERR) {
            err = ConnectionError(b.ctx, b.endpoint, "sending");
            redisFree(b.ctx);
            b.ctx = nullptr;
          }
        }
      }
      if (b.ctx == nullptr && err.code() == StatusCode::kPermissionDenied) {
        // The node answered and refused the credentials: final, and the node is not failing.
        for (size_t i : b.calls) {
          (*calls)[i].status = err;
          ask_node[i] = -1;
        }
      } else if (b.ctx == nullptr) {
        for (size_t i : b.calls) {
          (*calls)[i].status = err;
          retry.push_back(i);
        }
        need_refresh = need_pause = true;
        std::lock_guard<std::mutex> l(mu_);
        NodeFailedLocked(b.node, err);
        failed_nodes.push_back(b.node);
      }
    }
    for (Batch& b : batches) {
      if (b.ctx == nullptr) continue;
      std::vector<size_t> answered;  // calls of this batch with a final reply
      size_t k = 0;
      Status conn_err, transient;  // transient: a CLUSTERDOWN-like reply of this node
      for (; k < b.calls.size(); ++k) {
        const size_t i = b.calls[k];
        RedisCall& call = (*calls)[i];
        void* raw = nullptr;
        if (ask_node[i] >= 0) {
          if (redisGetReply(b.ctx, &raw) != REDIS_OK) break;
          freeReplyObject(raw);
          raw = nullptr;
          ask_node[i] = -1;
        }
        if (redisGetReply(b.ctx, &raw) != REDIS_OK) break;
        RedisReplyPtr r(static_cast<redisReply*>(raw));
        if (r->type == REDIS_REPLY_ERROR) {
          const std::string_view e(r->str, r->len);
          int slot = 0;
          RedisEndpoint ep;
          if (StartsWith(e, "MOVED ") && ParseRedirect(e, &slot, &ep)) {
            std::lock_guard<std::mutex> l(mu_);
            slots_[slot] = NodeIndexLocked(ep);
            need_refresh = true;  // one moved slot usually means the map changed more widely
            call.status = Unavailable("redis: " + std::string(e));
            retry.push_back(i);
            continue;
          }
          if (StartsWith(e, "ASK ") && ParseRedirect(e, &slot, &ep)) {
            std::lock_guard<std::mutex> l(mu_);
            ask_node[i] = NodeIndexLocked(ep);
            call.status = Unavailable("redis: " + std::string(e));
            retry.push_back(i);
            continue;
          }
          if (IsAuthError(e)) {
            call.status = AuthError(b.endpoint, e);  // final: no retry, not waited for
            continue;
          }
          if (StartsWith(e, "TRYAGAIN") || StartsWith(e, "CLUSTERDOWN") || StartsWith(e, "LOADING") ||
              StartsWith(e, "MASTERDOWN") || StartsWith(e, "READONLY")) {
            // Transient while a cluster heals or a replica takes over: retry after a pause.
            call.status = Unavailable("redis " + b.endpoint.ToString() + ": " + std::string(e));
            if (transient.ok()) transient = call.status;
            if (StartsWith(e, "CLUSTERDOWN") && cluster_down.ok()) cluster_down = call.status;
            retry.push_back(i);
            need_refresh = need_pause = true;
            continue;
          }
        }
        call.reply = std::move(r);
        call.status = Status::Ok();  // an earlier attempt's error no longer applies
        answered.push_back(i);
      }
      if (k < b.calls.size()) {
        conn_err = ConnectionError(b.ctx, b.endpoint, "reading a reply");
        for (; k < b.calls.size(); ++k) {
          (*calls)[b.calls[k]].status = conn_err;
          retry.push_back(b.calls[k]);
        }
        redisFree(b.ctx);
        b.ctx = nullptr;
        need_refresh = need_pause = true;
        {
          std::lock_guard<std::mutex> l(mu_);
          NodeFailedLocked(b.node, conn_err);
          failed_nodes.push_back(b.node);
        }
        // Replies already read stand: a write that answered OK but lacks its WAIT is retried below.
        if (wait_replicas > 0)
          for (size_t i : answered) {
            (*calls)[i].reply.reset();
            (*calls)[i].status = conn_err;
            retry.push_back(i);
          }
        continue;
      }
      if (wait_replicas > 0) {
        void* raw = nullptr;
        if (redisGetReply(b.ctx, &raw) != REDIS_OK) {
          conn_err = ConnectionError(b.ctx, b.endpoint, "reading the WAIT reply");
          redisFree(b.ctx);
          b.ctx = nullptr;
          for (size_t i : answered) {
            (*calls)[i].reply.reset();
            (*calls)[i].status = conn_err;
            retry.push_back(i);
          }
          need_refresh = need_pause = true;
          std::lock_guard<std::mutex> l(mu_);
          NodeFailedLocked(b.node, conn_err);
          failed_nodes.push_back(b.node);
          continue;
        }
        RedisReplyPtr w(static_cast<redisReply*>(raw));
        const long long acked = w->type == REDIS_REPLY_INTEGER ? w->integer : -1;
        if (w->type == REDIS_REPLY_ERROR && IsAuthError(std::string_view(w->str, w->len))) {
          // The user may write but not WAIT (an ACL denial): not acknowledged, and final.
          const Status st = AuthError(b.endpoint, "WAIT refused: " + std::string(w->str, w->len));
          for (size_t i : answered) {
            (*calls)[i].reply.reset();
            (*calls)[i].status = st;
          }
        } else if (acked < wait_replicas) {
          // Not on enough replicas: a failover now could lose it. Not acknowledged; retried.
          const Status st = Unavailable("redis " + b.endpoint.ToString() + ": write reached " +
                                        std::to_string(std::max(0LL, acked)) + " of " + wait_n +
                                        " replicas within " + wait_ms + " ms (WAIT)");
          for (size_t i : answered) {
            (*calls)[i].reply.reset();
            (*calls)[i].status = st;
            retry.push_back(i);
          }
          need_refresh = need_pause = true;
          if (transient.ok()) transient = st;
        }
      }
      {
        std::lock_guard<std::mutex> l(mu_);
        if (!cluster_down.ok()) {
          // cluster_state:fail is the whole remote failing, not one node, and it is the
          // outage that began with the first node that failed (the cluster says so only
          // cluster-node-timeout later): every node's window opens at that first failure,
          // so a queue spread over the masters waits one window in all, not one per master
          // as each is reached in turn, nor a second one for the masters still answering.
          const auto since = OutageStartLocked();
          for (int n = 0; n < static_cast<int>(nodes_.size()); ++n) {
            NodeFailedLocked(n, cluster_down, since);
            failed_nodes.push_back(n);
          }
        } else if (transient.ok()) {
          NodeAnsweredLocked(b.node);
        } else {
          NodeFailedLocked(b.node, transient);
          failed_nodes.push_back(b.node);
        }
      }
      GiveBack(b.node, b.ctx);
      b.ctx = nullptr;
    }
    if (retry.empty()) break;
    if (Clock::now() >= deadline) {
      // The calls keep their last error; the nodes that made this batch wait retry_ms are
      // down now, so the batches queued behind it fail at once instead of waiting again.
      std::lock_guard<std::mutex> l(mu_);
      for (int node : failed_nodes) MarkDownLocked(node);
      break;
    }
    if (need_pause) {
      // Not past the batch's deadline: a node's window may end sooner, and the round that
      // finds it ended fails its calls at once (see the routing above).
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      std::this_thread::sleep_for(std::min(std::chrono::milliseconds(backoff_ms), left));
      backoff_ms = std::min(backoff_ms * 2, 500);
    }
    if (need_refresh) RefreshSlots();
    std::sort(retry.begin(), retry.end());
    retry.erase(std::unique(retry.begin(), retry.end()), retry.end());
    pending = std::move(retry);
  }
}

}  // namespace kvtier
