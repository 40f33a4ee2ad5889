"""The per-answer routing log: which model wrote each token, and the router score.

Compact binary form (2 bytes per token), for keeping every answer cheaply:

    b"TRLG" | u8 version=1 | u8 flags | u32 start_position | u32 n_tokens
    | u8 len + edge model fingerprint | u8 len + cloud model fingerprint
    | n_tokens x (u8 score, u8 writer)          score = round(score * 255)
    | [n_tokens x u32 token id]                 only when flags & TOKEN_IDS

writer: bit 0 set = written by the cloud; bit 1 set = no score was computed
(cloud-only policy); bit 2 set = the device wrote it because the cloud was lost.
No text and no hidden states are stored; token ids only when enabled.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Iterator

MAGIC = b"TRLG"
VERSION = 1
FLAG_TOKEN_IDS = 1

CLOUD, NO_SCORE, FALLBACK = 1, 2, 4


@dataclass(slots=True)
class RoutingLog:
    edge_model: str = ""
    cloud_model: str = ""
    start_position: int = 0
    record_token_ids: bool = False
    _scores: bytearray = field(default_factory=bytearray)
    _writers: bytearray = field(default_factory=bytearray)
    _ids: list[int] = field(default_factory=list)

    def append(self, route: str, score: float | None, token_id: int = 0, fallback: bool = False) -> None:
        writer = (CLOUD if route == "cloud" else 0) | (NO_SCORE if score is None else 0) | (FALLBACK if fallback else 0)
        self._scores.append(0 if score is None else min(255, max(0, round(score * 255))))
        self._writers.append(writer)
        if self.record_token_ids:
            self._ids.append(token_id)

    def __len__(self) -> int:
        return len(self._writers)

    def to_bytes(self) -> bytes:
        flags = FLAG_TOKEN_IDS if self.record_token_ids else 0
        edge, cloud = self.edge_model.encode()[:255], self.cloud_model.encode()[:255]
        out = bytearray(MAGIC)
        out += struct.pack("<BBII", VERSION, flags, self.start_position, len(self))
        out += bytes([len(edge)]) + edge + bytes([len(cloud)]) + cloud
        pairs = bytearray(2 * len(self))
        pairs[0::2], pairs[1::2] = self._scores, self._writers
        out += pairs
        if self.record_token_ids:
            out += struct.pack(f"<{len(self._ids)}I", *self._ids)
        return bytes(out)


@dataclass(frozen=True, slots=True)
class LoggedToken:
    position: int
    writer: str  # "edge" | "cloud"
    model: str  # fingerprint of the model that wrote it
    score: float | None  # dequantised, 1/255 resolution
    fallback: bool
    token_id: int | None


def read(data: bytes) -> Iterator[LoggedToken]:
    """Decode a binary routing log; ValueError names what is wrong."""
    if data[:4] != MAGIC:
        raise ValueError("not a TokenRouter routing log (bad magic)")
    try:
        version, flags, start, n = struct.unpack_from("<BBII", data, 4)
        if version != VERSION:
            raise ValueError(f"unsupported routing log version {version}")
        pos = 14
        models = []
        for _ in range(2):
            ln = data[pos]
            models.append(data[pos + 1 : pos + 1 + ln].decode())
            pos += 1 + ln
        pairs = data[pos : pos + 2 * n]
        ids = struct.unpack_from(f"<{n}I", data, pos + 2 * n) if flags & FLAG_TOKEN_IDS else None
    except (struct.error, IndexError):
        raise ValueError("routing log is truncated") from None
    if len(pairs) != 2 * n:
        raise ValueError("routing log is truncated")
    for i in range(n):
        q, w = pairs[2 * i], pairs[2 * i + 1]
        yield LoggedToken(
            position=start + i,
            writer="cloud" if w & CLOUD else "edge",
            model=models[1] if w & CLOUD else models[0],
            score=None if w & NO_SCORE else q / 255,
            fallback=bool(w & FALLBACK),
            token_id=None if ids is None else ids[i],
        )


def to_jsonl(data: bytes) -> str:
    """Auditor export: one JSON object per token."""
    return "".join(
        json.dumps({k: getattr(t, k) for k in LoggedToken.__slots__ if not (k == "token_id" and t.token_id is None)})
        + "\n"
        for t in read(data)
    )
