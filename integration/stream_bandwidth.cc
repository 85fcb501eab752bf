#include "integration/stream_bandwidth.h"

#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/partitioner.h>
#include <oneapi/tbb/task_arena.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <string>
#include <vector>

#include "integration/sysinfo.h"
#include "kernels/tbb_tsan.h"

namespace kvtier {
namespace {

constexpr uint64_t kMiB = 1ull << 20;

// "32768K", "8M", "1G" or plain bytes, as sysfs writes a cache size; 0 when unreadable.
uint64_t ParseCacheSize(const std::string& s) {
  if (s.empty()) return 0;
  size_t used = 0;
  unsigned long long v = 0;
  try {
    v = std::stoull(s, &used);
  } catch (...) {
    return 0;
  }
  const char unit = used < s.size() ? s[used] : ' ';
  switch (unit) {
    case 'K':
      return v << 10;
    case 'M':
      return v << 20;
    case 'G':
      return v << 30;
    default:
      return v;
  }
}

}  // namespace

Status StreamBandwidthOptions::Validate() const {
  if (buffer_bytes != 0 && buffer_bytes < kMiB)
    return InvalidArgument(
        "StreamBandwidthOptions.buffer_bytes must be 0 (sized from the cache) or at least "
        "1 MiB (got " +
        std::to_string(buffer_bytes) + ")");
  if (passes < 1 || passes > 100)
    return InvalidArgument("StreamBandwidthOptions.passes must be in [1, 100] (got " +
                           std::to_string(passes) + ")");
  return Status::Ok();
}

uint64_t LastLevelCacheBytes() {
  uint64_t best = 0;
  for (int i = 0; i < 8; ++i) {
    const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(i) + "/";
    std::ifstream type_file(dir + "type"), size_file(dir + "size");
    if (!type_file || !size_file) continue;
    std::string type, size;
    type_file >> type;
    size_file >> size;
    if (type == "Instruction") continue;
    best = std::max(best, ParseCacheSize(size));
  }
  if (best == 0) {
#ifdef _SC_LEVEL3_CACHE_SIZE
    const long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
    if (l3 > 0) best = static_cast<uint64_t>(l3);
#endif
  }
  return best;
}

Result<StreamBandwidth> MeasureStreamBandwidth(const StreamBandwidthOptions& options) {
  KVTIER_RETURN_IF_ERROR(options.Validate());
  const double start = NowSeconds();
  StreamBandwidth bw;
  bw.llc_bytes = LastLevelCacheBytes();
  bw.buffer_bytes = options.buffer_bytes != 0 ? options.buffer_bytes
                    : bw.llc_bytes == 0
                        ? 64 * kMiB
                        : std::clamp<uint64_t>(bw.llc_bytes + bw.llc_bytes / 2, 64 * kMiB, 1024 * kMiB);
  bw.threads = tbb::this_task_arena::max_concurrency();
  bw.passes = options.passes;
  const size_t words = bw.buffer_bytes / sizeof(uint64_t);
  // Mapped (not from the heap) so that it goes back to the system at once. Not in huge pages:
  // on the 2-core VM their faults made the fill several times slower (2.6 s for 520 MiB against
  // 0.35 s in 4 KiB pages).
  const size_t mapped = words * sizeof(uint64_t);
  void* map = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (map == MAP_FAILED)
    return ResourceExhausted("MeasureStreamBandwidth: could not map a buffer of " +
                             std::to_string(bw.buffer_bytes) + " bytes");
  struct Unmap {
    void* p;
    size_t n;
    ~Unmap() { munmap(p, n); }
  } unmap{map, mapped};
  uint64_t* data = static_cast<uint64_t*>(map);
  // Parts of equal size, two per thread, each summed into its own cache line.
  const int parts = 2 * std::max(1, bw.threads);
  std::vector<uint64_t> sums(static_cast<size_t>(parts) * 8, 0);
  auto over_parts = [&](auto&& body) {
    TsanForkJoin fj;  // kernels/tbb_tsan.h
    tbb::parallel_for(tbb::blocked_range<int>(0, parts, 1), fj.Body([&](const tbb::blocked_range<int>& r) {
      for (int i = r.begin(); i < r.end(); ++i)
        body(i, words * static_cast<size_t>(i) / parts, words * static_cast<size_t>(i + 1) / parts);
    }),
                      tbb::simple_partitioner());
    fj.Join();
  };
  // Written (not only allocated) so that every page is backed by memory of its own, each by the
  // thread that reads it later. The fill leaves at most the cache's worth of the buffer's end
  // in the cache, and each pass reads from the start: no pass before the timed ones is needed.
  over_parts([&](int, size_t a, size_t b) {
    for (size_t w = a; w < b; ++w) data[w] = w * 0x9E3779B97F4A7C15ull;
  });
  std::vector<double> rates;
  for (int pass = 0; pass < options.passes; ++pass) {
    const double t0 = NowSeconds();
    over_parts([&](int i, size_t a, size_t b) {
      uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
      size_t w = a;
      for (; w + 4 <= b; w += 4) s0 += data[w], s1 += data[w + 1], s2 += data[w + 2], s3 += data[w + 3];
      for (; w < b; ++w) s0 += data[w];
      sums[static_cast<size_t>(i) * 8] += s0 + s1 + s2 + s3;
    });
    const double s = NowSeconds() - t0;
    if (s > 0) rates.push_back(static_cast<double>(words * sizeof(uint64_t)) / s);
  }
  // The sums are kept (a read of them) so that the passes cannot be optimised away.
  uint64_t total = 0;
  for (uint64_t s : sums) total += s;
  volatile uint64_t sink = total;
  (void)sink;
  if (rates.empty()) return Internal("MeasureStreamBandwidth: no pass took measurable time");
  std::sort(rates.begin(), rates.end());
  const size_t n = rates.size();
  bw.bytes_per_s = n % 2 ? rates[n / 2] : 0.5 * (rates[n / 2 - 1] + rates[n / 2]);
  bw.best_bytes_per_s = rates.back();
  bw.passes = static_cast<int>(n);
  bw.ms = 1e3 * (NowSeconds() - start);
  return bw;
}

}  // namespace kvtier
