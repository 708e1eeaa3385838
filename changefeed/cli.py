"""The ``changefeed`` command: demo, example API, standalone publisher, debugging tools.

Each sub-command is a thin shell around the packages; it parses arguments,
sets up logging, and turns expected failures (bad config, database down, bad
URL) into one clear line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import re
import shutil
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar
from urllib.parse import urlsplit

import orjson

from changefeed import __version__
from changefeed.bootstrap import bearer_headers
from changefeed.logs import configure_logging
from changefeed.visible import visible

if TYPE_CHECKING:
    from changefeed.compaction import Progress

__all__ = ["main"]

_EPILOG = {
    "demo": "example:\n  changefeed demo --duration 20",
    "example-api": "example:\n  changefeed example-api --dsn postgresql://postgres@127.0.0.1:5432/postgres"
    " --port 8080",
    "serve": "example:\n  changefeed serve --config deploy/changefeed.toml",
    "listen": "examples:\n"
    "  changefeed listen http://127.0.0.1:8080 --resource vm:nic,alias\n"
    "  changefeed listen http://127.0.0.1:8080 --resource vm:nic,alias --resource server --mirror\n"
    "  changefeed listen http://127.0.0.1:8080 --resource vm --sub-resources nic,alias\n"
    "  changefeed listen http://127.0.0.1:8080 --resource vm --mirror --checkpoint vms.sqlite",
    "stats": "example:\n  changefeed stats http://127.0.0.1:8080",
    "db": "example:\n  changefeed db init --dsn postgresql://postgres@127.0.0.1:5432/postgres",
    "compact": "example:\n  changefeed compact --dsn postgresql://postgres@127.0.0.1:5432/postgres"
    " --max-age 24h --compaction-lag 10m --dry-run",
}


class CommandError(Exception):
    """An expected failure of a command: printed as one line, exit status 1 (2 for usage)."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


_TOKEN_HELP = "bearer token (default: $CHANGEFEED_TOKEN, which keeps it out of the process list)"


def _dsn(args: argparse.Namespace) -> str:
    dsn: str | None = args.dsn or os.environ.get("CHANGEFEED_DSN")
    if not dsn:
        raise CommandError("a database is needed: pass --dsn DSN or set CHANGEFEED_DSN", 2)
    return dsn


_N = TypeVar("_N", int, float)


def _checked(
    parse: Callable[[str], _N], valid: Callable[[_N], bool], what: str
) -> Callable[[str], _N]:
    """An argparse ``type``: ``parse`` the text and refuse it unless ``valid`` (argparse
    then exits with status 2, naming the option and saying it ``must be {what}``)."""

    def convert(text: str) -> _N:
        try:
            value = parse(text)
        except ValueError:
            value = None
        if value is None or not valid(value):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return value

    return convert


_positive_int = _checked(int, lambda n: n >= 1, "a whole number of at least 1")
_positive_seconds = _checked(
    float, lambda x: math.isfinite(x) and x > 0, "a number of seconds above 0"
)
_seconds_or_off = _checked(
    float, lambda x: math.isfinite(x) and x >= 0, "a number of seconds, or 0 for off"
)
_positive_rate = _checked(float, lambda x: math.isfinite(x) and x > 0, "a number above 0")
_port = _checked(int, lambda n: 0 <= n <= 65535, "a port from 0 to 65535")


def _base_url(text: str) -> str:
    """An argparse ``type``: a publisher's base URL, refused (status 2) unless it is
    an http(s) or ws(s) URL with a host and a valid port."""
    import httpx

    what = f"must be an http(s):// or ws(s):// URL with a host and a valid port, got {text!r}"
    try:
        parts = urlsplit(text)  # a broken IPv6 literal raises
        parts.port  # noqa: B018 -- a port that is not one raises
        httpx.URL(text).host  # noqa: B018 -- as the clients read it: no control characters, IDNA
    except (ValueError, httpx.InvalidURL):  # IDNA's errors are ValueErrors
        raise argparse.ArgumentTypeError(what) from None
    host = parts.hostname
    if parts.scheme not in ("http", "https", "ws", "wss") or not host or not host.isprintable():
        raise argparse.ArgumentTypeError(what)
    if any(c.isspace() for c in host):
        raise argparse.ArgumentTypeError(what)
    return text


class _Parser(argparse.ArgumentParser):
    """argparse, with a hint where it reads a value for an option as an option of its
    own: ``--compaction-lag -1s`` leaves ``--compaction-lag`` seemingly without one."""

    _given: Sequence[str] = ()
    """The arguments this parser was given (each subcommand's parser gets its own)."""

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: Any = None
    ) -> tuple[argparse.Namespace, list[str]]:
        self._given = tuple(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        missing = re.fullmatch(r"argument (\S+): expected one argument", message)
        given = list(self._given)
        # argparse names every spelling of the option ("-r/--resource"): the one typed.
        typed = [f for f in (missing.group(1).split("/") if missing else ()) if f in given]
        if typed:
            flag = typed[0]
            after = given[given.index(flag) + 1 :]
            if after and after[0].startswith("-"):
                message += f" (a value that begins with '-' goes after '=': {flag}={after[0]})"
        super().error(message)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="changefeed",
        description="Change-feed publish/subscribe middleware (after Joyent RFD 5).",
        epilog="Run 'changefeed COMMAND --help' for a command's options and an example.",
    )
    parser.add_argument("--version", action="version", version=f"changefeed {__version__}")
    parser.add_argument(
        "--log-level",
        default=None,
        choices=["debug", "info", "warning", "error"],
        help="default: info (warning for the demo, which prints its own story)",
    )
    parser.add_argument(
        "--log-json",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="JSON log lines (default: JSON unless stderr is a terminal)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        return sub.add_parser(
            name,
            help=help_text,
            description=help_text,
            epilog=_EPILOG.get(name),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )

    demo = command(
        "demo",
        "Run the example VM API with its publisher on an embedded "
        "PostgreSQL, a DNS listener mirroring it, and a load generator.",
    )
    demo.add_argument(
        "--dsn", help="use this PostgreSQL instead of the embedded one (or CHANGEFEED_DSN)"
    )
    demo.add_argument(
        "--duration",
        type=_positive_seconds,
        default=None,
        help="stop after this many seconds (default: until Ctrl-C)",
    )
    demo.add_argument("--port", type=_port, default=0, help="API port (default: a free one)")
    demo.add_argument("--rate", type=_positive_rate, default=5.0, help="VM writes per second")
    demo.add_argument("--data-dir", help="embedded PostgreSQL data directory")
    demo.add_argument(
        "--standby",
        action="store_true",
        help="also start an embedded hot standby (streaming replication) and let the "
        "publisher read the feed there",
    )

    api = command(
        "example-api", "Serve only the example VM API (VMs and servers) with its publisher."
    )
    api.add_argument("--dsn", help="PostgreSQL DSN (or CHANGEFEED_DSN)")
    api.add_argument(
        "--read-dsn",
        default=None,
        metavar="DSN",
        help="a hot standby of --dsn to read the feed from ([publisher] read_dsn, docs/config.md)",
    )
    api.add_argument("--host", default="127.0.0.1")
    api.add_argument("--port", type=_port, default=8080)
    api.add_argument(
        "--token",
        action="append",
        default=[],
        help="accept this bearer token (repeatable); default: no auth",
    )
    api.add_argument(
        "--header-timeout",
        type=_seconds_or_off,
        default=None,
        metavar="SECONDS",
        help="close an HTTP connection whose request head has not arrived by then, "
        "or whose request body stops arriving for as long; 0: off, behind a proxy "
        "that bounds them (default: that of [server] header_timeout, docs/config.md)",
    )

    serve = command(
        "serve",
        "Run a standalone publisher for feeds other services write "
        "with SELECT changefeed.publish(...).",
    )
    serve.add_argument("--config", required=True, help="TOML config file (docs/config.md)")
    serve.add_argument("--host", default=None, help="override [server] host")
    serve.add_argument("--port", type=_port, default=None, help="override [server] port")

    listen = command(
        "listen",
        "Register with a publisher and print change items as JSON lines (changefeedsnoop).",
    )
    listen.add_argument(
        "url", type=_base_url, help="publisher base URL, e.g. http://127.0.0.1:8080"
    )
    listen.add_argument(
        "--resource",
        action="append",
        required=True,
        metavar="NAME[:SUB,SUB]",
        help="a resource and, after a colon, its sub-resources (none: all of them); "
        "repeat it for several resources on one connection",
    )
    listen.add_argument(
        "--sub-resources",
        default="",
        help="comma-separated sub-resources of the one --resource (same as NAME:SUB,SUB)",
    )
    listen.add_argument("--since", help="resume from this cursor")
    listen.add_argument(
        "--checkpoint",
        metavar="FILE",
        help="keep the cursor (and, with --mirror, the mirrors) in this SQLite file: "
        "a run resumes where the last one stopped (one run per file at a time; "
        "exit status 1 when its saves are failing at the end)",
    )
    listen.add_argument(
        "--mirror",
        action="store_true",
        help="keep a mirror of the resources, print each change to it, and the whole"
        " mirror when stopped (not when refused)",
    )
    listen.add_argument("--id-field", default="uuid", help="id field of bootstrap items")
    listen.add_argument("--token", default=os.environ.get("CHANGEFEED_TOKEN"), help=_TOKEN_HELP)
    listen.add_argument(
        "--count",
        type=_positive_int,
        default=None,
        help="exit after exactly this many items (1 when --duration runs out first)",
    )
    listen.add_argument(
        "--duration", type=_positive_seconds, default=None, help="exit after this many seconds"
    )
    listen.add_argument(
        "--status",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="live status line on stderr, with each route's bootstrap progress "
        "(default: when stderr is a terminal)",
    )
    listen.add_argument(
        "--status-interval",
        type=_positive_seconds,
        default=0.5,
        help="seconds between status lines",
    )
    listen.add_argument(
        "--page-limit",
        type=_positive_int,
        default=None,
        help="items per bootstrap page asked for (default: the listener's)",
    )

    stats = command("stats", "Print a publisher's /changefeeds/stats readably.")
    stats.add_argument("url", type=_base_url, help="publisher base URL")
    stats.add_argument("--json", action="store_true", help="raw JSON")
    stats.add_argument("--token", default=os.environ.get("CHANGEFEED_TOKEN"), help=_TOKEN_HELP)

    db = command("db", "Feed schema management.")
    db_sub = db.add_subparsers(dest="db_command", metavar="ACTION", required=True)
    init = db_sub.add_parser(
        "init",
        help="create or upgrade the feed schema (idempotent)",
        epilog=_EPILOG["db"],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    init.add_argument("--dsn", help="PostgreSQL DSN (or CHANGEFEED_DSN)")
    init.add_argument("--schema", default="changefeed")

    compact = command("compact", "Compact and garbage-collect old feed entries with Spark.")
    compact.add_argument("--dsn", help="PostgreSQL DSN (or CHANGEFEED_DSN)")
    compact.add_argument("--schema", default="changefeed")
    compact.add_argument("--max-age", default="24h", help="garbage: entries older than this")
    compact.add_argument(
        "--compaction-lag", default="10m", help="only entries older than this are merged"
    )
    compact.add_argument("--master", default="local[*]", help="Spark master URL")
    compact.add_argument("--jdbc-jar", default=None, help="PostgreSQL JDBC driver jar")
    compact.add_argument("--dry-run", action="store_true", help="report, change nothing")
    compact.add_argument(
        "--full",
        action="store_true",
        help="read the whole feed (default: only what changed since the last run, when it can)",
    )
    compact.add_argument(
        "--replay-wait",
        default="60s",
        help="how long the drops wait for streaming standbys to replay the widened entries",
    )
    compact.add_argument(
        "--batch-size", type=_positive_int, default=5000, help="entries per apply transaction"
    )
    compact.add_argument(
        "--partitions",
        type=_positive_int,
        default=None,
        help="read partitions (default: one per 64 MiB)",
    )
    compact.add_argument(
        "--keepers",
        default="auto",
        metavar="auto|lookup|scan",
        help="how an incremental run finds the previous keepers of the ids it touches"
        " (default auto: by how much of the feed they fill)",
    )
    compact.add_argument(
        "--progress",
        choices=["auto", "bar", "log"],
        default="auto",
        help="bar: progress bars on stderr; log: progress as log lines"
        " (default: bars when stderr is a terminal)",
    )
    return parser


async def _db_init(args: argparse.Namespace) -> int:
    import asyncpg

    from changefeed.schemas import ProtocolError, apply_schema, quote_schema, schema_version

    try:
        quote_schema(args.schema)
    except ProtocolError as exc:
        raise CommandError(f"--schema: {exc.message}", 2) from None
    dsn = _dsn(args)
    try:
        conn = await asyncpg.connect(dsn, timeout=10)
    except (OSError, asyncpg.PostgresError) as exc:
        raise CommandError(f"cannot connect to the database: {exc}") from None
    except ValueError as exc:  # a DSN asyncpg cannot parse (ClientConfigurationError is one)
        raise CommandError(f"--dsn: not a usable PostgreSQL DSN: {exc}", 2) from None
    try:
        applied = await apply_schema(conn, args.schema)
        version = await schema_version(conn, args.schema)
    except asyncpg.PostgresError as exc:  # a role that may not create it, say
        raise CommandError(f"cannot apply schema {args.schema!r}: {exc}") from None
    finally:
        await conn.close()
    what = f"applied {applied}" if applied else "already up to date"
    print(f"schema {args.schema!r} at version {version} ({what})")
    return 0


async def _stats(args: argparse.Namespace) -> int:
    import httpx

    headers = bearer_headers(args.token)
    url = args.url.rstrip("/") + "/changefeeds/stats"
    try:
        async with httpx.AsyncClient(timeout=10, headers=headers) as client:
            response = await client.get(url)
    except httpx.HTTPError as exc:
        raise CommandError(f"cannot reach {url}: {exc}") from None
    if response.status_code != 200:
        raise CommandError(f"{url} answered {response.status_code}: {response.text[:200]}")
    try:
        doc = orjson.loads(response.content)
    except orjson.JSONDecodeError as exc:
        raise CommandError(f"{url} answered 200 with a body that is not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise CommandError(f"{url} answered 200 with JSON that is not a stats document")
    if args.json:
        print(response.text)
        return 0
    from changefeed.stats_view import render_stats

    width = shutil.get_terminal_size().columns if sys.stdout.isatty() else None
    try:
        text = render_stats(doc, width=width)
    except (AttributeError, TypeError, ValueError, KeyError) as exc:
        # Another version's document, or not a publisher's: say so, not a traceback.
        raise CommandError(
            f"{url} answered a stats document this version cannot show ({exc!r})"
        ) from None
    print(text)
    return 0


async def _example_api(args: argparse.Namespace) -> int:
    from changefeed.example.vmapi import create_app
    from changefeed.publisher.config import ServerConfig
    from changefeed.serving import DrainingServer, server_config
    from changefeed.standalone import check_database, check_same_feed

    header_timeout = args.header_timeout
    if header_timeout is None:
        header_timeout = ServerConfig().header_timeout
    dsn = _dsn(args)
    await check_database(dsn, None, key="--dsn")
    overrides: dict[str, Any] = {"auth_tokens": tuple(args.token)} if args.token else {}
    if args.read_dsn:
        await check_database(args.read_dsn, None, key="--read-dsn")
        await check_same_feed(dsn, args.read_dsn, None, keys=("--dsn", "--read-dsn"))
        overrides["read_dsn"] = args.read_dsn
    app = create_app(dsn, **overrides)
    config = server_config(
        app.state.publisher.listeners_first(app),
        args.host,
        args.port,
        fast_path=True,
        head_timeout=header_timeout or None,
    )

    def announce(address: str) -> None:
        print(
            f"example VM API with publisher on http://{address} "
            f"(websocket ws://{address}/changefeeds)",
            flush=True,
        )

    server = DrainingServer(config, [app.state.publisher], owns_process=True, announce=announce)
    await server.serve()
    return 0 if server.started else 1


async def _serve(args: argparse.Namespace) -> int:
    from changefeed.standalone import run_standalone

    return await run_standalone(args.config, host=args.host, port=args.port)


async def _listen(args: argparse.Namespace) -> int:
    from changefeed.snoop import UsageError, run_listen

    try:
        return await run_listen(args)
    except UsageError as exc:
        raise CommandError(str(exc), 2) from None


async def _demo(args: argparse.Namespace) -> int:
    from changefeed.demo import run_demo
    from changefeed.standalone import check_database

    if dsn := args.dsn or os.environ.get("CHANGEFEED_DSN"):
        await check_database(dsn, None, key="--dsn")  # one clear line, not a traceback
    return await run_demo(args)


def _compact(args: argparse.Namespace) -> int:
    from changefeed.compaction import (
        CompactionError,
        check_durations,
        check_keepers,
        check_master_form,
        parse_duration,
        run_compaction,
    )

    try:
        max_age = parse_duration(args.max_age, "--max-age")
        lag = parse_duration(args.compaction_lag, "--compaction-lag")
        replay_wait = parse_duration(args.replay_wait, "--replay-wait")
        # The job's own rules, said with the flags' names: a usage error, before Spark.
        check_durations(
            max_age, lag, args.batch_size, names=("--max-age", "--compaction-lag", "--batch-size")
        )
        check_keepers(args.keepers, "--keepers")
    except CompactionError as exc:
        raise CommandError(str(exc), 2) from None
    try:
        check_master_form(args.master)
    except CompactionError as exc:
        raise CommandError(f"--master: {exc}", 2) from None
    dsn = _dsn(args)
    # SIGTERM (systemd, a CronJob's deadline) unwinds like Ctrl-C: the Spark session
    # stops and its scratch directory goes, the staging table is dropped.
    terminated = _Terminated()
    previous = signal.signal(signal.SIGTERM, terminated)
    with contextlib.ExitStack() as restore, _compaction_progress(args.progress) as progress:
        restore.callback(signal.signal, signal.SIGTERM, previous)
        try:
            summary = run_compaction(
                dsn,
                schema=args.schema,
                max_age=max_age,
                compaction_lag=lag,
                master=args.master,
                dry_run=args.dry_run,
                jdbc_jar=args.jdbc_jar,
                batch_size=args.batch_size,
                partitions=args.partitions,
                progress=progress,
                full=args.full,
                replay_wait=replay_wait,
                keepers=args.keepers,
            )
        except Exception as exc:
            if terminated.status is not None:  # Spark's calls broke as the signal came
                raise SystemExit(terminated.status) from None
            if isinstance(exc, CompactionError):
                raise CommandError(str(exc)) from None
            raise
    print(summary.to_text())
    return 0


class _Terminated:
    """A SIGTERM handler that unwinds the command once (``SystemExit``, 128 + the
    signal); a second signal while it unwinds changes nothing."""

    def __init__(self) -> None:
        self.status: int | None = None

    def __call__(self, signum: int, frame: object) -> None:
        if self.status is not None:
            return
        self.status = 128 + signum
        raise SystemExit(self.status)


@contextlib.contextmanager
def _compaction_progress(mode: str) -> Iterator[Progress]:
    """Bars on a terminal (stderr), log lines otherwise, or as ``--progress`` says."""
    from changefeed.compaction import LogProgress

    if mode == "auto":
        mode = "bar" if sys.stderr.isatty() else "log"
    if mode == "bar":
        try:
            from changefeed.compaction.progress_rich import RichProgress
        except ImportError:  # rich comes with the spark extra; without it, log lines
            pass
        else:
            with RichProgress() as bars:
                yield bars
            return
    yield LogProgress()


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop where it is installed (uvicorn[standard] brings it)."""
    try:
        import uvloop
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


_COMMAND_EXTRAS = {
    "demo": "serve",
    "example-api": "serve",
    "serve": "serve",
    "db": "publisher",
    "compact": "spark",
}
"""The extra of the distribution each command needs beyond a plain ``pip install
changefeed`` (which has what ``listen`` and ``stats`` need)."""

_EXTRA_MODULES = frozenset(
    {"asyncpg", "starlette", "prometheus_client", "uvicorn", "pyspark", "rich"}
)
"""Top-level modules that only an extra installs (pyproject.toml)."""


def _missing_extra(command: str, exc: ModuleNotFoundError) -> CommandError | None:
    """The one clear line for a command run without the extra it needs (None: the
    missing module is no extra's, a real error)."""
    module = (exc.name or "").partition(".")[0]
    extra = _COMMAND_EXTRAS.get(command)
    if extra is None or module not in _EXTRA_MODULES:
        return None
    return CommandError(
        f"needs changefeed[{extra}], which is not installed here (no module {module!r}):"
        f" pip install 'changefeed[{extra}]'"
    )


_ASYNC_COMMANDS = {
    "db": _db_init,
    "stats": _stats,
    "example-api": _example_api,
    "serve": _serve,
    "listen": _listen,
    "demo": _demo,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``changefeed`` console script."""
    args = _parser().parse_args(argv)
    level = args.log_level or ("warning" if args.command == "demo" else "info")
    configure_logging(level, args.log_json)
    try:
        if args.command == "compact":
            return _compact(args)
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            return runner.run(_ASYNC_COMMANDS[args.command](args))
    except CommandError as exc:
        _say_error(args.command, exc)
        return exc.status
    except ModuleNotFoundError as exc:
        missing = _missing_extra(args.command, exc)
        if missing is None:
            raise
        print(f"changefeed {args.command}: {missing}", file=sys.stderr)
        return missing.status
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # the last line of defence: one clear line
        from changefeed.bootstrap import BootstrapError
        from changefeed.listener import ListenerError

        known: tuple[type[Exception], ...] = (ListenerError, BootstrapError, OSError)
        try:
            from changefeed.publisher import PublisherError
        except ImportError:  # a listener-only install: no publisher ran to raise one
            pass
        else:
            known += (PublisherError,)
        try:
            from changefeed.serving import UnsupportedUvicorn
        except ImportError:  # no uvicorn: no server ran to raise it
            pass
        else:
            known += (UnsupportedUvicorn,)
        if isinstance(exc, known):
            _say_error(args.command, exc)
            return 1
        raise


def _say_error(command: str, exc: BaseException) -> None:
    """One error on stderr. Its text may quote a server's answer or a peer's
    name: no control or format character of theirs reaches the terminal as
    itself (a line break stays one)."""
    text = "\n".join(visible(line) for line in str(exc).split("\n"))
    print(f"changefeed {command}: {text}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
