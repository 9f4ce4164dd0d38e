# The checks, one at a time or together (make lint typecheck test-fast), in the venv the README sets up.
PYTHON ?= python

.PHONY: test test-fast lint typecheck docs

test:  # every test, the README's test command: the real Triton servers and the slow ones included
	$(PYTHON) -m pytest -q

test-fast:  # all but the tests marked slow (real servers, killed processes, load runs)
	$(PYTHON) -m pytest -q -m "not slow"

lint:
	$(PYTHON) -m ruff check .

# needs the TensorRT stubs: pip install --no-deps --target build/tensorrt-stubs tensorrt-stubs==10.13.0.35.1
typecheck:
	$(PYTHON) -m refusion.tools.checks.trt_stubs > /dev/null
	$(PYTHON) -m mypy

docs:  # run the examples of README.md, docs/api.md and docs/serving.md; rewrite the output blocks they show
	$(PYTHON) -m refusion.tools.doc_examples --write
