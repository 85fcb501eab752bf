# kvtier — two commands for a newcomer:  `make run`  and  `make test`.
BUILD      ?= build
JOBS       ?= $(shell nproc)
KVTIER_CUDA ?= auto
CMAKE_ARGS ?=
# The main job: a long-sequence run on the default embedded setup (see README).
RUN_ARGS   ?= --context 131072 --data-dir $(BUILD)/run-data --json $(BUILD)/run-report.json

.PHONY: all deps configure build run test bench bench-retrieval clean

all: build

deps:
	@bash scripts/deps.sh

$(BUILD)/build.ninja: CMakeLists.txt | deps
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVTIER_CUDA=$(KVTIER_CUDA) $(CMAKE_ARGS)

configure: deps $(BUILD)/build.ninja

build: configure
	cmake --build $(BUILD) -j $(JOBS)

run: build
	rm -rf $(BUILD)/run-data
	./$(BUILD)/kvtier run $(RUN_ARGS)

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) --timeout 900

bench: build
	./$(BUILD)/kvtier_bench --benchmark_min_time=0.2
	bash scripts/bench_run.sh $(BUILD)
	bash scripts/bench_policies.sh $(BUILD)

# Retrieval overhead by context (32K, 128K, 1M) and index kind; the 1M runs take minutes.
bench-retrieval: build
	bash scripts/bench_retrieval.sh $(BUILD)

clean:
	rm -rf $(BUILD)
