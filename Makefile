# Two entry points (see README): `make demo` and `make test`. Both create/update .venv.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
MLX_LM_VERSION = $(shell $(PY) -c "import importlib.metadata as m; print(m.version('mlx-lm'))")
MLX_LM_SDIST   := .cache/mlx-lm-sdist
# The second run of the version-sensitive tests: the oldest versions supported, mlx 0.31.2 and
# mlx-lm 0.31.3 (the lines mlx-openai-server and mlx-omni-server pin mlx to, and vllm-mlx, Rapid-MLX
# and mlx-openai-server mlx-lm), in a venv of its own built by uv from PyPI (~20 s; pip ~3 min).
MLX_031       := .venv-mlx-031
MLX_031_PINS  := mlx==0.31.2 mlx-lm==0.31.3
MLX_031_TESTS := tests/test_core.py tests/core/test_graph.py tests/attach/test_attach.py tests/core/test_fix.py \
                 tests/test_readings.py tests/commands/test_serve.py tests/tiny/test_tiny.py

.PHONY: demo test test-mlx-031 test-peers lint lint-imports package-tree typecheck docs docs-image system-deps sdist bench clean

# uv installs what pip would, in seconds instead of minutes (pip stays in the venv for the tests).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U pip uv
	$(VENV)/bin/uv pip install -q --python $(PY) -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/mlx-watchdog demo $(ARGS)

# The manual (docs/) as a site in site/. tests/test_docs.py builds it with --strict (every link
# and anchor checked) and runs every ```python block of README.md and docs/.
docs: $(STAMP)
	$(VENV)/bin/mkdocs build

# The README's picture: the demo's passes drawn by --plot (tiny model, a few seconds).
docs-image: $(STAMP)
	$(VENV)/bin/mlx-watchdog demo --max-tokens 200 --no-metrics --plot docs/img/demo.png

# Prometheus, promtool and Alertmanager come from Debian's packages. As root we install them;
# otherwise the tests that need them skip loudly (never in CI, where CI=true makes them fail).
system-deps:
	@if command -v promtool >/dev/null && command -v prometheus >/dev/null && \
	    (command -v prometheus-alertmanager >/dev/null || command -v alertmanager >/dev/null); then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
	        prometheus prometheus-alertmanager; \
	else echo "WARNING: prometheus/promtool/alertmanager missing and not root: their tests will be skipped"; fi

# mlx-lm's own model test suite, from its source distribution on PyPI (tests/test_models.py).
$(MLX_LM_SDIST)/.done: $(STAMP)
	rm -rf $(MLX_LM_SDIST) && mkdir -p $(MLX_LM_SDIST)
	$(PY) -m pip download -q --no-deps --no-binary :all: -d $(MLX_LM_SDIST) "mlx-lm==$(MLX_LM_VERSION)"
	tar -xzf $(MLX_LM_SDIST)/mlx_lm-*.tar.gz -C $(MLX_LM_SDIST)
	touch $@

sdist: $(MLX_LM_SDIST)/.done

# lint and typecheck first: CI fails on them before the tests run (and before minutes of tests).
test: lint typecheck system-deps $(STAMP) sdist
	MLX_LM_SDIST=$(MLX_LM_SDIST) $(PY) -m pytest -q -p no:cacheprovider --ignore=tests/test_peers.py \
	    --ignore=tests/test_peers_rapid.py
	$(MAKE) test-mlx-031
	$(MAKE) test-peers

# The same package and its test extras, mlx and mlx-lm pinned (uv comes with the test extras).
$(MLX_031)/.installed: pyproject.toml $(STAMP)
	rm -rf $(MLX_031)
	$(VENV)/bin/uv venv -q --python $(PY) $(MLX_031)
	VIRTUAL_ENV=$(MLX_031) $(VENV)/bin/uv pip install -q -e '.[test]' $(MLX_031_PINS)
	touch $@

# Tests marked mlx_lm_neutral (the machine under load, or MLX's export at depth) ran once, in the main run.
test-mlx-031: $(MLX_031)/.installed
	$(MLX_031)/bin/python -c "import mlx.core as mx, mlx_lm; assert (mx.__version__, mlx_lm.__version__) == ('0.31.2', '0.31.3')"
	$(MLX_031)/bin/python -m pytest -q -p no:cacheprovider -m "not mlx_lm_neutral" $(MLX_031_TESTS)

# The servers users run (vllm-mlx, mlx-vlm's server; Rapid-MLX), from PyPI, in environments of
# their own cached outside the clone (tests/peers/envs.py, ~/.cache/mlx-watchdog/peers: one for
# vllm-mlx and mlx-vlm, one for Rapid-MLX, whose module is named vllm_mlx too), then their
# end-to-end tests under `mlx-watchdog run`, and the check of mlx-vlm's own cache-evaluation
# cadence against its source (the main run skips it where the environment is not built yet). A
# failed install fails under CI=true; elsewhere the tests skip loudly.
test-peers: $(STAMP)
	$(PY) tests/peers/envs.py || [ "$$CI" != true ]
	$(PY) -m pytest -q -p no:cacheprovider tests/test_peers.py tests/test_peers_rapid.py \
	    tests/core/test_sawtooth.py::test_the_cadence_reproduced_is_mlx_vlm_s_own

# ruff (lint and format), import-linter and mypy, as configured in pyproject.toml. The last two read
# the package through .cache/package, links that put exporters/ inside mlx_watchdog as the wheel
# does (neither can map folders onto package names).
PACKAGE_TREE := .cache/package

package-tree:
	rm -rf $(PACKAGE_TREE) && mkdir -p $(PACKAGE_TREE)/mlx_watchdog
	for f in watchdog/*; do ln -s "$$PWD/$$f" $(PACKAGE_TREE)/mlx_watchdog/; done
	ln -s "$$PWD/exporters" $(PACKAGE_TREE)/mlx_watchdog/exporters

lint: $(STAMP) lint-imports
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The import contracts (tool.importlinter): layers, who may import the tiny models, no circle.
lint-imports: $(STAMP) package-tree
	PYTHONPATH=$(PACKAGE_TREE) $(VENV)/bin/lint-imports --no-cache

typecheck: $(STAMP) package-tree
	$(VENV)/bin/mypy -p mlx_watchdog

# The benchmark suite (benchmarks/README.md): not part of `make test`, it takes about an hour and
# needs a quiet machine. Results go to BENCH_OUT; benchmarks/results/ keeps the curated ones.
bench: BENCH_OUT ?= .cache/bench
bench: $(STAMP)
	mkdir -p $(BENCH_OUT)
	$(PY) benchmarks/paired_speed.py --model llama --layers 48 --steps 2500 --reps 40 --chunk 25 \
	    --variants unwatched,aa,watched,fix --time-box 900 --jsonl $(BENCH_OUT)/speed_steady.jsonl --out $(BENCH_OUT)/speed_steady.md
	$(PY) benchmarks/paired_speed.py --model qwen3_next --layers 48 --batch 4 --steps 2500 --reps 5 --chunk 16 \
	    --variants unwatched,aa,fix,every256,handfix --compare fix:every256,fix:handfix --time-box 900 \
	    --jsonl $(BENCH_OUT)/speed_long.jsonl --out $(BENCH_OUT)/speed_long.md
	$(PY) benchmarks/observe_stall.py --out $(BENCH_OUT)/observe_stall.md
	rm -rf $(BENCH_OUT)/head && mkdir -p $(BENCH_OUT)/head && git archive HEAD watchdog | tar -x -C $(BENCH_OUT)/head
	$(PY) benchmarks/step_cost.py --bytecodes --version head=$(BENCH_OUT)/head --version tree=. --layers 4 \
	    --steps 300 --skip 150 --fix --out $(BENCH_OUT)/step_cost.md
	$(PY) benchmarks/evaluated_check.py --out $(BENCH_OUT)/evaluated_check.md
	$(PY) benchmarks/scrape_pause.py --json $(BENCH_OUT)/scrape_pause.json
	$(PY) benchmarks/prefill_cost.py > $(BENCH_OUT)/prefill_cost.md
	$(VENV)/bin/mlx-watchdog scan --jobs 2 --quiet --markdown $(BENCH_OUT)/scan.md --json > $(BENCH_OUT)/scan.json

clean:
	rm -rf $(VENV) $(MLX_031) .venv-mlx-lm-031 .cache build site *.egg-info
