#!/usr/bin/env bash
# The device tests of kvtier_tests on the emulated CUDA device (make test-gpu-emulated): a build
# with KVTIER_GPU_EMULATION runs kernels/cuda and the CUDA-side C++ on the CPU through HIP-CPU.
#   scripts/gpu_emulated.sh BUILD_DIR [JOBS]
# Device tests are those whose name says cuda, Cuda, CUDA or Device (the */cuda cases of the
# kernel backends, CudaHotTier, DeviceRetrieval*, DeviceForward, DeviceAppend, DeviceEndToEnd,
# AttentionBackend.SessionOnTheCudaTier...). They run in JOBS gtest shards; the summary says how
# many ran and names every skip with its reason. Fails when a test fails, when one skips for
# "no CUDA device" (here there is one: the emulated device) or skips without a reason. Then runs
# README.md's GPU embedding example, built beside kvtier_tests (kvtier_readme_gpu_example), through
# tests/readme_gpu_example_test.sh, which checks its output; fails when it fails or skips. Then the
# Python module's device tests, where this build made the module (see the end).
set -uo pipefail
build=${1:?usage: scripts/gpu_emulated.sh BUILD_DIR [JOBS]}
jobs=${2:-$(nproc)}
out="$build/gpu-emulated"
rm -rf "$out" && mkdir -p "$out"
filter='*cuda*:*Cuda*:*CUDA*:*Device*'
pids=()
for ((i = 0; i < jobs; i++)); do
  GTEST_TOTAL_SHARDS=$jobs GTEST_SHARD_INDEX=$i "$build/kvtier_tests" --gtest_filter="$filter" \
    --gtest_output="xml:$out/shard$i.xml" >"$out/shard$i.log" 2>&1 &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
python3 - "$out"/shard*.xml <<'PY' || rc=1
import sys, xml.etree.ElementTree as ET
ran, failed, skipped = [], [], []
for path in sys.argv[1:]:
    try:
        root = ET.parse(path).getroot()
    except Exception as e:
        print(f"gpu-emulated: no test report {path} ({e}): the shard crashed; see its log")
        sys.exit(1)
    for tc in root.iter("testcase"):
        name = f'{tc.get("classname")}.{tc.get("name")}'
        if tc.get("status") == "notrun":
            continue
        skip = tc.find("skipped")
        if skip is not None or tc.get("result") == "skipped":
            reason = (skip.get("message") if skip is not None else "") or ""
            skipped.append((name, reason.strip().splitlines()[-1] if reason.strip() else ""))
        elif tc.find("failure") is not None:
            failed.append(name)
        else:
            ran.append(name)
bad = [(n, r) for n, r in skipped if not r or "no CUDA device" in r]
print(f"gpu-emulated: {len(ran) + len(failed)} device tests ran on the emulated device "
      f"({len(ran)} passed, {len(failed)} failed); {len(skipped)} skipped")
for n, r in skipped:
    print(f"  skipped {n}: {r or '(no reason given)'}")
for n in failed:
    print(f"  FAILED {n}")
for n, r in bad:
    print(f"  not allowed here: {n} skipped {'without a reason' if not r else 'for want of a device'}")
sys.exit(1 if failed or bad or not ran else 0)
PY
example_rc=0
bash "$(dirname "$0")/../tests/readme_gpu_example_test.sh" "$build/kvtier_readme_gpu_example" \
  >"$out/readme_gpu_example.log" 2>&1 || example_rc=$?
if [[ $example_rc -eq 0 ]]; then
  echo "gpu-emulated: README.md's GPU embedding example ran: $(head -n 1 "$out/readme_gpu_example.log")"
else
  echo "gpu-emulated: README.md's GPU embedding example FAILED (exit $example_rc):"
  cat "$out/readme_gpu_example.log"
  rc=1
fi
if [[ $rc -ne 0 ]]; then
  for log in "$out"/shard*.log; do
    echo "---- $log (last 150 lines)"
    tail -n 150 "$log"
  done
fi
# The Python module built here (KVTIER_PYTHON: _kvtier*.so) on the emulated device: a copy of
# python/kvtier with it beside, first on PYTHONPATH (ahead of a host build installed in the venv),
# runs tests/python/test_device.py, which may not skip here (KVTIER_EXPECT_DEVICE_RUNTIME).
module=$(ls "$build"/_kvtier*.so 2>/dev/null | head -n 1)
if [[ -n "$module" ]]; then
  python=$(sed -n 's/^Python_EXECUTABLE:[A-Z]*=//p' "$build/CMakeCache.txt")
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  stage="$out/python"
  rm -rf "$stage" && mkdir -p "$stage" && cp -r "$root/python/kvtier" "$stage/" && cp "$module" "$stage/kvtier/"
  start=$SECONDS
  if KVTIER_EXPECT_DEVICE_RUNTIME=emulated PYTHONPATH="$stage" "${python:-python3}" -m pytest -q \
       -p no:cacheprovider "$root/tests/python/test_device.py" >"$out/python.log" 2>&1; then
    echo "gpu-emulated: Python device tests passed in $((SECONDS - start)) s ($(tail -n 1 "$out/python.log"))"
  else
    echo "gpu-emulated: Python device tests FAILED (tests/python/test_device.py):"
    cat "$out/python.log"
    rc=1
  fi
else
  echo "gpu-emulated: no Python module in $build (configure it with -DKVTIER_PYTHON=ON): its device tests did not run"
fi
exit $rc
