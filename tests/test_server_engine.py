"""The embedded engine under the batch scheduler: batching, fairness, the KV budget and eviction,
the engine contract (cloud_server/engine_api.py), the tie rule, batch isolation, and the
session's refusals over the wire.

Real model (SmolLM2-135M Q4_1), real llama.cpp context; the scheduler thread is
driven from asyncio exactly as the server drives it. The wire tests talk to a real
`tokenrouter-cloud serve` child process on loopback.
"""

from __future__ import annotations

import asyncio
import inspect
import threading

import numpy as np
import pytest
from websockets.sync.client import connect

from cloud_server.auth import KeyChecker
from cloud_server.batch import BatchEngine
from cloud_server.config import ServerConfig
from cloud_server.engine import CloudEngine
from cloud_server.engine_api import EmptyHistory, Engine, EngineFailed, EngineFull, Worker
from cloud_server.local import LocalCloudServer
from cloud_server.scheduler import EngineWorker
from cloud_server.session import Connection
from models.registry import DEFAULT_CLOUD_MODEL
from shared.decision import TIE_NATS
from shared.llama_backend import DecodeItem
from shared.protocol import (
    Accept,
    Error,
    ErrorCode,
    Generate,
    ProtocolError,
    Rollback,
    SamplingParams,
    Sync,
    Tokens,
    Verdict,
    Verify,
    decode,
    encode,
)
from shared.sampling import SamplingError
from tests.conftest import QUESTIONS, chat
from tests.helpers import hello


class Recorder:
    def __init__(self) -> None:
        self.batches: list[tuple[int, int]] = []
        self.waits: list[float] = []

    def on_batch(self, n_items: int, n_tokens: int, decode_s: float) -> None:
        self.batches.append((n_items, n_tokens))

    def on_queue_wait(self, seconds: float) -> None:
        self.waits.append(seconds)


def make(cloud_info, **kw) -> tuple[CloudEngine, EngineWorker, Recorder]:
    rec = Recorder()
    batch = kw.pop("max_batch_tokens", 512)
    eng = CloudEngine(cloud_info, threads=1, **kw)
    return eng, EngineWorker(eng, max_batch_tokens=batch, observer=rec), rec


def prompt_of(eng: CloudEngine, q: str) -> list[int]:
    return eng.model.chat_tokens(chat(q))


def test_sessions_are_batched_into_one_decode_and_keep_their_own_streams(cloud_info):
    eng, w, rec = make(cloud_info, n_ctx=4096, max_sessions=8)
    try:

        async def session(q: str) -> list[int]:
            h = await w.call(eng.open, prompt_of(eng, q), SamplingParams())
            return [(await w.generate(h))[0] for _ in range(6)]

        async def main() -> list[list[int]]:
            return await asyncio.gather(
                *(session(q) for q in ["what is the capital of france", "name a colour", "count to three", "say hi"])
            )

        outs = asyncio.run(main())
        assert max(n for n, _ in rec.batches) >= 3, f"requests of concurrent sessions must share decodes: {rec.batches}"
        assert all(len(o) == 6 for o in outs)
        assert "Paris" in eng.model.detokenize(outs[0])
        assert len(rec.batches) < 4 * 6, "four sessions x six tokens must take fewer decodes than one per token"
    finally:
        w.shutdown()


def test_long_prefill_is_chunked_and_does_not_starve_a_hard_token(cloud_info):
    """A ~300-token prefill from one session is cut into 64-token chunks; another session's token comes first."""
    eng, w, rec = make(cloud_info, n_ctx=4096, max_sessions=4, max_batch_tokens=64)
    try:

        async def main() -> tuple[float, float]:
            long = prompt_of(eng, "tell me a long story " * 30)
            a = await w.call(eng.open, long, SamplingParams())
            b = await w.call(eng.open, prompt_of(eng, "say hi"), SamplingParams())
            await w.prefill(b)
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            pa = asyncio.ensure_future(w.prefill(a))
            await asyncio.sleep(0)
            await w.generate(b)
            tb = loop.time() - t0
            await pa
            return tb, loop.time() - t0

        tb, ta = asyncio.run(main())
        assert tb < ta / 2, f"the hard token ({tb:.3f}s) waited for most of the long prefill ({ta:.3f}s)"
        assert max(t for _, t in rec.batches) <= 64
    finally:
        w.shutdown()


def test_a_prefill_keeps_the_next_token_ready_and_a_rollback_drops_it(cloud_info):
    """After a sync's prefill, a hard token with no new tokens is sampled from the kept logits:
    no decode, and the same token a fresh decode gives. A rollback (or new tokens) must not
    reuse them: the token then comes from a decode of the changed history."""
    eng, w, rec = make(cloud_info, n_ctx=2048, max_sessions=4)
    ref_eng, ref_w, _ = make(cloud_info, n_ctx=2048, max_sessions=4)
    try:

        async def main() -> None:
            prompt = prompt_of(eng, "what is the capital of france")
            h = await w.call(eng.open, prompt, SamplingParams())
            await w.prefill(h)
            decodes = len(rec.batches)
            first, _, compute_s = await w.generate(h)
            assert len(rec.batches) == decodes, "the kept logits must answer without a decode"
            assert compute_s == 0.0
            r = await ref_w.call(ref_eng.open, prompt, SamplingParams())  # no prefill: decodes the whole prompt
            assert first == (await ref_w.generate(r))[0]

            # roll back and write a different token at the same position: the length matches the
            # kept logits' again, but they describe another history
            await w.prefill(h)
            await w.call(eng.rollback, h, len(prompt))
            other = eng.model.tokenize(" Lyon")[0]
            await w.call(eng.append, h, [other])
            await ref_w.call(ref_eng.rollback, r, len(prompt))
            await ref_w.call(ref_eng.append, r, [other])
            decodes = len(rec.batches)
            got = (await w.generate(h))[0]
            assert len(rec.batches) > decodes, "a changed history must be decoded"
            assert got == (await ref_w.generate(r))[0]

        asyncio.run(main())
    finally:
        w.shutdown()
        ref_w.shutdown()


def test_a_lookahead_guess_is_the_token_written_next_and_new_tokens_drop_it(cloud_info):
    """guess announces the next token without writing it; a generate at that position then
    writes exactly that token without a decode, even with random sampling (where sampling again
    would mostly differ). Tokens appended after the guess make it stale: the next token is then
    decoded afresh."""
    eng, w, rec = make(cloud_info, n_ctx=2048, max_sessions=4)
    try:

        async def main() -> None:
            prompt = prompt_of(eng, "tell me a story about a dragon")
            hot = SamplingParams(temperature=1.5, top_p=1.0, top_k=1000, seed=7)
            h = await w.call(eng.open, prompt, hot)
            guesses, written = [], []
            for _ in range(12):
                await w.prefill(h)
                g = await w.call(eng.guess, h)
                assert g.token >= 0 and g.logprob <= 0.0
                assert await w.call(eng.guess, h) == g, "asking twice must not re-sample"
                assert len(g.top_ids) == 8 and g.top_logprobs == sorted(g.top_logprobs, reverse=True)
                assert g.token not in g.top_ids or g.top_logprobs[g.top_ids.index(g.token)] == pytest.approx(
                    g.logprob, abs=1e-4
                )
                assert len(eng.history(h)) == len(prompt) + len(written), "a guess is not part of the history"
                decodes = len(rec.batches)
                token, logprob, _ = await w.generate(h)
                assert len(rec.batches) == decodes
                assert logprob == g.logprob
                guesses.append(g.token)
                written.append(token)
            assert written == guesses

            await w.prefill(h)
            stale = (await w.call(eng.guess, h)).token
            await w.call(eng.append, h, [stale])  # the device wrote its own token there
            assert (await w.call(eng.guess, h)).token == -1, "no kept logits describe the longer history"
            decodes = len(rec.batches)
            await w.generate(h)
            assert len(rec.batches) > decodes

        asyncio.run(main())
    finally:
        w.shutdown()


def test_kv_budget_evicts_idle_sessions_lru_and_save_mode_restores_exactly(cloud_info):
    """One KV slot, three sessions taking turns: each turn evicts the other; saved state restores bit-exact."""
    ref_eng, ref_w, _ = make(cloud_info, n_ctx=2048, max_sessions=4)
    eng, w, _ = make(cloud_info, n_ctx=2048, max_sessions=4, kv_slots=1, evict_mode="save")
    qs = ["what is the capital of france", "name a colour", "count to three"]
    try:

        async def turns(worker: EngineWorker, engine: CloudEngine) -> list[list[int]]:
            hs = [await worker.call(engine.open, prompt_of(engine, q), SamplingParams()) for q in qs]
            outs: list[list[int]] = [[] for _ in qs]
            for _ in range(3):
                for i, h in enumerate(hs):  # sequential: identical decode layout in both engines
                    for _ in range(3):
                        outs[i].append((await worker.generate(h))[0])
            return outs

        ref = asyncio.run(turns(ref_w, ref_eng))
        got = asyncio.run(turns(w, eng))
        assert got == ref
        assert eng.pool.stats.evictions >= 8 and eng.pool.stats.restores_loaded >= 6
        assert eng.pool.n_resident == 1 and eng.pool.cells_used <= eng.ctx.n_ctx
    finally:
        ref_w.shutdown()
        w.shutdown()


def test_recompute_mode_rebuilds_from_history_within_a_small_budget(cloud_info):
    """A 512-cell budget cannot hold four ~170-token sessions at once: LRU eviction keeps them all working."""
    eng, w, _ = make(cloud_info, n_ctx=512, max_sessions=4)
    peak = 0
    try:

        async def main() -> list[str]:
            nonlocal peak
            hs = [
                await w.call(
                    eng.open, prompt_of(eng, f"question number {i}: " + "tell me about the sea " * 20), SamplingParams()
                )
                for i in range(4)
            ]
            outs: list[list[int]] = [[] for _ in hs]
            for _ in range(2):
                for i, h in enumerate(hs):
                    outs[i].append((await w.generate(h))[0])
                    peak = max(peak, eng.pool.cells_used)
            return [eng.model.detokenize(o) for o in outs]

        texts = asyncio.run(main())
        assert all(t.strip() for t in texts)
        assert eng.pool.stats.evictions > 0 and eng.pool.stats.restores_recomputed > 0
        assert peak <= eng.ctx.n_ctx, "KV cells in use must stay within the budget"
        assert eng.pool.kv_bytes_used <= eng.pool.kv_budget_bytes
    finally:
        w.shutdown()


def test_a_session_larger_than_the_whole_budget_fails_cleanly_and_others_go_on(cloud_info):
    eng, w, _ = make(cloud_info, n_ctx=256, max_sessions=2)
    try:

        async def main() -> int:
            big = await w.call(eng.open, prompt_of(eng, "word " * 400), SamplingParams())
            small = await w.call(eng.open, prompt_of(eng, "say hi"), SamplingParams())
            with pytest.raises(EngineFull, match="KV cells"):
                await w.generate(big)
            return (await w.generate(small))[0]

        assert asyncio.run(main()) >= 0
    finally:
        w.shutdown()


def test_plain_calls_still_run_on_the_engine_thread_in_order(cloud_info):
    """`await worker.call(engine.method, ...)` keeps working for code written before the scheduler."""
    eng, w, _ = make(cloud_info, n_ctx=1024, max_sessions=2)
    try:

        async def main() -> tuple[int, list[int]]:
            h = await w.call(eng.open, prompt_of(eng, "say hi"), SamplingParams())
            tok, _, _ = await w.call(eng.generate, h)
            await w.call(eng.rollback, h, len(prompt_of(eng, "say hi")))
            again, _, _ = await w.generate(h)
            return tok, [again]

        first, [again] = asyncio.run(main())
        assert first == again, "rollback then generate must give the same greedy token"
        assert w.submit(eng.n_sessions.__class__, 0).result(timeout=5) == 0
    finally:
        w.shutdown()


def test_split_kv_layout_caps_each_session_at_its_share(cloud_info):
    """Split layout: 4 slots x 256 cells; a session past its share gets EngineFull, the others are untouched."""
    eng, w, _ = make(cloud_info, n_ctx=1024, max_sessions=4, kv_layout="split")
    try:
        assert eng.pool.seq_cells == 256

        async def main() -> int:
            long = await w.call(eng.open, prompt_of(eng, "word " * 300), SamplingParams())
            ok = await w.call(eng.open, prompt_of(eng, "say hi"), SamplingParams())
            with pytest.raises(EngineFull, match="may hold 256"):
                await w.generate(long)
            return (await w.generate(ok))[0]

        assert asyncio.run(main()) >= 0
    finally:
        w.shutdown()


# --------------------------------------------------------------------------- the engine contract


def assert_implements(obj: object, proto: type) -> None:
    """`obj` passes the runtime check of `proto` and each of its methods takes the protocol's
    parameters, with the same names and defaults (runtime_checkable alone checks names only)."""
    assert isinstance(obj, proto), f"{type(obj).__name__} does not implement {proto.__name__}"
    for name, member in vars(proto).items():
        if name.startswith("_") or not inspect.isfunction(member):
            continue
        want = [(p.name, p.default) for p in inspect.signature(member).parameters.values()][1:]
        got = [(p.name, p.default) for p in inspect.signature(getattr(obj, name)).parameters.values()]
        assert got == want, f"{type(obj).__name__}.{name}{got} differs from {proto.__name__}.{name}{want}"


def test_the_engine_and_its_worker_implement_the_protocols(cloud_info):
    eng, w, _ = make(cloud_info, n_ctx=1024, max_sessions=2)
    try:
        assert_implements(eng, Engine)
        assert_implements(eng, BatchEngine)
        assert_implements(w, Worker)
        caps = eng.capabilities()
        assert caps.generate and caps.guess and caps.verify
        assert caps.max_verify_tokens == eng.n_batch - 1 and caps.n_vocab == eng.model.n_vocab == 49152
    finally:
        w.shutdown()


def test_an_empty_history_is_a_named_error_and_the_session_goes_on(cloud_info):
    """rollback(0) empties a session: generate (batched or not) and verify name the problem."""
    eng, w, _ = make(cloud_info, n_ctx=1024, max_sessions=2)
    try:

        async def main() -> None:
            prompt = prompt_of(eng, "say hi")
            h = await w.call(eng.open, prompt, SamplingParams())
            await w.call(eng.rollback, h, 0)
            for attempt in (w.generate(h), w.call(eng.generate, h), w.call(eng.verify, h, [1, 2], [0])):
                with pytest.raises(EmptyHistory, match="history is empty"):
                    await attempt
            assert eng.history(h) == []
            await w.call(eng.append, h, prompt)
            assert (await w.generate(h)).token >= 0

        asyncio.run(main())
    finally:
        w.shutdown()


def test_a_generate_for_a_closed_session_is_a_named_error_and_the_worker_goes_on(cloud_info):
    """A request whose session closed while it was queued (the only request of its step) fails
    naming the session; the scheduler's next step serves another session as before."""
    eng, w, _ = make(cloud_info, n_ctx=1024, max_sessions=2)
    try:

        async def main() -> None:
            prompt = prompt_of(eng, "say hi")
            h = await w.call(eng.open, prompt, SamplingParams())
            await w.call(eng.close, h)
            with pytest.raises(EngineFailed, match=f"session {h} is closed"):
                await w.generate(h)
            other = await w.call(eng.open, prompt, SamplingParams())
            assert (await w.generate(other)).token >= 0

        asyncio.run(main())
    finally:
        w.shutdown()


# --------------------------------------------------------------------------- the tie rule (shared/decision.py)

TIE_MARGIN = 0.03  # nats kept from TIE_NATS on either side: a decode in another batch layout may shift a gap a little


def greedy_positions(eng: CloudEngine, prompt: list[int], n: int) -> list[tuple[list[int], int, int, float]]:
    """(history, best, second best, gap in nats) at each of the first `n` greedy positions after `prompt`."""
    h = eng.open(prompt, SamplingParams())
    out = []
    try:
        for _ in range(n):
            eng.prefill(h)
            g = eng.guess(h)
            out.append((list(eng.history(h)), g.top_ids[0], g.top_ids[1], g.top_logprobs[0] - g.top_logprobs[1]))
            if eng.is_eog(eng.generate(h).token):
                break
    finally:
        eng.close(h)
    return out


def tie_and_beyond(eng: CloudEngine) -> tuple[tuple[list[int], int, int, float], tuple[list[int], int, int, float]]:
    """A real position whose second-best token is within TIE_NATS of the best, and one just beyond it."""
    tie = beyond = None
    for q in [*QUESTIONS, "tell me about the moon"]:
        for pos in greedy_positions(eng, prompt_of(eng, q), 20):
            gap = pos[3]
            if tie is None and gap <= TIE_NATS - TIE_MARGIN:
                tie = pos
            if beyond is None and TIE_NATS + TIE_MARGIN <= gap <= TIE_NATS + 0.4:
                beyond = pos
        if tie is not None and beyond is not None:
            return tie, beyond
    raise AssertionError(f"no near-tie found (tie {tie is not None}, beyond {beyond is not None})")


def test_a_proposed_or_drafted_token_within_tie_nats_of_the_best_stands(cloud_info):
    """Greedy: at a real near-tie the device's token (proposed with generate, drafted with a flagged
    verify) is the cloud's own choice; a gap just beyond TIE_NATS writes the cloud's best. On every
    path that writes a hard token: kept logits, a batched decode, the unbatched generate, verify."""
    eng, w, _ = make(cloud_info, n_ctx=2048, max_sessions=4)
    try:
        tie, beyond = tie_and_beyond(eng)

        async def main() -> None:
            for (history, best, second, gap), stands in ((tie, True), (beyond, False)):
                want = second if stands else best
                h = await w.call(eng.open, history, SamplingParams())
                await w.prefill(h)
                assert (await w.generate(h, second)).token == want, ("kept logits", gap)
                await w.call(eng.rollback, h, len(history))
                assert (await w.generate(h, second)).token == want, ("batched decode", gap)
                await w.call(eng.rollback, h, len(history))
                assert (await w.call(eng.generate, h, second)).token == want, ("unbatched", gap)
                await w.call(eng.rollback, h, len(history))
                await w.prefill(h)
                r = await w.call(eng.verify, h, [second], [0])
                assert (r.accepted, r.token) == ((1, -1) if stands else (0, best)), ("verify", gap)
                await w.call(eng.close, h)
                h = await w.call(eng.open, history, SamplingParams())
                await w.prefill(h)
                assert (await w.call(eng.guess, h)).token == best
                assert (await w.generate(h, second)).token == best, (
                    "a guess announced in a `next` is written as promised"
                )
                await w.call(eng.close, h)

        asyncio.run(main())
    finally:
        w.shutdown()


def test_the_tie_rule_over_the_wire(cloud_server, cloud_info):
    """The server writes the device's proposed token at a near-tie, and its own best just beyond one."""
    eng = CloudEngine(cloud_info, n_ctx=2048, max_sessions=2, threads=1)
    try:
        tie, beyond = tie_and_beyond(eng)
        q_of = {tuple(prompt_of(eng, q)): q for q in [*QUESTIONS, "tell me about the moon"]}
    finally:
        eng.close_all()
    for (history, best, second, gap), stands in ((tie, True), (beyond, False)):
        want = second if stands else best
        question = next(q for p, q in q_of.items() if list(p) == history[: len(p)])
        with connect(cloud_server.url, open_timeout=10, compression=None) as ws:
            acc = wire(ws, hello(cloud_info, cloud_server.api_key, question))
            assert isinstance(acc, Accept)
            if len(history) > acc.n_prompt:
                ws.send(encode(Sync(position=acc.n_prompt, tokens=history[acc.n_prompt :])))
            got = wire(ws, Generate(request_id=1, position=len(history), tokens=[], proposed=second))
            assert isinstance(got, Tokens) and got.ids == [want], (gap, got)


# --------------------------------------------------------------------------- batch isolation


class FaultyEngine(CloudEngine):
    """Test-only: the decodes of chosen sessions fail, as a broken kernel or a numerical blow-up would;
    a real model produces neither on demand. Sessions in `nan_handles` read NaN logits; any decode
    that includes a session in `raise_handles` raises. Everything else is the real engine."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.nan_handles: set[int] = set()
        self.raise_handles: set[int] = set()
        self.decodes: list[int] = []  # items per decode attempt
        self._nan_outs: set[int] = set()
        # the model runner's calls into llama.cpp, wrapped (every decode of the engine goes through them)
        self._real_decode_items, self._real_output_logits = self.runner.decode_items, self.runner.output_logits
        self.runner.decode_items = self._decode_items  # type: ignore[method-assign]
        self.runner.output_logits = self._output_logits  # type: ignore[method-assign]

    def _seqs_of(self, handles: set[int]) -> set[int]:
        return {self._sessions[h].kv.seq for h in handles if h in self._sessions}

    def _decode_items(self, items: list[DecodeItem]) -> list[int]:
        self.decodes.append(len(items))
        if {it.seq for it in items} & self._seqs_of(self.raise_handles):
            raise RuntimeError("injected kernel failure")
        outs = self._real_decode_items(items)
        poisoned = self._seqs_of(self.nan_handles)
        self._nan_outs = {o for it, o in zip(items, outs) if it.seq in poisoned}
        return outs

    def _output_logits(self, out: int) -> np.ndarray:
        logits = self._real_output_logits(out)
        return np.full_like(logits, np.nan) if out in self._nan_outs else logits


ISOLATION_QS = ["what is the capital of france", "name a colour", "count to three", "say hi"]


async def in_one_batch(w: EngineWorker, requests: list) -> list:
    """Await scheduler requests that all join one batch: the engine thread is held (a plain call
    waiting on a gate) until every request is queued. Results or exceptions, in order."""
    gate = threading.Event()
    w.submit(gate.wait, 30)
    tasks = [asyncio.ensure_future(r) for r in requests]
    await asyncio.sleep(0.05)  # every request is queued behind the gate
    gate.set()
    return await asyncio.gather(*tasks, return_exceptions=True)


async def _sessions_in_one_batch(
    eng: CloudEngine, w: EngineWorker, faulty: int | None, inject: str
) -> tuple[list[list[int]], dict]:
    """Four sessions write up to 6 tokens each in rounds, each round one batch (`in_one_batch`), so
    both runs decode the same layouts. The last session writes one token only. Session `faulty`
    (an index) fails by `inject`."""
    hs = [await w.call(eng.open, prompt_of(eng, q), SamplingParams()) for q in ISOLATION_QS]
    if faulty is not None:
        assert isinstance(eng, FaultyEngine)
        (eng.nan_handles if inject == "nan" else eng.raise_handles).add(hs[faulty])
    outs: list[list[int]] = [[] for _ in hs]
    errors: dict[int, BaseException] = {}
    for rnd in range(6):
        live = [i for i in range(len(hs)) if i not in errors and (i < len(hs) - 1 or rnd == 0)]
        for i, r in zip(live, await in_one_batch(w, [w.generate(hs[i]) for i in live])):
            if isinstance(r, BaseException):
                errors[i] = r
            else:
                outs[i].append(r.token)
    return outs, {"handles": hs, "errors": errors}


@pytest.mark.parametrize("inject", ["nan", "raise"])
def test_a_failing_request_fails_alone_and_the_others_tokens_are_unchanged(cloud_info, inject):
    """One session's decode fails inside a batch of four (NaN logits, or the decode raises): that
    request alone gets a named error; the other three get exactly the tokens of a run without the
    failure; the failed session keeps its history and writes its token once the fault is gone."""
    # split KV: a session attends over its own cells only, so the others' tokens cannot depend on
    # whether the failed session's cells are there (in a unified pool they may, at a near-tie)
    ref_eng, ref_w, _ = make(cloud_info, n_ctx=4096, max_sessions=4, kv_layout="split")
    eng = FaultyEngine(cloud_info, threads=1, n_ctx=4096, max_sessions=4, kv_layout="split")
    w = EngineWorker(eng)
    try:
        ref, _ = asyncio.run(_sessions_in_one_batch(ref_eng, ref_w, None, inject))

        async def main() -> tuple[list[list[int]], dict]:
            outs, info = await _sessions_in_one_batch(eng, w, 3, inject)
            h = info["handles"][3]
            assert eng.history(h) == prompt_of(eng, ISOLATION_QS[3]), "a failed request leaves the history as it was"
            eng.nan_handles.clear()
            eng.raise_handles.clear()
            info["after"] = (await w.generate(h)).token
            return outs, info

        got, info = asyncio.run(main())
        assert list(info["errors"]) == [3], info["errors"]
        assert isinstance(info["errors"][3], SamplingError if inject == "nan" else EngineFailed)
        assert got[:3] == ref[:3], "the other sessions' tokens must not change"
        assert info["after"] == ref[3][0]
        assert eng.decodes[0] == 4, "the four first decodes share one batch"
        if inject == "raise":
            assert eng.decodes[:5] == [4, 2, 2, 1, 1], (
                f"the failed batch is split down to the failing request: {eng.decodes}"
            )
    finally:
        ref_w.shutdown()
        w.shutdown()


def test_sampling_that_overflows_fails_only_that_session(cloud_info):
    """A temperature so small that logits / T overflow (the protocol refuses it at the edge; the
    engine must not trust that) is a SamplingError for that session; its batch-mate is served."""
    eng, w, rec = make(cloud_info, n_ctx=2048, max_sessions=4)
    ref_eng, ref_w, _ = make(cloud_info, n_ctx=2048, max_sessions=4)
    try:

        async def main() -> tuple[int, int]:
            p_bad, p_ok = prompt_of(eng, "say hi"), prompt_of(eng, "name a colour")
            bad = await w.call(eng.open, p_bad, SamplingParams(temperature=1e-308, top_k=40, top_p=1.0))
            ok = await w.call(eng.open, p_ok, SamplingParams())
            failed, served = await in_one_batch(w, [w.generate(bad), w.generate(ok)])
            assert isinstance(failed, SamplingError) and "not finite" in str(failed)
            assert eng.history(bad) == p_bad
            assert rec.batches[-1][0] == 2, "both requests were in one decode"
            r = await ref_w.call(ref_eng.open, p_ok, SamplingParams())
            assert not isinstance(served, BaseException)
            return served.token, (await ref_w.generate(r)).token

        got, want = asyncio.run(main())
        assert got == want
    finally:
        w.shutdown()
        ref_w.shutdown()


def test_nan_logits_reach_the_device_as_bad_field_and_the_session_survives(cloud_info):
    """The session layer (cloud_server/session.py) over the real engine: an engine failure is a
    named ProtocolError (the transport sends it as an `error` and keeps the connection), the
    history is as before, and the next generate at the same position is served."""
    eng = FaultyEngine(cloud_info, threads=1, n_ctx=2048, max_sessions=2)
    w = EngineWorker(eng)
    sent: list = []

    async def send(msg) -> None:
        sent.append(msg)

    try:

        async def main() -> None:
            conn = Connection(w, ServerConfig(insecure=True), KeyChecker([], insecure=True), cloud_info, send)
            await conn.on_message(hello(cloud_info, "any", "say hi"))
            acc = sent[-1]
            assert isinstance(acc, Accept)
            assert conn.session is not None
            eng.nan_handles.add(conn.session.handle)
            n = acc.n_prompt
            for rid in (1, 2):  # the device token makes the kept logits stale: a decode, which fails (twice)
                with pytest.raises(ProtocolError) as err:
                    await conn.on_message(Generate(request_id=rid, position=n, tokens=[28]))
                assert err.value.code == ErrorCode.BAD_FIELD and "not finite" in err.value.message
                assert len(eng.history(conn.session.handle)) == n, "the refused generate keeps none of its tokens"
            eng.nan_handles.clear()
            await conn.on_message(Generate(request_id=3, position=n, tokens=[28]))
            assert isinstance(sent[-1], Tokens) and sent[-1].position == n + 1
            await conn.close()

        asyncio.run(main())
    finally:
        w.shutdown()


# --------------------------------------------------------------------------- refusals at the wire

LIMITED, FREE = "limited-key", "free-key"


def wire(ws, msg) -> object:
    ws.send(encode(msg))
    return decode(ws.recv(timeout=20))


@pytest.fixture(scope="module")
def small_server(tmp_path_factory):
    """A server with a small KV budget (256 cells) and a key allowed 2 cloud tokens per minute."""
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"{LIMITED} name=limited tokens_per_minute=2\n{FREE} name=free\n")
    with LocalCloudServer(model=DEFAULT_CLOUD_MODEL, extra_args=["--api-keys", str(keys), "--n-ctx", "256"]) as server:
        yield server


def test_a_refused_generate_leaves_the_history_as_it_was(small_server, cloud_info):
    """A generate refused as busy (quota) or context_full keeps none of the tokens it carried: the
    device may send it again at the same position (before, the retry got out_of_order)."""
    with connect(small_server.url, open_timeout=10, compression=None) as ws:
        acc = wire(ws, hello(cloud_info, LIMITED))
        n = acc.n_prompt
        for rid in (1, 2):  # the key's two tokens
            assert isinstance(wire(ws, Generate(request_id=rid, position=n, tokens=[])), Tokens)
            n += 1
        for rid in (3, 4):  # refused twice at the same position, carrying the same device tokens
            reply = wire(ws, Generate(request_id=rid, position=n, tokens=[28, 29]))
            assert isinstance(reply, Error) and reply.code == ErrorCode.BUSY and "per minute" in reply.message, reply
        ws.send(encode(Sync(position=n, tokens=[28, 29])))  # the tokens are not there: the sync is in order
        reply = wire(ws, Generate(request_id=5, position=n + 2, tokens=[]))
        assert isinstance(reply, Error) and reply.code == ErrorCode.BUSY, reply

    with connect(small_server.url, open_timeout=10, compression=None) as ws:
        acc = wire(ws, hello(cloud_info, FREE))
        n = acc.n_prompt
        reply = wire(ws, Generate(request_id=1, position=n, tokens=[28] * 300))
        assert isinstance(reply, Error) and reply.code == ErrorCode.CONTEXT_FULL, reply
        reply = wire(ws, Generate(request_id=2, position=n, tokens=[28, 29]))  # the retry at the same position
        assert isinstance(reply, Tokens) and reply.position == n + 2, reply


def test_rollback_to_zero_then_generate_or_verify_is_a_named_error(small_server, cloud_info):
    """An empty history (rollback to 0) cannot be continued: bad_field saying so, and the session
    goes on (a sync at 0 restores it)."""
    with connect(small_server.url, open_timeout=10, compression=None) as ws:
        assert isinstance(wire(ws, hello(cloud_info, FREE)), Accept)
        ws.send(encode(Rollback(position=0)))
        for msg in (
            Generate(request_id=1, position=0, tokens=[]),
            Verify(request_id=2, position=0, tokens=[28], check=[0]),
        ):
            reply = wire(ws, msg)
            assert (
                isinstance(reply, Error) and reply.code == ErrorCode.BAD_FIELD and "history is empty" in reply.message
            ), reply
            assert reply.request_id == msg.request_id
        reply = wire(ws, Generate(request_id=3, position=0, tokens=[1, 28, 29]))  # carried tokens: nothing is empty
        assert isinstance(reply, Tokens) and reply.position == 3
        ws.send(encode(Rollback(position=0)))
        reply = wire(ws, Verify(request_id=4, position=0, tokens=[1, 28], check=[1]))
        assert isinstance(reply, Error) and reply.code == ErrorCode.BAD_FIELD, "verify drafts need a history to follow"
        ws.send(encode(Sync(position=0, tokens=[1, 28])))
        reply = wire(ws, Verify(request_id=5, position=2, tokens=[29], check=[0]))
        assert isinstance(reply, Verdict) and reply.position == 2
