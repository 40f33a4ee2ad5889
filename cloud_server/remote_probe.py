"""What a remote completions server can do, asked with a few requests of a short prompt.

Why apart from the engine (cloud_server/remote_engine.py): the probe runs once (or until the
server is up) and only decides the engine's capabilities: whether it lists top
log-probabilities (lookahead guesses, the tie rule) and how verify is served (`VERIFY_MODES`).
A server that answers a request without the field asked for does not support it; one that
refuses it (HTTP 4xx) neither.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from cloud_server.engine_api import Capabilities
from shared.completions import CompletionsClient, CompletionsError, first_choice
from shared.llama_backend import LlamaModel
from shared.protocol import NEXT_TOP, SamplingParams

log = logging.getLogger(__name__)

VERIFY_MODES = ("auto", "prompt-logprobs", "echo", "generate", "off")
MAX_VERIFY_ONE_PASS = 512  # drafts per verify with prompt log-probabilities or echo
MAX_VERIFY_GENERATE = 64  # drafts per verify by continuation (one decode step each)


@dataclass(frozen=True, slots=True)
class Probed:
    """What the probe found: the capabilities, how verify is served, whether top lists come back."""

    caps: Capabilities
    verify_mode: str
    top_logprobs: bool


def probe_server(client: CompletionsClient, model: LlamaModel, prompt_format: str, want: str, n_ctx: int) -> Probed:
    """Probe the server behind `client` for verify mode `want` (one of VERIFY_MODES); raises
    CompletionsError when the server is unreachable."""
    c = client
    prompt = model.chat_tokens([{"role": "user", "content": "Say hello."}])
    reply = c.post(c.body(prompt, 2, SamplingParams(), NEXT_TOP), probing=True)
    try:
        steps = c.positions(reply, 2) if reply else []
    except CompletionsError:  # no log-probabilities and a text that is not one token: no top lists
        steps = []
    top_logprobs = bool(steps) and len(steps[0].top) >= 2
    guess = top_logprobs and len(steps) >= 2 and len(steps[1].top) >= 2
    mode = "off"
    if want in ("auto", "prompt-logprobs"):
        reply = c.post(c.body(prompt, 1, SamplingParams(), NEXT_TOP, prompt_logprobs=True), probing=True)
        if reply and isinstance(first_choice(reply).get("prompt_logprobs"), list):
            mode = "prompt-logprobs"
    if mode == "off" and (want == "echo" or (want == "auto" and prompt_format == "ids")):
        reply = c.post(c.body(prompt, 1, SamplingParams(), NEXT_TOP, echo=True), probing=True)
        lp = first_choice(reply).get("logprobs") if reply else None
        if isinstance(lp, dict) and len(lp.get("token_logprobs") or []) > 1:  # the prompt's too
            mode = "echo"
    if mode == "off" and want in ("auto", "generate") and top_logprobs:
        mode = "generate"
    if want not in ("auto", mode):
        log.warning("remote engine at %s does not support --remote-verify %s; verify is off", c.base_url, want)
    limit = {"generate": MAX_VERIFY_GENERATE, "off": 0}.get(mode, MAX_VERIFY_ONE_PASS)
    how = f"verify: {mode}; guess: {'max_tokens 2' if guess else 'none'}; prompt: {prompt_format}"
    caps = Capabilities(
        "remote",
        model.n_vocab,
        guess=guess,
        verify=mode != "off",
        max_verify_tokens=limit,
        how=how,
        session_cells=n_ctx,
    )
    log.info("remote engine at %s: %s", c.base_url, how)
    return Probed(caps, mode, top_logprobs)
