# Two commands from a fresh clone:
#
#   make run     train the default job (ARGS="..." passes main.py flags: make run ARGS="--bundle-shape 2,1")
#   make test    run the test suite (ARGS="..." passes pytest arguments: make test ARGS='-m "not slow"')
#
# Both create a virtual environment in .venv on first use and install what it lacks; later calls
# only run. The environment sees the system's packages, so an installed PyTorch is used as it is
# instead of being downloaded again (pip installs only what is missing or outside the ranges of
# requirements.txt).
#
# On a machine with an NVIDIA GPU, in the same environment as make test:
#
#   make gpu-check   the NCCL tests, NCCL training runs and the GPU benchmark, each with a timeout;
#                    writes gpu-check-report.md and .json; exits 1 if any failed, 2 without CUDA
#                    (ARGS="..." passes scripts/gpu_check.py flags: ARGS="--timeout 900")

# The interpreter whose packages (PyTorch) the environment reuses.
PYTHON ?= $(shell command -v python 2>/dev/null || command -v python3)
VENV ?= .venv
ARGS ?=

BIN := $(VENV)/bin
# The oldest transformers release models are cut with (models/hf.py SUPPORTED), with the
# huggingface-hub and tokenizers it needs, in a directory of its own that
# tests/unit/test_hf_releases.py puts first on PYTHONPATH: the environment keeps the newest.
HF_OLDEST := 4.56.2
HF_OLDEST_DIR := $(VENV)/transformers-$(HF_OLDEST)
# The linters pip installs (hadolint, shellcheck) are found on PATH, by the tests too.
WITH_VENV := PATH="$(abspath $(BIN)):$$PATH"
RUN := $(WITH_VENV) $(BIN)/python

.PHONY: run test lint gpu-check

run: $(VENV)/.runtime
	$(RUN) main.py $(ARGS)

# The suite on $(TEST_WORKERS) pytest-xdist workers, each test file on one worker (its module
# fixtures built once): most tests wait on processes they started, so workers overlap what one
# would leave idle. TEST_WORKERS=0 runs it in this process. Its end says the wall time and how
# busy the machine's CPUs were (tests/conftest.py).
TEST_WORKERS ?= 2
test: $(VENV)/.dev $(HF_OLDEST_DIR)/.installed
	$(RUN) -m pytest -q -ra --durations=25 -n $(TEST_WORKERS) --dist loadfile $(ARGS)

gpu-check: $(VENV)/.gpu
	$(RUN) scripts/gpu_check.py --json gpu-check-report.json $(ARGS)

lint: $(VENV)/.dev
	$(RUN) -m mypy
	$(RUN) -m ruff check .
	$(RUN) -m ruff format --check .
	$(WITH_VENV) hadolint Dockerfile
	$(WITH_VENV) shellcheck scripts/*.sh scripts/slurm/bundle.sbatch docker/entrypoint.sh .ci/run

# Without ensurepip (Debian's python3 without python3-venv) the system's pip serves the venv.
$(BIN)/python:
	$(PYTHON) -m venv --system-site-packages $(VENV) \
	  || $(PYTHON) -m venv --system-site-packages --without-pip $(VENV)

# bundle itself is installed editable (-e .): scripts and tests import it from the working tree.
$(VENV)/.runtime: requirements.txt pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -r requirements.txt
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

# gpu-check needs the runtime and pytest only, so a GPU image without the linters (or without a
# registry: PIP_NO_INDEX=1 PIP_FIND_LINKS=wheels/) runs it. An image whose python is itself a
# virtual environment holding torch: make gpu-check VENV=/that/venv (a venv made from a venv sees
# the base interpreter's packages, not its parent's).
$(VENV)/.gpu: requirements-test.txt requirements.txt pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -r requirements-test.txt
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	touch $@ $(VENV)/.runtime

$(HF_OLDEST_DIR)/.installed: | $(BIN)/python
	$(BIN)/python -m pip install -q --no-deps --upgrade --target $(HF_OLDEST_DIR) \
	  transformers==$(HF_OLDEST) huggingface-hub==0.36.2 tokenizers==0.22.2
	PYTHONPATH=$(HF_OLDEST_DIR) $(BIN)/python -c "import transformers; transformers.GPT2Config()"
	touch $@

$(VENV)/.dev: requirements-dev.txt requirements-test.txt requirements.txt pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -r requirements-dev.txt
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	touch $@ $(VENV)/.runtime $(VENV)/.gpu
