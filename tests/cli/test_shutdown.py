"""The CLI's one shutdown path (`pagedkv.cli._shutdown`), signals sent to this very process."""

from __future__ import annotations

import os
import signal
import time

import pytest

from pagedkv.cli._shutdown import (
    BROKEN_PIPE_EXIT,
    SHUTDOWN_SIGNALS,
    Shutdown,
    StopOnSignal,
    exit_code,
    raise_on_signals,
)


def deliver(signum: int) -> None:
    """Send `signum` to this process; its Python handler has run when this returns."""
    os.kill(os.getpid(), signum)
    time.sleep(0.05)  # a sleep is cut short by the signal: the handler runs here at the latest


@pytest.mark.parametrize("signum", SHUTDOWN_SIGNALS, ids=lambda s: s.name)
def test_each_signal_raises_shutdown_and_the_old_handler_comes_back(signum):
    before = signal.getsignal(signum)
    with pytest.raises(Shutdown) as caught:
        with raise_on_signals():
            deliver(signum)
    assert caught.value.signum == signum
    assert isinstance(caught.value, KeyboardInterrupt)  # every clean-up of Ctrl-C runs
    assert exit_code(caught.value) == 128 + signum
    assert signal.getsignal(signum) is before


def test_a_bare_keyboard_interrupt_is_sigint():
    assert exit_code(KeyboardInterrupt()) == 130
    assert BROKEN_PIPE_EXIT == 141


def test_an_ignored_signal_stays_ignored():
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under nohup
    try:
        with raise_on_signals():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGHUP)  # ignored: nothing raised
    finally:
        signal.signal(signal.SIGHUP, previous)


@pytest.mark.parametrize("signum", SHUTDOWN_SIGNALS, ids=lambda s: s.name)
def test_the_first_signal_asks_to_stop_and_the_second_aborts(signum, capsys):
    with StopOnSignal() as stop:
        assert not stop() and stop.exit_code() == 0
        deliver(signum)
        assert stop() and stop.signum == signum
        assert stop.exit_code() == 128 + signum
        with pytest.raises(Shutdown) as caught:
            deliver(signum)
    assert caught.value.signum == signum
    again = "Ctrl-C" if signum == signal.SIGINT else signum.name
    assert capsys.readouterr().err == (
        f"\nstopping: the report covers what was measured so far ({again} again to abort)\n"
    )


def test_a_shutdown_swallowed_where_it_landed_is_raised_when_the_block_ends():
    class SwallowsInDel:
        def __del__(self) -> None:
            deliver(signal.SIGTERM)  # the handler's exception is "ignored" in __del__

    with pytest.raises(Shutdown) as caught:
        with raise_on_signals():
            SwallowsInDel()  # collected at once: its __del__ runs here
    assert caught.value.signum == signal.SIGTERM


def test_a_shutdown_caught_on_purpose_stays_caught():
    with raise_on_signals():
        try:
            deliver(signal.SIGINT)
        except KeyboardInterrupt:  # as `events listen` ends on Ctrl-C
            pass
