# Two entry points: `make run` and `make test`. Both install into .venv first.
# `make bench` reproduces the bench table, the zoo's convnets included (`make zoo` exports them once
# into .cache/zoo), and generation's tokens/s against ONNX Runtime GenAI; TUNE_TRIALS=400 adds a tuned column (hours). `make tune-db` regenerates the shipped
# tuning database (compiler/tuning_db) for this machine's vector ISA and core count (hours).
VENV := .venv
PY := $(VENV)/bin/python
PIP_CACHE_DIR ?= $(CURDIR)/.cache/pip
export PIP_CACHE_DIR

.PHONY: install run test lint bench zoo proto tune-db loadtest

TUNE_TRIALS ?= 0

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e '.[dev]'
	touch $@

install: $(VENV)/.installed

# KServe's REST client for tests/integration/test_v2.py, in an environment of its own:
# its pins (psutil<6, starlette>=1.3) clash with jitserve's.
KSERVE_VENV := .cache/kserve-venv
$(KSERVE_VENV)/.installed:
	python3 -m venv $(KSERVE_VENV)
	$(KSERVE_VENV)/bin/pip install --quiet kserve==0.21.0
	touch $@

lint: install
	$(VENV)/bin/ruff check .

test: lint $(KSERVE_VENV)/.installed
	.ci/system-packages
	$(PY) -m pytest

run: install
	$(PY) -m server

# The model zoo (loadtest/zoo.py): torchvision's convnets, ViT-B/16, GPT-2 and BERT-base with random
# weights, exported once into .cache/zoo by an environment of their own (torch is several GB; nothing
# else imports it).
# Hugging Face transformers and onnxscript (torch's dynamo exporter) for the transformers.
ZOO_VENV := .cache/zoo-venv
$(ZOO_VENV)/.installed-2:
	python3 -m venv $(ZOO_VENV)
	$(ZOO_VENV)/bin/pip install --quiet torch==2.14.1 torchvision==0.29.1 onnx==1.23.2 \
		transformers==5.24.0 onnxscript==0.7.2
	touch $@

zoo: $(ZOO_VENV)/.installed-2
	$(ZOO_VENV)/bin/python -W ignore::DeprecationWarning loadtest/zoo.py

# ONNX Runtime GenAI, generation's peer in `make bench` (loadtest/bench_generate.py), in an environment of its
# own: it brings its own onnxruntime.
GENAI_VENV := .cache/genai-venv
$(GENAI_VENV)/.installed:
	python3 -m venv $(GENAI_VENV)
	$(GENAI_VENV)/bin/pip install --quiet onnxruntime-genai==0.18.0
	touch $@

bench: install zoo $(GENAI_VENV)/.installed
	$(PY) loadtest/bench_table.py --tune-trials $(TUNE_TRIALS)
	$(PY) loadtest/bench_generate.py --genai-python $(GENAI_VENV)/bin/python

# A concurrency sweep per protocol (REST JSON, V2 binary, gRPC), perf_analyzer's way: tables and plots.
loadtest: install
	.ci/system-packages
	$(PY) loadtest/sweep.py

tune-db: install zoo
	$(PY) loadtest/tune_db.py

# The gRPC front door's descriptor set, checked in beside its .proto (tests/server/test_grpc_api.py
# fails when it differs from what this generates).
proto: install
	$(PY) -m grpc_tools.protoc -I . --descriptor_set_out=server/grpc_api/inference.binpb server/grpc_api/inference.proto
