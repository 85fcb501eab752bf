#!/usr/bin/env bash
# The tree's static checks.
#   scripts/lint.sh format          every C/C++/CUDA source is as .clang-format writes it (fast;
#                                   part of `make test`, hence CI). `make format` rewrites them.
#   scripts/lint.sh tidy BUILD_DIR  .clang-tidy's checks over the library and tool sources, with
#                                   BUILD_DIR's compile_commands.json (`make lint` runs both).
#   scripts/lint.sh syncs           no source blocks the host on the device except through the
#                                   counting wrappers of offload/device_sync_cuda.h (part of the
#                                   format stage, and a ctest test). `syncs --self-test`: the check
#                                   refuses each kind of blocking call and passes what it should.
#   scripts/lint.sh allocs          no source allocates or frees device or pinned host memory
#                                   except through the counting wrappers of
#                                   offload/device_memory_cuda.h (part of the format stage, and a
#                                   ctest test). `allocs --self-test`: the check refuses each
#                                   kind of allocation and passes what it should.
# Exit status 1 names the files that fail.
set -uo pipefail
cd "$(dirname "$0")/.."
FORMAT=${CLANG_FORMAT:-clang-format-14}
TIDY=${CLANG_TIDY:-clang-tidy-14}
# Everything of ours; tests/fixtures holds data, not code.
sources() { git ls-files '*.cc' '*.h' '*.c' '*.cu' '*.cuh' | grep -v '^tests/fixtures/'; }
# The CUDA runtime's calls that block the host, or may (every copy: an asynchronous one blocks
# when its host memory is pageable, which no grep can tell). Comments are left out. A file that
# says `host-sync-lint: async-copies-only` (kernels/cuda: its copies run on the caller's stream,
# between device buffers or from the pinned memory the caller passes, and the caller counts its
# waits) may hold cudaMemcpyAsync and cudaMemcpyBatchAsync, nothing else of the list.
# Prints FILE:LINE: TEXT for each call found; exit status 1 when there is one.
blocking_calls() {
  awk '
    FNR == 1 { async_ok = 0 }
    /host-sync-lint: async-copies-only/ { async_ok = 1 }
    {
      code = $0
      sub(/\/\/.*/, "", code)
      if (code !~ /cuda(StreamSynchronize|EventSynchronize|DeviceSynchronize|Memcpy[A-Za-z0-9]*)[[:space:]]*[(]/) next
      rest = code
      gsub(/cudaMemcpy(Batch)?Async[[:space:]]*[(]/, "", rest)
      if (async_ok && rest !~ /cuda(StreamSynchronize|EventSynchronize|DeviceSynchronize|Memcpy[A-Za-z0-9]*)[[:space:]]*[(]/) next
      print FILENAME ":" FNR ": " $0
      found = 1
    }
    END { exit found ? 1 : 0 }' "$@"
}
# The CUDA runtime's allocations and frees of device and pinned host memory (cudaMalloc and every
# cudaMalloc*, cudaFree and every cudaFree*, cudaHostAlloc, cudaHostRegister/Unregister).
# Comments are left out. Prints FILE:LINE: TEXT for each call found; exit status 1 when there is one.
allocation_calls() {
  awk '
    {
      code = $0
      sub(/\/\/.*/, "", code)
      if (code !~ /cuda(Malloc[A-Za-z0-9]*|Free[A-Za-z0-9]*|HostAlloc|HostRegister|HostUnregister)[[:space:]]*[(]/) next
      print FILENAME ":" FNR ": " $0
      found = 1
    }
    END { exit found ? 1 : 0 }' "$@"
}
case "${1:-}" in
  format)
    bad=()
    while read -r f; do
      "$FORMAT" --dry-run --Werror "$f" >/dev/null 2>&1 || bad+=("$f")
    done < <(sources)
    if ((${#bad[@]})); then
      echo "lint: ${#bad[@]} files differ from .clang-format (make format rewrites them):"
      printf '  %s\n' "${bad[@]}"
      exit 1
    fi
    echo "lint: $(sources | wc -l) files formatted as .clang-format says"
    ;;
  tidy)
    build=${2:?usage: scripts/lint.sh tidy BUILD_DIR}
    [[ -f "$build/compile_commands.json" ]] || { echo "lint: no $build/compile_commands.json (configure first)" >&2; exit 2; }
    # The library and the tools; tests are left out (GoogleTest's macros trip several checks).
    # Only files the build compiles (kernels/cuda's host files exist in CUDA builds only).
    mapfile -t files < <(git ls-files 'kernels/*.cc' 'store/*.cc' 'offload/*.cc' 'retrieval/*.cc' \
                                     'engine/*.cc' 'integration/*.cc' |
                         grep -F -f <(grep -o '"file": *"[^"]*"' "$build/compile_commands.json" |
                                      sed 's/.*"\([^"]*\)"$/\1/' | sed "s|^$PWD/||"))
    printf '%s\n' "${files[@]}" | xargs -P "$(nproc)" -n 4 "$TIDY" -p "$build" --quiet 2> "$build/tidy.log"
    rc=$?
    grep -E 'warning:|error:' "$build/tidy.log" | grep -v 'warnings generated' || true
    ((rc == 0)) && echo "lint: clang-tidy clean over ${#files[@]} files" || { echo "lint: clang-tidy found the above"; exit 1; }
    ;;
  syncs)
    if [[ "${2:-}" == "--self-test" ]]; then
      tmp=$(mktemp -d)
      trap 'rm -rf "$tmp"' EXIT
      # Each line of bad.cc and async_bad.cu must be reported, no line of good.cc or async.cu.
      printf '%s\n' 'cudaStreamSynchronize(s);' 'e = cudaEventSynchronize(ev);' 'cudaDeviceSynchronize();' \
        'cudaMemcpy(d, h, n, cudaMemcpyHostToDevice);' 'cudaMemcpyToSymbol(sym, h, n);' \
        'cudaMemcpyAsync(d, h, n, cudaMemcpyHostToDevice, s);' 'cudaMemcpy2DAsync (d, p, h, p, w, n, k, s);' \
        'x = 1; cudaStreamSynchronize(s);  // a comment after the call' >"$tmp/bad.cc"
      printf '%s\n' '// cudaStreamSynchronize(s) in a comment' 'device_sync::SyncStream(s);' \
        'kernels::cuda::MemcpyBatchAsync(d, h, n, c, s);' \
        'cudaStreamQuery(s); cudaEventQuery(ev); cudaEventRecord(ev, s);' >"$tmp/good.cc"
      printf '%s\n' '// host-sync-lint: async-copies-only' \
        'CheckCall(cudaMemcpyAsync(d, h, n, cudaMemcpyDeviceToDevice, s));' \
        'CheckCall(cudaMemcpyBatchAsync(d, h, n, c, a, i, 1, s));' >"$tmp/async.cu"
      printf '%s\n' '// host-sync-lint: async-copies-only' 'cudaStreamSynchronize(s);' \
        'cudaMemcpy(d, h, n, cudaMemcpyDeviceToHost);' >"$tmp/async_bad.cu"
      got=$(cd "$tmp" && blocking_calls bad.cc good.cc async.cu async_bad.cu | cut -d: -f1,2 | tr '\n' ' ')
      want="bad.cc:1 bad.cc:2 bad.cc:3 bad.cc:4 bad.cc:5 bad.cc:6 bad.cc:7 bad.cc:8 async_bad.cu:2 async_bad.cu:3 "
      if [[ "$got" != "$want" ]]; then
        echo "lint syncs self-test: reported [$got], expected [$want]"
        exit 1
      fi
      echo "lint syncs self-test: each kind of blocking call refused; comments, wrappers, async-only files passed"
      exit 0
    fi
    # Tests may wait as they like; bench/gpu_measure.cc times raw runtime calls (kvtier_gpu_bench
    # links kernels only); the emulation layer is the runtime; the wrappers call it.
    mapfile -t files < <(sources | grep -vE '^(tests/|bench/|kernels/cuda/emulation/)' |
                         grep -vx 'offload/device_sync.cc')
    if ! found=$(blocking_calls "${files[@]}"); then
      echo "lint: blocking device calls outside offload/device_sync_cuda.h's counting wrappers"
      echo "(SyncStream, SyncEvent, SyncDevice, CopyBlocking, CopyAsync: every host wait is counted):"
      echo "$found" | sed 's/^/  /'
      exit 1
    fi
    echo "lint: no blocking device call outside offload/device_sync in ${#files[@]} files"
    ;;
  allocs)
    if [[ "${2:-}" == "--self-test" ]]; then
      tmp=$(mktemp -d)
      trap 'rm -rf "$tmp"' EXIT
      # Each line of bad.cc must be reported, no line of good.cc.
      printf '%s\n' 'cudaMalloc(&p, n);' 'e = cudaFree(p);' 'cudaMallocHost(&h, n);' 'cudaHostAlloc(&h, n, f);' \
        'cudaFreeHost(h);' 'cudaMallocAsync (&p, n, s);' 'cudaFreeAsync(p, s);' 'cudaMallocManaged(&p, n);' \
        'cudaMallocPitch(&p, &pitch, w, h);' 'cudaHostRegister(h, n, f);' 'cudaHostUnregister(h);' \
        'x = 1; cudaFree(p);  // a comment after the call' >"$tmp/bad.cc"
      printf '%s\n' '// cudaMalloc(&p, n) in a comment' 'device_memory::Malloc(&p, n, DeviceMemoryOwner::kHotTier);' \
        'device_memory::Free(p); device_memory::HostAlloc(&h, n, f); device_memory::FreeHost(h);' \
        'return ResourceExhausted("cudaMalloc of " + std::to_string(n) + " bytes failed");' \
        'cudaMemGetInfo(&free, &total);' >"$tmp/good.cc"
      got=$(cd "$tmp" && allocation_calls bad.cc good.cc | cut -d: -f1,2 | tr '\n' ' ')
      want="bad.cc:1 bad.cc:2 bad.cc:3 bad.cc:4 bad.cc:5 bad.cc:6 bad.cc:7 bad.cc:8 bad.cc:9 bad.cc:10 bad.cc:11 bad.cc:12 "
      if [[ "$got" != "$want" ]]; then
        echo "lint allocs self-test: reported [$got], expected [$want]"
        exit 1
      fi
      echo "lint allocs self-test: each kind of allocation refused; comments, messages and wrappers passed"
      exit 0
    fi
    # Tests allocate as they like; bench/gpu_measure.cc times raw runtime calls (kvtier_gpu_bench
    # links kernels only); the emulation layer is the runtime; the wrappers call it. kernels/cuda
    # (which depends on nothing of ours) allocates nothing: its callers pass workspaces.
    mapfile -t files < <(sources | grep -vE '^(tests/|bench/|kernels/cuda/emulation/)' |
                         grep -vx 'offload/device_memory.cc')
    if ! found=$(allocation_calls "${files[@]}"); then
      echo "lint: device or pinned memory allocated outside offload/device_memory_cuda.h's counting wrappers"
      echo "(device_memory::Malloc, Free, HostAlloc, FreeHost: every byte of device memory is counted):"
      echo "$found" | sed 's/^/  /'
      exit 1
    fi
    echo "lint: no device allocation outside offload/device_memory in ${#files[@]} files"
    ;;
  *) echo "usage: scripts/lint.sh format | tidy BUILD_DIR | syncs [--self-test] | allocs [--self-test]" >&2; exit 2 ;;
esac
