/* changefeed dashboard: reads ./stats about once a second and draws it.
 *
 * Every value goes into the page as text (textContent, text nodes, attribute
 * values), never as markup: instance and service names are whatever listeners
 * sent. Those names are shown through `escaped`, which escapes the characters
 * that would reorder, hide or break the text around them. Fields a publisher
 * does not report are shown as "—", never guessed.
 * Thresholds for the colours are those of deploy/prometheus/changefeed-alerts.yml.
 */
"use strict";
(() => {
  const POLL_MS = 1000;
  const HIDDEN_POLL_MS = 10000;
  const TIMEOUT_MS = 5000;
  const STALE_MS = 4000;
  const ROWS_PER_POLL_SECOND = 1000; // a big stats document is read less often
  const LISTED = 25; // evictions and refusals shown
  const statsUrl = new URL("stats", document.baseURI);
  const SVG = "http://www.w3.org/2000/svg";

  const $ = (id) => document.getElementById(id);
  const integer = new Intl.NumberFormat("en-US", { maximumFractionDigits: 0 });
  const decimals = [0, 1, 2, 3].map(
    (d) => new Intl.NumberFormat("en-US", { minimumFractionDigits: d, maximumFractionDigits: d }),
  );

  let lastGood = null; // { doc, at: client ms }
  let failure = null; // { kind: "auth" | "http" | "network", message }
  let serverOffset = 0; // server clock - client clock, ms (from the Date header)
  let timer = null;
  let inFlight = false;
  let filterText = "";

  // -- small builders ---------------------------------------------------------

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === undefined || value === null) continue;
      if (key === "class") node.className = value;
      else if (key === "text") node.textContent = String(value);
      else node.setAttribute(key, String(value));
    }
    node.append(...children.filter((c) => c !== null && c !== undefined));
    return node;
  }

  function svg(tag, attrs, text) {
    const node = document.createElementNS(SVG, tag);
    for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, String(value));
    if (text !== undefined) node.textContent = text;
    return node;
  }

  const has = (value) => value !== undefined && value !== null;

  // Bidirectional controls (U+202E, U+2066-U+2069, ...) would reorder the text
  // around them, so that "abc\u202Egnp.exe" reads "abcexe.png"; control,
  // zero-width and separator characters hide or break it. A listener chooses its
  // names: each such character is shown as its escape. The rule is the server's
  // (changefeed/visible.py: what Python's str.isprintable refuses, that is the
  // Unicode categories Other and Separator but the space), and so is the escape
  // (Python's repr): tests/test_dashboard.py checks that both show a name alike.
  const UNSAFE = /(?! )[\p{C}\p{Z}]/gu;
  const NAMED = { "\t": "\\t", "\n": "\\n", "\r": "\\r" };

  function escapeOne(c) {
    const code = c.codePointAt(0);
    const hex = code.toString(16);
    if (NAMED[c]) return NAMED[c];
    if (code < 0x100) return `\\x${hex.padStart(2, "0")}`;
    if (code < 0x10000) return `\\u${hex.padStart(4, "0")}`;
    return `\\U${hex.padStart(8, "0")}`;
  }

  /** A name a listener sent, as text, with the characters above escaped (\u202e). */
  function escaped(value) {
    return String(value).replace(UNSAFE, escapeOne);
  }

  function missing(what) {
    return el("span", { class: "missing", title: `${what}: not reported by this publisher`, text: "—" });
  }

  /** A number and its unit, the unit smaller: "1,204 items", "0.42 s". */
  function quantity(value, unit, digits = 0) {
    const frag = document.createDocumentFragment();
    frag.append(decimals[digits].format(value));
    if (unit) frag.append(el("span", { class: "unit", text: unit }));
    return frag;
  }

  function rateDigits(value) {
    return value >= 100 ? 0 : value >= 10 ? 1 : 2;
  }

  function seconds(value) {
    if (!has(value)) return null;
    if (value >= 120) return duration(value);
    return quantity(value, "s", value >= 10 ? 1 : 2);
  }

  /** 45 s, 3 min 12 s, 2 h 05 min, 3 d 4 h */
  function duration(total) {
    const s = Math.max(0, Math.floor(total));
    if (s < 60) return `${s} s`;
    if (s < 3600) return `${Math.floor(s / 60)} min ${s % 60} s`;
    if (s < 86400) return `${Math.floor(s / 3600)} h ${String(Math.floor((s % 3600) / 60)).padStart(2, "0")} min`;
    return `${Math.floor(s / 86400)} d ${Math.floor((s % 86400) / 3600)} h`;
  }

  function bytes(value) {
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let v = value;
    let i = 0;
    while (v >= 1024 && i < units.length - 1) {
      v /= 1024;
      i += 1;
    }
    return quantity(v, units[i], i === 0 ? 0 : 1);
  }

  function compact(value) {
    const abs = Math.abs(value);
    if (abs >= 1e6) return `${decimals[abs >= 1e7 ? 0 : 1].format(value / 1e6)}M`;
    if (abs >= 1e3) return `${decimals[abs >= 1e4 ? 0 : 1].format(value / 1e3)}k`;
    return decimals[abs >= 10 || value === 0 ? 0 : 1].format(value);
  }

  function position(pos) {
    if (!Array.isArray(pos) || pos.length !== 2) return null;
    return `txid ${pos[0]} · id ${pos[1]}`;
  }

  const serverNow = () => Date.now() + serverOffset;

  function ago(iso) {
    const t = Date.parse(iso);
    if (Number.isNaN(t)) return null;
    return el("span", { title: iso, text: `${duration((serverNow() - t) / 1000)} ago` });
  }

  function since(iso) {
    const t = Date.parse(iso);
    if (Number.isNaN(t)) return null;
    return el("span", { title: `since ${iso}`, text: duration((serverNow() - t) / 1000) });
  }

  function level(value, warn, bad) {
    if (!has(value)) return "";
    return value > bad ? "bad" : value > warn ? "warn" : "ok";
  }

  function badge(text, tone) {
    return el("span", { class: `state ${tone}`, text });
  }

  const TAILER_TONE = { running: "ok", starting: "warn", reconnecting: "warn" };

  function tailerTone(status) {
    return TAILER_TONE[status] || "bad";
  }

  function stateBadge(state) {
    if (state === "live") return badge("live", "ok");
    if (state === "catching_up") return badge("catching up", "warn");
    if (has(state)) return badge(String(state), "unknown");
    return missing("delivery state");
  }

  function kindText(kind) {
    if (!kind || typeof kind !== "object") return "";
    const subs = Array.isArray(kind.subResources) ? kind.subResources : [];
    return `${kind.resource}${subs.length ? ` (${subs.join(", ")})` : " (all)"}`;
  }

  function cell(content, cls, title) {
    const td = el("td", { class: cls, title });
    if (content === null || content === undefined) td.append(missing("value"));
    else td.append(content);
    return td;
  }

  function setTile(id, value, sub, tone) {
    const tile = $(id);
    tile.className = `tile ${tone || ""}`;
    const valueNode = tile.querySelector(".value");
    valueNode.replaceChildren(has(value) ? value : missing(tile.querySelector("h2").textContent));
    tile.querySelector(".sub").textContent = sub || "";
  }

  function facts(dl, rows) {
    const nodes = [];
    for (const [label, value, cls, title] of rows) {
      nodes.push(el("dt", { text: label }));
      const dd = el("dd", { class: cls, title });
      dd.append(has(value) ? value : missing(label));
      nodes.push(dd);
    }
    dl.replaceChildren(...nodes);
  }

  // -- the sections -----------------------------------------------------------

  function latestRates(doc) {
    const samples = doc.rates && Array.isArray(doc.rates.samples) ? doc.rates.samples : [];
    return samples.length ? samples[samples.length - 1] : null;
  }

  function renderTiles(doc) {
    const tailer = doc.tailer || {};
    const rows = Array.isArray(doc.registrations) ? doc.registrations : [];
    const latest = latestRates(doc);
    const counters = doc.counters || {};

    const tailSub = tailer.lastError
      ? tailer.lastError
      : has(tailer.lagSeconds)
        ? `tail lag ${decimals[2].format(tailer.lagSeconds)} s`
        : "";
    setTile("tile-tailer", tailer.status, tailSub, tailerTone(tailer.status));

    setTile(
      "tile-listeners",
      quantity(doc.listeners || 0, ""),
      `${integer.format(doc.connections || 0)} connections${doc.draining ? " · draining" : ""}`,
      doc.draining ? "warn" : "",
    );

    const entries = latest ? latest.entriesPerSecond : null;
    setTile(
      "tile-entries",
      has(entries) ? quantity(entries, "/s", rateDigits(entries)) : null,
      has(tailer.entries) ? `${integer.format(tailer.entries)} since start` : "",
    );
    const deliveries = latest ? latest.deliveriesPerSecond : null;
    setTile(
      "tile-deliveries",
      has(deliveries) ? quantity(deliveries, "/s", rateDigits(deliveries)) : null,
      has(counters.sent) ? `${integer.format(counters.sent)} items since start` : "",
    );

    const lags = rows.map((r) => r.lagSeconds).filter(has);
    const deepest = rows.reduce((m, r) => Math.max(m, r.queueDepth || 0), 0);
    $("tile-lag").querySelector("h2").textContent = lags.length ? "Worst listener lag" : "Deepest send queue";
    if (lags.length) {
      const worst = Math.max(...lags);
      const behind = rows.filter((r) => r.state === "catching_up").length;
      setTile(
        "tile-lag",
        seconds(worst),
        `${behind} catching up · deepest queue ${integer.format(deepest)}`,
        level(worst, 5, 30),
      );
    } else {
      setTile(
        "tile-lag",
        rows.length ? quantity(deepest, "items") : null,
        rows.length ? "listener lag: not reported by this publisher" : "no listeners",
        rows.length ? level(deepest, 256, 2048) : "",
      );
    }

    const xact = tailer.oldestOpenTransactionSeconds;
    setTile("tile-xact", seconds(xact), "every delivery waits for it", level(xact, 10, 60));
  }

  function sortKey(row) {
    return [
      row.state === "catching_up" ? 0 : 1,
      -(row.lagEntries || 0),
      -(row.queueDepth || 0),
      String(row.service),
      String(row.instance),
    ];
  }

  function compareRows(a, b) {
    const ka = sortKey(a);
    const kb = sortKey(b);
    for (let i = 0; i < ka.length; i += 1) {
      if (ka[i] < kb[i]) return -1;
      if (ka[i] > kb[i]) return 1;
    }
    return 0;
  }

  function renderListeners(doc) {
    const rows = Array.isArray(doc.registrations) ? [...doc.registrations] : [];
    rows.sort(compareRows);
    const needle = filterText.trim().toLowerCase();
    const shown = needle
      ? rows.filter((r) =>
          [escaped(r.instance), escaped(r.service), kindText(r.changeKind), r.peer, r.state]
            .join(" ")
            .toLowerCase()
            .includes(needle),
        )
      : rows;
    const body = $("listeners").tBodies[0];
    const trs = shown.map((r) =>
      el(
        "tr",
        {},
        cell(stateBadge(r.state)),
        cell(escaped(r.instance), "mono clip", escaped(r.instance)),
        cell(escaped(r.service), "clip", escaped(r.service)),
        cell(kindText(r.changeKind)),
        cell(String(r.peer || ""), "mono"),
        cell(since(r.connectedSince), "num"),
        cell(has(r.delivered) ? quantity(r.delivered, "") : null, "num"),
        cell(has(r.queueDepth) ? quantity(r.queueDepth, "") : null, `num ${level(r.queueDepth, 256, 2048)}`),
        cell(has(r.lagEntries) ? quantity(r.lagEntries, "") : null, "num"),
        cell(seconds(r.lagSeconds), `num ${level(r.lagSeconds, 5, 30)}`),
      ),
    );
    if (!trs.length) {
      const text = rows.length ? "no listener matches the filter" : "no listener is registered here";
      trs.push(el("tr", {}, el("td", { class: "none", colspan: 10, text })));
    }
    body.replaceChildren(...trs);
    let note = `${integer.format(rows.length)} registrations on ${integer.format(doc.listeners || 0)} connections`;
    if (needle) note = `${integer.format(shown.length)} of ${note}`;
    if (doc.truncated) note += " (list truncated by the publisher)";
    $("listeners-note").textContent = note;
  }

  function renderFeed(doc) {
    const feed = doc.feed || {};
    facts($("feed"), [
      ["Head (newest entry)", position(feed.head), "mono", "(txid, id) of the newest entry"],
      ["Low-water mark", position(feed.lowWater), "mono", "cursors before this bootstrap again instead of resuming"],
      ["Oldest entry", has(feed.oldestEntrySeconds) ? `${duration(feed.oldestEntrySeconds)} old` : null],
      ["Size on disk", has(feed.bytes) ? bytes(feed.bytes) : null],
    ]);
  }

  function renderTailer(doc) {
    const t = doc.tailer || {};
    facts($("tailer"), [
      ["Status", has(t.status) ? badge(t.status, tailerTone(t.status)) : null],
      ["Position", position(t.position), "mono", "(txid, id) of the last entry read"],
      ["Tail lag", seconds(t.lagSeconds), "", "age of the newest entry when it was read"],
      ["Last published", has(t.lastPublished) ? ago(t.lastPublished) : null],
      ["Oldest open transaction", seconds(t.oldestOpenTransactionSeconds)],
      ["Waiting for fan-out", seconds(t.fanoutWaitSeconds)],
      [
        "Doorbells · polls · reconnects",
        [t.doorbells, t.polls, t.reconnects].every(has)
          ? `${integer.format(t.doorbells)} · ${integer.format(t.polls)} · ${integer.format(t.reconnects)}`
          : null,
      ],
    ]);
    const error = $("tailer-error");
    error.hidden = !t.lastError;
    error.textContent = t.lastError ? `Last error: ${t.lastError}` : "";
  }

  function renderRecent(tableId, noteId, items, total, build, emptyText) {
    const body = $(tableId).tBodies[0];
    const columns = $(tableId).tHead.rows[0].cells.length;
    if (!Array.isArray(items)) {
      body.replaceChildren(
        el("tr", {}, el("td", { class: "none", colspan: columns, text: "not reported by this publisher" })),
      );
      $(noteId).textContent = total;
      return;
    }
    const newest = items.slice(-LISTED).reverse();
    const trs = newest.map(build);
    if (!trs.length) trs.push(el("tr", {}, el("td", { class: "none", colspan: columns, text: emptyText })));
    body.replaceChildren(...trs);
    $(noteId).textContent = total;
  }

  function renderEvictions(doc) {
    const counters = doc.counters || {};
    const total = has(counters.evictions) ? `${integer.format(counters.evictions)} since start` : "";
    renderRecent(
      "evictions",
      "evictions-note",
      doc.recentEvictions,
      total,
      (e) =>
        el(
          "tr",
          {},
          cell(ago(e.at)),
          cell(has(e.code) ? escaped(e.code) : null, "mono", has(e.reason) ? escaped(e.reason) : undefined),
          cell(escaped(e.instance), "mono clip", escaped(e.instance)),
          cell(escaped(e.service), "clip", escaped(e.service)),
          cell((Array.isArray(e.changeKinds) ? e.changeKinds : []).map(kindText).join("; ")),
          cell(has(e.delivered) ? quantity(e.delivered, "") : null, "num"),
          cell(has(e.dropped) ? quantity(e.dropped, "") : null, "num bad"),
        ),
      "none: every listener keeps up",
    );
  }

  function renderRefusals(doc) {
    const refused = (doc.counters && doc.counters.refused) || {};
    const total = Object.entries(refused)
      .map(([code, n]) => `${code} ${integer.format(n)}`)
      .join(" · ");
    renderRecent(
      "refusals",
      "refusals-note",
      doc.recentRefusals,
      total ? `since start: ${total}` : "",
      (r) =>
        el(
          "tr",
          {},
          cell(ago(r.at)),
          cell(badge(String(r.code), "bad")),
          cell(String(r.endpoint)),
          cell(String(r.peer || ""), "mono"),
          cell(escaped(r.reason || ""), "wrap"),
        ),
      "none",
    );
  }

  // The counters of the "Since start" line: declared with every other view of them
  // (publisher/figures.py), and written into the page as data.
  const SINCE_START = (() => {
    try {
      const listed = JSON.parse(($("since-start") || {}).textContent || "[]");
      return Array.isArray(listed) ? listed : [];
    } catch {
      return [];
    }
  })();

  function renderCounters(doc) {
    const c = doc.counters || {};
    const parts = SINCE_START.map(([key, label]) => [label, c[key]]).filter(([, v]) => has(v));
    $("counters").replaceChildren(
      el("strong", { text: "Since start" }),
      ...parts.map(([label, v]) => el("span", { text: `${integer.format(v)} ${label}` })),
    );
  }

  // -- the charts -------------------------------------------------------------

  function niceCeiling(value) {
    if (!(value > 0)) return 1;
    const exp = 10 ** Math.floor(Math.log10(value));
    for (const m of [1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10]) if (m * exp >= value) return m * exp;
    return 10 * exp;
  }

  function drawChart(figure, rates, key) {
    const box = figure.querySelector("svg");
    const width = Math.max(240, Math.round(box.getBoundingClientRect().width) || 600);
    const height = 150;
    const pad = { left: 48, right: 10, top: 10, bottom: 22 };
    box.setAttribute("viewBox", `0 0 ${width} ${height}`);
    const latestLabel = figure.querySelector(".latest");
    if (!rates || !Array.isArray(rates.samples)) {
      latestLabel.textContent = "";
      box.replaceChildren(svg("text", { class: "empty", x: pad.left, y: height / 2 }, "rates: not reported by this publisher"));
      return;
    }
    const interval = Number(rates.intervalSeconds) || 5;
    const span = Number(rates.spanSeconds) || 600;
    const points = rates.samples
      .map((s) => ({ t: Date.parse(s.at), v: Number(s[key]) || 0, evictions: (Number(s.evictionsPerSecond) || 0) * (Number(s.seconds) || interval) }))
      .filter((p) => !Number.isNaN(p.t));
    const end = points.length ? points[points.length - 1].t : serverNow();
    const start = end - span * 1000;
    const peak = points.reduce((m, p) => Math.max(m, p.v), 0);
    const top = niceCeiling(peak);
    const plotW = width - pad.left - pad.right;
    const plotH = height - pad.top - pad.bottom;
    const x = (t) => pad.left + ((t - start) / (end - start)) * plotW;
    const y = (v) => pad.top + (1 - v / top) * plotH;
    const nodes = [];

    for (const fraction of [0, 0.5, 1]) {
      const gy = y(top * fraction);
      nodes.push(svg("line", { class: "grid", x1: pad.left, x2: width - pad.right, y1: gy, y2: gy }));
      nodes.push(svg("text", { class: "axis", x: pad.left - 6, y: gy + 4, "text-anchor": "end" }, compact(top * fraction)));
    }
    const minutes = span / 60;
    for (const fraction of [0, 0.5, 1]) {
      const label = fraction === 1 ? "now" : `−${decimals[0].format(minutes * (1 - fraction))} min`;
      const anchor = fraction === 0 ? "start" : fraction === 1 ? "end" : "middle";
      nodes.push(svg("text", { class: "axis", x: pad.left + fraction * plotW, y: height - 6, "text-anchor": anchor }, label));
    }

    // A gap of more than a few intervals (the publisher was too busy to sample) breaks the line.
    const segments = [];
    let current = [];
    for (const p of points) {
      if (current.length && p.t - current[current.length - 1].t > 3 * interval * 1000) {
        segments.push(current);
        current = [];
      }
      current.push(p);
    }
    if (current.length) segments.push(current);
    const fmt = (n) => n.toFixed(1);
    const line = segments.map((seg) => seg.map((p, i) => `${i ? "L" : "M"}${fmt(x(p.t))},${fmt(y(p.v))}`).join("")).join("");
    const area = segments
      .filter((seg) => seg.length > 1)
      .map((seg) => `M${fmt(x(seg[0].t))},${fmt(y(0))}${seg.map((p) => `L${fmt(x(p.t))},${fmt(y(p.v))}`).join("")}L${fmt(x(seg[seg.length - 1].t))},${fmt(y(0))}Z`)
      .join("");
    if (area) nodes.push(svg("path", { class: "area", d: area }));
    if (line) nodes.push(svg("path", { class: "line", d: line }));
    for (const p of points) {
      if (p.evictions > 0) {
        const tick = svg("line", { class: "eviction", x1: x(p.t), x2: x(p.t), y1: pad.top + plotH - 8, y2: pad.top + plotH });
        tick.append(svg("title", {}, `${Math.round(p.evictions)} evicted`));
        nodes.push(tick);
      }
    }
    if (points.length) {
      const last = points[points.length - 1];
      nodes.push(svg("circle", { class: "line", cx: fmt(x(last.t)), cy: fmt(y(last.v)), r: 2.5 }));
      latestLabel.textContent = `now ${decimals[rateDigits(last.v)].format(last.v)}/s · peak ${decimals[rateDigits(peak)].format(peak)}/s`;
    } else {
      latestLabel.textContent = "";
      nodes.push(
        svg("text", { class: "empty", x: pad.left + 8, y: pad.top + plotH / 2 }, `collecting: the first rate comes after ${decimals[0].format(2 * interval)} s`),
      );
    }
    box.replaceChildren(...nodes);
  }

  function renderCharts(doc) {
    drawChart($("chart-entries"), doc.rates, "entriesPerSecond");
    drawChart($("chart-deliveries"), doc.rates, "deliveriesPerSecond");
    const rates = doc.rates;
    $("rates-note").textContent = rates
      ? `last ${decimals[0].format((rates.spanSeconds || 600) / 60)} min, one point per ${rates.intervalSeconds} s; red ticks: evictions`
      : "";
  }

  function render(doc) {
    renderTiles(doc);
    renderCharts(doc);
    renderListeners(doc);
    renderFeed(doc);
    renderTailer(doc);
    renderEvictions(doc);
    renderRefusals(doc);
    renderCounters(doc);
  }

  // -- polling and freshness ----------------------------------------------------

  function noteServerClock(response) {
    const date = Date.parse(response.headers.get("Date") || "");
    if (Number.isNaN(date)) return;
    // The header has whole seconds: move the offset only when it is off by more.
    const estimate = date + 500 - Date.now();
    if (Math.abs(estimate - serverOffset) > 1500) serverOffset = estimate;
  }

  async function errorMessage(response) {
    try {
      const body = await response.json();
      if (body && body.error && body.error.message) return String(body.error.message);
    } catch (_) {
      // not the protocol's error body
    }
    return response.statusText || "";
  }

  function nextDelay() {
    if (document.hidden) return HIDDEN_POLL_MS;
    const rows = lastGood && Array.isArray(lastGood.doc.registrations) ? lastGood.doc.registrations.length : 0;
    return Math.min(HIDDEN_POLL_MS, POLL_MS * Math.max(1, Math.ceil(rows / ROWS_PER_POLL_SECOND)));
  }

  function schedule(delay) {
    clearTimeout(timer);
    timer = setTimeout(poll, delay);
  }

  async function poll() {
    if (inFlight) return;
    inFlight = true;
    const controller = new AbortController();
    const deadline = setTimeout(() => controller.abort(), TIMEOUT_MS);
    try {
      const response = await fetch(statsUrl, {
        cache: "no-store",
        credentials: "same-origin",
        headers: { Accept: "application/json" },
        signal: controller.signal,
      });
      if (response.status === 401 || response.status === 403) {
        failure = { kind: "auth", message: `HTTP ${response.status}: ${await errorMessage(response)}` };
      } else if (!response.ok) {
        failure = { kind: "http", message: `HTTP ${response.status}: ${await errorMessage(response)}` };
      } else {
        const doc = await response.json();
        noteServerClock(response);
        lastGood = { doc, at: Date.now() };
        failure = null;
        try {
          render(doc);
        } catch (err) {
          failure = { kind: "http", message: `this page could not draw the answer (${err})` };
          console.error(err);
        }
      }
    } catch (err) {
      const message = err && err.name === "AbortError" ? `no answer within ${TIMEOUT_MS / 1000} s` : "the publisher cannot be reached";
      failure = { kind: "network", message };
    } finally {
      clearTimeout(deadline);
      inFlight = false;
      freshness();
      schedule(nextDelay());
    }
  }

  function freshness() {
    const pill = $("connection");
    const banner = $("banner");
    const age = lastGood ? Date.now() - lastGood.at : null;
    const fresh = age !== null && age <= STALE_MS && (!failure || failure.kind !== "auth");
    document.body.classList.toggle("waiting", lastGood === null);
    document.body.classList.toggle("stale", lastGood !== null && !fresh);
    const doc = lastGood ? lastGood.doc : null;
    let bannerText = "";
    let bannerTone = "bad";
    if (failure && failure.kind === "auth") {
      pill.className = "pill bad";
      pill.textContent = "unauthorized";
      bannerText = `Not authorized (${failure.message}). Reload the page and sign in with the bearer token as the password.`;
    } else if (fresh) {
      pill.className = failure ? "pill warn" : "pill ok";
      pill.textContent = failure ? `retrying · ${failure.message}` : `live · updated ${decimals[1].format(age / 1000)} s ago`;
      if (doc && doc.draining) {
        bannerText = "This instance is draining: it refuses new listeners and is closing the ones it has.";
        bannerTone = "warn";
      }
    } else if (lastGood === null) {
      pill.className = failure ? "pill bad" : "pill";
      pill.textContent = failure ? "disconnected" : "connecting…";
      if (failure) bannerText = `Cannot read ${statsUrl.pathname}: ${failure.message}.`;
    } else {
      pill.className = "pill bad";
      pill.textContent = `disconnected · stale for ${duration(age / 1000)}`;
      const when = new Date(lastGood.at).toLocaleTimeString();
      const why = failure ? failure.message : "no answer";
      bannerText = `Stale: ${why}. The figures below are from ${when} and are not current.`;
    }
    banner.hidden = !bannerText;
    banner.textContent = bannerText;
    banner.className = `banner ${bannerTone}`;
    const status = doc && doc.tailer ? doc.tailer.status : "";
    document.title = fresh && doc ? `${status} · ${doc.listeners} listeners · changefeed` : "stale · changefeed";
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("host").textContent = location.host;
    $("filter").addEventListener("input", (event) => {
      filterText = event.target.value;
      if (lastGood) renderListeners(lastGood.doc);
    });
    document.addEventListener("visibilitychange", () => {
      if (!document.hidden) schedule(0);
    });
    window.addEventListener("resize", () => {
      if (lastGood) renderCharts(lastGood.doc);
    });
    setInterval(freshness, 250);
    poll();
  });
})();
