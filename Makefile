# specmesh: `make run` starts the local mesh on the default model, `make test` runs the suite.
# Both do all set-up first (idempotent): venv, CPU torch, deps, protobuf stubs, model fetch.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.specmesh-installed
PROTOS := $(wildcard protos/specmesh/v1/*.proto)
STUBS := specmesh/v1/specmesh_pb2.py specmesh/v1/specmesh_pb2_grpc.py specmesh/v1/admin_pb2.py specmesh/v1/admin_pb2_grpc.py
# optional extras: ray (`specmesh ray`, tests/e2e/test_ray.py) is a 79 MB CPU-only wheel, cheap next to
# torch, so it is installed by default; `make setup EXTRAS=test` skips it (test_ray.py then skips)
EXTRAS ?= test,ray

.PHONY: setup venv deps protos model kernel run test test-unit chaos clean

setup: deps protos model kernel

$(VPY):
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip

# torch first, pinned to the CPU build, so nothing later can pull a multi-GB CUDA build.
$(STAMP): pyproject.toml | $(VPY)
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e '.[$(EXTRAS)]'
	@if ! command -v redis-server >/dev/null 2>&1; then \
	  echo "installing redis-server"; (apt-get update -qq && apt-get install -y -qq redis-server) || \
	  echo "warning: could not install redis-server"; fi
	touch $(STAMP)

deps: $(STAMP)

$(STUBS): $(PROTOS) | $(STAMP)
	$(VPY) -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. --pyi_out=. $(PROTOS)

protos: $(STUBS)

model: deps
	$(VPY) -m specmesh.cli fetch-model

# the CPU verify kernel, compiled once and cached (it reports, never fails, where it cannot build)
kernel: deps
	$(VPY) -m specmesh.engine.cpu_gemm

run: setup
	$(VPY) -m specmesh.cli up $(ARGS)

test: setup
	$(VPY) -m pytest -ra $(PYTEST_ARGS)

test-unit: deps protos
	$(VPY) -m pytest -ra tests/unit

# the full reliability suite (docs/reliability.md): its own meshes on loopback, ~35 minutes
chaos: setup
	$(VPY) -m specmesh.cli chaos --docs docs/reliability.md $(ARGS)

clean:
	rm -f $(STUBS) specmesh/v1/*_pb2.pyi
