"""Run `llama_cpp.server` with llama.cpp's repacked weight buffers switched off.

Why: on CPUs with AMX (Intel Sapphire Rapids and later) the AMX matmul that
those buffers select segfaults in the first batched decode with the pinned
llama.cpp build; `shared/llama_backend.py` switches them off for the same
reason. llama-cpp-python's server has no option for it, so this wrapper sets
the default before the server loads its model.

    python tests/llama_server_plain_kernels.py --model M.gguf --port 8000 ...
"""

import runpy

import llama_cpp.llama_cpp as lc

_default_params = lc.llama_model_default_params


def _plain_kernel_params():  # type: ignore[no-untyped-def]
    params = _default_params()
    params.use_extra_bufts = False
    return params


lc.llama_model_default_params = _plain_kernel_params
runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)
