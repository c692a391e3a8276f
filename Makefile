# The two commands of the README: `make pipeline` (default profile end to end) and `make test`.
# Both create .venv from requirements.txt first when it is missing or out of date.
VENV := .venv
PY := $(VENV)/bin/python
PROFILE ?= default

$(VENV)/.installed: requirements.txt pyproject.toml setup.sh
	./setup.sh
	touch $@

.PHONY: pipeline test
pipeline: $(VENV)/.installed
	$(PY) flows/full_pipeline.py --config $(PROFILE)

test: $(VENV)/.installed
	$(PY) -m pytest -q --timeout 1200 -n 2 --dist loadfile --no-loadscope-reorder
