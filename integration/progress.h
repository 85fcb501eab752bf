// Progress of a long phase (a prefill, the full-attention baseline, one `kvtier infinite`
// sample) on stderr, so a job of minutes is never silent. On a terminal one line is redrawn
// in place with the share done, the rate and the time left; on anything else (a log file, a
// pipe, a test) no carriage returns are written: one line when the phase ends, with its time
// and rate. Off (--quiet): nothing.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>

#include "integration/sysinfo.h"

namespace kvtier {

/// "12 s", "3 min 20 s", "1 h 05 min": a duration as a person reads it.
inline std::string FormatDuration(double s) {
  char buf[48];
  if (!(s >= 0)) s = 0;
  if (s < 10)
    std::snprintf(buf, sizeof(buf), "%.1f s", s);
  else if (s < 120)
    std::snprintf(buf, sizeof(buf), "%.0f s", s);
  else if (s < 7200)
    std::snprintf(buf, sizeof(buf), "%d min %02d s", static_cast<int>(s) / 60, static_cast<int>(s) % 60);
  else
    std::snprintf(buf, sizeof(buf), "%d h %02d min", static_cast<int>(s) / 3600,
                  static_cast<int>(s) / 60 % 60);
  return buf;
}

class Progress {
 public:
  /// on: false under --quiet. what: the phase ("prefill"); total: its units of work; unit:
  /// their name in the rate ("tokens" -> "5200 tokens/s").
  Progress(bool on, std::string what, int64_t total, std::string unit)
      : on_(on),
        tty_(on && isatty(2) == 1),
        what_(std::move(what)),
        unit_(std::move(unit)),
        total_(std::max<int64_t>(1, total)),
        t0_(NowSeconds()) {}
  ~Progress() = default;
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  /// `done` units of `total` are done. On a terminal the line is redrawn (at most 5 times a
  /// second); elsewhere nothing is printed before Done.
  void Update(int64_t done) {
    done_ = done;
    if (!tty_ || finished_) return;
    const double now = NowSeconds();
    if (now - last_draw_ < 0.2 && done < total_) return;
    last_draw_ = now;
    const double t = now - t0_;
    const double rate = t > 0 ? static_cast<double>(done) / t : 0;
    std::string eta = "ETA ?";
    if (rate > 0) eta = "ETA " + FormatDuration(static_cast<double>(total_ - done) / rate);
    std::fprintf(stderr, "\r[kvtier] %s %3d%% (%lld/%lld %s, %s, %s)\033[K", what_.c_str(),
                 static_cast<int>(100 * done / total_), static_cast<long long>(done),
                 static_cast<long long>(total_), unit_.c_str(), Rate(rate).c_str(), eta.c_str());
    std::fflush(stderr);
  }

  /// The phase ended: one line with its time and rate (`extra` appended), on a terminal in
  /// place of the redrawn one. Printed once; later calls do nothing.
  void Done(const std::string& extra = "") {
    if (!on_ || finished_) return;
    finished_ = true;
    const double t = NowSeconds() - t0_;
    std::fprintf(stderr, "%s[kvtier] %s: %lld %s in %s (%s)%s%s\n", tty_ ? "\r" : "", what_.c_str(),
                 static_cast<long long>(done_), unit_.c_str(), FormatDuration(t).c_str(),
                 Rate(t > 0 ? static_cast<double>(done_) / t : 0).c_str(), extra.c_str(),
                 tty_ ? "\033[K" : "");
    std::fflush(stderr);
  }

  double elapsed() const { return NowSeconds() - t0_; }

 private:
  std::string Rate(double per_s) const {
    char buf[64];
    std::snprintf(buf, sizeof(buf), per_s >= 10 ? "%.0f %s/s" : "%.2f %s/s", per_s, unit_.c_str());
    return buf;
  }

  bool on_, tty_;
  std::string what_, unit_;
  int64_t total_;
  double t0_;
  double last_draw_ = -1;
  int64_t done_ = 0;
  bool finished_ = false;
};

}  // namespace kvtier
