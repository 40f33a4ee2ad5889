"""A client for OpenAI-compatible completions servers (vLLM, SGLang, llama.cpp servers): requests
and their replies read as positions with top log-probabilities.

Why in shared/: the cloud server's remote engine (cloud_server/remote_engine.py) and the
trainer's eval against a remote engine (models/train/evaluate.py, `--cloud-engine`) ask the same
servers the same way, and neither may import the other.

A reply is read as `Position`s: the token at each position, its log-probability and the top
alternatives the server listed. Token ids come from "token_id:N" names (vLLM,
return_tokens_as_token_ids), a `tokens` list (llama.cpp server, return_tokens), vLLM's
prompt_logprobs keys, or a token's text mapped back through the local vocabulary (exactly one
token must read that way). `Position.view` is the logits-like row shared/decision.py's rules
are applied to: the listed log-probabilities, -inf for every other token (an approximation:
an unlisted token counts as infinitely unlikely).

Prompt formats:
    ids   the prompt is a list of token ids (vLLM, SGLang, llama.cpp server): exact
    text  the prompt is the detokenized history with control tokens spelled out (servers that
          take only strings, e.g. llama-cpp-python's): re-tokenized there, which may split rare
          tokens differently
"""

from __future__ import annotations

import ctypes
import http.client
import json
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence
from urllib.parse import urlsplit

import llama_cpp as lc
import numpy as np

from shared.llama_backend import LlamaModel
from shared.model_info import ModelInfo
from shared.protocol import NEXT_TOP, SamplingParams
from shared.sampling import Guess

PROMPT_FORMATS = ("ids", "text")


class CompletionsError(RuntimeError):
    """The completions server failed or answered something this client cannot read."""


class VocabModel(LlamaModel):
    """A LlamaModel loaded vocab-only: tokenizer, chat template and fingerprints, no weights."""

    def __init__(self, info: ModelInfo) -> None:
        super().__init__(info, vocab_only=True)
        eos = int(lc.llama_vocab_eos(self.vocab))  # what chat models end a turn with (SmolLM2: <|im_end|>)
        self.end_token = eos if eos >= 0 else int(lc.llama_vocab_eot(self.vocab))
        self._by_text: dict[str, int] | None = None
        self._by_text_lock = threading.Lock()

    def special_bytes(self, token: int) -> bytes:
        """Bytes of a token with control tokens spelled out (for text prompts)."""
        buf = ctypes.create_string_buffer(256)
        n = lc.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, True)
        return buf.raw[: max(n, 0)]

    def token_for_text(self, text: str) -> int | None:
        """The token whose text is `text`, if exactly one token reads that way."""
        with self._by_text_lock:
            if self._by_text is None:
                seen: dict[str, int] = {}
                dup: set[str] = set()
                for t in range(self.n_vocab):
                    try:
                        s = self.special_bytes(t).decode("utf-8")
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
class Position:
    """What the server reported at one position: its token there (-1: unknown), that token's
    log-probability (None: not listed) and the top alternatives it listed (id -> log-probability)."""

    token: int
    logprob: float | None
    top: dict[int, float] = field(default_factory=dict)

    @property
    def listed(self) -> bool:
        """The server listed log-probabilities here (else only its token is known)."""
        return bool(self.top) or self.logprob is not None

    def view(self, n_vocab: int) -> np.ndarray:
        """A logits-like row: listed log-probabilities, -inf elsewhere (see the module docstring)."""
        row = np.full(n_vocab, -np.inf, dtype=np.float32)
        for t, lp in self.top.items():
            row[t] = lp
        if self.token >= 0 and self.logprob is not None:
            row[self.token] = self.logprob
        return row

    def logprob_of(self, token: int) -> float:
        if token == self.token and self.logprob is not None:
            return self.logprob
        return self.top.get(token, 0.0)

    def guess(self) -> Guess:
        """This position's choice as a lookahead guess, with its top list most likely first."""
        ids = sorted(self.top, key=lambda t: -self.top[t])[:NEXT_TOP]
        return Guess(self.token, self.logprob_of(self.token), ids, [self.top[t] for t in ids])


class CompletionsClient:
    """Requests to one completions endpoint, one keep-alive connection per thread (thread-safe)."""

    def __init__(
        self,
        model: VocabModel,
        base_url: str,
        model_name: str = "",
        api_key: str = "",
        prompt_format: str = "ids",
        timeout_s: float = 30.0,
    ) -> None:
        if prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"remote prompt format must be 'ids' or 'text', got {prompt_format!r}")
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"remote engine URL must look like http://host:port/v1, got {base_url!r}")
        self.model = model
        self.base_url = base_url.rstrip("/")
        self.model_name = model_name
        self.api_key = api_key
        self.prompt_format = prompt_format
        self.timeout_s = timeout_s
        self._url = url
        self._path = url.path.rstrip("/") + "/completions"
        self._local = threading.local()

    # ---------------------------------------------------------------- requests

    def body(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        sampling: SamplingParams,
        logprobs: int | None,
        echo: bool = False,
        prompt_logprobs: bool = False,
    ) -> dict[str, Any]:
        """A completions request; `seed` is the sampling seed plus the position (a reproducible draw per position)."""
        body: dict[str, Any] = {
            "prompt": self.prompt(prompt),
            "max_tokens": max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
            "seed": sampling.seed + len(prompt),
            "stream": False,
            "return_tokens_as_token_ids": True,  # vLLM
            "return_tokens": True,  # llama.cpp server
        }
        if logprobs is not None:
            body["logprobs"] = logprobs
        if echo:
            body["echo"] = True
        if prompt_logprobs:
            body["prompt_logprobs"] = logprobs or 1  # vLLM
        if self.model_name:
            body["model"] = self.model_name
        return body

    def prompt(self, tokens: Sequence[int]) -> Any:
        if self.prompt_format == "ids":
            return list(tokens)
        toks = tokens[1:] if self.model.add_bos and list(tokens[:1]) == [self.model.bos] else tokens
        return b"".join(self.model.special_bytes(t) for t in toks).decode("utf-8", errors="replace")

    def post(self, body: dict[str, Any], probing: bool = False) -> dict[str, Any] | None:
        """POST to the completions endpoint. With `probing`, a refusal (HTTP 4xx) is None (not supported)."""
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
                    raise CompletionsError(f"remote engine at {self.base_url} unreachable: {exc}") from exc
                continue
            if probing and 400 <= resp.status < 500:
                return None
            if resp.status != 200:
                raise CompletionsError(
                    f"remote engine answered HTTP {resp.status}: {raw[:300].decode(errors='replace')}"
                )
            try:
                reply = json.loads(raw)
            except json.JSONDecodeError:
                raise CompletionsError("remote engine answered something that is not JSON") from None
            if not isinstance(reply, dict):
                raise CompletionsError("remote engine answered something that is not a JSON object")
            return reply
        raise AssertionError("unreachable")

    def stream(self, body: dict[str, Any]) -> Iterator[Position]:
        """The generated positions of a streamed completion (server-sent events), as they come.

        Why: a caller that needs only a prefix of the completion (verify by continuation stops at
        the first draft off the engine's path) closes this generator, which closes the connection,
        and the engine stops (vLLM and llama-cpp-python abort a request whose client went away;
        one or two more tokens may run first). An end of generation the engine does not list
        (llama-cpp-python) is yielded as the end token with nothing listed. A stream that ends
        without a finish reason (interrupted by the server) is a CompletionsError."""
        cls = http.client.HTTPSConnection if self._url.scheme == "https" else http.client.HTTPConnection
        conn = cls(self._url.hostname, self._url.port, timeout=self.timeout_s)  # type: ignore[arg-type]
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        try:
            try:
                conn.request("POST", self._path, body=json.dumps(dict(body, stream=True)).encode(), headers=headers)
                resp = conn.getresponse()
                if resp.status != 200:
                    raw = resp.read()
                    raise CompletionsError(
                        f"remote engine answered HTTP {resp.status}: {raw[:300].decode(errors='replace')}"
                    )
                last = -1
                while True:
                    line = resp.readline()
                    if not line:
                        break
                    line = line.strip()
                    if not line.startswith(b"data:"):
                        continue  # blank lines, comments, pings
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    choice = first_choice(json.loads(data))
                    lp = choice.get("logprobs")
                    n = len(lp.get("tokens") or []) if isinstance(lp, dict) else 0
                    if n:
                        for pos in self.positions({"choices": [choice]}, n):
                            last = pos.token
                            yield pos
                    reason = choice.get("finish_reason")
                    if reason:
                        if reason == "stop" and not self.model.is_eog(last):
                            yield Position(self.model.end_token, None)
                        return
            except (OSError, http.client.HTTPException, json.JSONDecodeError) as exc:
                raise CompletionsError(f"remote engine at {self.base_url} failed while streaming: {exc}") from exc
            raise CompletionsError("the engine ended the stream without a finish reason (interrupted)")
        finally:
            conn.close()

    def _conn(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            cls = http.client.HTTPSConnection if self._url.scheme == "https" else http.client.HTTPConnection
            conn = cls(self._url.hostname, self._url.port, timeout=self.timeout_s)  # type: ignore[arg-type]
            self._local.conn = conn
        return conn

    # ---------------------------------------------------------------- replies

    def token_id(self, name: Any) -> int | None:
        """A token named in a reply: "token_id:N" (vLLM), a number, or the token's text."""
        if isinstance(name, int) and not isinstance(name, bool):
            return name if 0 <= name < self.model.n_vocab else None
        if not isinstance(name, str):
            return None
        if name.startswith("token_id:"):
            digits = name.split(":", 1)[1]
            tok = int(digits) if digits.isdigit() else None
        elif name.isdigit() and self.prompt_format == "ids":  # vLLM prompt_logprobs keys
            tok = int(name)
        else:
            tok = self.model.token_for_text(name)
        return tok if tok is not None and 0 <= tok < self.model.n_vocab else None

    def top(self, entry: Any) -> dict[int, float]:
        """A top list ({name: logprob} or vLLM's {id: {"logprob": x, ...}}) by token id; unknown names dropped."""
        out: dict[int, float] = {}
        if isinstance(entry, dict):
            for name, value in entry.items():
                lp = value.get("logprob") if isinstance(value, dict) else value
                tok = self.token_id(name)
                if tok is not None and isinstance(lp, (int, float)) and tok not in out:
                    out[tok] = max(float(lp), -1e30)
        return out

    def positions(
        self,
        reply: dict[str, Any],
        max_tokens: int,
        prompt: Sequence[int] = (),
        n_scored: int = 0,
        echo: bool = False,
        prompt_logprobs: bool = False,
    ) -> list[Position]:
        """The generated positions of a reply, after (with echo or prompt_logprobs) its last
        `n_scored` prompt positions, whose tokens are `prompt`'s own."""
        choice = first_choice(reply)
        lp = choice.get("logprobs")
        names: list[Any] = []
        values: list[Any] = []
        tops: list[Any] = []
        if isinstance(lp, dict):
            names = list(lp.get("tokens") or [])
            values = list(lp.get("token_logprobs") or [])
            tops = list(lp.get("top_logprobs") or [])
        n_gen = _n_generated(reply, choice, names, echo)
        scored: list[Position] = []
        tail = list(prompt[len(prompt) - n_scored :]) if n_scored else []
        if prompt_logprobs:
            entries = choice.get("prompt_logprobs")
            if not isinstance(entries, list) or len(entries) < n_scored:
                raise CompletionsError("the engine sent no prompt log-probabilities (vLLM: prompt_logprobs)")
            for tok, entry in zip(tail, entries[len(entries) - n_scored :]):
                top = self.top(entry)
                scored.append(Position(tok, top.get(tok), top))
        elif echo:
            first = len(names) - n_gen - n_scored
            if first < 0:
                raise CompletionsError("the engine echoed fewer tokens than it was sent")
            for k, tok in zip(range(first, first + n_scored), tail):
                if self.token_id(names[k]) != tok:
                    raise CompletionsError(
                        "the echoed prompt does not line up with the drafts (a text prompt re-tokenized "
                        "differently); use token-id prompts or --remote-verify generate"
                    )
                scored.append(Position(tok, _number(values, k), self.top(tops[k] if k < len(tops) else None)))
        gen: list[Position] = []
        offset = len(names) - n_gen if echo else 0
        ids = choice.get("tokens") or reply.get("tokens")
        for k in range(offset, len(names)):
            tok = self.token_id(names[k])
            j = k - offset
            if tok is None and isinstance(ids, list) and j < len(ids) and isinstance(ids[j], int):
                tok = ids[j]
            gen.append(
                Position(-1 if tok is None else tok, _number(values, k), self.top(tops[k] if k < len(tops) else None))
            )
        if not gen and not echo:  # no logprobs: the token from the ids or the text, one at most
            tok = self._plain_token(choice, reply)
            gen = [Position(tok, None)] if tok is not None else []
        if any(p.token < 0 for p in gen):
            self._fill_from_text(choice, gen)
        if not gen and choice.get("finish_reason") == "stop":
            gen = [Position(self.model.end_token, None)]  # ended at once without listing the end token
        if not gen and not scored:
            raise CompletionsError(f"the engine wrote no token: {json.dumps(choice)[:200]}")
        return scored + gen[:max_tokens]

    def _plain_token(self, choice: dict[str, Any], reply: dict[str, Any]) -> int | None:
        ids = choice.get("tokens") or reply.get("tokens")
        if isinstance(ids, list) and ids and isinstance(ids[0], int):
            return ids[0] if 0 <= ids[0] < self.model.n_vocab else None
        text = choice.get("text") or ""
        if text:
            tok = self.model.token_for_text(text)
            if tok is None:
                raise CompletionsError(
                    f"cannot tell which token the remote engine wrote (text {text!r}); use prompt format 'ids' with "
                    "an engine that returns token ids (vLLM: return_tokens_as_token_ids, llama.cpp server: "
                    "return_tokens)"
                )
            return tok
        if choice.get("finish_reason") == "stop":
            return self.model.end_token  # the engine stopped at end of generation without echoing it
        raise CompletionsError(
            "cannot tell which token the remote engine wrote; use an engine that returns token ids "
            "(vLLM: return_tokens_as_token_ids, llama.cpp server: return_tokens)"
        )

    def _fill_from_text(self, choice: dict[str, Any], gen: list[Position]) -> None:
        """Tokens whose text did not name exactly one token: re-tokenize the completion text."""
        text = choice.get("text") or ""
        ids = self.model.tokenize(text, add_special=False) if text else []
        if len(ids) != len(gen):
            raise CompletionsError(
                f"cannot tell which tokens the remote engine wrote (text {text!r}); use prompt format 'ids' with "
                "an engine that returns token ids (vLLM: return_tokens_as_token_ids)"
            )
        for p, t in zip(gen, ids):
            if p.token < 0:
                p.token = t

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None


def first_choice(reply: dict[str, Any]) -> dict[str, Any]:
    """The reply's first choice object (CompletionsError if there is none)."""
    try:
        choice = reply["choices"][0]
    except (KeyError, IndexError, TypeError):
        raise CompletionsError(f"completions reply has no choices: {str(reply)[:200]}") from None
    if not isinstance(choice, dict):
        raise CompletionsError(f"completions reply has no choice object: {str(reply)[:200]}")
    return choice


def _number(values: list[Any], k: int) -> float | None:
    v = values[k] if k < len(values) else None
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _n_generated(reply: dict[str, Any], choice: dict[str, Any], names: list[Any], echo: bool) -> int:
    """Generated tokens listed in the reply's logprobs (with echo they follow the prompt's)."""
    if not echo:
        return len(names)
    usage = reply.get("usage")
    n = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if isinstance(n, int) and 0 <= n <= len(names):
        return n
    return 1 if choice.get("finish_reason") != "stop" else 0
