#include "integration/tier_report.h"

#include <cstdio>

namespace kvtier {

namespace {
double Share(uint64_t part, uint64_t total) {
  return total ? 100.0 * static_cast<double>(part) / total : 0.0;
}
}  // namespace

std::string TierTrafficText(const StoreCounters& c, bool remote, const std::string& indent) {
  // hits + misses = chunks fetched; every miss was served by warm, cold or remote (or failed).
  const uint64_t fetched = c.hits + c.misses;
  char buf[512];
  std::snprintf(buf, sizeof(buf),
                "fetched chunks by tier: hot %.1f%%, warm %.1f%%, cold %.1f%%, remote %.1f%% (of %llu)\n",
                Share(c.hits, fetched), Share(c.warm_loads, fetched), Share(c.cold_loads, fetched),
                Share(c.remote_loads, fetched), static_cast<unsigned long long>(fetched));
  std::string out = indent + buf;
  if (remote) {
    std::snprintf(
        buf, sizeof(buf),
        "remote tier: %llu chunks put (%.1f MiB), %llu read back (%.1f MiB), %llu not found (evicted), "
        "%llu corrupt, %llu errors\n",
        static_cast<unsigned long long>(c.remote_puts), c.remote_put_bytes / 1048576.0,
        static_cast<unsigned long long>(c.remote_gets), c.remote_get_bytes / 1048576.0,
        static_cast<unsigned long long>(c.remote_not_found),
        static_cast<unsigned long long>(c.remote_corrupt), static_cast<unsigned long long>(c.remote_errors));
    out += indent + buf;
  }
  if (c.pin_waits > 0) {
    std::snprintf(buf, sizeof(buf),
                  "pin waits: %llu fetches waited for pinned hot slots (%.1f ms in all), %llu timed out\n",
                  static_cast<unsigned long long>(c.pin_waits), c.pin_wait_us / 1000.0,
                  static_cast<unsigned long long>(c.pin_wait_timeouts));
    out += indent + buf;
  }
  return out;
}

void WriteTierTrafficJson(JsonWriter* w, const StoreCounters& c) {
  const uint64_t fetched = c.hits + c.misses;
  w->BeginObject();
  w->Key("fetched_chunks").Uint(fetched);
  w->Key("hit_rate").BeginObject();
  w->Key("hot").Double(fetched ? static_cast<double>(c.hits) / fetched : 0.0);
  w->Key("warm").Double(fetched ? static_cast<double>(c.warm_loads) / fetched : 0.0);
  w->Key("cold").Double(fetched ? static_cast<double>(c.cold_loads) / fetched : 0.0);
  w->Key("remote").Double(fetched ? static_cast<double>(c.remote_loads) / fetched : 0.0);
  w->EndObject();
  w->Key("bytes").BeginObject();
  w->Key("remote_put").Uint(c.remote_put_bytes).Key("remote_get").Uint(c.remote_get_bytes);
  w->EndObject();
  w->Key("remote").BeginObject();
  w->Key("puts")
      .Uint(c.remote_puts)
      .Key("gets")
      .Uint(c.remote_gets)
      .Key("not_found")
      .Uint(c.remote_not_found);
  w->Key("corrupt").Uint(c.remote_corrupt).Key("errors").Uint(c.remote_errors);
  w->EndObject();
  w->Key("pins").BeginObject();
  w->Key("waits").Uint(c.pin_waits).Key("wait_us").Uint(c.pin_wait_us);
  w->Key("wait_timeouts").Uint(c.pin_wait_timeouts).Key("reserved_slots").Uint(c.hot_reserved);
  w->EndObject();
  w->EndObject();
}

}  // namespace kvtier
