"""A cloud engine that asks an OpenAI-compatible completions server for each hard token.

Why: a 70B model runs across several GPUs in a serving engine built for it
(vLLM, SGLang, llama.cpp's server), not in this process. This server keeps
the protocol, sessions, quotas and audit; the engine behind it only ever sees
"continue this token sequence by one token, with its logprob". The whole
history is sent each time and the engine's prefix cache (vLLM
`--enable-prefix-caching`, on by default in V1) makes that cost only the new
tokens; many sessions' requests run concurrently and the engine batches them.

Prompt formats:
    ids   the prompt is a list of token ids (vLLM, SGLang, llama.cpp server):
          exact, no re-tokenization
    text  the prompt is the detokenized history (servers whose completions
          endpoint takes only strings, e.g. llama-cpp-python's server): the
          server re-tokenizes it, which may split rare generated tokens
          differently
The answer's token id is read from `tokens` (llama.cpp server, return_tokens),
from "token_id:N" logprob tokens (vLLM, return_tokens_as_token_ids), or
mapped back from the token's text through the local vocabulary.

The tokenizer comes from a GGUF of the same model loaded vocab-only (a few
MB of memory; the weights are never read).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import http.client
import json
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, TypeVar
from urllib.parse import urlsplit

import llama_cpp as lc

from cloud_server.engine_api import (
    Capabilities,
    EmptyHistory,
    EngineFailed,
    EngineFull,
    GenerateResult,
    NotSupported,
    VerifyResult,
)
from shared.llama_backend import LlamaModel
from shared.model_info import ModelInfo
from shared.protocol import SamplingParams
from shared.sampling import NO_GUESS, Guess

T = TypeVar("T")


class RemoteEngineError(EngineFailed):
    """The remote completions server failed or answered something unusable (the device gets `busy`)."""


class VocabModel(LlamaModel):
    """A LlamaModel loaded vocab-only: tokenizer, chat template and fingerprints, no weights."""

    def __init__(self, info: ModelInfo) -> None:
        super().__init__(info, vocab_only=True)
        eos = int(lc.llama_vocab_eos(self.vocab))  # what chat models end a turn with (SmolLM2: <|im_end|>)
        self.end_token = eos if eos >= 0 else int(lc.llama_vocab_eot(self.vocab))
        self._by_text: dict[str, int] | None = None

    def special_bytes(self, token: int) -> bytes:
        """Bytes of a token with control tokens spelled out (for text prompts)."""
        buf = ctypes.create_string_buffer(256)
        n = lc.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, True)
        return buf.raw[: max(n, 0)]

    def token_for_text(self, text: str) -> int | None:
        """The token whose text is `text`, if exactly one token reads that way."""
        if self._by_text is None:
            seen: dict[str, int] = {}
            dup: set[str] = set()
            for t in range(self.n_vocab):
                piece = self.special_bytes(t)
                try:
                    s = piece.decode("utf-8")
                except UnicodeDecodeError:
                    continue
                if s in seen:
                    dup.add(s)
                seen.setdefault(s, t)
            self._by_text = {k: v for k, v in seen.items() if k not in dup}
        tok = self._by_text.get(text)
        if tok is None and text:
            ids = self.tokenize(text, add_special=False)
            tok = ids[0] if len(ids) == 1 else None
        return tok


@dataclass(slots=True)
class RemoteSession:
    history: list[int]
    sampling: SamplingParams
    compute_s: float = 0.0


class RemoteEngine:
    """The `Engine` contract over a remote completions server; each `generate` is one request.

    What it cannot do, its capabilities say: it sees one sampled token and its logprob, no
    logits, so it can neither announce a guess (lookahead) nor verify drafts, and the tie rule
    (shared/decision.py) is not applied: the remote engine's own choice is written.
    Thread-safe: RemoteWorker runs requests of many sessions concurrently.
    """

    def __init__(
        self,
        info: ModelInfo,
        base_url: str,
        model_name: str = "",
        api_key: str = "",
        prompt_format: str = "ids",
        max_sessions: int = 64,
        n_ctx: int = 8192,
        timeout_s: float = 30.0,
    ) -> None:
        if prompt_format not in ("ids", "text"):
            raise ValueError(f"remote prompt format must be 'ids' or 'text', got {prompt_format!r}")
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"remote engine URL must look like http://host:port/v1, got {base_url!r}")
        self.model = VocabModel(info)
        self.base_url = base_url.rstrip("/")
        self.model_name = model_name
        self.api_key = api_key
        self.prompt_format = prompt_format
        self.max_sessions = max_sessions
        self.n_ctx = n_ctx  # tokens of context a session may use (the remote server's limit)
        self.timeout_s = timeout_s
        self._caps = Capabilities("remote", self.model.n_vocab, guess=False, verify=False, max_verify_tokens=0)
        self._url = url
        self._path = url.path.rstrip("/") + "/completions"
        self._sessions: dict[int, RemoteSession] = {}
        self._next = 0
        self._lock = threading.Lock()
        self._local = threading.local()

    def capabilities(self) -> Capabilities:
        return self._caps

    def chat_tokens(self, messages: list[dict]) -> list[int]:
        return self.model.chat_tokens(messages)

    # ---------------------------------------------------------------- sessions

    def open(self, prompt: list[int], sampling: SamplingParams) -> int:
        with self._lock:
            if len(self._sessions) >= self.max_sessions:
                raise EngineFull(f"all {self.max_sessions} sessions are in use")
            handle = self._next
            self._next += 1
            self._sessions[handle] = RemoteSession(list(prompt), sampling)
            return handle

    def close(self, handle: int) -> None:
        with self._lock:
            self._sessions.pop(handle, None)

    def history(self, handle: int) -> list[int]:
        return self._sessions[handle].history

    @property
    def n_sessions(self) -> int:
        return len(self._sessions)

    def append(self, handle: int, tokens: list[int]) -> None:
        self._sessions[handle].history.extend(tokens)

    def rollback(self, handle: int, n: int) -> None:
        s = self._sessions[handle]
        if not 0 <= n <= len(s.history):
            raise ValueError(f"cannot roll back to {n}: the history holds {len(s.history)} tokens")
        del s.history[n:]

    def prefill(self, handle: int) -> float:
        """Nothing to do: the remote engine's prefix cache fills on the next request."""
        return 0.0

    def is_eog(self, token: int) -> bool:
        return self.model.is_eog(token)

    def guess(self, handle: int) -> Guess:
        """No guess: the remote engine's logits are not seen here (capabilities().guess is False)."""
        return NO_GUESS

    def verify(
        self, handle: int, tokens: list[int], check: list[int], bonus: bool = False, tolerance: float = 0.0
    ) -> VerifyResult:
        raise NotSupported("verify is not supported by this server's engine (remote); use generate")

    # ---------------------------------------------------------------- the request

    def generate(self, handle: int, proposed: int = -1) -> GenerateResult:
        """The remote engine's next token (`proposed` is not used: see the class docstring); it joins the history."""
        s = self._sessions[handle]
        if not s.history:
            raise EmptyHistory("generate")
        if len(s.history) >= self.n_ctx:
            raise EngineFull(f"session needs {len(s.history) + 1} tokens of context; the server allows {self.n_ctx}")
        t0 = time.perf_counter()
        body = self._body(s)
        reply = self._post(body)
        token, logprob = self._parse(reply)
        s.history.append(token)
        dt = time.perf_counter() - t0
        s.compute_s += dt
        return GenerateResult(token, logprob, dt)

    def _body(self, s: RemoteSession) -> dict[str, Any]:
        p = s.sampling
        if self.prompt_format == "ids":
            prompt: Any = list(s.history)
        else:
            toks = s.history[1:] if self.model.add_bos and s.history[:1] == [self.model.bos] else s.history
            prompt = b"".join(self.model.special_bytes(t) for t in toks).decode("utf-8", errors="replace")
        body: dict[str, Any] = {
            "prompt": prompt,
            "max_tokens": 1,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "top_k": p.top_k,
            "seed": p.seed + len(s.history),  # a fresh, reproducible draw per position
            "logprobs": 1,
            "stream": False,
            "return_tokens_as_token_ids": True,  # vLLM
            "return_tokens": True,  # llama.cpp server
        }
        if self.model_name:
            body["model"] = self.model_name
        return body

    def _parse(self, reply: dict[str, Any]) -> tuple[int, float]:
        try:
            choice = reply["choices"][0]
        except (KeyError, IndexError, TypeError):
            raise RemoteEngineError(f"completions reply has no choices: {str(reply)[:200]}") from None
        if not isinstance(choice, dict):
            raise RemoteEngineError(f"completions reply has no choice object: {str(reply)[:200]}")
        text = choice.get("text") or ""
        lp = choice.get("logprobs") or {}
        logprob = 0.0
        token: int | None = None
        if isinstance(lp, dict):
            values = lp.get("token_logprobs") or []
            if values and isinstance(values[0], (int, float)):
                logprob = float(values[0])
            names = lp.get("tokens") or []
            if names and isinstance(names[0], str) and names[0].startswith("token_id:"):
                token_id = names[0].split(":", 1)[1]
                token = int(token_id) if token_id.isdigit() else None
        ids = choice.get("tokens") or reply.get("tokens")
        if token is None and isinstance(ids, list) and ids and isinstance(ids[0], int):
            token = ids[0]
        if token is None and text:
            token = self.model.token_for_text(text)
        if token is None and not text and choice.get("finish_reason") == "stop":
            token = self.model.end_token  # the engine stopped at end of generation without echoing it
        if token is None or not 0 <= token < self.model.n_vocab:
            raise RemoteEngineError(
                f"cannot tell which token the remote engine wrote (text {text!r}); use prompt format 'ids' with an "
                "engine that returns token ids (vLLM: return_tokens_as_token_ids, llama.cpp server: return_tokens)"
            )
        return token, logprob

    def _post(self, body: dict[str, Any]) -> dict[str, Any]:
        data = json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        for attempt in (0, 1):  # one retry on a dropped keep-alive connection
            conn = self._conn()
            try:
                conn.request("POST", self._path, body=data, headers=headers)
                resp = conn.getresponse()
                raw = resp.read()
            except (OSError, http.client.HTTPException) as exc:
                self._local.conn = None
                conn.close()
                if attempt:
                    raise RemoteEngineError(f"remote engine at {self.base_url} unreachable: {exc}") from exc
                continue
            if resp.status != 200:
                raise RemoteEngineError(
                    f"remote engine answered HTTP {resp.status}: {raw[:300].decode(errors='replace')}"
                )
            try:
                return json.loads(raw)
            except json.JSONDecodeError:
                raise RemoteEngineError("remote engine answered something that is not JSON") from None
        raise AssertionError("unreachable")

    def _conn(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            cls = http.client.HTTPSConnection if self._url.scheme == "https" else http.client.HTTPConnection
            conn = cls(self._url.hostname, self._url.port, timeout=self.timeout_s)  # type: ignore[arg-type]
            self._local.conn = conn
        return conn

    def close_all(self) -> None:
        with self._lock:
            self._sessions.clear()
        self.model.close()


class RemoteWorker:
    """The `Worker` over a RemoteEngine: requests run concurrently in threads (the remote engine batches)."""

    def __init__(self, engine: RemoteEngine, concurrency: int = 64) -> None:
        self.engine = engine
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="remote")

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        return self._pool.submit(fn, *args)

    async def generate(self, handle: int, proposed: int = -1) -> GenerateResult:
        return await self.call(self.engine.generate, handle, proposed)

    async def prefill(self, handle: int) -> float:
        return 0.0

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
        self.engine.close_all()
