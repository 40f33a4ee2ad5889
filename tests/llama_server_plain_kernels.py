"""Run `llama_cpp.server` with the same kernel choice as shared/llama_backend.py.

Why: with ggml's AMX kernels compiled in (a build made on an Intel Sapphire
Rapids or later CPU), llama.cpp's repacked weight buffers select the AMX
matmul, which segfaults in the first batched decode with the pinned build.
llama-cpp-python's server has no option for it, so this wrapper switches the
buffers off (only for such a build) before the server loads its model.

    python tests/llama_server_plain_kernels.py --model M.gguf --port 8000 ...
"""

import runpy

import llama_cpp.llama_cpp as lc

from shared.llama_backend import amx_compiled

_default_params = lc.llama_model_default_params


def _safe_params():  # type: ignore[no-untyped-def]
    params = _default_params()
    params.use_extra_bufts = not amx_compiled()
    return params


lc.llama_model_default_params = _safe_params
runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)
