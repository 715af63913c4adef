"""Who runs next: the waiting jobs of every client, and the slots each holds.

Pure bookkeeping, no trio and no engine, so that the admission rules can be
tested alone: admission is round-robin across clients, then across each
client's owners (its connections), and one client holds at most
``max_running_per_client`` engine slots, so that another client's request
finds a slot while one client floods the engine, through either door.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable
from typing import Generic, Protocol, TypeVar

import attrs

__all__ = ["FairQueue", "Waiting"]


class Waiting(Protocol):
    """What the queue needs of a job."""

    @property
    def job_id(self) -> int: ...

    @property
    def fair_key(self) -> Hashable: ...

    @property
    def client_key(self) -> Hashable: ...


J = TypeVar("J", bound=Waiting)


@attrs.define(eq=False)
class _ClientQueue(Generic[J]):
    """One client's waiting jobs, per owner, and the owners' turn order."""

    owners: dict[Hashable, dict[int, J]] = attrs.Factory(dict)
    rotation: collections.deque[Hashable] = attrs.Factory(collections.deque)


class FairQueue(Generic[J]):
    """Waiting jobs in fair order, and the running jobs per client."""

    def __init__(self, max_running_per_client: int) -> None:
        if max_running_per_client < 1:
            raise ValueError(f"max_running_per_client must be >= 1, got {max_running_per_client!r}")
        self.max_running_per_client = max_running_per_client
        self.waiting = 0
        self._queues: dict[Hashable, _ClientQueue[J]] = {}
        self._rotation: collections.deque[Hashable] = collections.deque()
        self._running: collections.Counter[Hashable] = collections.Counter()

    def __bool__(self) -> bool:
        return self.waiting > 0

    def push(self, job: J) -> None:
        """Queue ``job`` behind its owner's earlier jobs."""
        client = self._queues.get(job.client_key)
        if client is None:
            client = self._queues[job.client_key] = _ClientQueue()
            self._rotation.append(job.client_key)
        queue = client.owners.get(job.fair_key)
        if queue is None:
            queue = client.owners[job.fair_key] = {}
            client.rotation.append(job.fair_key)
        queue[job.job_id] = job
        self.waiting += 1

    def __contains__(self, job: J) -> bool:
        client = self._queues.get(job.client_key)
        if client is None:
            return False
        queue = client.owners.get(job.fair_key)
        return queue is not None and job.job_id in queue

    def remove(self, job: J) -> None:
        """Take a waiting ``job`` out (stopped, refused, or admitted)."""
        client = self._queues[job.client_key]
        queue = client.owners[job.fair_key]
        del queue[job.job_id]
        self.waiting -= 1
        if not queue:
            del client.owners[job.fair_key]
            client.rotation.remove(job.fair_key)
        if not client.owners:
            del self._queues[job.client_key]
            self._rotation.remove(job.client_key)

    def may_run(self, client: Hashable) -> bool:
        """Whether ``client`` holds fewer slots than its cap."""
        return self._running[client] < self.max_running_per_client

    def pop(self) -> J | None:
        """The first waiting job of the next owner of the next client in the
        rotation that may take a slot, counted as running; that client, and
        that owner within it, go to the back of their rotations. None when no
        waiting client may take one."""
        for _ in range(len(self._rotation)):
            key = self._rotation[0]
            self._rotation.rotate(-1)
            if not self.may_run(key):
                continue
            client = self._queues[key]
            owner = client.rotation[0]
            client.rotation.rotate(-1)
            job = next(iter(client.owners[owner].values()))
            self.remove(job)
            self._running[key] += 1
            return job
        return None

    def release(self, job: J) -> None:
        """A running ``job`` gave its slot back."""
        key = job.client_key
        self._running[key] -= 1
        if self._running[key] <= 0:
            del self._running[key]

    def drain(self) -> list[J]:
        """Every waiting job, in no particular order; the queue is then empty."""
        jobs = [
            job
            for client in self._queues.values()
            for queue in client.owners.values()
            for job in queue.values()
        ]
        self._queues.clear()
        self._rotation.clear()
        self._running.clear()
        self.waiting = 0
        return jobs
