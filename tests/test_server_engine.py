"""The embedded engine under the batch scheduler: batching, fairness, the KV budget and eviction.

Real model (SmolLM2-135M Q4_1), real llama.cpp context; the scheduler thread is
driven from asyncio exactly as the server drives it.
"""

from __future__ import annotations

import asyncio

import pytest

from cloud_server.engine import CloudEngine, EngineFull, EngineWorker
from shared.protocol import SamplingParams
from tests.conftest import chat


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
            return await asyncio.gather(*(session(q) for q in ["what is the capital of france", "name a colour", "count to three", "say hi"]))

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
    """peek_next announces the next token without writing it; a generate at that position then
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
                g = await w.call(eng.peek_next, h)
                assert g.token >= 0 and g.logprob <= 0.0
                assert await w.call(eng.peek_next, h) == g, "asking twice must not re-sample"
                assert len(g.top_ids) == 8 and g.top_logprobs == sorted(g.top_logprobs, reverse=True)
                assert g.token not in g.top_ids or g.top_logprobs[g.top_ids.index(g.token)] == pytest.approx(g.logprob, abs=1e-4)
                assert len(eng.history(h)) == len(prompt) + len(written), "a guess is not part of the history"
                decodes = len(rec.batches)
                token, logprob, _ = await w.generate(h)
                assert len(rec.batches) == decodes
                assert logprob == g.logprob
                guesses.append(g.token)
                written.append(token)
            assert written == guesses

            await w.prefill(h)
            stale = (await w.call(eng.peek_next, h)).token
            await w.call(eng.append, h, [stale])  # the device wrote its own token there
            assert (await w.call(eng.peek_next, h)).token == -1, "no kept logits describe the longer history"
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
        assert eng.stats.evictions >= 8 and eng.stats.restores_loaded >= 6
        assert eng.n_resident == 1 and eng.cells_used <= eng.ctx.n_ctx
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
            hs = [await w.call(eng.open, prompt_of(eng, f"question number {i}: " + "tell me about the sea " * 20), SamplingParams()) for i in range(4)]
            outs: list[list[int]] = [[] for _ in hs]
            for _ in range(2):
                for i, h in enumerate(hs):
                    outs[i].append((await w.generate(h))[0])
                    peak = max(peak, eng.cells_used)
            return [eng.model.detokenize(o) for o in outs]

        texts = asyncio.run(main())
        assert all(t.strip() for t in texts)
        assert eng.stats.evictions > 0 and eng.stats.restores_recomputed > 0
        assert peak <= eng.ctx.n_ctx, "KV cells in use must stay within the budget"
        assert eng.kv_bytes_used <= eng.kv_budget_bytes
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
            tok, _, _ = await w.call(eng.generate_one, h)
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
        assert eng.seq_cells == 256
        async def main() -> int:
            long = await w.call(eng.open, prompt_of(eng, "word " * 300), SamplingParams())
            ok = await w.call(eng.open, prompt_of(eng, "say hi"), SamplingParams())
            with pytest.raises(EngineFull, match="may hold 256"):
                await w.generate(long)
            return (await w.generate(ok))[0]

        assert asyncio.run(main()) >= 0
    finally:
        w.shutdown()
