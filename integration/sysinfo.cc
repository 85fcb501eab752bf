#include "integration/sysinfo.h"

#include <chrono>
#include <cstdio>
#include <cstring>

namespace kvtier {
namespace {

// Reads "<field>:   <n> kB" from /proc/self/status; 0 when absent.
uint64_t StatusKb(const char* field) {
  std::FILE* f = std::fopen("/proc/self/status", "r");
  if (!f) return 0;
  char line[256];
  const size_t len = std::strlen(field);
  uint64_t kb = 0;
  while (std::fgets(line, sizeof line, f)) {
    if (std::strncmp(line, field, len) == 0 && line[len] == ':') {
      unsigned long long v = 0;
      if (std::sscanf(line + len + 1, "%llu", &v) == 1) kb = v;
      break;
    }
  }
  std::fclose(f);
  return kb;
}

}  // namespace

uint64_t PeakRssBytes() { return StatusKb("VmHWM") * 1024; }

uint64_t CurrentRssBytes() { return StatusKb("VmRSS") * 1024; }

bool ResetPeakRss() {
  std::FILE* f = std::fopen("/proc/self/clear_refs", "w");
  if (!f) return false;
  const bool wrote = std::fputs("5", f) >= 0;
  const bool closed = std::fclose(f) == 0;  // the write reaches the kernel on flush
  return wrote && closed;
}

double NowSeconds() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

}  // namespace kvtier
