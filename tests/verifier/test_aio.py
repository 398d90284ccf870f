"""`await_all`: one call awaited in place (the event loop is not handed over), several
gathered, exceptions returned in place when asked."""

from __future__ import annotations

import asyncio

import pytest

from verifier.aio import await_all


async def _answer(value):
    return value  # answers without suspending, like n-gram lookup in the verifier


async def _fail(exc):
    raise exc


async def _count_turns(run):
    """Run `run()` while another task counts the event loop's turns it gets."""
    turns = 0
    stop = False

    async def spin():
        nonlocal turns
        while not stop:
            turns += 1
            await asyncio.sleep(0)

    spinner = asyncio.ensure_future(spin())
    await asyncio.sleep(0)  # let it start
    before = turns
    result = await run()
    during = turns - before
    stop = True
    await spinner
    return result, during


def test_a_single_call_is_awaited_without_handing_the_loop_over():
    result, during = asyncio.run(_count_turns(lambda: await_all([_answer(7)])))
    assert result == [7]
    assert during == 0


def test_several_calls_are_gathered_in_order():
    async def main():
        async def slow(v, delay):
            await asyncio.sleep(delay)
            return v
        return await _count_turns(lambda: await_all([slow("a", 0.02), slow("b", 0.0), _answer("c")]))

    result, during = asyncio.run(main())
    assert result == ["a", "b", "c"]
    assert during > 0  # gathered calls run as tasks: the other task gets turns


@pytest.mark.parametrize("n", [1, 2])
def test_exceptions_are_returned_in_place_when_asked(n):
    err = ValueError("replica down")
    calls = [_fail(err)] + [_answer(i) for i in range(n - 1)]
    assert asyncio.run(await_all(calls, return_exceptions=True)) == [err] + list(range(n - 1))


@pytest.mark.parametrize("n", [1, 2])
def test_exceptions_propagate_otherwise(n):
    calls = [_fail(ValueError("boom"))] + [_answer(i) for i in range(n - 1)]
    with pytest.raises(ValueError, match="boom"):
        asyncio.run(await_all(calls))


def test_cancelling_the_caller_cancels_an_in_place_call_even_with_return_exceptions():
    async def main():
        started = asyncio.Event()

        async def hang():
            started.set()
            await asyncio.sleep(60)

        task = asyncio.ensure_future(await_all([hang()], return_exceptions=True))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def test_no_calls_no_results():
    assert asyncio.run(await_all([])) == []
