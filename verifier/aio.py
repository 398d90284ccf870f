"""Awaiting a round's proposer calls together without a task per call when there is one.

Both the engine (one call per proposer method) and the proposer router (one call per
replica) usually have a single call to make a round. `asyncio.gather` wraps each call in a
task, so even a call that answers without suspending (n-gram lookup in the verifier) hands
the event loop to other work first: in a served replica, the token streams of the requests
in flight, which then run in series with the pass that follows instead of beside it.
Measured served, chat at 32 clients with `static:2`, every other pass awaiting its one call
in place: choosing and proposing 1.3 ms against 3.1 (median), the pass no slower, about
3 ms a pass less in all (of about 150).
"""

from __future__ import annotations

import asyncio
from typing import Awaitable


async def await_all(calls: list[Awaitable], *, return_exceptions: bool = False) -> list:
    """The results of `calls`, in order, run concurrently when there are several; a single
    call is awaited in place (no task, no turn of the event loop). With
    `return_exceptions`, a call's exception is returned in its place, as `asyncio.gather`
    does; an in-place call returns an `Exception` only, so cancelling the caller still
    cancels it."""
    if not calls:
        return []
    if len(calls) == 1:
        if not return_exceptions:
            return [await calls[0]]
        try:
            return [await calls[0]]
        except Exception as exc:
            return [exc]
    return list(await asyncio.gather(*calls, return_exceptions=return_exceptions))
