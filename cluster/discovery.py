"""Where proposer replicas publish their gRPC address and verifiers look it up.

Ray Serve routes handle calls itself but does not expose replica addresses, and the
per-round proposer path must not go through Serve (one handle hop costs ~3 ms; a raw
gRPC stream message ~0.3 ms). So each proposer replica runs its own gRPC server and
announces `host:port` here every `HEARTBEAT_S`; an entry not refreshed within `TTL_S` is
dead (a killed replica cannot withdraw). One small named actor per application.
"""

from __future__ import annotations

import time

import ray

HEARTBEAT_S = 0.5
TTL_S = 2.0
NAMESPACE = "splitspec"


@ray.remote(num_cpus=0, max_restarts=-1)
class ProposerDirectory:
    def __init__(self) -> None:
        # deployment -> replica id -> (address, last heartbeat on this actor's clock)
        self._entries: dict[str, dict[str, tuple[str, float]]] = {}

    def announce(self, deployment: str, replica_id: str, address: str) -> None:
        self._entries.setdefault(deployment, {})[replica_id] = (address, time.monotonic())

    def withdraw(self, deployment: str, replica_id: str) -> None:
        self._entries.get(deployment, {}).pop(replica_id, None)

    def replicas(self, deployment: str) -> dict[str, str]:
        """Live replicas of `deployment`: replica id -> gRPC address."""
        now = time.monotonic()
        entries = self._entries.get(deployment, {})
        for replica_id in [r for r, (_, seen) in entries.items() if now - seen > TTL_S]:
            del entries[replica_id]
        return {r: address for r, (address, _) in entries.items()}


def directory_name(app_name: str) -> str:
    return f"proposer-directory:{app_name}"


def get_directory(app_name: str):
    """The application's directory actor, created on first use by whoever comes first."""
    return ProposerDirectory.options(
        name=directory_name(app_name), namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
    ).remote()


def kill_directory(app_name: str) -> None:
    """Remove the directory of a deleted application (it is detached)."""
    try:
        ray.kill(ray.get_actor(directory_name(app_name), namespace=NAMESPACE))
    except ValueError:
        pass
