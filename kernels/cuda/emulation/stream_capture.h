// Stream capture (CUDA graphs) on the emulated device: the state behind cudaStreamBeginCapture,
// cudaStreamEndCapture, cudaGraphLaunch and the capture checks of every runtime call in
// hip_cpu_compat.h, which is the only includer (it defines the cuda* calls over this).
//
// Model, as CUDA's stream capture (CUDA 13 runtime API and the programming guide's "CUDA Graphs"):
// - A capture sequence starts on one stream (its origin) and ends there. A stream that waits on
//   an event recorded in a capturing stream joins that stream's sequence (fork); the origin
//   waiting on an event recorded in the joined stream after its last work joins it back.
// - Work submitted to a stream of a live sequence is recorded (a Node: a function that enqueues
//   the same work on a given stream), not run. Replay enqueues the nodes in recording order on
//   one stream: a node is recorded after everything it depends on, so that order respects every
//   dependency of the captured graph (the emulation gives up the graph's concurrency, not its order).
// - A call that CUDA refuses inside a capture returns CUDA's error, invalidates the sequence(s)
//   concerned and records the error as the thread's last error (cudaGetLastError). An
//   invalidated sequence records nothing more (its streams answer kInvalidated) until it ends.
// - "Potentially unsafe" calls (allocation, freeing, blocking copies, waits on and queries of
//   streams and events outside the capture) are refused per
//   cudaThreadExchangeStreamCaptureMode: while the calling thread has a live sequence begun in a
//   mode other than Relaxed, or, when the thread's interaction mode is Global (the default),
//   while any other thread has one begun in Global mode.
// - Pinned and device memory are known from the allocations made through hip_cpu_compat.h's
//   cudaMalloc / cudaHostAlloc / cudaMallocHost (HIP-CPU's are all plain malloc): any other
//   address is pageable host memory, which an asynchronous copy may not touch in a capture.
// Every function here is thread-safe (one process-wide mutex); work submitted while no sequence
// is live takes a lock-free path.
#pragma once

#if !defined(KVTIER_GPU_EMULATION)
#error "kernels/cuda/emulation is the HIP-CPU build's stand-in for the CUDA headers only"
#endif

#include <hip/hip_runtime.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

// CUDA's enums for capture (driver_types.h), with CUDA's values.
enum cudaStreamCaptureMode {
  cudaStreamCaptureModeGlobal = 0,
  cudaStreamCaptureModeThreadLocal = 1,
  cudaStreamCaptureModeRelaxed = 2
};
enum cudaStreamCaptureStatus {
  cudaStreamCaptureStatusNone = 0,
  cudaStreamCaptureStatusActive = 1,
  cudaStreamCaptureStatusInvalidated = 2
};

namespace kvtier_emu::capture {

// CUDA's error codes for capture, which HIP-CPU's hipError_t has no enumerators for (the
// values are CUDA's; they lie within hipError_t's range of values).
inline constexpr hipError_t kIllegalState = static_cast<hipError_t>(401);
inline constexpr hipError_t kUnsupported = static_cast<hipError_t>(900);
inline constexpr hipError_t kInvalidated = static_cast<hipError_t>(901);
inline constexpr hipError_t kMerge = static_cast<hipError_t>(902);
inline constexpr hipError_t kUnmatched = static_cast<hipError_t>(903);
inline constexpr hipError_t kUnjoined = static_cast<hipError_t>(904);
inline constexpr hipError_t kIsolation = static_cast<hipError_t>(905);
inline constexpr hipError_t kImplicit = static_cast<hipError_t>(906);
inline constexpr hipError_t kCapturedEvent = static_cast<hipError_t>(907);
inline constexpr hipError_t kWrongThread = static_cast<hipError_t>(908);

/// CUDA's name and description of the codes above; nullptr for any other code.
inline const char* ErrorName(hipError_t e) {
  switch (static_cast<int>(e)) {
    case 401:
      return "cudaErrorIllegalState";
    case 900:
      return "cudaErrorStreamCaptureUnsupported";
    case 901:
      return "cudaErrorStreamCaptureInvalidated";
    case 902:
      return "cudaErrorStreamCaptureMerge";
    case 903:
      return "cudaErrorStreamCaptureUnmatched";
    case 904:
      return "cudaErrorStreamCaptureUnjoined";
    case 905:
      return "cudaErrorStreamCaptureIsolation";
    case 906:
      return "cudaErrorStreamCaptureImplicit";
    case 907:
      return "cudaErrorCapturedEvent";
    case 908:
      return "cudaErrorStreamCaptureWrongThread";
    default:
      return nullptr;
  }
}
inline const char* ErrorString(hipError_t e) {
  switch (static_cast<int>(e)) {
    case 401:
      return "the operation is not permitted in the current state (e.g. ending a capture never begun)";
    case 900:
      return "operation not permitted when stream is capturing";
    case 901:
      return "operation failed due to a previous error during capture";
    case 902:
      return "operation would result in a merge of separate capture sequences";
    case 903:
      return "capture was not ended in the same stream as it began";
    case 904:
      return "capturing stream has unjoined work";
    case 905:
      return "dependency created on uncaptured work in another stream";
    case 906:
      return "operation would make the legacy stream depend on a capturing blocking stream";
    case 907:
      return "operation not permitted on an event last recorded in a capturing stream";
    case 908:
      return "attempt to terminate a thread-local capture sequence from another thread";
    default:
      return nullptr;
  }
}

/// Enqueues one recorded piece of work (a launch, copy or memset, or a replayed graph) on a stream.
using Node = std::function<void(hipStream_t)>;

/// Per stream of a sequence, the tick (1-based node count) of the last node of each stream of
/// the sequence that this stream's future work depends on; its own entry is its own last node.
using Clock = std::map<hipStream_t, uint64_t>;

struct Sequence {
  hipStream_t origin = nullptr;
  cudaStreamCaptureMode mode = cudaStreamCaptureModeGlobal;
  std::thread::id thread;  ///< the thread that began it
  bool invalidated = false;
  std::vector<Node> nodes;
  std::unordered_map<hipStream_t, Clock> members;  ///< the origin and every joined stream
};

/// An event whose last record was in a capturing stream: its sequence and that stream's clock then.
struct CapturedEvent {
  std::shared_ptr<Sequence> sequence;
  Clock clock;
};

struct State {
  std::mutex mu;
  std::atomic<int> live{0};  ///< sequences begun and not yet ended
  std::unordered_map<hipStream_t, std::shared_ptr<Sequence>> capturing;  ///< member stream -> its sequence
  std::unordered_map<hipEvent_t, CapturedEvent> events;
  std::unordered_set<hipStream_t> non_blocking;  ///< streams created with cudaStreamNonBlocking
  std::map<uintptr_t, size_t> device_memory;     ///< base -> bytes, of cudaMalloc
  std::map<uintptr_t, size_t> pinned_memory;     ///< base -> bytes, of cudaHostAlloc / cudaMallocHost
};

inline State& Global() {
  static State state;
  return state;
}

/// The calling thread's capture interaction mode (cudaThreadExchangeStreamCaptureMode).
inline cudaStreamCaptureMode& ThreadMode() {
  thread_local cudaStreamCaptureMode mode = cudaStreamCaptureModeGlobal;
  return mode;
}

inline bool Live() { return Global().live.load(std::memory_order_acquire) > 0; }

/// Returns `e` after recording it as the thread's last error, as the CUDA runtime does.
inline hipError_t Fail(hipError_t e) {
  hip::detail::Runtime::set_last_error(e);
  return e;
}

// ---- memory and stream bookkeeping (always on: a capture judges memory allocated before it) ----
enum class Memory { kDevice, kPinned };

inline void NoteAllocation(Memory kind, void* p, size_t bytes) {
  if (p == nullptr) return;
  State& st = Global();
  std::lock_guard<std::mutex> lock(st.mu);
  (kind == Memory::kDevice ? st.device_memory : st.pinned_memory)[reinterpret_cast<uintptr_t>(p)] =
      bytes > 0 ? bytes : 1;
}
inline void ForgetAllocation(Memory kind, void* p) {
  if (p == nullptr) return;
  State& st = Global();
  std::lock_guard<std::mutex> lock(st.mu);
  (kind == Memory::kDevice ? st.device_memory : st.pinned_memory).erase(reinterpret_cast<uintptr_t>(p));
}
inline bool WithinLocked(const std::map<uintptr_t, size_t>& allocations, const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  auto it = allocations.upper_bound(a);
  if (it == allocations.begin()) return false;
  --it;
  return a - it->first < it->second;
}
/// Host memory that is not pinned: neither inside a cudaMalloc nor a pinned allocation.
inline bool PageableLocked(const State& st, const void* p) {
  return !WithinLocked(st.device_memory, p) && !WithinLocked(st.pinned_memory, p);
}

inline void NoteStream(hipStream_t s, bool non_blocking) {
  if (s == nullptr || !non_blocking) return;
  State& st = Global();
  std::lock_guard<std::mutex> lock(st.mu);
  st.non_blocking.insert(s);
}
inline void ForgetStream(hipStream_t s) {
  State& st = Global();
  std::lock_guard<std::mutex> lock(st.mu);
  st.non_blocking.erase(s);
}
inline void ForgetEvent(hipEvent_t e) {
  State& st = Global();
  std::lock_guard<std::mutex> lock(st.mu);
  st.events.erase(e);
}

// ---- the checks --------------------------------------------------------------------------------
inline void InvalidateLocked(const std::shared_ptr<Sequence>& s) { s->invalidated = true; }

/// The live sequences, each once.
inline std::vector<std::shared_ptr<Sequence>> SequencesLocked(const State& st) {
  std::vector<std::shared_ptr<Sequence>> out;
  for (const auto& [stream, seq] : st.capturing)
    if (seq->origin == stream) out.push_back(seq);
  return out;
}

/// The legacy stream (nullptr) is used: CUDA refuses that while a blocking stream (one created
/// without cudaStreamNonBlocking) captures, and invalidates those captures.
inline hipError_t LegacyStreamUseLocked(State& st) {
  bool conflict = false;
  for (const auto& [stream, seq] : st.capturing)
    if (st.non_blocking.count(stream) == 0) {
      InvalidateLocked(seq);
      conflict = true;
    }
  return conflict ? Fail(kImplicit) : hipSuccess;
}

/// A potentially unsafe call (allocation, freeing, a blocking copy): refused, invalidating the
/// sequences that forbid it, per the thread's interaction mode (the file's top comment).
inline hipError_t UnsafeCallLocked(State& st) {
  const cudaStreamCaptureMode mine = ThreadMode();
  if (mine == cudaStreamCaptureModeRelaxed) return hipSuccess;
  const std::thread::id self = std::this_thread::get_id();
  bool refused = false;
  for (const auto& seq : SequencesLocked(st)) {
    const bool forbids =
        seq->thread == self ? seq->mode != cudaStreamCaptureModeRelaxed
                            : mine == cudaStreamCaptureModeGlobal && seq->mode == cudaStreamCaptureModeGlobal;
    if (forbids) {
      InvalidateLocked(seq);
      refused = true;
    }
  }
  return refused ? Fail(kUnsupported) : hipSuccess;
}

/// Before cudaMalloc, cudaFree, cudaHostAlloc, cudaMallocHost, cudaFreeHost.
inline hipError_t BeforeUnsafeCall() {
  if (!Live()) return hipSuccess;
  State& st = Global();
  std::lock_guard<std::mutex> lock(st.mu);
  return UnsafeCallLocked(st);
}

/// Before cudaMemcpy and cudaMemset: work on the legacy stream, and potentially unsafe.
inline hipError_t BeforeBlockingCopy() {
  if (!Live()) return hipSuccess;
  State& st = Global();
  std::lock_guard<std::mutex> lock(st.mu);
  if (const hipError_t e = LegacyStreamUseLocked(st); e != hipSuccess) return e;
  return UnsafeCallLocked(st);
}

/// Before cudaStreamSynchronize / cudaStreamQuery of `s`: refused for a stream of a live
/// sequence (invalidating it), for the legacy stream while a blocking stream captures, and for
/// any other stream as a potentially unsafe call (per the capture modes).
inline hipError_t BeforeStreamWait(hipStream_t s) {
  if (!Live()) return hipSuccess;
  State& st = Global();
  std::lock_guard<std::mutex> lock(st.mu);
  if (s == nullptr)
    if (const hipError_t e = LegacyStreamUseLocked(st); e != hipSuccess) return e;
  const auto it = s == nullptr ? st.capturing.end() : st.capturing.find(s);
  if (it == st.capturing.end()) return UnsafeCallLocked(st);
  InvalidateLocked(it->second);
  return Fail(kUnsupported);
}

/// Before cudaDeviceSynchronize: the device encompasses every capturing stream, so any live
/// sequence refuses it (whatever its mode) and is invalidated.
inline hipError_t BeforeDeviceWait() {
  if (!Live()) return hipSuccess;
  State& st = Global();
  std::lock_guard<std::mutex> lock(st.mu);
  const auto live = SequencesLocked(st);
  for (const auto& seq : live) InvalidateLocked(seq);
  return live.empty() ? hipSuccess : Fail(kUnsupported);
}

/// Before cudaEventSynchronize / cudaEventQuery: refused for an event last recorded in a live
/// sequence (which is invalidated), whatever the mode; for any other event as a potentially
/// unsafe call (per the capture modes).
inline hipError_t BeforeEventWait(hipEvent_t e) {
  if (!Live()) return hipSuccess;
  State& st = Global();
  std::lock_guard<std::mutex> lock(st.mu);
  const auto it = st.events.find(e);
  if (it == st.events.end()) return UnsafeCallLocked(st);
  InvalidateLocked(it->second.sequence);
  return Fail(kCapturedEvent);
}

/// Work submitted to stream `s`: run (`enqueue(s)`) when `s` is not capturing, recorded when it
/// is. `host_sides` are addresses that must not be pageable host memory when the work is
/// recorded (a copy's source and destination): one that is refuses the work and invalidates
/// the capture (cudaErrorStreamCaptureUnsupported).
template <typename Enqueue>
inline hipError_t Submit(hipStream_t s, const Enqueue& enqueue,
                         std::initializer_list<const void*> host_sides = {}) {
  if (Live()) {
    State& st = Global();
    std::unique_lock<std::mutex> lock(st.mu);
    if (s == nullptr) {
      if (const hipError_t e = LegacyStreamUseLocked(st); e != hipSuccess) return e;
    } else if (const auto it = st.capturing.find(s); it != st.capturing.end()) {
      Sequence& seq = *it->second;
      if (seq.invalidated) return Fail(kInvalidated);
      for (const void* p : host_sides)
        if (PageableLocked(st, p)) {
          seq.invalidated = true;
          return Fail(kUnsupported);
        }
      seq.nodes.emplace_back(enqueue);
      seq.members[s][s] = seq.nodes.size();
      return hipSuccess;
    }
  }
  enqueue(s);
  return hipSuccess;
}

// ---- events --------------------------------------------------------------------------------------
/// cudaEventRecord: in a capturing stream it records no work, only what the event stands for
/// (the stream's position in the sequence) for a later cudaStreamWaitEvent.
inline hipError_t RecordEvent(hipEvent_t e, hipStream_t s) {
  if (Live()) {
    State& st = Global();
    std::unique_lock<std::mutex> lock(st.mu);
    if (s == nullptr) {
      if (const hipError_t err = LegacyStreamUseLocked(st); err != hipSuccess) return err;
    } else if (const auto it = st.capturing.find(s); it != st.capturing.end()) {
      if (e == nullptr) return Fail(hipErrorInvalidHandle);
      if (it->second->invalidated) return Fail(kInvalidated);
      st.events[e] = CapturedEvent{it->second, it->second->members[s]};
      return hipSuccess;
    }
    st.events.erase(e);
  }
  return hipEventRecord(e, s);
}

/// cudaStreamWaitEvent: a stream outside any capture that waits on an event recorded in a
/// capture joins that capture; a capturing stream may wait only on events of its own capture.
inline hipError_t WaitEvent(hipStream_t s, hipEvent_t e, unsigned flags) {
  if (Live()) {
    State& st = Global();
    std::unique_lock<std::mutex> lock(st.mu);
    if (s == nullptr)
      if (const hipError_t err = LegacyStreamUseLocked(st); err != hipSuccess) return err;
    const auto ev = st.events.find(e);
    const auto mine = s == nullptr ? st.capturing.end() : st.capturing.find(s);
    if (mine != st.capturing.end()) {
      const std::shared_ptr<Sequence> seq = mine->second;
      if (seq->invalidated) return Fail(kInvalidated);
      if (ev == st.events.end()) {  // a dependency on work outside the capture
        seq->invalidated = true;
        return Fail(kIsolation);
      }
      if (ev->second.sequence != seq) {
        seq->invalidated = true;
        ev->second.sequence->invalidated = true;
        return Fail(kMerge);
      }
      Clock& clock = seq->members[s];
      for (const auto& [stream, tick] : ev->second.clock) clock[stream] = std::max(clock[stream], tick);
      return hipSuccess;
    }
    if (ev != st.events.end() && s != nullptr) {  // fork: s joins the event's capture
      const std::shared_ptr<Sequence> seq = ev->second.sequence;
      if (seq->invalidated) return Fail(kInvalidated);
      seq->members[s] = ev->second.clock;
      st.capturing[s] = seq;
      return hipSuccess;
    }
    if (ev != st.events.end()) {  // the legacy stream cannot join a capture
      ev->second.sequence->invalidated = true;
      return Fail(kUnsupported);
    }
  }
  // Outside a capture. HIP-CPU runs every stream's work on one processor thread, stream by
  // stream, so a stream task that waits for another stream's event (hipStreamWaitEvent) can
  // block the thread that would run that event's work: the emulated device deadlocked on
  // kvtier's engine-stream ordering (Session::AppendDevice). The wait is made on the host
  // instead: the event's work was submitted before this call, so it ends without help, and
  // every later submission to `s` starts after it, which is all CUDA promises. The host blocks
  // here where a GPU would not; the library's host-sync counter counts kvtier's calls, not
  // this, and the emulator shows no speed anyway.
  (void)s, (void)flags;
  if (e == nullptr) return hipErrorInvalidHandle;
  const auto& done = is_done(*e);  // HIP-CPU's friend function, found by argument lookup
  if (done.valid()) done.wait();   // never recorded: complete, as CUDA treats it
  return hipSuccess;
}

// ---- begin, end, status ------------------------------------------------------------------------
inline hipError_t Begin(hipStream_t s, cudaStreamCaptureMode mode) {
  if (mode != cudaStreamCaptureModeGlobal && mode != cudaStreamCaptureModeThreadLocal &&
      mode != cudaStreamCaptureModeRelaxed)
    return Fail(hipErrorInvalidValue);
  if (s == nullptr) return Fail(kUnsupported);  // the legacy stream cannot capture
  State& st = Global();
  std::lock_guard<std::mutex> lock(st.mu);
  if (st.capturing.count(s) != 0) return Fail(kIllegalState);
  auto seq = std::make_shared<Sequence>();
  seq->origin = s;
  seq->mode = mode;
  seq->thread = std::this_thread::get_id();
  seq->members[s] = Clock{};
  st.capturing[s] = std::move(seq);
  st.live.fetch_add(1, std::memory_order_release);
  return hipSuccess;
}

/// Ends the sequence begun on `s`; on success *nodes holds its work in recording order. Every
/// stream of the sequence stops capturing, whatever the result (but kIllegalState,
/// kUnmatched and kWrongThread, which leave the sequence live).
inline hipError_t End(hipStream_t s, std::vector<Node>* nodes) {
  State& st = Global();
  std::lock_guard<std::mutex> lock(st.mu);
  const auto it = s == nullptr ? st.capturing.end() : st.capturing.find(s);
  if (it == st.capturing.end()) return Fail(kIllegalState);
  const std::shared_ptr<Sequence> seq = it->second;
  if (seq->origin != s) {
    seq->invalidated = true;
    return Fail(kUnmatched);
  }
  if (seq->mode != cudaStreamCaptureModeRelaxed && seq->thread != std::this_thread::get_id())
    return Fail(kWrongThread);
  for (const auto& [stream, clock] : seq->members) st.capturing.erase(stream);
  for (auto e = st.events.begin(); e != st.events.end();)
    e = e->second.sequence == seq ? st.events.erase(e) : std::next(e);
  st.live.fetch_sub(1, std::memory_order_release);
  if (seq->invalidated) return Fail(kInvalidated);
  // Every joined stream's last work must be something the origin waited on.
  const Clock& origin = seq->members[s];
  for (const auto& [stream, clock] : seq->members) {
    if (stream == s) continue;
    const auto own = clock.find(stream);
    const auto seen = origin.find(stream);
    if (own != clock.end() && (seen == origin.end() || seen->second < own->second)) return Fail(kUnjoined);
  }
  *nodes = std::move(seq->nodes);
  return hipSuccess;
}

inline hipError_t Status(hipStream_t s, cudaStreamCaptureStatus* status) {
  if (status == nullptr) return Fail(hipErrorInvalidValue);
  *status = cudaStreamCaptureStatusNone;
  if (!Live()) return hipSuccess;
  State& st = Global();
  std::lock_guard<std::mutex> lock(st.mu);
  if (s == nullptr) {  // CUDA: an error, not an invalidation, while a blocking stream captures
    for (const auto& [stream, seq] : st.capturing)
      if (st.non_blocking.count(stream) == 0) return Fail(kImplicit);
    return hipSuccess;
  }
  const auto it = st.capturing.find(s);
  if (it != st.capturing.end())
    *status = it->second->invalidated ? cudaStreamCaptureStatusInvalidated : cudaStreamCaptureStatusActive;
  return hipSuccess;
}

}  // namespace kvtier_emu::capture
