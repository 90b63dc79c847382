"""Stopping an edge's background asyncio tasks (membership and schedule loops, prefetch workers).

:func:`cancel_and_wait` returns once every task has finished: a task's own cancellation is
expected and swallowed, any other exception it ended with is raised to the caller.
"""

from __future__ import annotations

import asyncio
from typing import Sequence


async def cancel_and_wait(tasks: Sequence[asyncio.Future[None]]) -> None:
    """Cancel every task, then wait for each to finish."""
    for t in tasks:
        t.cancel()
    for t in tasks:
        try:
            await t
        except asyncio.CancelledError:
            pass
