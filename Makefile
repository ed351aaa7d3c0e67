# The two commands of the README: `make run` and `make test`. Both set up .venv first.
VENV ?= .venv
PROMPT ?= Write a haiku about memory.

.PHONY: setup run test bench

setup:
	bash scripts/setup.sh

run: setup
	$(VENV)/bin/tiered run "$(PROMPT)"

test: setup
	$(VENV)/bin/python -m pytest -q

bench: setup
	$(VENV)/bin/python benchmarks/cpu_dense.py
