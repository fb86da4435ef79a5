# Every target builds its own .venv, so a fresh machine with only Python needs nothing else.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

# The real-model corpus (tests/corpus). timm without its declared dependencies: it asks for
# torchvision, which pip would take as a CUDA build of torch. torchvision is the release made
# for torch 2.13, installed outside site-packages (tests/corpus/vision_import.py says why).
TIMM        := timm==1.0.31
TORCHVISION := torchvision==0.28.0

.PHONY: demo test test-real fuzz corpus sweep bench gpu clean

$(STAMP): pyproject.toml requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	$(PY) -m pip install --quiet -e ".[test,viz]"
	$(PY) -m pip install --quiet --no-deps $(TIMM)
	$(PY) -m pip install --quiet --no-deps --upgrade --target $(VENV)/torchvision $(TORCHVISION)
	touch $(STAMP)

# The demo's run written down with its date and machine: the record the README quotes.
demo: $(STAMP)
	$(PY) -m graphopt demo --record docs/demo.md

# Within 20 minutes on a 2-core machine: unit and property tests, the real-model corpus's quick
# subset (tests/corpus/__init__.py: QUICK, REGRESSIONS), then the benchmark suite
# in quick mode so it cannot rot. Tests marked slow wait for test-real. Property tests draw the
# same examples every run (tests/hypothesis_profiles.py). The 15 slowest tests are printed so the
# 20 minutes stay in sight.
test: $(STAMP)
	TRITON_INTERPRET=1 $(PY) -m pytest tests -q -m "not slow" --durations=15
	$(PY) -m pytest bench -q --benchmark-disable -p no:cacheprovider -o testpaths=bench --quick

# Every check on every model of the real-model corpus, every pair of passes on six of them, the
# memory promise through both frontends, and the tests too slow for make test (about 2 hours on 2
# cores). Two halves run at once, a thread each: the Triton interpreter keeps one core busy per
# process, so one process would take about twice as long (the halves' test times add to 4 hours).
# The second half's output follows the first's; an interrupt stops both.
REAL := OMP_NUM_THREADS=1 TRITON_INTERPRET=1 $(PY) -m pytest tests -q -m "realmodels or slow" --corpus=all
test-real: $(STAMP)
	@log=$$(mktemp); $(REAL) --shard=1/2 >$$log 2>&1 & other=$$!; \
	trap 'kill $$other 2>/dev/null; rm -f $$log; exit 130' INT TERM; \
	$(REAL) --shard=0/2; mine=$$?; wait $$other; theirs=$$?; \
	echo "--- make test-real, the other half (--shard=1/2):"; cat $$log; rm -f $$log; \
	exit $$((mine || theirs))

# Property tests with new draws (SEED=N for a given one), 5x as many; failures replay from .hypothesis/.
fuzz: $(STAMP)
	HYPOTHESIS_PROFILE=fuzz TRITON_INTERPRET=1 $(PY) -m pytest tests -m hypothesis -q -p no:cacheprovider \
		--hypothesis-show-statistics $(if $(SEED),--hypothesis-seed=$(SEED))

# The corpus table: model x check, errors and times (bench/corpus_report.py).
corpus: $(STAMP)
	$(PY) bench/corpus_report.py

# Recompute on every corpus model from graphopt's least budget to eager, against the model's
# own checkpointing: PNGs and a table in bench/results/recompute_sweep-cpu/.
sweep: $(STAMP)
	$(PY) bench/recompute_sweep.py

bench: $(STAMP)
	$(PY) -m pytest bench -q -o testpaths=bench --benchmark-columns=min,median,max,rounds --benchmark-sort=name

# Every GPU benchmark within 8 minutes on one GPU, each in a process of its own with its own time
# limit: results and an index in bench/results/<device>-<date>/ (with $OUT set, packed into $OUT;
# bench/gpu_all.py). Builds nothing, since a GPU machine may have no network: it runs GPU_PYTHON, the
# .venv's python where there is one, else python3, which must have torch. Without CUDA: the reduced
# CPU modes. GPU_ARGS passes more, e.g. GPU_ARGS="--only fuse,rows".
GPU_PYTHON ?= $(if $(wildcard $(PY)),$(PY),python3)
gpu:
	$(GPU_PYTHON) bench/gpu_all.py $(GPU_ARGS)

clean:
	rm -rf $(VENV) graphopt-dump .pytest_cache .benchmarks .hypothesis
