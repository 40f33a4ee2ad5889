"""What a connection reports to besides the engine: quotas, metrics, the audit log.

One object so `Connection` gets a single optional argument; every part has a
do-nothing default, so code that builds a Connection without them still works.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cloud_server.audit import AuditLog, AuditOptions
from cloud_server.metrics import ServerMetrics
from cloud_server.quotas import Quotas
from cloud_server.routing_watch import RoutingWatch


@dataclass(slots=True)
class Services:
    quotas: Quotas = field(default_factory=Quotas)
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    audit: AuditLog = field(default_factory=lambda: AuditLog(AuditOptions(), cloud_model=""))
    abuse_warmup_tokens: int = 32
    watch: RoutingWatch = field(default_factory=RoutingWatch)
