"""Cancellation always reaches the task it was sent to.

Python before 3.12 has ``asyncio.wait_for`` return a result that arrives in the same loop
turn as the caller's cancellation, dropping the cancellation: an engine core cancelled at
shutdown just as a worker's step reply came in went on running, and the shutdown waited
for it forever (a Ray pipeline test hung so in CI). ``aiolm.timeouts.wait_for`` propagates
it, and ``Actor.stop`` repeats a cancellation until the task ends.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from aiolm.actors import Actor
from aiolm.timeouts import wait_for


async def _cancel_as_result_arrives(waiting) -> asyncio.Task:
    """A task awaiting ``waiting(inner)``, cancelled in the turn that ``inner`` resolves."""
    inner = asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(waiting(inner))
    await asyncio.sleep(0)  # the task now waits
    inner.set_result("reply")
    task.cancel()
    await asyncio.wait({task}, timeout=5)
    return task


def test_a_cancel_in_the_turn_a_result_arrives_is_not_lost():
    task = asyncio.run(_cancel_as_result_arrives(lambda inner: wait_for(inner, 10.0)))
    assert task.cancelled()


def test_timeout_cancels_the_awaited_and_lets_it_clean_up():
    cleaned = []

    async def slow():
        try:
            await asyncio.sleep(60)
        finally:
            cleaned.append(True)

    async def main():
        with pytest.raises(asyncio.TimeoutError):
            await wait_for(slow(), 0.05)
        assert cleaned == [True]
        assert await wait_for(asyncio.sleep(0, "ok"), 5) == "ok"
        assert await wait_for(asyncio.sleep(0, "unbounded"), None) == "unbounded"
        with pytest.raises(ValueError):
            await wait_for(_raises(), 5)

    asyncio.run(main())


async def _raises():
    raise ValueError("inner")


class _Stubborn(Actor[None]):
    """Swallows its first cancellation, as code awaiting asyncio.wait_for may."""

    name = "stubborn"

    async def run(self) -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            pass
        await asyncio.sleep(3600)


def test_actor_stop_ends_a_task_that_swallowed_a_cancel():
    async def main():
        actor = _Stubborn()
        actor.start(lambda a, e: None)
        await asyncio.sleep(0)
        stopping = asyncio.ensure_future(actor.stop())
        await asyncio.wait({stopping}, timeout=10)
        assert stopping.done() and not actor.running

    asyncio.run(main())


def test_a_handler_cancelled_while_its_work_unwinds_stays_cancelled():
    """until_disconnect, after the client left, waits for the cancelled work's cleanup; a cancel
    of the handler meanwhile (the server's shutdown) must end the handler, not be taken for
    the work's own end (the handler went on as if the client had simply gone)."""
    from aiolm.server.sse import ClientGone, until_disconnect

    async def main():
        gone = asyncio.Event()

        async def receive():
            await gone.wait()
            return {"type": "http.disconnect"}

        async def work():
            try:
                await asyncio.sleep(100)
            finally:
                await asyncio.sleep(0.2)  # its cleanup takes a moment (an abort's round trip)

        async def handler():
            try:
                await until_disconnect(receive, work())
            except ClientGone:
                return "went on"

        h = asyncio.ensure_future(handler())
        await asyncio.sleep(0.05)
        gone.set()
        await asyncio.sleep(0.05)
        h.cancel()
        await asyncio.wait({h}, timeout=5)
        return h

    assert asyncio.run(main()).cancelled()


def test_a_call_given_up_on_does_not_hold_up_the_exit():
    """A blocking call past its timeout (Ray's control store, unreachable) is left in a daemon
    thread: the loop's run ends at once, where asyncio.to_thread's would wait for the call."""
    import subprocess
    import sys

    code = (
        "import asyncio, time\n"
        "from aiolm.timeouts import in_daemon_thread, wait_for\n"
        "async def main():\n"
        "    try:\n"
        "        await wait_for(in_daemon_thread(time.sleep, 30), 0.2)\n"
        "    except asyncio.TimeoutError:\n"
        "        print('timed out')\n"
        "    print(await wait_for(in_daemon_thread(sum, [1, 2]), 5))\n"
        "asyncio.run(main())\n"
    )
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=25)
    assert out.returncode == 0 and out.stdout.split() == ["timed", "out", "3"], out.stderr
    assert time.monotonic() - t0 < 15
