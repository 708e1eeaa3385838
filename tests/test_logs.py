"""What ``changefeed.logs.configure_logging`` does to a process's log."""

from __future__ import annotations

import json

from helpers import run_python


def test_other_libraries_warnings_come_out_as_json_lines_with_their_traceback() -> None:
    """asyncpg's pool warns, with a traceback, while a primary is down: in a process
    whose logging changefeed set up, that is one JSON line (it was Python's bare
    last-resort text, which breaks a stream of JSON lines)."""
    code = (
        "import logging\n"
        "from changefeed.logs import configure_logging, log_event\n"
        "configure_logging('info', json_output=True)\n"
        "try:\n"
        "    raise ConnectionRefusedError('primary down')\n"
        "except OSError:\n"
        "    pool = logging.getLogger('asyncpg.pool')\n"
        "    pool.warning('Failed to restore the pool', exc_info=True)\n"
        "log_event(logging.getLogger('changefeed.test'), 'own.event', answer=42)\n"
    )
    done = run_python(code)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stderr.splitlines()]
    foreign, own = lines
    assert foreign["logger"] == "asyncpg.pool" and foreign["level"] == "warning"
    assert foreign["event"] == "Failed to restore the pool"
    assert "ConnectionRefusedError: primary down" in foreign["exc"]
    assert own["event"] == "own.event" and own["answer"] == 42


def test_a_warning_where_nobody_set_up_logging_keeps_its_fields_and_traceback() -> None:
    """An app that embeds the publisher and never calls ``configure_logging`` (or
    a module uvicorn's ``--ws`` option imports before the app could) has no
    handler: Python's last resort printed a warning's event name alone, so "plain
    ASGI" came without the reason why. The line keeps its fields and traceback;
    what is below WARNING stays quiet, as it would have."""
    code = (
        "import logging\n"
        "from changefeed.logs import log_event\n"
        "log = logging.getLogger('changefeed.test')\n"
        "log_event(log, 'quiet.event', answer=1)\n"
        "try:\n"
        "    raise ValueError('bad value')\n"
        "except ValueError as exc:\n"
        "    log_event(log, 'own.warning', logging.WARNING, exc=exc, why='the reason')\n"
    )
    done = run_python(code)
    assert done.returncode == 0, done.stderr
    assert "quiet.event" not in done.stderr
    first, *rest = done.stderr.splitlines()
    assert first.split()[1:] == ["warning", "changefeed.test", "own.warning", "why=the", "reason"]
    assert "ValueError: bad value" in rest[-1]


def test_a_warning_where_nobody_set_up_logging_and_stderr_is_gone_loses_only_the_line() -> None:
    """A closed stderr (a daemon that closed its descriptors) costs the line, as
    Python's last resort would, never the caller's work."""
    code = (
        "import logging, sys\n"
        "from changefeed.logs import log_event\n"
        "sys.stderr.close()\n"
        "log_event(logging.getLogger('changefeed.test'), 'own.warning', logging.WARNING)\n"
        "print('went on')\n"
    )
    done = run_python(code)
    assert done.returncode == 0 and done.stdout.strip() == "went on", done.stderr
