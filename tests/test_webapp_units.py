"""The desktop app's parts that need no models and no browser: settings file, the browser's
playback accounting, frame times, push-to-talk and file injection, audio file reading, and the
server's guard (token, Host, Origin) on a real loopback server that has not loaded any model."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import soundfile as sf
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from edge_client.answer import Answer, Traffic
from edge_client.cli import build_parser
from edge_client.options import GeneratorOptions
from edge_client.voice.audio_io import Frame
from edge_client.voice.events import TurnDone
from edge_client.voice.pipeline import VoiceOptions
from edge_client.voice.turn_record import turn_json
from edge_client.voice.wavfile import AudioFileError, read_audio, read_wav, write_wav
from edge_client.webapp.bridge import BrowserMicrophone, BrowserPlayback, FrameClock, InputGate, page_time
from edge_client.webapp.cli import cmd_app
from edge_client.webapp.conversation import TurnLog
from edge_client.webapp.core import AppCore, cloud_label
from edge_client.webapp.server import AppServer
from edge_client.webapp.settings import AppSettings, SettingsError, SettingsStore

# ---------------------------------------------------------------- settings


def test_settings_file_is_owner_only_and_never_shows_the_key(tmp_path):
    store = SettingsStore(tmp_path / "cfg" / "tokenrouter" / "app.json")
    s = AppSettings().updated(
        {"cloud": "wss://cloud.example:8765/v1/route", "api_key": "sekrit", "cloud_fraction": "0.4"}
    )
    store.save(s)
    assert stat.S_IMODE(store.path.stat().st_mode) == 0o600
    assert stat.S_IMODE(store.path.parent.stat().st_mode) == 0o700
    assert store.load() == s and s.cloud_fraction == 0.4
    pub = s.public()
    assert "api_key" not in pub and pub["api_key_set"] is True and "sekrit" not in json.dumps(pub)
    os.chmod(store.path, 0o644)  # a file someone made readable is made owner-only again
    store.load()
    assert stat.S_IMODE(store.path.stat().st_mode) == 0o600


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"cloud": "http://example.com"}, "cloud"),
        ({"cloud_fraction": 1.5}, "cloud_fraction"),
        ({"cloud_fraction": "lots"}, "cloud_fraction"),
        ({"check": "sometimes"}, "check"),
        ({"talk_mode": "telepathy"}, "talk_mode"),
        ({"barge_in": "yes"}, "barge_in"),
        ({"pace": 9}, "pace"),
        ({"voice": "someone-else"}, "voice"),
        ({"colour": "blue"}, "colour"),
    ],
)
def test_bad_settings_are_refused_naming_the_setting(changes, field):
    with pytest.raises(SettingsError) as e:
        AppSettings().updated(changes)
    assert e.value.field == field and str(e.value)


def test_a_damaged_settings_file_falls_back_to_defaults(tmp_path):
    p = tmp_path / "app.json"
    p.write_text(json.dumps({"cloud": "ftp://nope", "cloud_fraction": 0.5}))
    s = SettingsStore(p).load()
    assert s.cloud == "local" and s.cloud_fraction == 0.5  # the bad one dropped, the good one kept
    p.write_text("{not json")
    assert SettingsStore(p).load() == AppSettings()


def test_cloud_label_hides_credentials():
    assert cloud_label("wss://user:pw@cloud.example:8765/v1/route") == "wss://cloud.example:8765/v1/route"


# ---------------------------------------------------------------- the browser as speaker and microphone


def test_playback_follows_the_pages_reports():
    sent: list = []
    buf = BrowserPlayback(sent.append)
    buf.start_turn()
    buf.put(np.full(1000, 0.5, np.float32))
    buf.put(np.zeros(500, np.float32))
    assert buf.pending == 1500 and buf.played == 0 and buf.first_out_t is None
    assert sent[0] == {"type": "play_turn", "seq": 1} and isinstance(sent[1], bytes) and len(sent[1]) == 4 + 2000
    time.sleep(0.02)
    t = buf.first_sent_t + 0.01  # played 10 ms after it was sent, reported later
    buf.on_progress(1, 600, True, t=t)
    assert (buf.played, buf.pending, buf.first_out_t) == (600, 900, t)
    buf.on_progress(0, 1500, False)  # a late report about an earlier turn
    assert buf.played == 600
    buf.paused = True
    assert sent[-1] == {"type": "play_pause", "paused": True}
    assert buf.flush() == 600 and buf.pending == 0
    buf.put(np.zeros(100, np.float32))  # the cancelled turn's last chunk is not sent
    buf.on_progress(1, 700, False)
    assert buf.pending == 0 and not isinstance(sent[-1], bytes)
    buf.start_turn()
    assert (buf.played, buf.pending, buf.first_out_t, buf.first_sent_t) == (0, 0, None, None) and sent[-1]["seq"] == 2


def test_the_pages_play_stamp_counts_not_the_reports_trip_and_stays_within_sent_and_now():
    """The page stamps its report on the machine's wall clock; the first audio is then when it played,
    not when the report arrived, but never before the audio was sent nor in the future."""
    now_wall, now_mono = time.time(), time.monotonic()
    t = page_time(now_wall * 1000 - 40.0)  # reported 40 ms ago
    assert t is not None and abs((now_mono - t) - 0.040) < 0.005
    assert page_time(None) is None and page_time("12") is None and page_time(True) is None
    assert page_time(float("nan")) is None and page_time(float("inf")) is None

    buf = BrowserPlayback(lambda m: None)
    buf.start_turn()
    buf.put(np.zeros(100, np.float32))
    sent = buf.first_sent_t
    time.sleep(0.02)
    buf.on_progress(1, 50, True, t=sent + 0.005)  # played 5 ms after it was sent
    assert buf.first_out_t == sent + 0.005
    buf.start_turn()
    buf.put(np.zeros(100, np.float32))
    buf.on_progress(1 + 1, 50, True, t=buf.first_sent_t - 10.0)  # a page clock behind ours: not before sent
    assert buf.first_out_t == buf.first_sent_t
    buf.start_turn()
    buf.put(np.zeros(100, np.float32))
    before = time.monotonic()
    buf.on_progress(3, 50, True, t=before + 10.0)  # ahead of ours: not in the future
    assert before <= buf.first_out_t <= time.monotonic()


def test_frame_clock_keeps_real_spacing_of_bunched_frames():
    c = FrameClock()
    t = [c.stamp(320, 100.0 + 0.02 * (i + 1) + 0.005) for i in range(10)]  # steady, 5 ms transit
    late = [c.stamp(320, 100.35) for _ in range(5)]  # five frames delayed, then arriving together
    assert all(b - a == pytest.approx(0.02, abs=1e-6) for a, b in zip(t + late, (t + late)[1:]))
    assert late[-1] <= 100.35 and late[-1] == pytest.approx(100.3 + 0.005, abs=1e-6)


def test_microphone_generates_silence_while_the_page_has_none():
    mic = BrowserMicrophone()
    stop = threading.Event()
    frames = mic.frames(stop)
    got = [next(frames) for _ in range(5)]
    assert all(not f.samples.any() and len(f.samples) == 320 for f in got)
    assert all(b.t_end > a.t_end for a, b in zip(got, got[1:]))
    mic.set_mic(True)
    mic.push((np.full(320, 1000, "<i2")).tobytes())
    f = next(frames)
    assert f.samples[0] == pytest.approx(1000 / 32768) and f.t_end >= got[-1].t_end
    stop.set()


class _ListSource:
    def __init__(self, n: int) -> None:
        self.n = n

    def start(self) -> None: ...
    def close(self) -> None: ...

    def frames(self, stop):
        for i in range(self.n):
            yield Frame(np.ones(320, np.float32), float(i))


def test_push_to_talk_and_dropped_files_replace_the_input():
    gate = InputGate(_ListSource(6))
    gate.push_to_talk = True
    out = []
    for i, f in enumerate(gate.frames(threading.Event())):
        if i == 1:
            gate.talking = True
        if i == 3:
            gate.inject(np.full(400, 0.25, np.float32))  # 1.25 frames of file
        out.append(f.samples)
    assert not out[0].any() and not out[1].any()  # key not held (it is pressed during frame 1's wait)
    assert out[2].all()
    assert np.all(out[4] == 0.25) and np.all(out[5][:80] == 0.25) and not out[5][80:].any()


# ---------------------------------------------------------------- audio files people have


@pytest.fixture()
def tone() -> np.ndarray:
    t = np.arange(8000) / 16000
    return (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)


@pytest.mark.parametrize(
    "fmt, subtype, ext",
    [
        ("WAVEX", "PCM_24", "wav"),
        ("WAV", "FLOAT", "wav"),
        ("WAV", "PCM_24", "wav"),
        ("FLAC", "PCM_16", "flac"),
        ("OGG", "VORBIS", "ogg"),
    ],
)
def test_common_audio_files_are_read(tmp_path, tone, fmt, subtype, ext):
    p = tmp_path / f"a.{ext}"
    sf.write(p, np.stack([tone, tone], axis=1), 16000, format=fmt, subtype=subtype)
    x, rate = read_wav(p)
    assert rate == 16000 and len(x) == len(tone) and x.dtype == np.float32
    assert np.abs(x - tone).max() < (0.05 if ext == "ogg" else 1e-3)


def test_a_sox_made_extensible_wav_is_read(tmp_path, tone):
    if shutil.which("sox") is None:
        pytest.skip("sox not installed (scripts/setup.sh installs it)")
    src, ext = tmp_path / "src.wav", tmp_path / "ext.wav"
    write_wav(src, tone, 16000)
    subprocess.run(["sox", str(src), "-b", "24", str(ext)], check=True)
    assert ext.read_bytes()[20:22] == b"\xfe\xff"  # WAVE_FORMAT_EXTENSIBLE (65534): `wave` refuses it
    x, rate = read_wav(ext)
    assert rate == 16000 and np.abs(x - tone).max() < 1e-3


def test_unreadable_files_get_clear_errors(tmp_path, tone):
    cases = {
        "short.wav": (b"RIFF\x00\x00", "truncated"),
        "notes.wav": (b"hello, this is text\n" * 10, "not a readable audio file"),
        "empty.flac": (b"", "empty"),
    }
    for name, (data, says) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(AudioFileError, match=says):
            read_audio(tmp_path / name)
    flac = tmp_path / "cut.flac"
    sf.write(flac, tone, 16000, format="FLAC")
    flac.write_bytes(flac.read_bytes()[:30])
    with pytest.raises(AudioFileError, match="looks like FLAC"):
        read_audio(flac)
    with pytest.raises(AudioFileError, match="no such file"):
        read_audio(tmp_path / "missing.wav")
    with pytest.raises(AudioFileError, match="drop.ogg"):
        read_audio(b"OggS" + b"\x00" * 40, "drop.ogg")


# ---------------------------------------------------------------- the command line


def test_app_refuses_bad_options_before_loading_models(tmp_path, capsys):
    parse = build_parser().parse_args
    assert cmd_app(parse(["app", "--no-browser", "--config", str(tmp_path / "a.json"), "--cloud", "http://x"])) == 2
    assert "ws:// or wss://" in capsys.readouterr().err
    assert cmd_app(parse(["app", "--no-browser", "--config", str(tmp_path / "a.json"), "--threshold", "0.5"])) == 2
    assert "--cloud-fraction" in capsys.readouterr().err
    assert cmd_app(parse(["app", "--no-browser", "--config", str(tmp_path / "a.json"), "--tier", "gemma"])) == 2
    assert "a tier (--tier) is local:MODEL or a ws:// or wss:// URL" in capsys.readouterr().err
    assert (
        cmd_app(parse(["app", "--no-browser", "--config", str(tmp_path / "a.json"), "--tier", "local:gemma3-270m"]))
        == 2
    )
    err = capsys.readouterr().err
    assert "is a base model" in err and "--allow-base-model" in err
    assert not (tmp_path / "a.json").exists()  # nothing saved from the command line


# ---------------------------------------------------------------- the server's guard


@pytest.fixture()
def bare_server(tmp_path):
    """A real app server on loopback whose core never loads (the guard and static files need none)."""
    core = AppCore(GeneratorOptions(cloud="none"), VoiceOptions(), SettingsStore(tmp_path / "app.json"))
    srv = AppServer(core, port=0)
    srv.start()
    yield srv
    srv.stop()


def _get(
    url: str, headers: dict | None = None, method: str = "GET", data: bytes | None = None
) -> tuple[int, dict, bytes]:
    req = urllib.request.Request(url, headers=headers or {}, method=method, data=data)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def test_only_the_token_opens_the_page(bare_server):
    srv = bare_server
    assert srv.sock.getsockname()[0] == "127.0.0.1"
    base = f"http://127.0.0.1:{srv.port}"
    status, headers, body = _get(srv.url)
    assert status == 200 and b"TokenRouter" in body
    assert (
        "frame-ancestors 'none'" in headers["content-security-policy"] and headers["referrer-policy"] == "no-referrer"
    )
    assert b"http://" not in body.replace(b"http://127.0.0.1", b"") and b"https://" not in body  # no CDN
    assert _get(srv.url + "static/app.js")[0] == 200
    wrong = srv.token[:-1] + ("y" if srv.token.endswith("x") else "x")  # one character off (never the token itself)
    for path in [
        "/",
        "/favicon.ico",
        f"/{wrong}/",
        f"/{wrong}/static/app.js",
        "/static/app.js",
        f"/{srv.token}x/api/settings",
    ]:
        assert _get(base + path)[0] == 403, path
    assert _get(srv.url, headers={"Host": "evil.example"})[0] == 403  # DNS rebinding
    assert _get(srv.url + "static/..%2fserver.py")[0] == 404
    # a POST from another origin (a web page in the same browser) is refused even with the token
    code, _, _ = _get(
        srv.url + "api/settings", {"Origin": "http://evil.example", "Content-Type": "application/json"}, "POST", b"{}"
    )
    assert code == 403


def test_the_launch_link_works_once(bare_server):
    srv = bare_server

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *a, **k):
            return None

    opener = urllib.request.build_opener(NoRedirect)
    with pytest.raises(urllib.error.HTTPError) as e:
        opener.open(srv.launch_url, timeout=10)
    assert e.value.code == 303 and e.value.headers["location"] == f"/{srv.token}/"
    assert _get(srv.launch_url)[0] == 403


def test_websocket_needs_token_and_origin(bare_server):
    srv = bare_server
    ws_url = f"ws://127.0.0.1:{srv.port}/{srv.token}/ws"
    origin = f"http://127.0.0.1:{srv.port}"
    for url, org in [(ws_url, None), (ws_url, "http://evil.example"), (f"ws://127.0.0.1:{srv.port}/nope/ws", origin)]:
        with pytest.raises(InvalidStatus):
            connect(url, origin=org, open_timeout=5).close()
    with connect(ws_url, origin=origin, open_timeout=5) as ws:
        assert json.loads(ws.recv(timeout=5))["type"] == "loading"  # the core is not loaded: the page says so


# ---------------------------------------------------------------- the conversation the page shows


def _done(question: str, reply: str, n_tokens: int = 30, n_cloud: int = 6, **answer: object) -> TurnDone:
    a = Answer(policy="router", text=reply, **answer)  # type: ignore[arg-type]
    a.tokens = list(range(n_tokens))
    a.routes = ["cloud"] * n_cloud + ["edge"] * (n_tokens - n_cloud)
    a.scores = [0.5] * n_tokens
    a.pieces = ["x"] * n_tokens
    return TurnDone(question, a, reply, False)


def hist(*pairs: tuple[str, str]) -> list[dict[str, str]]:
    return [m for q, r in pairs for m in ({"role": "user", "content": q}, {"role": "assistant", "content": r})]


def test_the_turn_log_matches_records_to_the_history_the_model_keeps():
    """A reloaded tab gets one record per remembered pair: the newest record of a question asked twice, none for
    a pair the log never saw, and nothing from before a reset or from turns the history trimmed."""
    log = TurnLog()
    s = AppSettings()
    recs = [log.add(_done(q, r), s) for q, r in [("hi", "hello"), ("what time", "noon"), ("hi", "hello")]]
    assert log.for_history(hist(("hi", "hello"), ("what time", "noon"), ("hi", "hello"))) == recs
    assert log.for_history(hist(("what time", "noon"), ("hi", "hello"))) == recs[1:]  # the oldest pair trimmed
    assert log.for_history(hist(("hi", "hello"))) == [recs[2]]  # after a reset, asked again: the newest
    assert log.for_history(hist(("unseen", "reply"), ("hi", "hello"))) == [None, recs[2]]
    assert log.for_history([]) == []
    reset = TurnDone("start over", None, "", False, reset=True)
    assert log.add(reset, s)["reset"] and len(log.records) == 3  # a reset is not a turn to show


def test_the_cloud_share_is_shown_against_its_target_with_the_reasons_an_answer_differs():
    log = TurnLog()
    s = AppSettings(cloud_fraction=0.3)
    c = log.add(_done("q", "a", n_tokens=10, n_cloud=1, overruled_positions=[4]), s)["cloud_share"]
    assert c["answer"] == 0.1 and c["target"] == 0.3 and c["since_target"] == 0.1 and c["since_target_tokens"] == 10
    assert c["why"] == ["a short answer: one token is 10% of it", "1 token from the cloud's check of the first clause"]
    c = log.add(_done("q", "a", n_tokens=30, n_cloud=15), s)["cloud_share"]
    assert c["why"] == [] and c["since_target"] == round(16 / 40, 3)  # over both answers since the target was set
    c = log.add(_done("q", "a", n_tokens=30, n_cloud=0), s.updated({"cloud_fraction": 0.0}))["cloud_share"]
    assert c["since_target_tokens"] == 30 and "no cloud traffic" in c["why"][0]  # a new target: counted anew
    c = log.add(_done("q", "a", n_tokens=30, n_cloud=0, degraded=True), s)["cloud_share"]
    assert "the device wrote the rest" in c["why"][0]
    assert log.add(_done("q", "a", n_cloud=0), AppSettings(cloud="none"))["cloud_share"]["target"] == 0.0
    moved = _done("q", "a", n_tokens=30, n_cloud=9, traffic=Traffic(reconnects=1, failover_ms=40.0, resume_ms=300.0))
    rec = log.add(moved, s)  # a failover: the cloud's replica went away and another took the session
    assert rec["answer"]["reconnects"] == 1 and rec["answer"]["failover_lost_ms"] == 340.0
    assert rec["cloud_share"]["why"] == [
        "the cloud's server changed mid-answer: the session moved, at a cost of 340 ms"
    ]


def test_the_pages_record_is_the_turns_record_with_only_the_apps_own_facts_added():
    """One record of a turn (voice/turn_record.py, what `file --json` prints): the page's adds its message
    type and the cloud share against its target, and names nothing twice."""
    done = _done("q", "a", n_tokens=10, n_cloud=4)
    rec = TurnLog().add(done, AppSettings())
    assert {k: v for k, v in rec.items() if k not in ("type", "cloud_share")} == turn_json(done)
    assert rec["type"] == "turn_done" and rec["answer"]["n_cloud_tokens"] == 4 and rec["cloud_share"]["answer"] == 0.4


def test_a_finished_answer_says_when_it_was_cut_at_the_limit():
    rec = TurnLog().add(_done("q", "a", finish_reason="length"), AppSettings())
    assert rec["answer"]["finish_reason"] == "length"


def test_the_bare_address_says_where_the_full_one_is(bare_server):
    srv = bare_server
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/", timeout=5)
    body = e.value.read().decode()
    assert e.value.code == 403 and "printed in the terminal" in body and f":{srv.port}/<token>/" in body
    assert srv.token not in body
