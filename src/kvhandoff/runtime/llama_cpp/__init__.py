"""The llama.cpp engine: `state` reads and writes llama.cpp's sequence state, `backend` runs a model's conversations
in a llama.cpp context behind the cache seam. What scripts/setup.sh builds is named here, importable without
llama.cpp or torch."""

#: the llama-cpp-python release whose llama.cpp state layout `state` reads
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
#: how scripts/setup.sh builds it: no -march=native (it emits instructions a sandboxed CPU may refuse at run time);
#: no multimodal library (LLAVA_BUILD: llama-cpp-python loads it only for image chat handlers, which the engine
#: never uses)
LLAMA_CPP_BUILD_FLAGS = ("-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON "
                         "-DGGML_AVX512=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF "
                         "-DLLAMA_BUILD_TOOLS=OFF -DLLAMA_CURL=OFF -DLLAVA_BUILD=OFF")
INSTALL_HINT = (f'CMAKE_ARGS="{LLAMA_CPP_BUILD_FLAGS}" pip install --no-cache-dir --no-binary llama-cpp-python '
                f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION} (or bash scripts/setup.sh)")
