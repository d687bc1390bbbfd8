"""``python -m methods.llama_server_main --config_file F``: llama-cpp-python's OpenAI-compatible
server (``python -m llama_cpp.server``), with llama.cpp's CPU extra buffer types set as the
runtime sets them (:func:`kibidango.backends.llamacpp_backend.model_params`): off on CPUs with AMX,
where llama-cpp-python 0.3.36 crashed with SIGSEGV in ``ggml_backend_amx_mul_mat`` on the first
decode of any quantized GGUF (SmolLM2-135M-Instruct's Q4_1 among them). :func:`methods.local_server.llama_cpp_server`
starts this."""

from __future__ import annotations

from kibidango.backends.llamacpp_backend import model_params

if __name__ == "__main__":
    from llama_cpp.server.__main__ import main

    with model_params():  # for the server's lifetime: it loads its models after start-up
        main()
