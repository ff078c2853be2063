# Two entry points (see README): `make demo` and `make test`. Both create/update .venv.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
MLX_LM_VERSION = $(shell $(PY) -c "import importlib.metadata as m; print(m.version('mlx-lm'))")
MLX_LM_SDIST   := .cache/mlx-lm-sdist

.PHONY: demo test lint typecheck docs docs-image system-deps sdist bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	$(PY) -m pip install -q -e '.[test]'
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

test: system-deps $(STAMP) sdist
	MLX_LM_SDIST=$(MLX_LM_SDIST) $(PY) -m pytest -q -p no:cacheprovider

# ruff (lint and format) and mypy, as configured in pyproject.toml. mypy reads the package through
# .cache/typecheck, links that put exporters/ inside mlx_watchdog as the wheel does.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	rm -rf .cache/typecheck && mkdir -p .cache/typecheck/mlx_watchdog
	for f in watchdog/*; do ln -s "$$PWD/$$f" .cache/typecheck/mlx_watchdog/; done
	ln -s "$$PWD/exporters" .cache/typecheck/mlx_watchdog/exporters
	$(VENV)/bin/mypy -p mlx_watchdog

# Benchmarks are not part of `make test` (they take minutes and need a quiet machine).
bench: $(STAMP)
	$(PY) benchmarks/decode_tokens_per_s.py --model llama --steps 2000 --reps 5 --chunk 100
	$(PY) benchmarks/decode_tokens_per_s.py --model qwen3_next --steps 2000 --reps 5 --chunk 100
	$(PY) benchmarks/decode_tokens_per_s.py --model llama --layers 4 --hidden 512 --steps 600 --reps 5 --chunk 100 --variants unwatched,aa,handfix,watched,fix
	$(PY) benchmarks/decode_tokens_per_s.py --model qwen3_next --layers 4 --long --reps 3 --variants unwatched,aa,watched,fix
	$(PY) benchmarks/leak_overhead.py --steps 20000 --chunk 1000

clean:
	rm -rf $(VENV) .cache build site *.egg-info
