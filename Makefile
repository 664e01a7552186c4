# The two commands of the README:  make lab  (JupyterLab on notebooks/)  and  make test  (whole suite).
# Both create .venv if missing, install elasticlab with its dependencies, and build elasticlab._C.
PYTHON  ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
TORCH   ?= torch==2.13.0
PORT    ?= 8888
# JupyterLab refuses to run as root unless told; containers and CI machines often are root.
ROOTOPT := $(if $(filter 0,$(shell id -u)),--allow-root)
STAMP   := $(VENV)/.elasticlab-installed
CSRC    := $(shell find csrc -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh')
EXT     := elasticlab/.built

export TORCH_DISABLE_SHARE_RDZV_TCP_STORE := 1

.PHONY: lab test build clean

$(STAMP): pyproject.toml setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip setuptools wheel ninja
	$(BIN)/python -m pip install -q "$(TORCH)"
	ELASTICLAB_NO_EXT=1 $(BIN)/python -m pip install -q --no-build-isolation -e '.[test,ray,integrations]'
	$(BIN)/jupyter labextension disable "@jupyterlab/apputils-extension:announcements" >/dev/null
	touch $@

# Incremental (ninja) build of the extension in place.
$(EXT): $(STAMP) $(CSRC) setup.py
	MAX_JOBS=2 $(BIN)/python setup.py -q build_ext --inplace
	touch $@

build: $(EXT)

lab: build
	@echo "Starting JupyterLab on notebooks/ at http://127.0.0.1:$(PORT)/lab (the URL with its token follows)"
	cd notebooks && ../$(BIN)/jupyter lab --no-browser --ip=127.0.0.1 --port=$(PORT) \
	    --ServerApp.root_dir=. --ServerApp.open_browser=False $(ROOTOPT)

test: build
	PYTHONFAULTHANDLER=1 $(BIN)/python -m pytest $(PYTEST_ARGS)

clean:
	rm -rf build elasticlab/_C*.so $(EXT)
