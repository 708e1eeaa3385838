"""The dashboard in a real browser: Debian's Chromium, headless, driven by Playwright.

A real publisher on uvicorn and PostgreSQL; raw websocket listeners register
and receive what ``publish`` commits; the page must show them, their
deliveries and the rates as they happen, insert listener-chosen names as
text, and say so when the publisher stops answering. Also the dashboard's
auth: 401 with a Basic challenge, the token as Bearer or as the Basic
password, and a browser signing in that way.

``CHANGEFEED_SCREENSHOT=docs/dashboard.png`` also saves the page, after
ninety seconds of traffic, to that file (CI leaves it alone).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import math
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import orjson
import pytest
from helpers import wait_until
from playwright.async_api import Browser, Page, Route, async_playwright, expect
from publisher_fixtures import (
    PublisherUnderTest,
    connect_not_reading,
    receive_items,
    register,
    registration,
    running_publisher,
    write,
)
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import InvalidStatus

from changefeed.publisher import publish_many
from changefeed.publisher.rates import RateHistory
from changefeed.schemas import validate
from changefeed.visible import visible

CHROMIUM = Path("/usr/bin/chromium")
# No sandbox (tests may run as root), and no background connections: this
# machine may have no internet, and Chromium's own would only be refused.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SCREENSHOT = os.environ.get("CHANGEFEED_SCREENSHOT")

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(
        not CHROMIUM.exists(), reason="needs Debian's chromium (apt-get install chromium)"
    ),
]

OPS = "ops-token-all-resources"
DNS = "dns-token-vm-only"
HASHED = "hashed-token-network-only"
TOKENS: dict[str, Any] = {
    "auth_tokens": (OPS,),
    "token_resources": {
        DNS: ("vm",),
        "sha256:" + hashlib.sha256(HASHED.encode()).hexdigest(): ("network",),
    },
}
HOSTILE_INSTANCE = '<img src="x" onerror="document.body.dataset.pwned = 1">'
HOSTILE_SERVICE = "<b>dns</b>"
# A right-to-left override makes "invoice-\u202egnp.exe" read "invoice-exe.png"; an
# isolate, a mark, controls, separators and a tag character would hide, reorder or
# break the text around them.
BIDI_INSTANCE = "invoice-\u202egnp.exe"
BIDI_SERVICE = "dns\u2067\u200f\u2069\nq\t\x1b[31m\x85\xa0\u2028\ufeff\U000e0041"


@contextlib.asynccontextmanager
async def chromium() -> AsyncIterator[Browser]:
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(
            executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, timeout=30_000
        )
        try:
            yield browser
        finally:
            await browser.close()


def watch_for_errors(page: Page) -> list[str]:
    """Script errors and console errors (a CSP violation is one) seen by ``page``."""
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(f"page error: {exc}"))
    page.on(
        "console",
        lambda message: (
            errors.append(f"console: {message.text}") if message.type == "error" else None
        ),
    )
    return errors


def dashboard(pub: PublisherUnderTest) -> str:
    return pub.server.url + "/changefeeds/dashboard"


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def basic(user: str, password: str) -> dict[str, str]:
    credentials = base64.b64encode(f"{user}:{password}".encode()).decode()
    return {"Authorization": f"Basic {credentials}"}


def listener_row(page: Page, text: str) -> Any:
    return page.locator("#listeners tbody tr").filter(has_text=text)


async def chart_line(page: Page, chart: str) -> str:
    line = page.locator(f"#{chart} path.line")
    return await line.get_attribute("d") or "" if await line.count() else ""


async def wait_for_chart_change(page: Page, chart: str, before: str, timeout: float) -> str:
    """The chart's line once it differs from ``before`` and has at least two points."""
    async with asyncio.timeout(timeout):
        while True:
            now = await chart_line(page, chart)
            if now != before and now.count("L") >= 1:
                return now
            await asyncio.sleep(0.1)


async def refused_registration(url: str, resource: str) -> None:
    """A registration for a resource nobody publishes: the publisher refuses it."""
    async with connect(url, open_timeout=10) as ws:
        await ws.send(registration(resource, []))
        error = orjson.loads(await asyncio.wait_for(ws.recv(), 10))
        assert error["error"]["code"] == "unknown_resource"


async def test_the_page_shows_listeners_deliveries_and_rates_live_and_says_when_it_goes_stale(
    feed_dsn: str,
) -> None:
    async with chromium() as browser:
        page = await browser.new_page(viewport={"width": 1440, "height": 900})
        errors = watch_for_errors(page)
        listeners: list[ClientConnection] = []
        async with running_publisher(feed_dsn) as pub:
            # One reading a second instead of every 5 s: the chart moves within the test.
            pub.publisher.rates = RateHistory(interval=1.0, span=120.0)
            response = await page.goto(dashboard(pub))
            assert response is not None and response.status == 200
            await expect(page.locator("#connection")).to_contain_text("live", timeout=10_000)
            await expect(page.locator("#tile-tailer .value")).to_have_text("running")
            await expect(page.locator("#listeners tbody")).to_contain_text(
                "no listener is registered here"
            )

            tcns, _ = await register(pub.ws_url, registration())
            hostile, _ = await register(
                pub.ws_url,
                registration(
                    "network", ["subnet"], instance=HOSTILE_INSTANCE, service=HOSTILE_SERVICE
                ),
            )
            bidi, _ = await register(
                pub.ws_url, registration(subs=[], instance=BIDI_INSTANCE, service=BIDI_SERVICE)
            )
            listeners += [tcns, hostile, bidi]
            await refused_registration(pub.ws_url, "nosuch")

            row = listener_row(page, "tcns")
            await expect(row).to_have_count(1, timeout=10_000)
            await expect(row.locator("td").nth(3)).to_have_text("vm (nic, alias)")
            await expect(page.locator("#tile-listeners .value")).to_have_text("3")

            await write(pub.dsn, [("vm", ["alias"], f"vm-{i}") for i in range(20)])
            await receive_items(tcns, 20)
            await expect(row.locator("td").nth(6)).to_have_text("20", timeout=10_000)
            first = await wait_for_chart_change(page, "chart-deliveries", "", timeout=20)

            await write(pub.dsn, [("vm", ["nic"], f"vm-{i}") for i in range(30)])
            await receive_items(tcns, 30)
            await expect(row.locator("td").nth(6)).to_have_text("50", timeout=10_000)
            await wait_for_chart_change(page, "chart-deliveries", first, timeout=20)
            await expect(page.locator("#chart-entries .latest")).not_to_contain_text(
                "peak 0.00/s", timeout=10_000
            )
            validate("stats", pub.publisher.stats())

            # Listener-chosen names are text, never markup.
            hostile_row = listener_row(page, HOSTILE_SERVICE)
            await expect(hostile_row.locator("td").nth(1)).to_have_text(HOSTILE_INSTANCE)
            await expect(hostile_row.locator("td").nth(2)).to_have_text(HOSTILE_SERVICE)
            assert await page.locator("#listeners img, #listeners b").count() == 0
            # ... and characters that would reorder, hide or break them are shown escaped.
            bidi_row = listener_row(page, "gnp.exe")
            instance, service = bidi_row.locator("td").nth(1), bidi_row.locator("td").nth(2)
            await expect(instance).to_have_text("invoice-\\u202egnp.exe")
            await expect(instance).to_have_attribute("title", "invoice-\\u202egnp.exe")
            # The page and the server (`changefeed stats`, the logs) show a name alike.
            assert visible(BIDI_SERVICE) == (
                "dns\\u2067\\u200f\\u2069\\nq\\t\\x1b[31m\\x85\\xa0\\u2028\\ufeff\\U000e0041"
            )
            await expect(service).to_have_text(visible(BIDI_SERVICE))
            refusal = page.locator("#refusals tbody tr").first
            await expect(refusal).to_contain_text("unknown_resource")
            await expect(refusal).to_contain_text("no change feed for resource 'nosuch'")
            assert await page.evaluate("document.body.dataset.pwned") is None

            if SCREENSHOT:
                await hostile.close()
                await bidi.close()
                await _screenshot(page, pub, listeners)
            for ws in listeners:
                await ws.close()

        # The publisher is gone: the page must say its figures are stale.
        await expect(page.locator("#connection")).to_contain_text("disconnected", timeout=15_000)
        await expect(page.locator("#banner")).to_contain_text("Stale")
        assert "stale" in (await page.locator("body").get_attribute("class") or "")
        # The failed fetches are the only errors the page may have seen.
        assert [e for e in errors if "Failed to load resource" not in e] == []


async def _screenshot(
    page: Page, pub: PublisherUnderTest, listeners: list[ClientConnection]
) -> None:
    """Saves the page to ``SCREENSHOT`` after ninety seconds of writes at a rate
    that rises and falls, read by a few more listeners, so the chart has a shape."""
    others = [
        ("cns", registration(subs=[], instance="0b3c2a1e-cns-1", service="cns")),
        ("fwapi", registration(subs=["nic"], instance="7f00e4d2-fwapi-1", service="fwapi")),
        ("napi", registration("network", ["subnet"], instance="51d3aa90-napi-2", service="napi")),
    ]
    for _, frame in others:
        ws, _ = await register(pub.ws_url, frame)
        listeners.append(ws)

    async def drain(ws: ClientConnection) -> None:
        with contextlib.suppress(Exception):
            async for _ in ws:
                pass

    readers = [asyncio.create_task(drain(ws)) for ws in listeners]

    # One that reads slower than the feed is written: it falls behind and catches up.
    slow = await connect_not_reading(pub.ws_url, ping_interval=None)
    await slow.send(registration(subs=[], instance="3e9b7c10-slow-1", service="docker"))
    listeners.append(slow)

    async def dawdle() -> None:
        with contextlib.suppress(Exception):
            while True:
                for _ in range(40):
                    await slow.recv()
                await asyncio.sleep(2)

    readers.append(asyncio.create_task(dawdle()))
    tick = 0.2
    for step in range(int(90 / tick)):
        per_second = 30 + 25 * math.sin(step * tick / 12)
        count = max(1, round(per_second * tick))
        entries = [("vm", ["alias"], f"shot-{step}-{i}") for i in range(count)]
        await write(pub.dsn, [*entries, ("network", ["subnet"], f"net-{step}")])
        await asyncio.sleep(tick)
    # A last burst of big items: the slow one falls behind and shows its lag.
    conn = await asyncpg.connect(pub.dsn)
    try:
        burst = [("vm", ["alias"], f"burst-{i}-{'x' * 800}") for i in range(20_000)]
        await publish_many(conn, burst)  # 16 MB: more than the slow one's buffers hold
    finally:
        await conn.close()
    await wait_until(lambda: pub.publisher.stats()["catchingUp"] > 0, timeout=60)
    await asyncio.sleep(3)  # the page polls every second: let it show the lag (a picture)
    await page.screenshot(path=SCREENSHOT, full_page=True)
    for reader in readers:
        reader.cancel()
    await asyncio.gather(*readers, return_exceptions=True)


async def test_the_page_shows_delivery_state_lag_head_and_low_water_when_stats_has_them(
    feed_dsn: str,
) -> None:
    """Fields the stats document may carry (delivery state, lag, head, low-water
    mark, evictions): the real document from a real publisher, with them added."""
    async with chromium() as browser, running_publisher(feed_dsn) as pub:
        page = await browser.new_page()
        errors = watch_for_errors(page)
        tcns, _ = await register(pub.ws_url, registration())

        async def with_the_new_fields(route: Route) -> None:
            response = await route.fetch()
            doc = await response.json()
            for row in doc["registrations"]:
                row.update(state="catching_up", lagEntries=1234, lagSeconds=42.5)
            doc["feed"].update(head=[9001, 777], lowWater=[8000, 12])
            doc["recentEvictions"] = [
                {
                    "at": "2030-01-01T00:00:00.000Z",
                    "code": "keepalive_timeout",
                    "reason": "no answer to pings, and no progress meanwhile",
                    "instance": HOSTILE_INSTANCE,
                    "service": "slowpoke",
                    "peer": "127.0.0.1:1",
                    "changeKinds": [{"resource": "vm", "subResources": []}],
                    "connectedSince": "2030-01-01T00:00:00.000Z",
                    "delivered": 10,
                    "dropped": 4096,
                }
            ]
            await route.fulfill(response=response, json=doc)

        await page.route("**/changefeeds/stats", with_the_new_fields)
        await page.goto(dashboard(pub))
        row = listener_row(page, "tcns")
        await expect(row.locator("td").nth(0)).to_have_text("catching up", timeout=10_000)
        await expect(row.locator("td").nth(8)).to_have_text("1,234")
        await expect(row.locator("td").nth(9)).to_have_text("42.5s")
        await expect(page.locator("#tile-lag .value")).to_have_text("42.5s")
        await expect(page.locator("#tile-lag")).to_have_class("tile bad")
        await expect(page.locator("#feed")).to_contain_text("txid 9001 · id 777")
        await expect(page.locator("#feed")).to_contain_text("txid 8000 · id 12")
        eviction = page.locator("#evictions tbody tr").first
        await expect(eviction).to_contain_text("slowpoke")
        why = eviction.locator("td").nth(1)
        await expect(why).to_have_text("keepalive_timeout")
        await expect(why).to_have_attribute(
            "title", "no answer to pings, and no progress meanwhile"
        )
        await expect(eviction.locator("td").nth(2)).to_have_text(HOSTILE_INSTANCE)
        assert await page.evaluate("document.body.dataset.pwned") is None
        assert errors == []
        await tcns.close()


async def test_the_dashboard_and_stats_refuse_a_missing_token_and_take_it_as_bearer_or_basic(
    feed_dsn: str,
) -> None:
    async with (
        running_publisher(feed_dsn, **TOKENS) as pub,
        httpx.AsyncClient(base_url=pub.server.url) as http,
    ):
        page = await http.get("/changefeeds/dashboard")
        assert page.status_code == 401
        assert page.headers["WWW-Authenticate"] == 'Basic realm="changefeed", charset="UTF-8"'
        stats = await http.get("/changefeeds/stats")
        assert stats.status_code == 401
        assert stats.headers["WWW-Authenticate"] == "Bearer"
        for wrong in (basic("ops", "nope"), bearer("nope"), {"Authorization": f"Basic {OPS}"}):
            assert (await http.get("/changefeeds/dashboard", headers=wrong)).status_code == 401
            assert (await http.get("/changefeeds/stats", headers=wrong)).status_code == 401

        for good in (bearer(OPS), basic("anyone", OPS), basic("", OPS)):
            page = await http.get("/changefeeds/dashboard", headers=good)
            assert page.status_code == 200
            assert page.headers["content-type"] == "text/html; charset=utf-8"
            assert "frame-ancestors 'none'" in page.headers["Content-Security-Policy"]
            assert "script-src 'self';" in page.headers["Content-Security-Policy"]
            assert page.headers["X-Frame-Options"] == "DENY"
            assert (await http.get("/changefeeds/stats", headers=good)).status_code == 200

        # Basic is for the browser's routes only: the websocket wants Bearer.
        with pytest.raises(InvalidStatus) as refused:
            await connect(pub.ws_url, additional_headers=basic("ops", OPS))
        assert refused.value.response.status_code == 401

        # A token limited to some resources sees only their listeners, as Basic too;
        # the sha256: form of a token works the same way.
        network, _ = await register(
            pub.ws_url, registration("network", ["subnet"]), additional_headers=bearer(OPS)
        )
        vm_only = (await http.get("/changefeeds/stats", headers=basic("dns", DNS))).json()
        assert vm_only["registrations"] == [] and vm_only["recentRefusals"] == []
        hashed = (await http.get("/changefeeds/stats", headers=basic("x", HASHED))).json()
        assert [r["changeKind"]["resource"] for r in hashed["registrations"]] == ["network"]
        everything = (await http.get("/changefeeds/stats", headers=bearer(OPS))).json()
        validate("stats", everything)
        assert {r["code"] for r in everything["recentRefusals"]} == {"unauthorized"}
        await network.close()

        # The page's own files hold no data and need no token; nothing else is served.
        script = await http.get("/changefeeds/dashboard/dashboard.js")
        assert script.status_code == 200
        assert script.headers["content-type"] == "text/javascript; charset=utf-8"
        again = await http.get(
            "/changefeeds/dashboard/dashboard.js",
            headers={"If-None-Match": script.headers["ETag"]},
        )
        assert again.status_code == 304
        assert (await http.get("/changefeeds/dashboard/..%2Fauth.py")).status_code == 404
        assert (await http.get("/changefeeds/dashboard/nope.js")).status_code == 404


async def test_a_browser_signs_in_with_the_token_as_basic_password_and_the_page_reads_stats(
    feed_dsn: str,
) -> None:
    async with chromium() as browser, running_publisher(feed_dsn, **TOKENS) as pub:
        # Playwright answers the page's Basic challenge as a person at the prompt would.
        context = await browser.new_context(
            http_credentials={"username": "operator", "password": OPS}
        )
        page = await context.new_page()
        errors = watch_for_errors(page)
        response = await page.goto(dashboard(pub))
        assert response is not None and response.status == 200
        # The page's fetches of /changefeeds/stats carry the same credentials.
        await expect(page.locator("#connection")).to_contain_text("live", timeout=10_000)
        await expect(page.locator("#tile-tailer .value")).to_have_text("running")
        # Refused at most once: the navigation that got the challenge, none of the fetches.
        assert pub.publisher.stats()["counters"]["refused"].get("unauthorized", 0) <= 1
        assert errors == []
        await context.close()
