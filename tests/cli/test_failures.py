"""The CLI's thread excepthook when threading hands it no exception value (issue 54's type check)."""
import threading

from ignite_amp.cli import failures


def test_a_thread_error_without_a_value_goes_to_the_usual_hook(monkeypatch):
    # threading's documentation: ExceptHookArgs.exc_value "can be None"; the hook read its __cause__ (AttributeError).
    seen = []
    monkeypatch.setitem(failures.state, "excepthook", seen.append)
    args = threading.ExceptHookArgs([RuntimeError, None, None, threading.current_thread()])
    failures.thread_failed(args)
    assert seen == [args]
