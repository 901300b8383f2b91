"""The events a real Prefect server sends out: a subscriber to its event stream (the websocket
the UI's Event Feed reads) in a thread, with the events it received (the test server persists
no events, but it streams them)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from prefect.events.clients import get_events_subscriber
from prefect.events.filters import EventFilter, EventNameFilter
from prefect.events.schemas.events import ReceivedEvent


class EventFeed:
    """Every event whose name starts with one of ``prefixes``, as the server streams it."""

    def __init__(self, prefixes: list[str]) -> None:
        self.received: list[ReceivedEvent] = []
        self._filter = EventFilter(event=EventNameFilter(prefix=prefixes))
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._listen()), daemon=True)

    async def _listen(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        async with get_events_subscriber(filter=self._filter) as subscriber:
            self._ready.set()
            events = subscriber.__aiter__()
            while not self._stop.is_set():
                waiter = asyncio.ensure_future(events.__anext__())
                stopper = asyncio.ensure_future(self._stop.wait())
                done, _ = await asyncio.wait({waiter, stopper},
                                             return_when=asyncio.FIRST_COMPLETED)
                for pending in {waiter, stopper} - done:
                    pending.cancel()
                if waiter in done:
                    self.received.append(waiter.result())

    def start(self) -> None:
        self._thread.start()
        if not self._ready.wait(30):
            raise TimeoutError("the server's event stream did not open within 30 s")

    def close(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def named(self, name: str) -> list[ReceivedEvent]:
        return [e for e in self.received if e.event == name]

    def wait_for(self, name: str, ready: Callable[[list[ReceivedEvent]], bool] = bool,
                 timeout: float = 30.0) -> list[ReceivedEvent]:
        """The events named ``name`` once ``ready(them)`` holds (or the timeout passed)."""
        deadline = time.monotonic() + timeout
        while not ready(self.named(name)) and time.monotonic() < deadline:
            time.sleep(0.1)
        return self.named(name)


@contextmanager
def event_feed(prefixes: list[str] | None = None) -> Iterator[EventFeed]:
    feed = EventFeed(prefixes or ["caffe2ckpt."])
    feed.start()
    try:
        yield feed
    finally:
        feed.close()
