"""Restart what dies, as systemd's ``Restart=always`` would for the fleet's units: each supervised part
is checked every ``every`` seconds; a dead one is restarted after a back-off that doubles from
``backoff_min`` to ``backoff_max`` while it keeps dying and resets once it has stayed up for
``stable_after`` seconds. Every death and restart is logged (structured) and counted."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

log = logging.getLogger("weightcast.supervisor")


@dataclass
class Part:
    name: str
    alive: Callable[[], Awaitable[bool]]
    restart: Callable[[], Awaitable[None]]
    how_it_ended: Callable[[], str] = lambda: "not answering"   # for the log: "exit code 1", "signal SIGKILL"
    backoff: float = 0.0
    next_try: float = 0.0
    up_since: float = field(default_factory=time.monotonic)
    restarts: int = 0
    last_error: str = ""


class Supervisor:
    def __init__(self, every: float = 0.5, backoff_min: float = 0.5, backoff_max: float = 30.0,
                 stable_after: float = 60.0):
        self.every, self.backoff_min, self.backoff_max, self.stable_after = every, backoff_min, backoff_max, stable_after
        self.parts: dict[str, Part] = {}
        self._task: asyncio.Task | None = None

    def add(self, name: str, alive: Callable[[], Awaitable[bool]], restart: Callable[[], Awaitable[None]],
            how_it_ended: Callable[[], str] | None = None) -> None:
        self.parts[name] = Part(name, alive, restart, *([how_it_ended] if how_it_ended else []))

    def start(self) -> "Supervisor":
        self._task = asyncio.create_task(self._run(), name="supervisor")
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def report(self) -> dict[str, dict]:
        return {p.name: {"restarts": p.restarts, "last_error": p.last_error} for p in self.parts.values()}

    async def _run(self) -> None:
        while True:
            for p in list(self.parts.values()):
                await self._check(p)
            await asyncio.sleep(self.every)

    async def _check(self, p: Part) -> None:
        now = time.monotonic()
        if await p.alive():
            if p.backoff and now - p.up_since >= self.stable_after:
                p.backoff = 0.0                 # it has stayed up: the next death restarts at once again
            return
        if now < p.next_try:
            return
        p.backoff = min(self.backoff_max, max(self.backoff_min, p.backoff * 2))
        p.next_try = now + p.backoff
        ended = p.how_it_ended()
        log.warning(f"{p.name} died ({ended}); restarting it", extra={"part": p.name, "ended": ended,
                                                                       "restarts": p.restarts,
                                                                       "next_backoff_s": p.backoff})
        try:
            await p.restart()
        except Exception as e:              # keep supervising the others; retry this one after the back-off
            p.last_error = f"{type(e).__name__}: {e}"
            log.error(f"restart of {p.name} failed", extra={"part": p.name, "error": p.last_error})
            return
        p.restarts += 1
        p.up_since = time.monotonic()
        log.info(f"{p.name} restarted", extra={"part": p.name, "restarts": p.restarts})
