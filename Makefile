# Two entry points (see README): `make main` (the main job) and `make test` (the project's tests).
# Everything else here is how they get a working environment on a fresh machine.

PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# In this order: the engines run in two xdist lanes (one group per engine, given to the worker
# that frees first), so no two engines of one family (vLLM, LMCache) overlap on a 2-core runner.
REAL_ENGINES ?= vllm lmcache sglang-server vllm-lmcache sglang dynamo omlx vllm-obj dynamo-vllm
# `make mutants` judges these in a session of their own. lmcache-redis was moved out when two
# LMCache stacks in one session seemed to disturb each other; both symptoms had other causes
# since found (LMCache's 1 Hz eviction loop; a client signalled before its finalizers unlinked
# its segments). `make engines` runs it as the last xdist lane group.
SEPARATE_ENGINES ?= lmcache-redis
RESULTS ?= results
# The mutation matrix (the self-tests' if they wrote one, else the committed one): report pages
# list each check's kills.
# Expanded where used (after selftest has run), not here.
# The per-engine proof table of `make mutants`: real engines' pages list what violated their measures.
KILLS = --mutation-matrix $(firstword $(wildcard $(RESULTS)/selftest/mutation-matrix.json) docs/mutation-matrix.json) \
  $(if $(wildcard docs/mutants.json),--proof docs/mutants.json)

.PHONY: main test lint envs selftest selftest-harness selftest-engines engines matrix mutants mutants-smoke history venv clean example-llamacpp

venv: $(VENV)/.ready

# torch first, pinned to the CPU build, so nothing pulls a multi-GB CUDA torch.
$(VENV)/.ready: pyproject.toml
	@echo "[setup] suite environment in $(VENV)"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --progress-bar off "torch==2.13.0+cpu" \
	  || $(BIN)/python -m pip install -q --progress-bar off "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
	$(BIN)/python -m pip install -q --progress-bar off -e '.[reference,dev]'
	touch $@

# The main job: every suite against the default (reference) engine, with the Allure report.
main: venv
	$(BIN)/kvconform run --results-dir $(RESULTS)/main --report-dir $(RESULTS)/main/report $(KILLS)

# The project's tests: lint, harness self-tests + mutation matrix + contract tests, then the
# suites against the real engines (each in its own cached environment).
# The harness self-tests run while the engine environments build (a cold build is mostly
# downloads and unpacking); the self-tests that need an engine environment run after.
test: lint
	$(MAKE) -j 2 envs selftest-harness
	$(MAKE) selftest-engines engines mutants-smoke

lint: venv
	$(BIN)/ruff check .
	$(BIN)/python -m mypy

selftest: selftest-harness selftest-engines

selftest-harness: venv
	$(BIN)/python -m pytest tests -n 2 --dist loadfile --ignore tests/system/attach -m "not engine_env" \
	  --results-dir $(RESULTS)/selftest --durations=25

# After the environments: self-tests marked `engine_env` launch or parse in a built engine
# environment (tests/system/engine_envs.py) and skip, saying so, where it is missing.
selftest-engines: envs
	$(BIN)/python -m pytest tests -n 2 --dist loadfile --ignore tests/system/attach -m engine_env \
	  --results-dir $(RESULTS)/selftest-engines --durations=10

envs: venv
	$(BIN)/kvconform env build $(REAL_ENGINES) $(SEPARATE_ENGINES)  # by engine: lmcache-redis builds lmcache's

# The report and the dashboard are written whatever the checks' outcome; the exit code is pytest's.
engines: envs
	$(BIN)/python -m pytest kvconform/suites $(addprefix --engine ,$(REAL_ENGINES) $(SEPARATE_ENGINES)) -n 2 --dist loadgroup \
	  --results-dir $(RESULTS)/engines --alluredir $(RESULTS)/engines/allure -rsfE --tb=short --durations=25; code=$$?; \
	$(BIN)/kvconform report $(RESULTS)/engines/allure --results $(RESULTS)/engines --out $(RESULTS)/engines/report \
	  $(KILLS) || echo "[engines] report not generated"; \
	$(BIN)/kvconform dashboard $(RESULTS)/engines | tail -1; exit $$code
	$(BIN)/python -m pytest tests/system/attach --results-dir $(RESULTS)/attach

clean:
	rm -rf $(VENV) $(RESULTS)

# Long run, not part of CI: the mutation matrix with every fault of the reference engine and of
# the test doubles run (docs/mutation-matrix.md + .json, dated, with the commit). The self-tests
# read these runs as evidence and remake only the smoke faults and those whose checks, engine or
# declaration changed since (tests/system/mutation_runs.py).
matrix: venv
	KVCONFORM_MATRIX=full $(BIN)/python -m pytest tests/system/test_mutation_matrix.py tests/system/test_engine_only_checks.py \
	  -p no:cacheprovider --results-dir $(RESULTS)/matrix

# Long run, not part of CI: every engine's full run, then each engine's mutants (small patches of
# its own code, each adapter's mutants.toml) against the same checks as the clean engine, and the
# per-engine proof table: docs/mutants.md (+ .json), dated, with the commit.
mutants: envs
	-$(BIN)/python -m pytest kvconform/suites $(addprefix --engine ,$(REAL_ENGINES)) --results-dir $(RESULTS)/judged -q
	-for e in $(SEPARATE_ENGINES); do \
	  $(BIN)/python -m pytest kvconform/suites --engine $$e --results-dir $(RESULTS)/judged-$$e -q; done
	$(BIN)/kvconform mutants --judged $(RESULTS)/judged $(addprefix --judged $(RESULTS)/judged-,$(SEPARATE_ENGINES)) \
	  --work $(RESULTS)/mutants --out docs/mutants.md

# In CI, after `engines`: one fast mutant per engine against the engines run's clean records, so
# the machinery itself stays tested (the full table is `make mutants`). Two at a time, in this
# order so the two LMCache stacks do not overlap; any failure fails the target (xargs exits 123).
SMOKE_MUTANTS ?= vllm:eviction_unannounced lmcache:fs_l2_listeners_unfired sglang-server:eviction_unannounced \
  sglang:transfer_bytes_ignore_fanout omlx:exact_hit_state_at_n lmcache-redis:l2_restore_on_access \
  vllm-obj:obj_key_per_process vllm-lmcache:cache_salt_not_hashed dynamo:gpu_blocks_override_dropped \
  dynamo-vllm:cache_salt_not_forwarded
mutants-smoke: venv
	printf '%s\n' $(SMOKE_MUTANTS) | xargs -P 2 -n 1 sh -c 'e=$${0%%:*}; \
	  exec $(BIN)/kvconform mutants --engine $$e --mutant $${0#*:} --clean-from $(RESULTS)/engines \
	    --work $(RESULTS)/mutants-smoke/$$e --out $(RESULTS)/mutants-smoke/$$e.md'

# Not part of CI: the seventh engine, out of tree (examples/llamacpp_adapter: llama.cpp's
# llama-server, built from source in its own environment, ~5 min on 2 cores). Installed the way a
# team installs its adapter: a venv with the suite and the adapter package, then the suites.
example-llamacpp:
	$(PYTHON) -m venv $(RESULTS)/llamacpp-venv
	$(RESULTS)/llamacpp-venv/bin/pip install -q --progress-bar off -e . -e examples/llamacpp_adapter
	$(RESULTS)/llamacpp-venv/bin/kvconform env build llamacpp
	cd $(RESULTS) && llamacpp-venv/bin/python -m pytest --pyargs kvconform.suites --engine llamacpp \
	  --results-dir llamacpp -q -p no:cacheprovider

# Long run, not part of CI: the release-history corpus (kvconform/history/defects.toml). Builds each
# bug's last bad and first fixed release (environments cached like the others), runs its check on
# both, and writes docs/history.md (+ .json): caught when the bad release violates the measure and
# the fixed one holds it. `HISTORY_ONLY="id id"` runs some and keeps the others' last verdicts.
HISTORY_ONLY ?=
history: venv
	$(BIN)/kvconform history --work $(RESULTS)/history --out docs/history.md \
	  $(if $(HISTORY_ONLY),--merge $(addprefix --only ,$(HISTORY_ONLY)))
