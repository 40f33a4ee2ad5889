"""Cloud server options, as one plain dataclass (the CLI fills it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from models.registry import DEFAULT_CLOUD_MODEL
from shared.protocol import MAX_MESSAGE_BYTES

# the line `tokenrouter-cloud serve` prints once it listens (cloud_server/local.py waits for it)
READY_LINE = "TOKENROUTER_CLOUD_READY"


@dataclass(slots=True)
class ServerConfig:
    model: str = DEFAULT_CLOUD_MODEL
    api_keys: list[str] = field(
        default_factory=list
    )  # plain keys or "sha256:<hex>" digests, with optional quota options
    insecure: bool = False  # accept any key (local use only)
    n_ctx: int = 8192  # KV cells shared by all sessions: the KV memory budget
    max_sessions: int = 16  # open sessions (connections past hello)
    max_message_bytes: int = MAX_MESSAGE_BYTES
    max_tokens_per_request: int = 512
    # a hello's prompt, priced before it is read (cloud_server/session.py): its messages and their text in bytes
    max_prompt_messages: int = 256
    max_prompt_bytes: int = 64 << 10
    max_errors_per_connection: int = 32  # then the connection is closed
    idle_timeout_s: float = 300.0  # a connection silent this long is closed
    send_timeout_s: float = 30.0  # a device that reads nothing this long is disconnected (slow reader)
    # SIGTERM drains (cloud_server/drain.py): sessions finish their request, then close 1001; past this,
    # the rest are closed anyway (keep it under Kubernetes' terminationGracePeriodSeconds)
    drain_timeout_s: float = 20.0
    # connections that have not said hello (cloud_server/hello_gate.py): a deadline, and caps in all and per address
    hello_timeout_s: float = 5.0  # a connection without an accepted hello this long after connecting is closed
    max_pre_hello: int = 256  # connections waiting for their hello, all addresses together
    max_pre_hello_per_address: int = 64  # ... from one client address (behind a proxy: the proxy's address)
    api_docs: bool = False  # FastAPI's /docs, /redoc and /openapi.json (off: they describe the server to anyone)
    max_send_queue_bytes: int = 1 << 20  # bytes queued unread for one connection before it is closed (slow reader)
    threads: int | None = None
    record_dir: str | None = (
        None  # flywheel: record live hard tokens as training shards (off by default; a privacy choice)
    )
    record_edge_models: list[str] = field(default_factory=list)  # edge models recorded besides the known ones
    record_queue_bytes: int = 32 << 20  # flywheel rows waiting for its writer thread; past it, rows are dropped
    record_max_bytes: int = 1 << 30  # the record dir's shards; past it, rows are dropped
    # scheduling and the KV budget (embedded engine)
    kv_slots: int | None = None  # sessions holding KV cells at once (default max_sessions, at most 256)
    evict_mode: str = "recompute"  # "recompute" (re-prefill from history) or "save" (KV copied to host memory)
    max_saved_bytes: int = 256 << 20  # host memory for saved KV states
    max_batch_tokens: int = 512  # tokens per batched decode
    max_session_step_tokens: int = 64  # tokens one session takes of one decode: a long prefill's or verify's chunk
    n_gpu_layers: int = 0  # layers offloaded to the GPU (CUDA builds of llama-cpp-python; -1 = all)
    kv_layout: str = "unified"  # "split": each KV slot gets n_ctx / kv_slots cells (much faster with many sessions)
    # limits per connection and per key
    max_messages_per_s: float = 200.0  # sustained; bursts of twice this are allowed
    key_max_sessions: int | None = None  # defaults for keys without their own options
    key_tokens_per_minute: int | None = None
    key_max_cloud_fraction: float | None = None
    key_kv_churn_per_minute: int | None = 8192  # KV cells a key's sessions may make others recompute per minute
    key_explore_per_minute: int | None = 60  # exploration requests a key's sessions may make per minute
    # engine seconds a key's sessions may use per minute (cloud_server/fair_share.py); past it they wait
    key_engine_seconds_per_minute: float | None = None
    abuse_warmup_tokens: int = 32
    # the routing watch (cloud_server/routing_watch.py): alarm when a session's rates leave the fleet's band
    alarm_quantile: float = 0.01  # the band holds all but this share of sessions on each side
    alarm_min_sessions: int = 20  # sessions seen before the band is trusted
    alarm_min_keys: int = 5  # other keys seen before a session is judged (0: one key's sessions judge each other)
    # audit log
    audit_dir: str | None = None
    audit_sample_rate: float = 1.0
    audit_retention_days: float = 30.0
    audit_token_ids: bool = False
    # remote engine (OpenAI-compatible completions: vLLM, SGLang, llama.cpp server)
    remote_url: str | None = None  # e.g. http://vllm:8000/v1; None = embedded llama.cpp engine
    remote_model: str = ""  # model name the remote server serves
    remote_api_key: str = ""
    remote_prompt_format: str = "ids"  # "ids" (token-id prompts) or "text" (servers that only take strings)
    remote_timeout_s: float = 30.0
    remote_verify: str = (
        "auto"  # how verify is served: auto | prompt-logprobs | echo | generate | off (remote_engine.py)
    )
    remote_concurrency: int = 64
