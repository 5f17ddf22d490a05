# Two set-up commands (see README): `make run` and `make test`. Each creates .venv when absent.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8000
DB ?= plans.sqlite
PYTEST_ARGS ?=

.PHONY: run test lint bench install-run install-test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# The service needs no torch.
$(VENV)/.run-installed: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q -e .
	touch $@

# Tests need torch (pinned CPU build), the dev tools, the model integrations' libraries and Ray
# (tests/api/test_ray_runner.py; Ray adds ~25 s and ~280 MB to a clean install).
$(VENV)/.test-installed: $(BIN)/python pyproject.toml
	# parity: Megatron-Core's own scheduler for tests/planner/test_megatron_parity.py (installs in ~11 s
	# beside the pinned torch 2.13.0, which its requirement torch>=2.6 keeps). trl: TRL's SFTTrainer
	# under DCP plans (test_hf_trainer.py's equivalence test; one pure-Python wheel, ~1 s, keeps
	# torch 2.13.0 and transformers 5.24.0).
	$(BIN)/python -m pip install -q -e '.[torch,dev,hf,ray,parity,trl]'
	touch $@ $(VENV)/.run-installed

# Debian's headless Chromium for the dashboard's browser test (tests/api/test_dashboard_browser.py;
# ~25 s once). Where apt-get is missing or we are not root, the test is skipped and says why.
$(VENV)/.browser-installed: $(BIN)/python
	@if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
	  || echo "chromium not installed: the dashboard's browser test will be skipped"; fi
	touch $@

install-run: $(VENV)/.run-installed
install-test: $(VENV)/.test-installed

# The planner service on $(HOST):$(PORT), embedded analytic cost models, plans in the SQLite file $(DB).
run: install-run
	$(BIN)/dcp serve --host $(HOST) --port $(PORT) --db $(DB)

# Two xdist workers (tests/conftest.py groups the modules), then the tests that judge measured wall
# times with nothing beside them (`alone`; exit 5 = none selected, e.g. PYTEST_ARGS naming one file).
# The `alone` part runs whether or not the first part passed; make fails if either did.
test: install-test $(VENV)/.browser-installed
	status=0; \
	$(BIN)/python -m pytest -q -n 2 --dist loadscope -m 'not alone' --durations=25 $(PYTEST_ARGS) || status=1; \
	$(BIN)/python -m pytest -q -m alone --durations=5 $(PYTEST_ARGS) || [ $$? -eq 5 ] || status=1; \
	exit $$status

lint: install-test
	$(BIN)/ruff check .
	$(BIN)/mypy costmodel planner api executor dcp_cli ingest report

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
