"""The models a server serves, and their lifecycle.

Started with ``--model`` (or an engine given to :func:`~trioserve.server.serve`),
a server serves that one model, loaded before it listens, under any name a
request gives. Started with ``--models-dir``, it serves the catalog's models
(:mod:`trioserve.engine.catalog`) by id or alias, each loaded on demand:

* ``load`` starts a model's task in the registry's nursery. The task opens an
  engine thread, loads the engine there (off the event loop: other models'
  requests go on), builds its :class:`~trioserve.server.served.ServedModel`,
  runs its scheduler, and waits to be unloaded. A load that fails marks the
  model ``failed`` with the reason; the server and the other models go on.
* ``unload`` drains: the model takes no new request (refused ``overloaded``,
  naming it), running ones get ``unload_timeout`` seconds to finish, the rest
  end with "the model ... was unloaded", then its engine is closed on its
  thread and the memory it held is handed back.
* At most ``max_loaded`` models are loaded (or loading) at once: loading one
  more unloads the least recently used (idle ones first), and starts once that
  one is gone.
* A request for a model that is not loaded loads it when ``autoload`` is on
  (the default), and waits for it; else it is refused, naming the model.
* ``sleep_idle_s``: a model no request used for that long is unloaded
  (status ``sleeping``) and loaded again by the next request for it.

Statuses: ``unloaded``, ``loading``, ``loaded``, ``unloading``, ``sleeping``,
``failed``. Every change is published on :meth:`Models.watch`.
"""

from __future__ import annotations

import collections
import logging
import math
import typing
from collections.abc import Callable, Hashable, Mapping
from typing import TYPE_CHECKING, Any, Literal

import attrs
import trio

from trioserve.engine.base import Engine
from trioserve.engine.catalog import valid_model_id
from trioserve.engine.heap import give_back_freed_memory
from trioserve.engine.progress import LoadProgress, reporting_to
from trioserve.errors import TrioserveError
from trioserve.generation import Overloaded, admit_client
from trioserve.generation.engine_thread import EngineThread, open_loaded_engine

from .served import ModelSettings, ServedModel, model_template

if TYPE_CHECKING:
    from trioserve.engine.catalog import Catalog, CatalogEntry
    from trioserve.metrics import Metrics

__all__ = [
    "ModelError",
    "ModelSlot",
    "ModelStatus",
    "Models",
]

log = logging.getLogger("trioserve.models")

ModelStatus = Literal["unloaded", "loading", "loaded", "unloading", "sleeping", "failed"]
STATUSES: tuple[ModelStatus, ...] = typing.get_args(ModelStatus)

#: A function that loads an engine (blocking; called on the model's engine thread).
EngineLoader = Callable[[], Engine]

#: Seconds between two looks at a loading model's progress.
PROGRESS_INTERVAL = 0.25


class ModelError(Exception):
    """A request names a model that cannot serve it: ``status`` 404 (no such
    model), 409 (the operation does not apply) or 503 (not loaded, failed,
    unloading, or the server is shutting down)."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


@attrs.define(eq=False)
class ModelSlot:
    """One servable model and where it stands."""

    id: str
    entry: CatalogEntry | None = None
    status: ModelStatus = "unloaded"
    #: Why it failed (``failed``), else None.
    reason: str | None = None
    served: ServedModel | None = None
    #: trio.current_time() of its last use by a request.
    last_used: float = -math.inf
    #: Seconds its last load took.
    load_seconds: float | None = None
    #: Its load's progress while it loads (the loading thread writes it).
    progress: LoadProgress | None = None
    #: trio.current_time() when its last unload began.
    unload_began: float = 0.0
    #: Set when its status changes (then replaced).
    changed: trio.Event = attrs.Factory(trio.Event)
    _unload: trio.Event | None = None
    _ended: trio.Event | None = None
    #: Counts its loads: a task whose load is no longer the latest (the model
    #: was loaded again while it unloaded) leaves the status to the new one.
    _loads: int = 0
    #: Whether its current load has its place under ``max_loaded``.
    _roomed: bool = False

    def describe(self) -> dict[str, Any]:
        """``GET /models``' entry, in llama-server's shape (plus ours)."""
        status: dict[str, Any] = {"value": self.status}
        if self.reason is not None:
            status["reason"] = self.reason
        if self.load_seconds is not None and self.status == "loaded":
            status["load_seconds"] = round(self.load_seconds, 3)
        if self.status == "loading":
            progress = self.progress
            status["progress"] = round(progress.fraction, 3) if progress is not None else 0.0
        described: dict[str, Any] = {"id": self.id, "status": status}
        if self.entry is not None:
            described.update(self.entry.describe())
        if self.served is not None:
            info = self.served.info
            described.update(
                engine=info.engine, context_length=info.context_length, kernels=info.kernels
            )
        return described


@attrs.define(eq=False)
class Models:
    """The server's models (see the module's docstring). Built by
    :meth:`single` or :meth:`from_catalog`; :meth:`run` in the server's
    nursery holds every model's task."""

    settings: ModelSettings
    slots: dict[str, ModelSlot]
    #: The model a request that names none gets.
    default_id: str
    catalog: Catalog | None = None
    #: Makes the loader of a slot's engine (None: models cannot be loaded).
    loader_of: Callable[[ModelSlot], EngineLoader] | None = None
    metrics: Metrics | None = None
    is_draining: Callable[[], bool] = lambda: False
    max_loaded: int | None = None
    autoload: bool = True
    unload_timeout: float = 30.0
    sleep_idle_s: float | None = None
    #: Whether requests choose among them by name (else every name is the one model).
    named: bool = False
    #: Generations in flight per client, over every model.
    in_flight: collections.Counter[Hashable] = attrs.Factory(collections.Counter)
    _nursery: trio.Nursery | None = None
    _watchers: list[trio.MemorySendChannel[dict[str, Any]]] = attrs.Factory(list)

    # -- construction -----------------------------------------------------------------

    @classmethod
    def single(
        cls,
        engine: Engine,
        settings: ModelSettings,
        *,
        engine_thread: EngineThread | None = None,
        metrics: Metrics | None = None,
        is_draining: Callable[[], bool] = lambda: False,
        chat_template: Any = "auto",
    ) -> Models:
        """One model, loaded, served under every name (``--model``);
        ``chat_template``: as :meth:`ServedModel.build` takes it."""
        name = engine.info.model_name
        models = cls(settings=settings, slots={}, default_id=name, metrics=metrics)
        models.is_draining = is_draining
        served = ServedModel.build(
            name,
            engine,
            settings,
            engine_thread=engine_thread,
            metrics=metrics,
            is_draining=is_draining,
            in_flight=models.in_flight,
            chat_template=chat_template,
        )
        models.slots[name] = ModelSlot(id=name, status="loaded", served=served)
        return models

    @classmethod
    def from_catalog(
        cls,
        catalog: Catalog,
        loader_of: Callable[[ModelSlot], EngineLoader],
        settings: ModelSettings,
        **options: Any,
    ) -> Models:
        """The catalog's models, none loaded (``--models-dir``)."""
        if not catalog.entries:
            raise TrioserveError(f"--models-dir {str(catalog.root)!r} holds no model")
        slots = {entry.id: ModelSlot(id=entry.id, entry=entry) for entry in catalog.entries}
        return cls(
            settings=settings,
            slots=slots,
            default_id=catalog.entries[0].id,
            catalog=catalog,
            loader_of=loader_of,
            named=True,
            **options,
        )

    @classmethod
    def from_loaders(
        cls,
        loaders: Mapping[str, EngineLoader],
        settings: ModelSettings | None = None,
        **options: Any,
    ) -> Models:
        """Models by name, each made by its loader (called on the model's
        engine thread), none loaded: what a trio program embeds (the first
        name is the default). ``options``: :class:`Models`' fields
        (``max_loaded``, ``autoload``, ``unload_timeout``, ``sleep_idle_s``)."""
        names = list(loaders)
        if not names or not all(valid_model_id(name) for name in names):
            raise ValueError(f"models need names (letters, digits, '.', '_', '-'), got {names!r}")
        return cls(
            settings=settings or ModelSettings(),
            slots={name: ModelSlot(id=name) for name in names},
            default_id=names[0],
            loader_of=lambda slot: loaders[slot.id],
            named=True,
            **options,
        )

    @property
    def several(self) -> bool:
        """Whether models are chosen by name (``--models-dir``, :meth:`from_loaders`)."""
        return self.named

    # -- finding and using --------------------------------------------------------------

    def slot(self, name: str | None) -> ModelSlot:
        """The slot a request's ``model`` names (None: the default). With one
        model, every name is it; with a catalog, an id or alias, else
        :class:`ModelError` 404."""
        if name is None or not self.named:
            return self.slots[self.default_id]
        entry = self.catalog.find(name) if self.catalog is not None else None
        found = self.slots.get(entry.id if entry is not None else name)
        if found is None:
            raise ModelError(
                404,
                f"the model {name[:200]!r} does not exist (GET /models lists them)",
                "model_not_found",
            )
        return found

    def loaded(self) -> list[ServedModel]:
        return [s.served for s in self.slots.values() if s.served is not None]

    def default_served(self) -> ServedModel | None:
        """The default model's pipeline when it is loaded (for what needs
        a model but names none: the ``info`` reply's model)."""
        return self.slots[self.default_id].served

    async def acquire(self, name: str | None, client: Hashable | None = None) -> ServedModel:
        """The loaded model ``name`` names, loading it first where that is
        allowed (and waiting for it); :class:`ModelError` when it cannot be
        had. Cancelled with the request that waits. A request that waits for
        a load counts as one of ``client``'s requests in flight meanwhile
        (``--max-requests-per-client``): past its limit,
        :class:`~trioserve.generation.Overloaded`."""
        slot = self.slot(name)
        waiting = False
        try:
            while True:
                if slot.status == "loaded" and slot.served is not None:
                    slot.last_used = trio.current_time()
                    return slot.served
                self._check_loadable(slot)
                if client is not None and not waiting:
                    self.admit(client)
                    self.in_flight[client] += 1
                    waiting = True
                if slot.status in ("unloaded", "sleeping"):
                    self.load(slot.id)
                await slot.changed.wait()
        finally:
            if waiting:
                assert client is not None
                self.in_flight[client] -= 1
                if self.in_flight[client] <= 0:
                    del self.in_flight[client]

    def _check_loadable(self, slot: ModelSlot) -> None:
        """:class:`ModelError` when a request cannot wait for ``slot``'s model."""
        if self.is_draining():
            raise ModelError(503, "the server is shutting down", "overloaded")
        if slot.status == "failed":
            raise ModelError(
                503,
                f"the model {slot.id!r} failed to load: {slot.reason} "
                "(POST /models/load tries again)",
                "model_failed",
            )
        if slot.status == "unloaded" and not self.autoload:
            raise ModelError(
                503,
                f"the model {slot.id!r} is not loaded (POST /models/load loads it)",
                "model_not_loaded",
            )

    # -- lifecycle ----------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Hold every model's task until cancelled (then each stops as an
        unload past its timeout: its jobs end, its engine is closed)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for slot in self.slots.values():
                if slot.served is not None:  # single(): loaded already
                    await nursery.start(_serve_single, slot, slot.served)
            task_status.started()
            try:
                await self._publish_progress()
            finally:
                for slot in self.slots.values():
                    slot._unload = None
                for send in self._watchers:
                    send.close()

    async def _publish_progress(self) -> None:
        """Forever: publish each loading model's progress as it rises (``GET
        /models/sse``, the load-progress metric), in steps of a percent at
        least, every :data:`PROGRESS_INTERVAL` seconds."""
        # Per load (a new load of a model starts from 0 again).
        published: dict[str, tuple[LoadProgress, float]] = {}
        while True:
            await trio.sleep(PROGRESS_INTERVAL)
            for slot in self.slots.values():
                progress = slot.progress
                if progress is None or slot.status != "loading":
                    published.pop(slot.id, None)
                    continue
                last = published.get(slot.id)
                floor = last[1] if last is not None and last[0] is progress else 0.0
                if progress.fraction >= floor + 0.01:
                    published[slot.id] = (progress, progress.fraction)
                    self._publish(slot)

    def load(self, name: str) -> ModelSlot:
        """Start loading ``name`` (an id or alias); nothing when it is loaded
        or loading. Over ``max_loaded``, the least recently used model is
        unloaded first. :class:`ModelError` when it cannot be."""
        slot = self.slot(name)
        if not self.several or self.loader_of is None or self._nursery is None:
            raise ModelError(409, "this server serves one model (started with --model)", "single")
        if self.is_draining():
            raise ModelError(503, "the server is shutting down", "overloaded")
        if slot.status == "loading" and slot._unload is not None and slot._unload.is_set():
            slot._unload = trio.Event()  # an unload asked for during the load is taken back
        if slot.status in ("loaded", "loading"):
            return slot
        # Unloading: loaded again once it is gone (then room is made as for any load).
        after = slot._ended if slot.status == "unloading" else None
        slot._roomed = False
        slot._unload = trio.Event()
        slot._ended = trio.Event()
        slot._loads += 1
        slot.reason = None
        self._set(slot, "loading")
        self._nursery.start_soon(
            _run_model, self, slot, after, slot._loads, name=f"model {slot.id}"
        )
        return slot

    def unload(self, name: str) -> ModelSlot:
        """Ask ``name`` to unload (it drains first); nothing when it is not loaded."""
        slot = self.slot(name)
        if not self.several:
            raise ModelError(409, "this server serves one model (started with --model)", "single")
        if slot.status == "loaded":
            self._begin_unload(slot)
        elif slot.status == "loading" and slot._unload is not None:
            slot._unload.set()  # unloaded once loaded
        elif slot.status == "sleeping":
            self._set(slot, "unloaded")
        return slot

    def admit(self, client: Hashable, n: int = 1) -> None:
        """Raise :class:`~trioserve.generation.Overloaded` unless ``client``
        may start ``n`` more generations (on any model): a door's check before
        it reads a body."""
        if self.is_draining():
            raise Overloaded("the server is shutting down and takes no new requests", draining=True)
        admit_client(self.in_flight, client, n, self.settings.max_requests_per_client)

    async def wait_idle(self) -> None:
        """Return once no loaded model has a job running or waiting."""
        for served in self.loaded():
            await served.scheduler.wait_idle()

    def statistics(self) -> tuple[int, int]:
        """(running, waiting) jobs over every loaded model."""
        running = waiting = 0
        for served in self.loaded():
            stats = served.scheduler.statistics()
            running += stats.running
            waiting += stats.waiting
        return running, waiting

    def watch(self, capacity: int = 64) -> trio.MemoryReceiveChannel[dict[str, Any]]:
        """Every status change from now on (``GET /models/sse``); a watcher
        that falls ``capacity`` events behind is dropped (its channel closes)."""
        # Watchers that went away (their receiving end closed) are dropped now,
        # not at the next change: reconnects on a quiet server must not pile up.
        self._watchers = [w for w in self._watchers if w.statistics().open_receive_channels]
        send, receive = trio.open_memory_channel[dict[str, Any]](capacity)
        self._watchers.append(send)
        return receive

    def wake_waiters(self) -> None:
        """Wake every request waiting for a load, so that it sees the
        server's shutdown (:meth:`acquire` then refuses it)."""
        for slot in self.slots.values():
            event, slot.changed = slot.changed, trio.Event()
            event.set()

    # -- the model's task ---------------------------------------------------------------

    def _room_for(self, loading: ModelSlot) -> trio.Event | None:
        """Room for ``loading`` under ``max_loaded``: None when it has it (it
        then counts against the bound), else an event to wait for before
        asking again (a model's unload ending, or another load's status
        changing). Over the bound, the least recently used loaded model (an
        idle one first) is asked to unload."""
        if self.max_loaded is None:
            loading._roomed = True
            return None
        held = [
            s
            for s in self.slots.values()
            if s is not loading
            and (s.status in ("loaded", "unloading") or (s.status == "loading" and s._roomed))
        ]
        if len(held) < self.max_loaded:
            loading._roomed = True
            return None
        unloading = [s for s in held if s.status == "unloading" and s._ended is not None]
        candidates = [s for s in held if s.status == "loaded"]
        if len(unloading) >= len(held) - self.max_loaded + 1 or not candidates:
            # Enough is on its way out already (or all of it is loading): wait.
            waiting = unloading[0]._ended if unloading else held[0].changed
            assert waiting is not None
            return waiting

        def busy(slot: ModelSlot) -> bool:
            return slot.served is not None and slot.served.in_flight() > 0

        victim = min(candidates, key=lambda s: (busy(s), s.last_used))
        log.info(
            "unloading %s (least recently used) to load %s (--models-max %d)",
            victim.id,
            loading.id,
            self.max_loaded,
        )
        assert victim._ended is not None
        self._begin_unload(victim)
        return victim._ended

    def _begin_unload(self, slot: ModelSlot) -> None:
        """From now on ``slot``'s model takes no new request (refused, naming
        it) and its task drains it."""
        slot.unload_began = trio.current_time()
        served = slot.served
        if served is not None:
            served.generations.draining_message = (
                f"the model {slot.id!r} is unloading and takes no new requests"
            )
            served.unloading = True
        self._set(slot, "unloading")
        if slot._unload is not None:
            slot._unload.set()

    def _set(self, slot: ModelSlot, status: ModelStatus) -> None:
        slot.status = status
        if self.metrics is not None and self.named:
            self.metrics.models.status(slot.id, status, STATUSES)
        event, slot.changed = slot.changed, trio.Event()
        event.set()
        self._publish(slot)

    def _publish(self, slot: ModelSlot) -> None:
        """Tell the watchers (and the metrics) where ``slot`` stands."""
        status = slot.describe()["status"]
        if self.metrics is not None and self.named and "progress" in status:
            self.metrics.models.progress(slot.id, status["progress"])
        update = {"id": slot.id, "status": status}
        for send in list(self._watchers):
            try:
                send.send_nowait(update)
            except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
                send.close()
                self._watchers.remove(send)


async def _run_model(models: Models, slot: ModelSlot, after: trio.Event | None, load: int) -> None:
    """Load, serve and unload one model: an exception boundary (a failed
    load marks the model failed and leaves everything else serving)."""
    ended = slot._ended
    loaded: list[bool] = []
    try:
        if after is not None:
            await after.wait()
        while (room := models._room_for(slot)) is not None:
            await room.wait()
        try:
            sleeping = await _load_and_serve(models, slot, load, loaded)
        except Exception as group:  # the model's exception boundary
            exc = _leaf(group)
            if isinstance(exc, TrioserveError | OSError | MemoryError):
                reason = str(exc) or type(exc).__name__
                log.warning("the model %s failed: %s", slot.id, reason)
            else:
                reason = f"{type(exc).__name__}: {exc}"
                log.error("the model %s failed: %s", slot.id, reason, exc_info=group)
            slot.served = None
            if loaded:  # it served: an error on its way out does not make it unloadable
                if models.metrics is not None:
                    models.metrics.model_unloaded(slot.id)
                if slot._loads == load:
                    models._set(slot, "unloaded")
                return
            if models.metrics is not None:
                models.metrics.models.load(slot.id, seconds=None, ok=False)
            if slot._loads == load:
                slot.reason = reason[:500]
                models._set(slot, "failed")
            return
        # The engine is closed and its thread gone: hand its memory back.
        if models.metrics is not None:
            models.metrics.model_unloaded(slot.id)
        await trio.to_thread.run_sync(give_back_freed_memory)
        log.info(
            "unloaded the model %s (drained and closed in %.2f s)",
            slot.id,
            trio.current_time() - slot.unload_began,
            extra={"fields": {"model": slot.id}},
        )
        if slot._loads == load:
            models._set(slot, "sleeping" if sleeping else "unloaded")
    finally:
        if ended is not None:
            ended.set()


async def _load_and_serve(models: Models, slot: ModelSlot, load: int, loaded: list[bool]) -> bool:
    """Load the model on a thread of its own, serve it until it is
    unloaded, close it; whether it went to sleep (``loaded`` gets an entry
    once it has loaded)."""
    assert models.loader_of is not None
    loader = models.loader_of(slot)
    progress = slot.progress = LoadProgress(give_way=lambda: _others_busy(models, slot))

    def load_reporting() -> Engine:
        with reporting_to(progress):
            return loader()

    started = trio.current_time()
    log.info("loading the model %s", slot.id)
    try:
        async with open_loaded_engine(load_reporting, name=f"trioserve-{slot.id}"[:15]) as (
            engine,
            thread,
        ):
            return await _serve_engine(models, slot, load, loaded, engine, thread, started)
    finally:
        slot.progress = None


async def _serve_engine(
    models: Models,
    slot: ModelSlot,
    load: int,
    loaded: list[bool],
    engine: Engine,
    thread: EngineThread,
    started: float,
) -> bool:
    """Serve a model whose engine has loaded (:func:`_load_and_serve`)."""
    slot.load_seconds = trio.current_time() - started
    served = ServedModel.build(
        slot.id,
        engine,
        models.settings,
        engine_thread=thread,
        metrics=models.metrics,
        is_draining=models.is_draining,
        in_flight=models.in_flight,
        # Read and compiled on the model's thread: not on the event loop.
        chat_template=await thread.run_sync(
            model_template, engine.info, models.settings, slot.entry and slot.entry.chat_template
        ),
    )
    served.generations.model_id = slot.id
    loaded.append(True)
    log.info(
        "loaded the model %s in %.2f s (engine %s)",
        slot.id,
        slot.load_seconds,
        engine.info.engine,
        extra={"fields": {"model": slot.id, "load_s": round(slot.load_seconds, 3)}},
    )
    if models.metrics is not None:
        models.metrics.models.load(slot.id, seconds=slot.load_seconds, ok=True)
    async with trio.open_nursery() as nursery:
        return await _serve_loaded(models, slot, served, nursery, load)


async def _serve_loaded(
    models: Models, slot: ModelSlot, served: ServedModel, nursery: trio.Nursery, load: int
) -> bool:
    """Run ``served``'s scheduler until the model is asked to unload (or
    sleeps), then drain it and stop the scheduler; whether it sleeps."""
    await nursery.start(served.scheduler.run)
    slot.served = served
    slot.last_used = trio.current_time()
    slot.progress = None  # kept until now: the status shows it while loading
    if slot.status != "loaded":
        models._set(slot, "loaded")
    sleeping = await _until_unload(models, slot, served)
    # Not when the model was loaded again meanwhile (that load's status is its own).
    if slot._loads == load and slot.status != "unloading":
        models._begin_unload(slot)
    served.unloading = True
    with trio.move_on_after(models.unload_timeout):
        while served.in_flight() > 0 or served.scheduler.busy:
            await served.scheduler.wait_idle()
            await trio.sleep(0.02)
    left = served.in_flight()
    if left:
        log.warning(
            "the model %s unloads with %d requests unfinished after %.0f s: they end",
            slot.id,
            left,
            models.unload_timeout,
        )
    served.scheduler.closing_message = f"the model {slot.id!r} was unloaded"
    nursery.cancel_scope.cancel()
    slot.served = None
    return sleeping


async def _serve_single(
    slot: ModelSlot,
    served: ServedModel,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """The one model of :meth:`single`: its scheduler, until the server stops."""
    async with trio.open_nursery() as nursery:
        await nursery.start(served.scheduler.run)
        task_status.started()


async def _until_unload(models: Models, slot: ModelSlot, served: ServedModel) -> bool:
    """Wait until ``slot`` is asked to unload (False) or has been idle
    for ``sleep_idle_s`` (True)."""
    asked = slot._unload
    assert asked is not None
    while True:
        if models.sleep_idle_s is None:
            await asked.wait()
            return False
        idle_for = trio.current_time() - slot.last_used
        with trio.move_on_after(max(0.0, models.sleep_idle_s - idle_for)):
            await asked.wait()
            return False
        if served.in_flight() == 0 and not served.scheduler.busy:
            if trio.current_time() - slot.last_used >= models.sleep_idle_s:
                log.info("the model %s sleeps (idle %.0f s)", slot.id, models.sleep_idle_s)
                return True
        else:
            slot.last_used = trio.current_time()


def _others_busy(models: Models, loading: ModelSlot) -> bool:
    """Whether a model other than ``loading`` has work (asked on the loading
    thread: the load gives way to it)."""
    slots = models.slots.values()
    return any((o := s.served) and s is not loading and o.scheduler.busy for s in slots)


def _leaf(error: BaseException) -> BaseException:
    """The one exception inside nested single-exception groups."""
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error
