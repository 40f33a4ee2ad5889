"""`tokenrouter-edge app`: serve the desktop assistant's page on loopback and open the browser.

    tokenrouter-edge app [--no-browser] [--port N] [--audio browser|device] [--config FILE] ...

`edge_client.cli.build_parser` calls `add_app_subcommand`; the subparser sets `handler`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import webbrowser
from typing import Any

from edge_client.options import DEFAULT_CHECK
from edge_client.options_cli import add_generation_options, options_from_args
from edge_client.voice.audio_io import DeviceError, resolve_device
from edge_client.voice.options_cli import add_voice_options, voice_options_from_args

from .core import AppCore
from .server import AppServer
from .settings import SettingsError, SettingsStore

DEFAULT_PORT = 8790  # a fixed port keeps the page's origin, so the browser remembers the microphone permission

log = logging.getLogger(__name__)


def add_app_subcommand(sub: Any) -> None:
    a = sub.add_parser("app", help="the desktop assistant: a local page in the browser (docs/app.md)")
    a.add_argument(
        "--no-browser", action="store_true", help="do not open the browser; open the printed address yourself"
    )
    a.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"loopback port (default {DEFAULT_PORT}; a free one if taken)"
    )
    a.add_argument(
        "--audio",
        choices=["browser", "device"],
        default="browser",
        help="browser: the page's microphone and speakers, with the browser's echo cancellation (default); "
        "device: this machine's audio devices through sounddevice",
    )
    a.add_argument("--config", metavar="FILE", help="settings file (default ~/.config/tokenrouter/app.json)")
    a.add_argument("--input-device", help="--audio device: microphone name part or index (overrides the saved setting)")
    a.add_argument("--output-device", help="--audio device: speaker name part or index")
    a.add_argument(
        "--duplex",
        choices=["full", "half"],
        default=None,
        help="full: listen while speaking (barge-in); default full in the browser (its echo cancellation), "
        "half with --audio device (no echo cancellation there: full needs headphones)",
    )
    add_voice_options(a)
    add_generation_options(a)
    # None = not given: the saved settings decide (a flag given here overrides them for this launch only)
    a.set_defaults(handler=cmd_app, cloud=None, check=None, api_key=None)


def _fail(msg: str) -> int:
    print(f"tokenrouter-edge: {msg}", file=sys.stderr)
    return 2


def build_core(args: argparse.Namespace) -> AppCore:
    """The app's core from the command line (not loaded yet); raises SettingsError, DeviceError, ValueError."""
    if args.threshold is not None:
        raise ValueError("the app sets the cloud share with --cloud-fraction (or its slider), not --threshold")
    overrides: dict[str, Any] = {}
    if args.cloud is not None:
        overrides["cloud"] = args.cloud
    key = args.api_key if args.api_key is not None else os.environ.get("TOKENROUTER_API_KEY")
    if key:
        overrides["api_key"] = key
    if args.cloud_fraction is not None:
        overrides["cloud_fraction"] = args.cloud_fraction
    if args.check is not None:
        overrides["check"] = args.check
    for name in ("input_device", "output_device"):
        if getattr(args, name):
            overrides[name] = getattr(args, name)
    if args.duplex is not None and args.audio == "browser":
        overrides["barge_in"] = args.duplex == "full"
    args.cloud, args.check, args.api_key = args.cloud or "local", args.check or DEFAULT_CHECK, args.api_key or ""
    vopts = voice_options_from_args(args)
    vopts.full_duplex = args.duplex == "full"  # --audio device; the browser's comes from the barge-in setting
    gen_opts = options_from_args(args)
    gen_opts.validate()  # a malformed --tier, a base model without --allow-base-model: before any model loads
    core = AppCore(gen_opts, vopts, SettingsStore(args.config), overrides, audio=args.audio)
    if args.audio == "device":  # fail before loading models
        resolve_device(core.settings.input_device or None, "input")
        resolve_device(core.settings.output_device or None, "output")
    return core


def cmd_app(args: argparse.Namespace) -> int:
    try:
        core = build_core(args)
    except (SettingsError, DeviceError, ValueError) as e:
        return _fail(str(e))
    server = AppServer(core, port=args.port)
    print(
        f"TokenRouter assistant: {server.url}\n(loading the models; the page shows when it is ready; Ctrl-C quits)",
        flush=True,
    )
    threading.Thread(target=core.load, name="app-load", daemon=True).start()
    if not args.no_browser:
        threading.Thread(target=_open_browser, args=(server.launch_url,), daemon=True).start()
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        if core.active is not None:
            core.active.stop_now()
        core.close()
    if core.load_error:
        return _fail(core.load_error)
    return 0


def _open_browser(url: str) -> None:
    try:
        if not webbrowser.open(url):
            print("no browser found: open the address above yourself", file=sys.stderr)
    except Exception as e:
        print(f"could not open a browser ({e}): open the address above yourself", file=sys.stderr)
