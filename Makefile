# Every target builds its own .venv, so a fresh machine with only Python needs nothing else.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	$(PY) -m pip install --quiet -e ".[test,viz]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m graphopt demo

# Unit tests, then the benchmark suite in quick mode so it cannot rot.
test: $(STAMP)
	TRITON_INTERPRET=1 $(PY) -m pytest tests -q
	$(PY) -m pytest bench -q --benchmark-disable -p no:cacheprovider -o testpaths=bench --quick

bench: $(STAMP)
	$(PY) -m pytest bench -q -o testpaths=bench --benchmark-columns=min,median,max,rounds --benchmark-sort=name

clean:
	rm -rf $(VENV) graphopt-dump .pytest_cache .benchmarks
