# kvmesh developer commands. `make run` and `make test` are the README's two commands.
.PHONY: setup run up demo status down test lint proto proto-check bench-index

VENV := .venv/bin

setup:            ## install system packages, the venv, kvmesh and the tiny model
	scripts/bootstrap.sh

run: setup        ## start the suite in the background, send one real request, show health
	$(VENV)/kvmesh up --detach
	$(VENV)/kvmesh demo
	$(VENV)/kvmesh status

up: setup         ## start the suite in the foreground (Ctrl-C stops it)
	$(VENV)/kvmesh up

status:
	$(VENV)/kvmesh status

down:
	$(VENV)/kvmesh down

test:             ## the full test command (CI runs exactly this)
	scripts/test.sh

lint:
	$(VENV)/ruff check . && $(VENV)/mypy libs services

proto:            ## regenerate libs/kvmesh/v1 from protos/
	PYTHON=$(VENV)/python scripts/gen_protos.sh

proto-check:
	PATH=$(CURDIR)/.venv/bin:$$PATH scripts/check_protos.sh
