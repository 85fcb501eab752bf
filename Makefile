# kvtier — two commands for a newcomer:  `make run`  and  `make test`.
BUILD      ?= build
JOBS       ?= $(shell nproc)
KVTIER_CUDA ?= auto
CMAKE_ARGS ?=
# The main job: a long-sequence run on the default embedded setup (see README).
RUN_ARGS   ?= --context 131072 --data-dir $(BUILD)/run-data --json $(BUILD)/run-report.json

.PHONY: all deps deps-checks configure build run test test-release test-asan test-tsan fuzz soak lint-tidy \
        bench bench-retrieval bench-scaling profile-step gpu-check test-gpu-emulated format lint lint-format clean

# ---- checks beyond the Release suite (all part of `make test`, hence of CI) ------------------
# Each has its own build directory, built with clang from Debian (scripts/deps.sh checks).
ASAN_BUILD   ?= build-asan
TSAN_BUILD   ?= build-tsan
CLANG_CC     ?= clang-14
CLANG_CXX    ?= clang++-14
# Seconds each libFuzzer target runs (five targets, two at a time): `make fuzz` is the long run
# for humans (FUZZ_SECONDS=1800 for a longer one); `make test`, hence CI, gives each target
# TEST_FUZZ_SECONDS from its committed corpus, enough to replay the corpus and catch a
# regression on its inputs, not to explore.
FUZZ_SECONDS      ?= 300
TEST_FUZZ_SECONDS ?= 10
# Kill/reopen cycles of `make soak` (every suite runs 20 of them: Soak.* in tests/offload/soak_test.cc).
SOAK_CYCLES  ?= 1000
# Debian's FAISS is linked against GCC's OpenMP runtime (libgomp): the clang builds link that
# one too instead of LLVM's libomp, so that no process holds two OpenMP runtimes.
GOMP_LIB     := $(shell gcc -print-file-name=libgomp.so 2>/dev/null)
# -O1, as the ASan and TSan manuals advise: the suites stay fast enough, and the builds compile
# about a third faster than at -O2 (kernels/cpu/attention.cc under ASan+UBSan: 34 s against 53).
# Line tables only: enough for file:line in reports, much cheaper than full debug info.
CLANG_CMAKE   = -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVTIER_CUDA=off \
                "-DCMAKE_C_FLAGS_RELWITHDEBINFO=-O1 -gline-tables-only -DNDEBUG" \
                "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -gline-tables-only -DNDEBUG" \
                -DCMAKE_C_COMPILER=$(CLANG_CC) -DCMAKE_CXX_COMPILER=$(CLANG_CXX) \
                -DOpenMP_C_FLAGS=-fopenmp=libgomp -DOpenMP_CXX_FLAGS=-fopenmp=libgomp \
                -DOpenMP_C_LIB_NAMES=gomp -DOpenMP_CXX_LIB_NAMES=gomp -DOpenMP_gomp_LIBRARY=$(GOMP_LIB)
# The concurrency tests, the ones ThreadSanitizer builds and runs.
TSAN_TESTS    = tests/offload/tiered_store_test.cc;tests/engine/session_test.cc;tests/engine/session_pins_test.cc;tests/integration/stress_test.cc;tests/offload/crash_test.cc;tests/offload/soak_test.cc;tests/offload/cold_tier_test.cc;tests/offload/ack_manifest_test.cc;tests/offload/remote_tier_test.cc;tests/offload/device_append_test.cc;tests/offload/landing_test.cc;tests/offload/promoter_test.cc;tests/offload/lower_writer_test.cc;tests/offload/warm_addresses_test.cc
# A UBSan report aborts the test (compiled without recovery); leaks fail it too.
export ASAN_OPTIONS  ?= detect_leaks=1:strict_string_checks=1:check_initialization_order=1
export UBSAN_OPTIONS ?= print_stacktrace=1
# Reports go to files (log_path), so that those of the child processes the SIGKILL tests
# start (and kill, so their exit status says nothing) fail the job too.
TSAN_REPORTS  = $(CURDIR)/$(TSAN_BUILD)/tsan-reports
TSAN_ENV      = TSAN_OPTIONS="suppressions=$(CURDIR)/tests/tsan.supp second_deadlock_stack=1 history_size=4 log_path=$(TSAN_REPORTS)/report"
TIMED         = bash scripts/timed.sh
# The emulated GPU: the CUDA sources compiled by the host compiler against HIP-CPU (CI keeps it
# at ../shared/third_party/hip-cpu beside the checkout; it is never copied into this tree).
GPU_EMU_BUILD ?= build-gpu-emulated
HIP_CPU       ?= $(abspath $(CURDIR)/../shared/third_party/hip-cpu)
PY_VENV       ?= $(CURDIR)/.venv

all: build

deps:
	@bash scripts/deps.sh

deps-checks:
	@bash scripts/deps.sh checks

$(BUILD)/build.ninja: CMakeLists.txt | deps
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVTIER_CUDA=$(KVTIER_CUDA) $(CMAKE_ARGS)

# A KVTIER_CUDA other than the one the build directory was configured with configures it again
# (e.g. `make run`, then `make test KVTIER_CUDA=on` in the same checkout).
configure: deps $(BUILD)/build.ninja
	@grep -qx 'KVTIER_CUDA:STRING=$(KVTIER_CUDA)' $(BUILD)/CMakeCache.txt || \
	  cmake -S . -B $(BUILD) -DKVTIER_CUDA=$(KVTIER_CUDA)

build: configure
	cmake --build $(BUILD) -j $(JOBS)

# The main job first: only the CLI and the library under it (no tests, benchmarks or GPU bench).
run: configure
	cmake --build $(BUILD) -j $(JOBS) --target kvtier_cli
	rm -rf $(BUILD)/run-data
	./$(BUILD)/kvtier run $(RUN_ARGS)

# The format check, the Release build, .clang-tidy's checks over the library and tools on its
# compile commands, the Release suite, then AddressSanitizer+UBSan, ThreadSanitizer and the fuzzers, one
# after the other (each stage prints how long it took).
test:
	@$(TIMED) "format check" $(MAKE) --no-print-directory lint-format
	@$(TIMED) "Release build" $(MAKE) --no-print-directory build
	@$(TIMED) "clang-tidy" $(MAKE) --no-print-directory lint-tidy
	@$(TIMED) "Release suite" $(MAKE) --no-print-directory test-release
	@$(TIMED) "emulated GPU build and device tests" $(MAKE) --no-print-directory test-gpu-emulated
	@$(TIMED) "ASan+UBSan build and suite" $(MAKE) --no-print-directory test-asan
	@$(TIMED) "TSan build and concurrency tests" $(MAKE) --no-print-directory test-tsan
	@$(TIMED) "fuzzers" $(MAKE) --no-print-directory fuzz FUZZ_SECONDS=$(TEST_FUZZ_SECONDS)

test-release: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) --timeout 900

# The CUDA half executed on the CPU: kernels/cuda/*.cu and the CUDA-side C++ built against HIP-CPU
# (KVTIER_GPU_EMULATION; no nvcc), then every device test of kvtier_tests on that emulated device
# (scripts/gpu_emulated.sh prints how many ran and each skip's reason), then the Python module's
# device tests (tests/python/test_device.py) against the module built there. Skipped, saying so, where
# HIP-CPU is absent (a user's fresh clone without ../shared).
# The same build holds the Python module (KVTIER_PYTHON, against the project's venv: scripts/python_env.sh
# env), whose device tests (tests/python/test_device.py) scripts/gpu_emulated.sh runs after the C++ ones.
$(GPU_EMU_BUILD)/build.ninja: CMakeLists.txt Makefile | deps $(PY_VENV)/bin/python
	cmake -S . -B $(GPU_EMU_BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVTIER_CUDA=off \
	  -DKVTIER_GPU_EMULATION=$(HIP_CPU) "-DKVTIER_TEST_GLOB=$(GPU_EMU_TESTS)" \
	  -DKVTIER_PYTHON=ON -DPython_EXECUTABLE=$(PY_VENV)/bin/python

# The project's venv without the package (scripts/python_env.sh env); the Release suite's Python.Package
# makes the same one.
$(PY_VENV)/bin/python:
	bash scripts/python_env.sh env

# The test files holding device tests (the rest has none, so the emulated build skips them).
GPU_EMU_TESTS = tests/offload/device_sync_test.cc;tests/offload/device_memory_test.cc;tests/kernels/graph_capture_test.cc;tests/kernels/kernel_backends_test.cc;tests/offload/attention_backend_test.cc;tests/retrieval/device_retrieval_test.cc;tests/integration/model_test.cc;tests/offload/cuda_hot_tier_test.cc;tests/offload/device_append_test.cc;tests/kernels/device_end_to_end_test.cc;tests/offload/tiered_store_test.cc;tests/engine/c_api_cuda_test.cc;tests/engine/device_session_test.cc;tests/kernels/chunk_table_test.cc;tests/kernels/entropy_grant_test.cc;tests/kernels/device_step_chain_test.cc;tests/engine/device_lane_test.cc;tests/kernels/representatives_test.cc

test-gpu-emulated: deps
	@if [ ! -f "$(HIP_CPU)/include/hip/hip_runtime.h" ]; then \
	  echo "test-gpu-emulated: SKIPPED: no HIP-CPU at $(HIP_CPU) (set HIP_CPU=<folder> to run the CUDA sources on the CPU)"; \
	else \
	  $(MAKE) --no-print-directory $(GPU_EMU_BUILD)/build.ninja && \
	  cmake --build $(GPU_EMU_BUILD) -j $(JOBS) --target kvtier_tests _kvtier && \
	  bash scripts/gpu_emulated.sh $(GPU_EMU_BUILD) $(JOBS); \
	fi

# The whole suite under AddressSanitizer and UBSan (clang). Tests that measure memory or
# allocate up to a limit skip themselves here, saying why (tests/test_util.h). The same
# build holds the fuzz targets (KVTIER_FUZZ: libFuzzer's coverage instrumentation).
$(ASAN_BUILD)/build.ninja: CMakeLists.txt Makefile | deps-checks
	cmake -S . -B $(ASAN_BUILD) $(CLANG_CMAKE) -DKVTIER_SANITIZE=address,undefined -DKVTIER_FUZZ=ON \
	  "-DKVTIER_TEST_EXCLUDE=$(ASAN_SKIP)"

# Four accuracy runs of the trained model over 8 samples of 2K prompts (ASAN_SKIP, a GoogleTest
# negative filter the build's ctest suites get: KVTIER_TEST_EXCLUDE) are left to
# the Release suite: under the sanitizers they cost 330 of the suite's 615 CPU-seconds, and they
# run the model path that Cli.TrainedModelFindsThePasskeyAtTrainingLength, kept here, runs on
# 512-token prompts; the other `infinite` tests (--compare rows, Compress) and
# tests/engine/session_test.cc's Compress tests stay in the sanitizer suite.
ASAN_SKIP = Cli.RetrievalCarriesTheModelPastItsTrainingLength:Cli.InfiniteCompressStreamingLosesTheNeedle:Cli.InfiniteCompressKeepsTheNeedleWithH2O:Cli.DefaultsCopyATenDigitNeedlePastTheTrainingLength

test-asan: deps-checks $(ASAN_BUILD)/build.ninja
	cmake --build $(ASAN_BUILD) -j $(JOBS) --target kvtier_tests kvtier_c_api_test fuzzers
	cd $(ASAN_BUILD) && ctest --output-on-failure -j $(JOBS) --timeout 900

# The concurrency tests (store, sessions, stress job, SIGKILL crash and soak, cold tier)
# under ThreadSanitizer; tests/tsan.supp lists the only suppressions and why. The install
# and C API programs are not concurrency tests: they run in the other two suites.
$(TSAN_BUILD)/build.ninja: CMakeLists.txt Makefile | deps-checks
	cmake -S . -B $(TSAN_BUILD) $(CLANG_CMAKE) -DKVTIER_SANITIZE=thread "-DKVTIER_TEST_GLOB=$(TSAN_TESTS)"

test-tsan: deps-checks $(TSAN_BUILD)/build.ninja
	cmake --build $(TSAN_BUILD) -j $(JOBS) --target kvtier_tests
	rm -rf $(TSAN_REPORTS) && mkdir -p $(TSAN_REPORTS)
	cd $(TSAN_BUILD) && $(TSAN_ENV) ctest --output-on-failure -j $(JOBS) --timeout 900 -E '^(Install|CApi)[.]'
	@if ls $(TSAN_REPORTS)/report.* >/dev/null 2>&1; then cat $(TSAN_REPORTS)/report.*; \
	  echo "ThreadSanitizer reported the races above (child processes included)"; exit 1; fi

# Each libFuzzer target for FUZZ_SECONDS from its committed seed corpus (tests/fuzz/corpus).
fuzz: deps-checks $(ASAN_BUILD)/build.ninja
	cmake --build $(ASAN_BUILD) -j $(JOBS) --target fuzzers
	bash scripts/fuzz.sh $(ASAN_BUILD) $(FUZZ_SECONDS)

# Rewrites every source as .clang-format says (make test checks that nothing differs).
format:
	git ls-files '*.cc' '*.h' '*.c' '*.cu' '*.cuh' | grep -v '^tests/fixtures/' | xargs clang-format-14 -i

lint-format: deps-checks
	bash scripts/lint.sh format
	bash scripts/lint.sh syncs
	bash scripts/lint.sh allocs

# The static checks: the format check, then .clang-tidy's checks over the library and tools.
lint: lint-format lint-tidy

# .clang-tidy's checks over the library and tool sources, on $(BUILD)'s compile commands.
lint-tidy: deps-checks configure
	bash scripts/lint.sh tidy $(BUILD)

# SIGKILL soak: SOAK_CYCLES kill/reopen cycles on one store, every acknowledged chunk checked.
soak: build
	cd $(BUILD) && KVTIER_SOAK_CYCLES=$(SOAK_CYCLES) ./kvtier_tests --gtest_filter='Soak.*'

# Google Benchmark (bench/*_bench.cc: BM_GemmVsOpenBlas is kernels::Gemm against OpenBLAS, one
# core), then the trained model at 4K and 32K on one thread: its cost per token against the
# one-core arithmetic floor (the cpu/floor column; the target is the total within 3x at 32K),
# then the `kvtier run` scripts.
bench: build
	./$(BUILD)/kvtier_bench --benchmark_min_time=0.2
	./$(BUILD)/kvtier infinite --quiet --weights models/kvtier-tiny.safetensors --task passkey --contexts 4096,32768 --samples 2 --seed 11 --threads 1
	bash scripts/bench_run.sh $(BUILD)
	bash scripts/bench_policies.sh $(BUILD)

# `kvtier run` at 32K, 128K, 512K and 1M, three runs each: step time, the ratio to full attention,
# needle hit, peak RSS and index bytes as median and range, in a table and a plot (the 1M runs
# take the most: full attention over 1M tokens is their baseline). KVTIER_BENCH_CONTEXTS and
# KVTIER_BENCH_RUNS change the set.
bench-scaling: configure
	cmake --build $(BUILD) -j $(JOBS) --target kvtier_cli
	bash scripts/bench_scaling.sh $(BUILD)

# Where the 128K decode step's CPU time goes, by part (perf; scripts/profile_step.sh).
profile-step: configure
	cmake --build $(BUILD) -j $(JOBS) --target kvtier_cli
	bash scripts/profile_step.sh $(BUILD)

# Retrieval overhead by context (32K, 128K, 1M) and index kind; the 1M runs take minutes.
bench-retrieval: build
	bash scripts/bench_retrieval.sh $(BUILD)

# One command on a lent GPU machine: CUDA build, the cuda kernel tests, the GPU measurements
# (scripts/gpu_check.sh; its own build directory). Record what it prints in docs/gpu.md.
GPU_OUT ?= gpu-out
gpu-check:
	bash scripts/gpu_check.sh $(GPU_OUT)

clean:
	rm -rf $(BUILD) $(ASAN_BUILD) $(TSAN_BUILD) $(GPU_EMU_BUILD)
