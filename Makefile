# make demo | make test | make bench  -- each creates .venv if missing and installs what it needs.
# make test-lowest: the suite in .venv-lowest, on exactly the lowest versions pyproject.toml
# allows (constraints-lowest.txt); make test runs on the newest it allows.
# make image: the shard and demo images, with docker if it answers, else podman (docker/images.py;
# where no image registry is reachable it first makes a Python base from Debian's mirror).
# make test-image: those images and docker-compose.yml run for real (docker/image_e2e.py).
# make bench-peers: the same bench next to TensorFlow, PyTorch RPC, Ray and Redis, from its own
# virtualenv (.venv-peers, ~3 GB) so their pins stay out of .venv.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip --disable-pip-version-check -q

LOWEST_VENV := .venv-lowest
LOWEST_BIN  := $(LOWEST_VENV)/bin

PEERS_VENV := .venv-peers
PEERS_BIN  := $(PEERS_VENV)/bin

.PHONY: demo test test-lowest image test-image bench bench-peers redis-server chromium etcd lint typecheck clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip

# One stamp per extra, remade when pyproject.toml changes.
$(VENV)/.stamp-%: pyproject.toml | $(BIN)/python
	$(PIP) install -e '.[$*]'
	@touch $@

demo: $(VENV)/.stamp-demo
	$(BIN)/paramshard demo

# The suite runs in one pytest process per core and one more (pytest-xdist), each test file
# whole in one of them (--dist loadfile: a module's shared fleet is started once). The shard,
# worker and tool processes its tests start keep the cores busy most of the time; the rest its
# tests wait (for a lease to end, a timeout, a frozen replica), and the extra process fills
# those waits. `PYTEST_ARGS=-n0 make test` runs them one at a time.
PYTEST_ARGS ?= -n $(shell $(PYTHON) -c "import os; print((os.cpu_count() or 1) + 1)") --dist loadfile

test: lint typecheck chromium etcd
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# Debian's chromium and its driver, for the browser tests (tests/e2e/test_dashboard.py);
# installed with apt-get when missing and we are root. Otherwise this says what to install,
# and that test module skips saying so (it fails under CI).
chromium:
	@{ command -v chromium >/dev/null && command -v chromedriver >/dev/null; } \
	  || { [ "$$(id -u)" = 0 ] && apt-get update -qq \
	       && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; } \
	  || echo "the browser tests need chromium and chromium-driver:" \
	          "apt-get install -y chromium chromium-driver" >&2

# Debian's etcd-server, for the leadership tests (tests/helpers/etcd.py starts one per test
# module); installed with apt-get when missing and we are root. Otherwise this says what to
# install, and those tests skip saying so (they fail under CI).
etcd:
	@command -v etcd >/dev/null \
	  || { [ "$$(id -u)" = 0 ] && apt-get update -qq \
	       && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server; } \
	  || echo "the leadership tests need etcd: apt-get install -y etcd-server" >&2

# ruff's rules and its formatting (pyproject.toml [tool.ruff]); part of make test. `ruff format`
# and `ruff check --fix` make most of what they ask.
lint: $(VENV)/.stamp-test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# mypy --strict on the SDK (pyproject.toml [tool.mypy]); part of make test.
typecheck: $(VENV)/.stamp-test
	$(BIN)/mypy

$(LOWEST_VENV)/.stamp: pyproject.toml constraints-lowest.txt
	test -x $(LOWEST_BIN)/python || $(PYTHON) -m venv $(LOWEST_VENV)
	$(LOWEST_BIN)/python -m pip --disable-pip-version-check -q install --upgrade pip
	$(LOWEST_BIN)/python -m pip --disable-pip-version-check -q install \
	  -c constraints-lowest.txt -e '.[test]'
	@touch $@

test-lowest: $(LOWEST_VENV)/.stamp chromium etcd
	$(LOWEST_BIN)/python -m pytest -q $(PYTEST_ARGS)

image:
	$(PYTHON) docker/images.py build

# Installs podman, runc and debootstrap with apt-get when no engine runs and we are root; exits
# non-zero when no engine can run here, unless PARAMSHARD_SKIP_IMAGE=1 (then it says so and skips).
test-image: $(VENV)/.stamp-image
	$(BIN)/python docker/image_e2e.py

bench: $(VENV)/.stamp-bench
	$(BIN)/python -m bench $(BENCH_ARGS)

# torch is pinned in the `peers` extra to the CPU wheel these machines carry.
$(PEERS_VENV)/.stamp: pyproject.toml
	test -x $(PEERS_BIN)/python || $(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_BIN)/python -m pip --disable-pip-version-check -q install --upgrade pip
	$(PEERS_BIN)/python -m pip --disable-pip-version-check -q install -e '.[peers]'
	@touch $@

# Debian's redis-server; installed with apt-get when missing and we are root.
redis-server:
	@command -v redis-server >/dev/null || { [ "$$(id -u)" = 0 ] \
	  && apt-get update -q && apt-get install -y -q redis-server; } \
	  || { echo "bench-peers needs redis-server: apt-get install -y redis-server" >&2; exit 1; }

bench-peers: $(PEERS_VENV)/.stamp redis-server
	$(PEERS_BIN)/python -m bench --peers $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(LOWEST_VENV) $(PEERS_VENV) build *.egg-info .pytest_cache .hypothesis .mypy_cache bench/results
