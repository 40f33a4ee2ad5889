"""What the app loads once per launch and shares with each tab in turn: models, generator, cloud, settings.

Settings from the page are applied between answers: the generator's options (`reconfigure`), a
routing policy rebuilt for a new cloud fraction, a new cloud target (the next answer connects to
it), a new Piper pace. The conversation history lives here too, so a reloaded tab keeps it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import replace
from typing import Any, Callable
from urllib.parse import urlsplit

from edge_client.cloud_link import CloudBusy, CloudLink, CloudRejected, CloudUnavailable
from edge_client.generator import RoutedGenerator
from edge_client.local_cloud import loopback_server, tier_clouds
from edge_client.options import GeneratorOptions
from edge_client.voice.audio_io import DeviceError, list_devices
from edge_client.voice.dialogue import Dialogue
from edge_client.voice.events import TurnDone
from edge_client.voice.pipeline import Engines, VoiceOptions
from edge_client.voice.tts import Synthesizer
from models.registry import model_info
from shared.llama_backend import LlamaModel
from shared.policy import PolicyConfig

from .conversation import TurnLog
from .settings import AppSettings, SettingsStore

log = logging.getLogger(__name__)


class _AppLink(CloudLink):
    """A link whose refused session (a wrong key, say) leaves the app answering on the device: the
    generator treats a refusal as a configuration error and stops the answer, which in the app
    would silence the assistant over a setting the person can fix on the page."""

    def open(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().open(*args, **kwargs)
        except CloudRejected as e:
            raise CloudUnavailable(f"{e}; check the cloud URL and key in Settings") from e


class CloudTarget:
    """The generator's `connect`: a link to whichever cloud the settings name now.

    Swapped between answers by `AppCore.apply`; the generator's cloud session calls it when the
    next answer needs a link."""

    def __init__(self, timeout_s: float = 2.0) -> None:
        self.url = ""
        self.key = ""
        self.timeout_s = timeout_s

    def __call__(self) -> CloudLink:
        if not self.url:
            raise CloudUnavailable("no cloud configured")
        return _AppLink(self.url, self.key, timeout_s=self.timeout_s)


def cloud_label(cloud: str) -> str:
    """The cloud as the page shows it: never a key, never a URL's user info."""
    if cloud in ("local", "none"):
        return {"local": "local server (loopback)", "none": "none (device only)"}[cloud]
    u = urlsplit(cloud)
    return f"{u.scheme}://{u.hostname}{f':{u.port}' if u.port else ''}{u.path}"


class AppCore:
    """Models, generator, cloud and settings for one launch of the app.

    `audio` is "browser" (the page's microphone and speakers) or "device" (sounddevice on this
    machine). `saved` is what the settings file holds; `settings` is what is in force, which the
    command line may override for this launch without writing it to the file."""

    def __init__(
        self,
        gen_opts: GeneratorOptions,
        vopts: VoiceOptions,
        store: SettingsStore,
        overrides: dict[str, Any] | None = None,
        audio: str = "browser",
        reply_limit_s: float | None = None,
    ) -> None:
        self.gen_opts = gen_opts
        self.vopts = vopts
        self.store = store
        self.saved = store.load()
        self.settings = self.saved.updated(overrides or {})
        self.audio = audio
        self.reply_limit_s = reply_limit_s  # benchmarks: each turn ends once this much of it played (0: first audio)
        self.base_policy = gen_opts.policy
        self.target = CloudTarget(gen_opts.cloud_timeout_s)
        self.gen: RoutedGenerator | None = None
        self.engines: Engines | None = None
        self.dialogue: Dialogue | None = None
        self.ready = threading.Event()
        self.load_error: str | None = None
        self.turn_listeners: list[Callable[[TurnDone], None]] = []  # tests and benchmarks observe finished turns
        self.log = TurnLog()  # finished turns as the page shows them, for a tab that reloads
        self._probe: tuple[tuple[str, str], dict[str, Any]] | None = None  # the last connection test of the target
        self.active: Any = None  # the connected tab's session.Session (not imported: it imports this module)
        self._stack = contextlib.ExitStack()
        self._local: tuple[str, str] | None = None
        self._apply_lock = threading.Lock()

    # ---------------------------------------------------------------- loading

    def load(self) -> None:
        """Load the models, reach the cloud, warm everything up (seconds); sets `ready` or `load_error`."""
        try:
            s = self.settings
            edge = LlamaModel(model_info(self.gen_opts.edge_model))
            self._stack.callback(edge.close)
            self._point_target(s.cloud, s.api_key)
            opts = replace(
                self.gen_opts,
                cloud_fraction=s.cloud_fraction,
                threshold=0.5,
                check=s.check,
                policy=self._policy_for(s),
            )
            # a pool (--tier): the tiers above the cloud start with the app (unless it starts on the device
            # alone) and stay whatever cloud the settings name
            tier_connects = self._stack.enter_context(tier_clouds(opts))
            gen = RoutedGenerator(edge, opts, self.target, tier_connects=tier_connects)
            self._stack.callback(gen.close)
            tts = replace(self.vopts.tts, length_scale=self._length_scale(s.pace))
            self.engines = Engines(gen, self.vopts.asr, tts, self.vopts.dialogue.system_prompt, self.vopts.turn)
            self.gen = gen
            self.dialogue = Dialogue(self.vopts.dialogue, gen.count_tokens)
        except Exception as e:
            log.exception("the app could not load")
            self.load_error = f"{type(e).__name__}: {e}"
        finally:
            self.ready.set()
        if self.load_error is None and not self.device_only(self.settings):
            # the badge says whether the cloud is there before the first answer needs it
            threading.Thread(target=self.probe_cloud, name="cloud-probe", daemon=True).start()

    def probe_cloud(self) -> None:
        """Test the configured cloud and show the result on the connected tab."""
        s = self.settings
        self.test_cloud(s.cloud, s.api_key)
        if self.active is not None:
            self.active.send(self.cloud_status())

    def close(self) -> None:
        self._stack.close()

    # ---------------------------------------------------------------- settings

    def apply(self, changes: dict[str, Any]) -> AppSettings:
        """Validate `changes`, apply them to the next answer, save them; raises SettingsError.
        Blocks while an answer is being generated (the generator's options change between answers)."""
        with self._apply_lock:
            new = self.settings.updated(changes)
            saved = self.saved.updated(changes)
            old = self.settings
            if (new.cloud, new.api_key) != (old.cloud, old.api_key):
                self._point_target(new.cloud, new.api_key)
                assert self.gen is not None
                self.gen.reconnect_next()  # the next answer connects to the new target
            elif self.device_only(new) and not self.device_only(old):
                assert self.gen is not None
                self.gen.reconnect_next()  # a share of 0 %: the session is closed, nothing more goes up
            if (new.cloud, new.cloud_fraction, new.check) != (old.cloud, old.cloud_fraction, old.check):
                self._reconfigure(new)
            if new.pace != old.pace and self.engines is not None:
                self.engines.synth = Synthesizer(replace(self.vopts.tts, length_scale=self._length_scale(new.pace)))
            self.settings, self.saved = new, saved
            self.store.save(saved)
            return new

    def _reconfigure(self, s: AppSettings) -> None:
        """Check mode, policy and cloud fraction for the next answer (the generator rebuilds its policy)."""
        assert self.gen is not None
        self.gen.reconfigure(check=s.check, cloud_fraction=s.cloud_fraction, threshold=0.5, policy=self._policy_for(s))

    def _policy_for(self, s: AppSettings) -> str:
        """No cloud: the device answers alone (a share of 0 % is the policy's own rule: shared/policy.py)."""
        return "edge" if s.cloud == "none" else self.base_policy

    def device_only(self, s: AppSettings) -> bool:
        """The device answers alone: no cloud, or the policy's rule (a cloud share of 0 %)."""
        return s.cloud == "none" or PolicyConfig(self.base_policy, cloud_fraction=s.cloud_fraction).device_alone

    @staticmethod
    def _length_scale(pace: float) -> float | None:
        return None if abs(pace - 1.0) < 1e-6 else float(pace)

    def _point_target(self, cloud: str, key: str) -> None:
        if cloud == "none":
            self.target.url, self.target.key = "", ""
        elif cloud == "local":
            self.target.url, self.target.key = self._local_server()
        else:
            self.target.url, self.target.key = cloud, key

    def _local_server(self) -> tuple[str, str]:
        """The loopback cloud server, started the first time it is needed and kept until the app exits."""
        if self._local is None:
            self._local = self._stack.enter_context(
                loopback_server(self.gen_opts.cloud_model, cpus=self.gen_opts.cloud_cpus)
            )
        return self._local

    # ---------------------------------------------------------------- what the page shows

    def cloud_status(self) -> dict[str, Any]:
        """The cloud as it stands now: device-only, connected, offline (with why), reachable (a test just
        passed) or pending (connects with the next answer). Never an earlier target's state."""
        s = self.settings
        gen = self.gen
        error = ""
        if self.device_only(s):
            state = "device-only"
        elif gen is not None and gen.link is not None and gen.link.connected:
            state = "connected"
        elif gen is not None and gen.last_cloud_error:
            state, error = "offline", gen.last_cloud_error
        elif self._probe is not None and self._probe[0] == (s.cloud, s.api_key):
            ok, message = self._probe[1]["ok"], self._probe[1]["message"]
            state, error = ("reachable", "") if ok else ("offline", message)
        else:
            state = "pending"
        label = cloud_label(s.cloud)
        if s.cloud != "none" and s.cloud_fraction == 0:
            label += "; cloud share 0%"
        return {"type": "cloud", "state": state, "label": label, "error": error}

    def devices(self) -> dict[str, list[str]]:
        """Input and output device names (--audio device), or empty lists when PortAudio is missing."""
        try:
            devs = list_devices()
        except DeviceError:
            return {"inputs": [], "outputs": []}
        return {
            "inputs": [d["name"] for d in devs if d["max_input_channels"] > 0],
            "outputs": [d["name"] for d in devs if d["max_output_channels"] > 0],
        }

    def test_cloud(self, cloud: str, key: str | None) -> dict[str, Any]:
        """Open and close a session with `cloud` (the stored key when `key` is None): ok, or why not.
        A test of the cloud in force is remembered: the page's badge shows it until an answer connects."""
        key = self.settings.api_key if key is None else key
        result = self._test_cloud(cloud, key)
        if (cloud, key) == (self.settings.cloud, self.settings.api_key):
            self._probe = ((cloud, key), result)
            if result["ok"] and self.gen is not None and self.gen.last_cloud_error:
                self.gen.reconnect_next()  # the cloud is back: the next answer connects anew
        return result

    def _test_cloud(self, cloud: str, key: str) -> dict[str, Any]:
        if cloud == "none":
            return {"ok": True, "message": "no cloud: the device answers alone"}
        try:
            url, key = self._local_server() if cloud == "local" else (cloud, key)
        except Exception as e:
            return {"ok": False, "message": f"the local cloud server did not start: {e}"}
        assert self.gen is not None
        edge = self.gen.edge
        messages = [{"role": "system", "content": self.vopts.dialogue.system_prompt}]
        link = CloudLink(url, key, timeout_s=5.0, connect_timeout_s=5.0)
        t0 = time.perf_counter()
        try:
            opts = self.gen.opts  # asked as an answer asks: a cloud whose model tokenizes differently shares text
            accept = link.open(
                edge.info,
                messages,
                edge.chat_tokens(messages),
                opts.sampling(),
                opts.text_mode,
                refuse_base_model=not opts.allow_base_model,
            )
            ms = (time.perf_counter() - t0) * 1000
            return {
                "ok": True,
                "message": f"connected to {cloud_label(cloud)} in {ms:.0f} ms; cloud model {accept.cloud_model[:16]}",
            }
        except CloudRejected as e:
            hint = "" if e.code == "base_model" else " (check the API key)"
            return {"ok": False, "message": f"the cloud refused the session: {e}{hint}"}
        except CloudBusy as e:  # reachable, the key works, no room now: answers come from the device meanwhile
            return {"ok": False, "message": f"{cloud_label(cloud)} is full right now: {e}"}
        except (CloudUnavailable, OSError) as e:
            return {"ok": False, "message": f"cannot reach {cloud_label(cloud)}: {e}"}
        except Exception as e:  # a server that speaks something else
            return {"ok": False, "message": f"{cloud_label(cloud)} did not answer as a TokenRouter cloud: {e}"}
        finally:
            link.close("connection test")
