"""A thin, fast layer over llama.cpp's C API (through llama-cpp-python's ctypes bindings).

Both sides use it: the device runs one sequence in a context; the cloud runs a
sequence per session in one shared context. Everything per-token stays in C or
in numpy views over llama.cpp's own buffers (no copies of the logits).

Why the low-level API rather than `llama_cpp.Llama`: one decode must give both
the next-token logits and the final hidden state (`embeddings=True`, pooling
none), and the KV cache must be truncated and shared per sequence exactly.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import llama_cpp as lc
import numpy as np

from shared.kernel_noise import from_environment as kernel_noise_from_environment
from shared.model_info import ModelInfo

log = logging.getLogger(__name__)


class ModelLoadError(RuntimeError):
    """llama.cpp could not load a model file."""


class DecodeError(RuntimeError):
    """llama_decode failed (most often: the context is full)."""


_init_lock = threading.Lock()
_initialised = False


_GGML_LOG_LEVEL_ERROR = 4  # ggml's enum: none, debug, info, warn, error, cont


@lc.llama_log_callback
def _llama_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    if level == _GGML_LOG_LEVEL_ERROR:
        log.error("llama.cpp: %s", text.decode(errors="replace").rstrip())


def _init_backend() -> None:
    global _initialised
    with _init_lock:
        if not _initialised:
            if not os.environ.get("TOKENROUTER_LLAMA_VERBOSE"):
                lc.llama_log_set(_llama_log, ctypes.c_void_p(0))
            lc.llama_backend_init()
            _initialised = True


def amx_compiled() -> bool:
    """Whether this llama.cpp build contains ggml's AMX kernels (built with -march=native on a
    CPU with AMX: Intel Sapphire Rapids and later). Their matmul segfaults in the first batched
    decode with this build (llama.cpp issue 20824), so such a build runs without repacked
    weights (see LlamaModel). A build without AMX gains only ~10% from them, so none is made."""
    global _amx
    if _amx is None:
        try:
            lib = ctypes.CDLL(str(Path(lc.__file__).parent / "lib" / "libggml-cpu.so"))
            _amx = bool(lib.ggml_cpu_has_amx_int8())
        except (OSError, AttributeError):
            _amx = False
    return _amx


_amx: bool | None = None


def default_threads() -> int:
    """llama.cpp's threads when none are asked for: the CPUs this process may run on (a process pinned to
    one core, by `--cpus` or by the test runner's workers, would otherwise spin two threads on it), at most 4."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(4, usable or 1))


class LlamaModel:
    """Weights, vocabulary and chat template of one GGUF model."""

    def __init__(self, info: ModelInfo, n_gpu_layers: int = 0, vocab_only: bool = False) -> None:
        """vocab_only: tokenizer and chat template without weights (a remote engine's front end)."""
        _init_backend()
        self.info = info
        params = lc.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        params.vocab_only = vocab_only
        # Repacked weight buffers (llama.cpp's "extra buffer types") make CPU decoding ~1.8x
        # faster, but with AMX kernels compiled in they select the AMX matmul, which crashes.
        params.use_extra_bufts = not amx_compiled()
        self.ptr = lc.llama_model_load_from_file(str(info.path).encode(), params)
        if not self.ptr:
            what = "the vocabulary of " if vocab_only else ""
            raise ModelLoadError(f"llama.cpp could not load {what}{info.path} (corrupt or unsupported GGUF?)")
        self.vocab = lc.llama_model_get_vocab(self.ptr)
        self.n_vocab = int(lc.llama_vocab_n_tokens(self.vocab))
        self.n_embd = int(lc.llama_model_n_embd(self.ptr))
        self.n_ctx_train = int(lc.llama_model_n_ctx_train(self.ptr))
        self.bos = int(lc.llama_vocab_bos(self.vocab))
        self.add_bos = bool(lc.llama_vocab_get_add_bos(self.vocab))
        self._piece = ctypes.create_string_buffer(256)
        self._pieces: dict[int, bytes] = {}
        self._template = self._load_template()
        self._formatters: dict[bool, Any] = {}  # compiled chat templates, by add_generation_prompt

    # ----------------------------------------------------------------- text <-> tokens

    def tokenize(self, text: str, add_special: bool = False, parse_special: bool = True) -> list[int]:
        """`parse_special` False: text that spells a control token (e.g. "<|im_end|>") stays text."""
        data = text.encode()
        n_max = len(data) + 8
        buf = (lc.llama_token * n_max)()
        n = lc.llama_tokenize(self.vocab, data, len(data), buf, n_max, add_special, parse_special)
        if n < 0:
            raise ValueError(f"tokenizer needs {-n} slots for a {len(data)}-byte text")
        return list(buf[:n])

    def token_bytes(self, token: int) -> bytes:
        """Bytes of a token as it reads in text; control tokens (e.g. <|im_end|>) read as nothing."""
        piece = self._pieces.get(token)
        if piece is None:
            n = lc.llama_token_to_piece(self.vocab, token, self._piece, len(self._piece), 0, False)
            piece = self._piece.raw[: max(n, 0)]
            self._pieces[token] = piece
        return piece

    def detokenize(self, tokens: Sequence[int]) -> str:
        return b"".join(self.token_bytes(t) for t in tokens).decode("utf-8", errors="replace")

    def is_eog(self, token: int) -> bool:
        return bool(lc.llama_vocab_is_eog(self.vocab, token))

    @property
    def eog_token(self) -> int:
        """The token that ends an answer (end of turn: EOS when it ends generation, else EOT)."""
        eos = int(lc.llama_vocab_eos(self.vocab))
        return eos if eos >= 0 and self.is_eog(eos) else int(lc.llama_vocab_eot(self.vocab))

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    # ----------------------------------------------------------------- chat template

    def _load_template(self) -> str | None:
        raw = lc.llama_model_chat_template(self.ptr, None)
        return raw.decode() if raw else None

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render chat messages with the GGUF's own Jinja template (plain text if it has none).

        The template is compiled once per model: compiling it took ~3 ms a call, and every answer
        renders its prompt before its first token (as does every partial transcript's prefill)."""
        if self._template is None:
            lines = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
            return "\n".join(lines) + ("\nAssistant:" if add_generation_prompt else "")
        formatter = self._formatters.get(add_generation_prompt)
        if formatter is None:
            from llama_cpp.llama_chat_format import Jinja2ChatFormatter

            bos = self.token_bytes(self.bos).decode(errors="replace") if self.bos >= 0 else ""
            formatter = Jinja2ChatFormatter(
                self._template, eos_token="", bos_token=bos, add_generation_prompt=add_generation_prompt
            )
            self._formatters[add_generation_prompt] = formatter
        return formatter(messages=messages).prompt

    def chat_tokens(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return self.prompt_tokens(self.render_chat(messages, add_generation_prompt))

    def prompt_tokens(self, text: str) -> list[int]:
        """Tokens of rendered prompt text (or a prefix of it), with BOS when the model wants one."""
        tokens = self.tokenize(text, add_special=False)
        if self.add_bos and self.bos >= 0 and (not tokens or tokens[0] != self.bos):
            tokens.insert(0, self.bos)
        return tokens

    def close(self) -> None:
        if self.ptr:
            lc.llama_model_free(self.ptr)
            self.ptr = None


@dataclass(frozen=True, slots=True)
class DecodeItem:
    """Tokens to append to one sequence, starting at position `pos`."""

    seq: int
    pos: int
    tokens: Sequence[int]


class LlamaContext:
    """A KV cache and compute buffers for up to `n_seq` sequences of one model.

    `decode` appends tokens to sequences in one batch and requests outputs
    (logits and hidden state) only for each item's last token; `logits(i)` and
    `hidden(i)` are numpy views over llama.cpp's buffers, valid until the next
    decode.
    """

    def __init__(
        self,
        model: LlamaModel,
        n_ctx: int = 2048,
        n_seq: int = 1,
        n_batch: int = 512,
        threads: int | None = None,
        embeddings: bool = True,
        kv_unified: bool = True,
    ) -> None:
        """kv_unified: sequences share one pool of n_ctx KV cells (the pool is the memory budget);
        False gives each sequence n_ctx / n_seq cells, so attention never scans other sessions' cells."""
        self.model = model
        self.n_seq = n_seq
        self.n_batch = n_batch
        params = lc.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = n_batch
        params.n_ubatch = n_batch
        params.n_seq_max = n_seq
        params.kv_unified = kv_unified
        params.embeddings = embeddings
        params.pooling_type = lc.LLAMA_POOLING_TYPE_NONE
        params.n_threads = params.n_threads_batch = threads or default_threads()
        self.ptr = lc.llama_init_from_model(model.ptr, params)
        if not self.ptr:
            raise ModelLoadError(f"llama.cpp could not create a context of {n_ctx} cells for {model.info.name}")
        self.n_ctx = int(lc.llama_n_ctx(self.ptr))
        self.mem = lc.llama_get_memory(self.ptr)
        self.embeddings = embeddings
        self._batch = lc.llama_batch_init(n_batch, 0, n_seq)
        self._n_outputs = 0
        noise = kernel_noise_from_environment()  # tests only (shared/kernel_noise.py); None by default
        if noise is not None:
            noise.attach(self)

    def decode(self, items: Sequence[DecodeItem]) -> list[int]:
        """Append each item's tokens; returns, per item, the output index of its last token.

        Rows longer than one batch are decoded in chunks; every item's last token
        goes into the final chunk (they are placed at the end), so all outputs are
        readable after this call.
        """
        heads = [(it.seq, it.pos + i, t) for it in items for i, t in enumerate(it.tokens[:-1])]
        lasts = [(it.seq, it.pos + len(it.tokens) - 1, it.tokens[-1]) for it in items if it.tokens]
        if len(lasts) > self.n_batch:
            raise ValueError(f"at most {self.n_batch} sequences per decode")
        rows = heads + lasts
        final_start = max(0, len(rows) - self.n_batch)
        for start in range(0, final_start, self.n_batch):
            self._run(rows[start : min(start + self.n_batch, final_start)], n_out=0)
        final = rows[final_start:]
        self._run(final, n_out=len(lasts))
        first_out = len(final) - len(lasts)
        outputs, k = [], 0
        for it in items:
            if it.tokens:
                outputs.append(first_out + k)
                k += 1
            else:
                outputs.append(-1)
        return outputs

    def decode_outputs(self, item: DecodeItem, outputs: Sequence[int]) -> list[int]:
        """Append one item's tokens with outputs at the given offsets within them (for
        verification and scoring: one forward pass, logits at several positions).

        Returns the output index of each requested offset. Tokens before the
        last batch-sized chunk are decoded first without outputs, so every
        requested offset must lie within the last `n_batch` tokens.
        """
        n = len(item.tokens)
        if any(not 0 <= o < n for o in outputs):
            raise ValueError(f"output offsets must be within [0, {n})")
        final_start = max(0, n - self.n_batch)
        if outputs and min(outputs) < final_start:
            raise ValueError(f"outputs must lie within the last {self.n_batch} tokens of the item")
        for start in range(0, final_start, self.n_batch):
            end = min(start + self.n_batch, final_start)
            self._run([(item.seq, item.pos + i, item.tokens[i]) for i in range(start, end)], n_out=0)
        want = set(outputs)
        b = self._batch
        for j, i in enumerate(range(final_start, n)):
            b.token[j] = item.tokens[i]
            b.pos[j] = item.pos + i
            b.n_seq_id[j] = 1
            b.seq_id[j][0] = item.seq
            b.logits[j] = 1 if i in want else 0
        b.n_tokens = n - final_start
        rc = lc.llama_decode(self.ptr, b)
        if rc != 0:
            raise DecodeError(self._decode_error(rc))
        return [o - final_start for o in outputs]

    def decode_one(self, seq: int, pos: int, token: int) -> None:
        """The per-token fast path: one token, output at index 0."""
        b = self._batch
        b.token[0] = token
        b.pos[0] = pos
        b.n_seq_id[0] = 1
        b.seq_id[0][0] = seq
        b.logits[0] = 1
        b.n_tokens = 1
        rc = lc.llama_decode(self.ptr, b)
        if rc != 0:
            raise DecodeError(self._decode_error(rc))

    def greedy(self, prompt: list[int], max_tokens: int, seq: int = 0) -> Iterator[tuple[int, int]]:
        """Greedy decoding of `prompt` on an empty `seq`: yields (output index, token) for each new
        token, ending after an end-of-generation token; read logits(i) / hidden(i) before the next step."""
        i = self.decode([DecodeItem(seq, 0, prompt)])[0]
        pos = len(prompt)
        for _ in range(max_tokens):
            token = int(np.argmax(self.logits(i)))
            yield i, token
            if self.model.is_eog(token):
                return
            self.decode_one(seq, pos, token)
            pos, i = pos + 1, 0

    def _run(self, rows: list[tuple[int, int, int]], n_out: int) -> None:
        b = self._batch
        n = len(rows)
        for i, (seq, pos, tok) in enumerate(rows):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = 1 if i >= n - n_out else 0
        b.n_tokens = n
        rc = lc.llama_decode(self.ptr, b)
        if rc != 0:
            raise DecodeError(self._decode_error(rc))

    def _decode_error(self, rc: int) -> str:
        if rc == 1:
            return f"KV cache full ({self.n_ctx} cells): shorten the conversation or raise n_ctx"
        return f"llama_decode failed with code {rc}"

    def logits(self, i: int) -> np.ndarray:
        ptr = lc.llama_get_logits_ith(self.ptr, i)
        return np.ctypeslib.as_array(ptr, shape=(self.model.n_vocab,))

    def hidden(self, i: int) -> np.ndarray:
        ptr = lc.llama_get_embeddings_ith(self.ptr, i)
        if not ptr:
            raise RuntimeError("no hidden state: the context was created without embeddings")
        return np.ctypeslib.as_array(ptr, shape=(self.model.n_embd,))

    # ----------------------------------------------------------------- KV cache

    def truncate(self, seq: int, n: int) -> None:
        """Forget positions >= n of a sequence (exact rollback)."""
        if not lc.llama_memory_seq_rm(self.mem, seq, n, -1):
            raise RuntimeError(f"llama.cpp refused to truncate sequence {seq} at {n}")

    def clear(self, seq: int) -> None:
        lc.llama_memory_seq_rm(self.mem, seq, -1, -1)

    def seq_len(self, seq: int) -> int:
        return int(lc.llama_memory_seq_pos_max(self.mem, seq)) + 1

    def save_seq(self, seq: int) -> bytes:
        size = lc.llama_state_seq_get_size(self.ptr, seq)
        buf = (ctypes.c_uint8 * size)()
        n = lc.llama_state_seq_get_data(self.ptr, buf, size, seq)
        return bytes(buf[:n])

    def load_seq(self, seq: int, state: bytes) -> None:
        buf = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
        if lc.llama_state_seq_set_data(self.ptr, buf, len(state), seq) == 0:
            raise RuntimeError(f"llama.cpp could not restore sequence {seq}")

    def close(self) -> None:
        if self.ptr:
            lc.llama_batch_free(self._batch)
            lc.llama_free(self.ptr)
            self.ptr = None
