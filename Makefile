# Everything installs itself: a fresh machine needs only python3 (3.11+) and make.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.demo-installed

.PHONY: demo test quick servers lint typecheck model model-tools docs pytest chaos bench audit lock clean

# Every dependency, tools included, at the versions and hashes CI tested:
# requirements/dev.lock (and requirements/server.lock, what `serve` needs, for a
# deployment). `make lock` regenerates both from pyproject.toml.
LOCK    := requirements/dev.lock
COMPILE := $(BIN)/pip-compile --quiet --generate-hashes --allow-unsafe --strip-extras \
	--no-emit-index-url --no-emit-find-links

# The long fault-injection run: make chaos DURATION=600 WORKERS=8 JOBS=3 SEED=1
DURATION ?= 300
WORKERS  ?= 8
JOBS     ?= 3
SEED     ?= 1
# A PostgreSQL URL to run several proxies on: make chaos STORE=postgresql://... PROXIES=2
STORE    ?=
PROXIES  ?= 1
CHAOS    = $(BIN)/fenceproxy chaos --duration $(DURATION) --workers $(WORKERS) --jobs $(JOBS) \
	--seed $(SEED) --proxies $(PROXIES) $(if $(STORE),--store '$(STORE)')

# The venv is filled by uv (requirements/installer.lock, hash-pinned like the rest),
# which installs the 138 locked packages in about 12 s where pip takes a minute of
# CPU; it trusts the certificates the system does, as pip is configured to here.
# Byte-compiled as pip does: where PYTHONDONTWRITEBYTECODE is set, as on CI's
# machines, every process the tests start would otherwise compile what it imports
# (0.45 s of CPU each).
INSTALLER := requirements/installer.lock
UV := $(BIN)/uv pip install --quiet --system-certs --compile-bytecode --python $(BIN)/python
$(STAMP): pyproject.toml $(LOCK) $(INSTALLER)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --require-hashes -r $(INSTALLER)
	$(UV) --require-hashes -r $(LOCK)
	$(UV) --no-deps --no-build-isolation -e .
	touch $(STAMP) $(DEMO_STAMP)

# The demo needs the proxy and a client, not the tools (requirements/demo.lock, with
# the build backend), and leaves the `fenceproxy` command in the venv, installed from
# the checkout (editable, without dependencies: it runs the checkout's code). uv fills
# it, as it does the test venv: pip spends 7 s of CPU on the 50,000 files the index
# lists for the lock's packages, uv half a second. A venv without pip of its own, given
# uv by this Python's pip when it has one, takes a tenth of a second instead of five.
DEMO_PIP := --quiet --no-compile --disable-pip-version-check --require-hashes -r $(INSTALLER)
DEMO_UV := $(BIN)/uv pip install --quiet --system-certs --python $(BIN)/python
$(DEMO_STAMP): pyproject.toml requirements/demo.lock $(INSTALLER)
	@if [ ! -x $(BIN)/pip ] && $(PYTHON) -m pip --version >/dev/null 2>&1; then \
	  $(PYTHON) -m venv --without-pip $(VENV) && \
	  $(PYTHON) -m pip --python $(BIN)/python install $(DEMO_PIP); \
	else false; fi || { $(PYTHON) -m venv $(VENV) && $(BIN)/pip install $(DEMO_PIP); }
	$(DEMO_UV) --require-hashes -r requirements/demo.lock
	$(DEMO_UV) --no-deps --no-build-isolation -e .
	touch $(DEMO_STAMP)

## The worked example on loopback with the embedded SQLite store.
demo: $(DEMO_STAMP)
	$(BIN)/fenceproxy demo

# pytest's worker processes (pytest-xdist) for `make test` and `make quick`: the tests
# mostly wait on sockets and processes, so more workers than cores; PYTEST_WORKERS=0
# runs them in this process. Tests are dealt out one at a time, the longest first
# (tests/conftest.py). Not --dist loadgroup: it tells tests apart by node id, and
# schemathesis gives all of one test's cases the same one (four would not run).
PYTEST_WORKERS ?= 4
XDIST = $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --maxschedchunk 1)

## Lint, types, the protocol model, the documentation site and the whole test suite.
## The model check keeps one core busy for minutes and needs nothing the rest does,
## so it runs beside them, from the start (before the servers and the venv are
## installed); its report follows theirs, and its failure fails the target as theirs
## does. The servers (Debian's packages, mostly a download) and the venv are installed
## at once. The tests run at a lower priority (nice 10) while the check does: it
## keeps its core and ends first, and the tests take what is left, then both cores.
test: model-tools
	@echo "$(PYTHON) model/check.py, in the background: its report comes at the end"
	@log=$$(mktemp); $(PYTHON) model/check.py >$$log 2>&1 & model=$$!; \
	$(MAKE) --no-print-directory -j2 servers $(STAMP) && \
	$(MAKE) --no-print-directory lint typecheck docs pytest PYTEST_NICE="nice -n 10"; \
	rest=$$?; \
	wait $$model; checked=$$?; \
	echo "--- $(PYTHON) model/check.py (ran beside the above) ---"; cat $$log; rm -f $$log; \
	[ $$checked = 0 ] || echo "make: model/check.py failed (exit $$checked)"; \
	[ $$rest = 0 ] && [ $$checked = 0 ]

lint: $(STAMP)
	$(BIN)/ruff check fenceproxy tests bench examples model docs/diagrams.py
	$(BIN)/ruff format --check fenceproxy tests bench examples model docs/diagrams.py

typecheck: $(STAMP)
	$(BIN)/mypy

## The protocol model (model/fenceproxy.pml) checked by spin: the protocol passes
## within the bounds model/check.py states, and every deliberate bug in it fails with
## a counterexample. Installs Debian's spin and gcc when missing (as root).
model: model-tools
	$(PYTHON) model/check.py

model-tools:
	@if ! command -v spin >/dev/null 2>&1 || ! command -v gcc >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing spin and gcc from Debian's packages"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	      apt-get install -y -qq --no-install-recommends spin gcc libc6-dev >/dev/null; \
	  fi; \
	fi

## The documentation site (mkdocs.yml, docs/) into site/. --strict: a broken link or
## anchor, or a page left out of nav, fails. Offline: no plugin fetches anything.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

PYTEST_NICE ?=
pytest: $(STAMP) servers
	$(BIN)/python -m compileall -q fenceproxy
	$(PYTEST_NICE) $(BIN)/pytest $(XDIST)

## The inner loop: lint and the tests that start no process of their own (not slow).
quick: lint $(STAMP) servers
	$(BIN)/pytest $(XDIST) -m "not slow" -q

## Servers the tests drive for real, from Debian's packages when missing (as root):
## nginx, the reference for how an upstream resolves a request path and the
## benchmark's baseline, PostgreSQL, the shared store (the tests start a throwaway
## cluster of their own), Patroni and etcd, which fail that cluster over, wrk, the
## benchmark's load generator, curl, a client the listener is driven with (TLS,
## 100 Continue), rclone, whose recipes (docs/tools.md) are tested against S3 and
## WebDAV, chromium with its driver, the browser the operator page is tested in, and
## prometheus (with promtool), which checks and runs the alerting rules, and strace,
## which counts the benchmark's system calls (bench/syscalls.py).
servers:
	@missing=""; \
	command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || missing="$$missing nginx"; \
	command -v initdb >/dev/null 2>&1 || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 \
	  || missing="$$missing postgresql"; \
	command -v patroni >/dev/null 2>&1 || missing="$$missing patroni"; \
	command -v etcd >/dev/null 2>&1 || missing="$$missing etcd-server"; \
	command -v wrk >/dev/null 2>&1 || missing="$$missing wrk"; \
	command -v curl >/dev/null 2>&1 || missing="$$missing curl"; \
	command -v rclone >/dev/null 2>&1 || missing="$$missing rclone"; \
	command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	command -v chromedriver >/dev/null 2>&1 || missing="$$missing chromium-driver"; \
	command -v promtool >/dev/null 2>&1 || missing="$$missing prometheus"; \
	command -v strace >/dev/null 2>&1 || missing="$$missing strace"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing$$missing from Debian's packages"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	      apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	  else \
	    echo "not installed:$$missing; the tests that need them are skipped"; \
	  fi; \
	fi

## Every fault on, for DURATION seconds, then the same run against a broken build.
chaos: $(STAMP)
	$(CHAOS)
	$(CHAOS) --proxy-command "$(BIN)/python tests/broken_fence.py" --expect-violations

## fenceproxy beside nginx and the bare upstream, driven by wrk, one table of ratios,
## then a waiting claim's wake-up and the capacity model's constants (docs/capacity.md):
## make bench BENCH_ARGS="--rounds 5 --no-postgres". Installs wrk and nginx as `servers` does.
BENCH_ARGS ?=
bench: $(STAMP) servers
	$(BIN)/python bench/run.py $(BENCH_ARGS)
	$(BIN)/python bench/wake.py $(if $(findstring --no-postgres,$(BENCH_ARGS)),--no-postgres)
	$(if $(findstring --no-postgres,$(BENCH_ARGS)),,$(BIN)/python bench/capacity.py)

## Known vulnerabilities in the locked dependencies fail the build. Needs an advisory
## database (PyPI's JSON API or OSV); --strict fails rather than passing when a
## dependency cannot be audited.
audit: $(STAMP)
	$(BIN)/pip-audit --strict --require-hashes --disable-pip --progress-spinner off \
	  -r requirements/server.lock -r $(LOCK)

## Regenerate the lock files from pyproject.toml (and requirements/build.in).
lock: $(STAMP)
	$(BIN)/pip install --quiet 'pip-tools>=7.4'
	$(COMPILE) -o $(INSTALLER) requirements/installer.in
	$(COMPILE) --extra server --extra test --extra dev --extra fast --extra otel -o $(LOCK) \
	  pyproject.toml requirements/build.in
	$(COMPILE) --extra server --extra fast --extra otel -c $(LOCK) -o requirements/server.lock \
	  pyproject.toml requirements/build.in
	$(COMPILE) -c $(LOCK) -o requirements/client.lock pyproject.toml
	$(COMPILE) --extra server -c $(LOCK) -o requirements/demo.lock pyproject.toml \
	  requirements/build.in

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
