"""The device's one entry point to a cloud server on loopback (`--cloud local`).

The only module of edge_client that imports cloud_server (tests/test_layering.py
checks it): the device otherwise knows the cloud only through the wire protocol.
The server runs as a separate process (cloud_server/local.py), as in production.
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable, Iterator

from cloud_server.local import LocalCloudServer
from edge_client.cloud_link import CloudLink
from edge_client.options import GeneratorOptions


@contextlib.contextmanager
def loopback_cloud(opts: GeneratorOptions) -> Iterator[Callable[[], CloudLink] | None]:
    """Yields how to connect to the cloud `opts` names: a server started here on loopback
    (`local`, stopped on exit), a remote URL, or None (`none`, or the device alone: policy `edge` or a
    cloud share of 0, shared/policy.py)."""
    if opts.cloud == "none" or (opts.cloud == "local" and opts.policy_config().device_alone):
        yield None
        return
    if opts.cloud != "local":
        key = opts.api_key or os.environ.get("TOKENROUTER_API_KEY", "")
        yield lambda: CloudLink(opts.cloud, key, timeout_s=opts.cloud_timeout_s)
        return
    with LocalCloudServer(model=opts.cloud_model, cpus=opts.cloud_cpus) as server:
        yield lambda: CloudLink(server.url, server.api_key, timeout_s=opts.cloud_timeout_s)


@contextlib.contextmanager
def tier_clouds(opts: GeneratorOptions) -> Iterator[list[Callable[[], CloudLink]]]:
    """How to connect to each tier above the cloud (`opts.tiers`): loopback servers started here
    (`local:MODEL`, stopped on exit) or remote URLs (with the cloud's key)."""
    key = opts.api_key or os.environ.get("TOKENROUTER_API_KEY", "")
    with contextlib.ExitStack() as stack:
        connects: list[Callable[[], CloudLink]] = []
        for tier in opts.tiers if not opts.policy_config().device_alone else ():
            if tier.startswith("local:"):
                server = stack.enter_context(LocalCloudServer(model=tier[len("local:") :], cpus=opts.cloud_cpus))
                url, tier_key = server.url, server.api_key
            else:
                url, tier_key = tier, key
            connects.append(lambda url=url, k=tier_key: CloudLink(url, k, timeout_s=opts.cloud_timeout_s))
        yield connects


@contextlib.contextmanager
def loopback_server(model: str, threads: int = 1, cpus: str = "") -> Iterator[tuple[str, str]]:
    """A cloud server process on loopback for `model` (the replay harness puts its network
    emulator in front), on the CPUs `cpus` names ("" = wherever): yields (WebSocket URL, API key);
    stopped on exit."""
    with LocalCloudServer(model=model, extra_args=["--threads", str(threads)], cpus=cpus) as server:
        yield server.url, server.api_key
