"""Exploration that cannot be gamed, and the routing watch's alarm.

The device asks the cloud, at random, about positions its router kept (--explore); the cloud
serves them from its key's exploration budget and declines the rest without harming the
session. The server compares each session's routing with the fleet's band and raises an alarm
(metric, log, audit log) when a session leaves it. Real servers on loopback, the real models."""

from __future__ import annotations

import json
import secrets

import pytest
from websockets.sync.client import connect

from cloud_server.auth import digest
from cloud_server.local import LocalCloudServer
from cloud_server.routing_watch import RoutingWatch, SessionRouting
from edge_client.cloud_link import CloudLink
from edge_client.generator import RoutedGenerator
from edge_client.options import GeneratorOptions
from models.registry import DEFAULT_CLOUD_MODEL
from shared.exploration import Exploration
from shared.protocol import Accept, decode
from tests.conftest import LONG_QUESTIONS, QUESTIONS, chat
from tests.helpers import hello_json, make_generator, metric, wait_for


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_exploration_draws_at_random_within_its_budget():
    clock = Clock()
    e = Exploration(1.0, per_minute=3, clock=clock)
    assert [e.pick() for _ in range(5)] == [True, True, True, False, False]  # a full bucket, then empty
    clock.t = 20.0  # 3 a minute: one more after 20 s
    assert [e.pick() for _ in range(3)] == [True, False, False]
    assert not any(Exploration(0.0, 100).pick() for _ in range(1000))
    share = sum(Exploration(0.25, 1e9).pick() for _ in range(4000)) / 4000
    assert 0.2 < share < 0.3
    with pytest.raises(ValueError, match="--explore"):
        Exploration(1.5, 6)
    with pytest.raises(ValueError, match="--explore-per-minute"):
        Exploration(0.1, -1)


def session(asked: int, positions: int = 100, checked: int = 0, overruled: int = 0, key: str = "k0") -> SessionRouting:
    return SessionRouting(key=key, positions=positions, asked=asked, checked=checked, overruled=overruled)


def test_the_watch_learns_the_fleets_band_and_flags_a_session_outside_it():
    watch = RoutingWatch(quantile=0.01, min_sessions=20, min_positions=64, min_keys=5)
    for i in range(19):
        assert watch.check(session(25 + i % 10, checked=80, overruled=4 + i % 4, key=f"k{i % 6}"), final=True) == []
    assert watch.band("routed_share", "new") is None  # not trusted before 20 sessions
    watch.check(session(30, checked=80, overruled=5, key="k5"), final=True)
    low, high = watch.band("routed_share", "new")
    assert low <= 0.25 and 0.34 <= high < 0.4
    # a session that keeps every token on the device while the check overrules a third of its drafts
    odd = session(0, positions=0, checked=0, key="odd")
    assert watch.check(odd) == []  # too few positions to judge
    odd.positions, odd.checked, odd.overruled = 70, 70, 24
    alarms = {(a.signal, a.side) for a in watch.check(odd)}
    assert alarms == {("routed_share", "low"), ("overrule_rate", "high")}
    odd.positions += 64
    assert watch.check(odd, final=True) == []  # each alarms once
    assert watch.bands["routed_share"].sessions == 21  # it joined the band, as one key among seven


def honest_fleet(watch: RoutingWatch, keys: int, sessions_each: int = 4) -> None:
    """Honest keys whose sessions route 3-5 % of their positions (none alarms)."""
    for i in range(sessions_each):
        for k in range(keys):
            assert watch.check(session(3 + (i + k) % 3, key=f"honest{k}"), final=True) == []


def test_one_keys_sessions_do_not_move_the_band():
    """Issue 47 #4: one key's 20 sessions that route nothing (a sync of 70 tokens, closed) made the band
    0.00-0.01 on a fresh server, and every honest session after them alarmed. A key weighs as one device."""
    watch = RoutingWatch()  # the defaults: 20 sessions, 5 keys
    for _ in range(20):
        assert watch.check(session(0, positions=70, key="hostile"), final=True) == []
    assert watch.band("routed_share", "honest0") is None  # one key: nothing is judged
    honest_fleet(watch, keys=5)
    before = watch.band("routed_share", "honest0")
    for _ in range(200):  # however many more sessions the key opens
        watch.check(session(0, positions=70, key="hostile"), final=True)
    assert watch.band("routed_share", "honest0") == before
    assert before[1] >= 0.05  # the honest sessions' rates are inside the band that judges them
    assert all(not watch.check(session(4, key=f"honest{k}"), final=True) for k in range(5))
    # and the key cannot hide its own sessions by widening the band: it is judged by the others'
    alarms = watch.check(session(0, positions=70, key="hostile"), final=True)
    assert [(a.signal, a.side) for a in alarms] == [("routed_share", "low")]


def test_nothing_is_judged_before_enough_keys():
    """With sessions enough but fewer other keys than --alarm-min-keys, no session alarms; one more key, and
    the odd one does. --alarm-min-keys 0: one key's sessions judge each other (a fleet behind one key)."""
    watch = RoutingWatch(min_keys=5)
    honest_fleet(watch, keys=4, sessions_each=10)
    odd = session(60, key="odd")
    assert watch.check(odd) == []  # four other keys
    honest_fleet(watch, keys=5, sessions_each=1)
    assert [a.side for a in watch.check(session(60, key="odd"))] == ["high"]
    single = RoutingWatch(min_keys=0)
    for i in range(20):
        single.check(session(3 + i % 3, key="fleet"), final=True)
    assert [a.side for a in single.check(session(60, key="fleet"))] == ["high"]


def test_a_band_that_moved_follows_the_fleet_again():
    """Alarmed sessions join the band (their key's part of it): when the whole fleet moves (a new router,
    or a band poisoned by colluding keys), its sessions alarm for a while, then fit again."""
    watch = RoutingWatch()
    honest_fleet(watch, keys=6)
    moved = [watch.check(session(30, key=f"honest{i % 6}"), final=True) for i in range(6 * 40)]
    assert any(moved[:6]), "the fleet's move was not seen"
    assert not any(moved[-12:]), "the band never followed the fleet"


@pytest.fixture(scope="module")
def stingy_server():
    """A cloud whose keys may explore twice a minute."""
    with LocalCloudServer(model=DEFAULT_CLOUD_MODEL, extra_args=["--key-explore-per-minute", "2"]) as server:
        yield server


@pytest.fixture()
def watched_server(tmp_path):
    """A new cloud (a fleet of its own, behind one key) whose routing watch trusts its band after 3 sessions,
    with an audit log."""
    args = ["--alarm-min-sessions", "3", "--alarm-min-keys", "0", "--audit-dir", str(tmp_path)]
    with LocalCloudServer(model=DEFAULT_CLOUD_MODEL, extra_args=args) as server:
        yield server


@pytest.mark.parametrize("text_mode", ["never", "always"])
def test_explored_positions_past_the_keys_budget_are_declined_and_the_session_goes_on(
    edge_model, stingy_server, text_mode
):
    """Every position is explored (the router keeps them all: threshold 1); the key's budget
    of 2 a minute is served, the rest declined: written by the device, not fallbacks, not
    degraded, and the session survives more declines than the server's error limit (32) would
    allow, in tokens and in text mode."""
    served0 = metric(stingy_server, "tokenrouter_explored_total")
    gen = make_generator(
        edge_model, stingy_server, threshold=1.0, explore=1.0, explore_per_minute=1000, text_mode=text_mode
    )
    answers = []
    try:
        for _ in range(12):  # one chat answered again on one session until its declines pass the error limit
            answers.append(gen.generate(chat(LONG_QUESTIONS[0]), max_tokens=48))
            link = gen.link
            assert link is not None and link.connected
            if len(answers) == 1:
                first_link = link
            assert link is first_link  # the same session: declines do not close it
            if sum(a.explore_declined for a in answers) > 40:
                break
    finally:
        gen.close()
    served = metric(stingy_server, "tokenrouter_explored_total") - served0
    assert served <= 2  # the key's budget (shared by both modes' runs)
    assert sum(a.round_trips for a in answers) == served
    for a in answers:
        assert a.shared_history == ("text" if text_mode == "always" else "tokens")
        assert not a.degraded and a.traffic.reconnects == 0 and a.cloud_timeouts == 0
        explored = a.explored_positions
        assert explored == sorted(set(explored)) and len(explored) >= a.n_tokens - a.n_cloud_tokens
        assert a.explore_declined == len(explored) - a.round_trips
        assert a.to_json()["explored_positions"] == explored
        assert a.to_json()["explore_declined"] == a.explore_declined
    assert sum(a.explore_declined for a in answers) > 40


def test_a_session_that_routes_unlike_the_fleet_raises_an_alarm(edge_model, watched_server, tmp_path):
    """Three sessions that route as calibrated (30 % of positions), then one that keeps every token on
    the device (threshold 1): the server's routing watch alarms on its routed share, counts it in
    /metrics and keeps its audit log with the alarm named."""

    def one_session(threshold: float, questions: list[str], **options: object) -> None:
        gen = make_generator(edge_model, watched_server, threshold=threshold, **options)
        try:
            n = 0
            for q in questions:
                n += gen.generate(chat(q), max_tokens=48).n_tokens
                if n >= 80:
                    break
            assert n >= 64, "too short a session to be judged"
        finally:
            gen.close()

    before = metric(watched_server, 'tokenrouter_routing_alarms_total{side="low",signal="routed_share"}')
    for i in range(3):
        one_session(0.5, LONG_QUESTIONS[i * 3 :] + QUESTIONS, cloud_fraction=0.3)
    assert metric(watched_server, "tokenrouter_routing_alarms_total") == before  # calibrated sessions: none
    one_session(1.0, LONG_QUESTIONS)
    low = 'tokenrouter_routing_alarms_total{side="low",signal="routed_share"}'
    wait_for(lambda: metric(watched_server, low) > before, 5)  # raised when the session closes
    assert metric(watched_server, low) == before + 1

    def alarmed() -> list[dict]:
        index = [json.loads(line) for p in tmp_path.glob("*/index.jsonl") for line in p.open()]
        return [e for e in index if e.get("alarms")]

    alarmed = wait_for(alarmed, 5)  # the audit log is written after the connection closed
    assert len(alarmed) == 1 and alarmed[0]["flagged"] and "routed_share 0.00 is low" in alarmed[0]["alarms"][0]


def test_one_keys_flood_raises_no_alarm_on_the_next_honest_session(edge_model, cloud_info, tmp_path):
    """Issue 47 #4 as it was found: on a fresh server with the default watch and an audit log, one key
    opens 20 sessions that each sync 70 device tokens and close; the next honest session ("describe how
    a bicycle works", 128 tokens) raised `routed_share 0.04 is high (fleet band 0.00-0.01)` and its audit
    entry was flagged. Now no alarm, nothing flagged, and the audit index names keys by digest only."""
    hostile = "hostile-" + secrets.token_hex(4)
    (tmp_path / "keys.txt").write_text(f"{hostile} name=hostile\n")
    audit = tmp_path / "audit"
    args = ["--api-keys", str(tmp_path / "keys.txt"), "--audit-dir", str(audit)]
    with LocalCloudServer(model=DEFAULT_CLOUD_MODEL, extra_args=args) as server:
        for _ in range(20):
            with connect(server.url, open_timeout=10) as ws:
                ws.send(hello_json(cloud_info, hostile, "what is the capital of france"))
                acc = decode(ws.recv(timeout=30))
                assert isinstance(acc, Accept), acc
                ws.send(json.dumps({"type": "sync", "position": acc.n_prompt, "tokens": [28] * 70}))
        # the product's device, as `tokenrouter-edge ask --max-tokens 128` runs it
        opts = GeneratorOptions(cloud=server.url, api_key=server.api_key, seed=7, max_tokens=128)
        gen = RoutedGenerator(edge_model, opts, lambda: CloudLink(server.url, server.api_key))
        try:
            question = [
                {"role": "system", "content": opts.system_prompt},
                {"role": "user", "content": "describe how a bicycle works"},
            ]
            answer = gen.generate(question)
        finally:
            gen.close()
        assert answer.n_tokens >= 64 and answer.n_cloud_tokens > 0, answer.to_json()

        def entries() -> list[dict]:
            index = [json.loads(line) for p in audit.glob("*/index.jsonl") for line in p.open()]
            return index if len(index) == 21 else []

        index = wait_for(entries, 10)
        assert len(index) == 21, index
        assert metric(server, "tokenrouter_routing_alarms_total{") == 0
    assert not [e for e in index if e["flagged"] or e.get("alarms")], index
    assert {e["key_digest"] for e in index if e["key"] == "hostile"} == {digest(hostile)}
    assert hostile not in "".join(p.read_text() for p in audit.glob("*/index.jsonl"))  # the digest, never the key
