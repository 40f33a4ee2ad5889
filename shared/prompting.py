"""Prompt text both sides agree on (the device answers with it, training labels with it)."""

from __future__ import annotations

DEFAULT_SYSTEM_PROMPT = "You are a helpful voice assistant. Answer briefly, in one or two sentences."
