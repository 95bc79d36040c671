// Live dashboard of one proxy node's control plane. No framework, no build step.
// Polls the node's own debug views (relative URLs) and updates the DOM in place,
// keyed by instance id, so 64 instances cost one cheap pass per tick.
"use strict";

(() => {
  // Fixed order, so a component keeps its place and colour in every bar.
  const COMPONENTS = [
    "inflight",
    "engine_running",
    "engine_waiting",
    "queue_depth",
    "pending_prefill",
    "active_decode",
    "backlog_ms",
  ];
  const WINDOW_MS = 180000; // sparkline span
  const RESERVATION_LIMIT = 500; // rows fetched; the table says when it is cut
  const FETCH_TIMEOUT_MS = 5000;

  const params = new URLSearchParams(window.location.search);
  // ?interval_ms= lets a test (or a very busy operator) change the refresh rate.
  const INTERVAL_MS = clamp(Number(params.get("interval_ms")) || 1000, 100, 60000);
  const CAPACITY = Math.min(3600, Math.ceil(WINDOW_MS / INTERVAL_MS) + 2);
  // ?limit= shows at most that many instances, the best ranked (the node's default:
  // 1000); the counts above the list always cover the whole pool.
  const LIMIT = Math.floor(clamp(Number(params.get("limit")) || 0, 0, 100000));
  const LOADS_URL = LIMIT > 0 ? `debug/instance_loads?limit=${LIMIT}` : "debug/instance_loads";

  const $ = (id) => document.getElementById(id);
  const el = {
    status: $("status"),
    pause: $("pause"),
    nodeId: $("node-id"),
    pool: $("pool"),
    coordination: $("coordination"),
    strategy: $("strategy"),
    instanceCount: $("instance-count"),
    inflightTotal: $("inflight-total"),
    instances: $("instances"),
    noInstances: $("no-instances"),
    legend: $("legend"),
    reservations: document.querySelector("#reservations tbody"),
    reservationCount: $("reservation-count"),
  };

  let paused = false;
  let timer = null;
  let polling = false;
  let ticks = 0;
  const rows = new Map(); // instance id -> row elements
  const histories = new Map(); // instance id -> Ring of (Redis time, score total)

  function clamp(value, lo, hi) {
    return Math.min(hi, Math.max(lo, value));
  }

  // A fixed-size ring buffer of (time, value); old samples fall off the back.
  class Ring {
    constructor(capacity) {
      this.t = new Float64Array(capacity);
      this.v = new Float64Array(capacity);
      this.head = 0;
      this.size = 0;
    }
    push(t, v) {
      this.t[this.head] = t;
      this.v[this.head] = v;
      this.head = (this.head + 1) % this.t.length;
      this.size = Math.min(this.size + 1, this.t.length);
    }
    *points() {
      const n = this.t.length;
      for (let i = 0; i < this.size; i++) {
        const k = (this.head - this.size + i + n) % n;
        yield [this.t[k], this.v[k]];
      }
    }
  }

  function buildLegend() {
    for (const name of COMPONENTS) {
      const li = document.createElement("li");
      const swatch = document.createElement("span");
      swatch.className = `swatch c-${name}`;
      li.append(swatch, document.createTextNode(name));
      el.legend.append(li);
    }
  }

  function makeRow(id) {
    const row = document.createElement("div");
    row.className = "row instance";
    row.setAttribute("role", "row");
    row.dataset.instance = id;
    const cell = (cls) => {
      const span = document.createElement("span");
      span.className = cls;
      span.setAttribute("role", "cell");
      row.append(span);
      return span;
    };
    const name = cell("id");
    name.textContent = id;
    name.title = id;
    const state = cell("state");
    const total = cell("total num");
    const inflight = cell("inflight num");
    const cached = cell("cached num");
    const timing = cell("timing");
    const track = cell("track");
    const bar = document.createElement("div");
    bar.className = "bar";
    bar.dataset.instance = id;
    const segs = {};
    for (const comp of COMPONENTS) {
      const seg = document.createElement("span");
      seg.className = `seg c-${comp}`;
      seg.dataset.component = comp;
      bar.append(seg);
      segs[comp] = seg;
    }
    track.append(bar);
    const sparkCell = cell("spark-cell");
    const spark = document.createElement("canvas");
    spark.className = "spark";
    spark.dataset.instance = id;
    sparkCell.append(spark);
    return { row, state, total, inflight, cached, timing, bar, segs, spark };
  }

  function fmt(value, digits) {
    return value === null || value === undefined ? "–" : Number(value).toFixed(digits);
  }

  function renderLoads(doc) {
    el.nodeId.textContent = doc.node_id;
    el.pool.textContent = doc.pool;
    el.coordination.textContent = doc.coordination;
    el.coordination.dataset.state = doc.coordination;
    el.strategy.textContent = doc.strategy;

    const instances = [...doc.instances].sort((a, b) =>
      a.id.localeCompare(b.id, undefined, { numeric: true }),
    );
    const seen = new Set();
    let maxTotal = 0;
    let inflightSum = 0;
    let alive = 0;
    let ejected = 0;
    for (const inst of instances) {
      const score = inst.least_load_score;
      if (score && score.total !== null) maxTotal = Math.max(maxTotal, score.total);
      if (inst.alive) alive++;
      if (isEjected(inst)) ejected++;
      inflightSum += inst.inflight || 0;
    }
    // A node's summary counts the whole pool; an older node's view is the whole pool.
    const pool = doc.summary || {
      instances: instances.length,
      alive,
      ejected,
      inflight: inflightSum,
    };
    el.instanceCount.textContent =
      `${pool.alive} alive / ${pool.instances}` +
      (pool.ejected ? `, ${pool.ejected} ejected` : "") +
      (pool.cordoned ? `, ${pool.cordoned} cordoned` : "") +
      (doc.truncated ? ` (the best ${instances.length} shown)` : "");
    el.inflightTotal.textContent = String(pool.inflight);
    el.noInstances.hidden = instances.length > 0;

    let previous = el.instances.querySelector(".row.head");
    for (const inst of instances) {
      seen.add(inst.id);
      let r = rows.get(inst.id);
      if (!r) {
        r = makeRow(inst.id);
        rows.set(inst.id, r);
        histories.set(inst.id, new Ring(CAPACITY));
      }
      if (previous.nextSibling !== r.row) previous.after(r.row);
      previous = r.row;

      const score = inst.least_load_score;
      const total = score ? score.total : null;
      r.row.dataset.alive = String(inst.alive);
      r.row.dataset.ejected = String(isEjected(inst));
      r.row.classList.toggle("stale", !inst.alive);
      r.row.classList.toggle("ejected", inst.alive && isEjected(inst));
      r.row.classList.toggle("cordoned", inst.alive && isCordoned(inst));
      r.state.textContent = stateText(inst);
      r.total.textContent = fmt(total, 2);
      r.inflight.textContent = inst.inflight === null ? "–" : String(inst.inflight);
      const prefix = inst.prefix || {};
      r.cached.textContent = String(prefix.expected_cached_tokens ?? 0);
      r.cached.title =
        "expected cached prompt tokens of this node's last request" +
        (prefix.index_tokens === null || prefix.index_tokens === undefined
          ? ""
          : `; the prefix index holds ${prefix.index_tokens} tokens for it`);
      r.timing.textContent = timingText(inst.timing);
      r.timing.title = timingTitle(inst.timing);
      r.bar.dataset.total = total === null ? "" : String(total);
      r.bar.dataset.inflight = String(inst.inflight ?? "");
      r.bar.title = tooltip(inst, score);
      const weighted = (score && score.weighted_components) || {};
      const weight = inst.weight > 0 ? inst.weight : 1;
      for (const comp of COMPONENTS) {
        const value = (weighted[comp] || 0) / weight;
        const seg = r.segs[comp];
        seg.dataset.value = String(value);
        // CSSOM, not a style attribute: allowed by the page's style-src 'self'.
        seg.style.width = maxTotal > 0 ? `${(100 * value) / maxTotal}%` : "0%";
      }
      histories.get(inst.id).push(doc.generated_at, total === null ? NaN : total);
    }
    for (const [id, r] of rows) {
      if (!seen.has(id)) {
        r.row.remove();
        rows.delete(id);
        histories.delete(id);
      }
    }
    drawSparklines(doc.generated_at);
  }

  // Passive health: an ejected instance is alive but kept out of selection.
  function isEjected(inst) {
    return Boolean(inst.outlier && inst.outlier.ejected);
  }

  // An operator's cordon (coordinator cordon): alive, out of rotation while it drains.
  function isCordoned(inst) {
    return Boolean(inst.outlier && inst.outlier.cordoned);
  }

  function stateText(inst) {
    if (!inst.alive) return "stale";
    if (isCordoned(inst)) return "cordoned";
    if (isEjected(inst)) return `ejected ${Math.ceil(inst.outlier.ejected_for_ms / 1000)}s`;
    return "alive";
  }

  // Where the predicting timing comes from: configured, learned or scaled (with the
  // instance's own samples), the pool's learned average, or the documented default.
  function timingText(t) {
    if (!t) return "–";
    const own = t.prefill === "learned" || t.prefill === "scaled";
    const n = own ? ` ${t.prefill_samples}` : "";
    return `${t.prefill}${n}`;
  }

  function timingTitle(t) {
    if (!t) return "no timing";
    return [
      `prefill: ${fmt(t.prefill_ms_per_token, 3)} ms/token + ${fmt(t.prefill_overhead_ms, 1)} ms` +
        ` (${t.prefill}, ${t.prefill_samples} samples)`,
      `decode: ${fmt(t.decode_ms_per_token, 2)} ms/token (${t.decode}, ${t.decode_samples} samples)`,
    ].join("\n");
  }

  function tooltip(inst, score) {
    const lines = [`${inst.id} (${stateText(inst)}, epoch ${inst.epoch})`];
    const outlier = inst.outlier;
    if (outlier && outlier.consecutive_failures) {
      const reason = outlier.last_failure_reason || "?";
      lines.push(`${outlier.consecutive_failures} failures in a row (last: ${reason})`);
    }
    if (score && score.total !== null) {
      lines.push(`score ${score.total.toFixed(3)}`);
      for (const [name, value] of Object.entries(score.weighted_components)) {
        lines.push(`  ${name}: ${value.toFixed(3)} (raw ${score.components[name]})`);
      }
    } else {
      lines.push("not scored");
    }
    return lines.join("\n");
  }

  function drawSparklines(now) {
    // One scale and one time axis for all rows, so their lines compare at a glance;
    // the axis grows from the first sample up to WINDOW_MS, then slides.
    let max = 0;
    let start = now;
    for (const ring of histories.values()) {
      for (const [t, v] of ring.points()) {
        if (t < now - WINDOW_MS) continue;
        start = Math.min(start, t);
        if (Number.isFinite(v)) max = Math.max(max, v);
      }
    }
    const span = Math.max(now - start, 1);
    const dpr = window.devicePixelRatio || 1;
    for (const [id, r] of rows) {
      const canvas = r.spark;
      const w = canvas.clientWidth;
      const h = canvas.clientHeight;
      if (!w || !h) continue;
      if (canvas.width !== Math.round(w * dpr)) canvas.width = Math.round(w * dpr);
      if (canvas.height !== Math.round(h * dpr)) canvas.height = Math.round(h * dpr);
      const ctx = canvas.getContext("2d");
      ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
      ctx.clearRect(0, 0, w, h);
      ctx.strokeStyle = getComputedStyle(canvas).color;
      ctx.lineWidth = 1.25;
      ctx.beginPath();
      let drawing = false;
      let samples = 0;
      for (const [t, v] of histories.get(id).points()) {
        if (t < start || !Number.isFinite(v)) {
          drawing = false; // a gap (unscored, or before the window) breaks the line
          continue;
        }
        const x = ((t - start) / span) * (w - 1);
        const y = h - 1 - (max > 0 ? (v / max) * (h - 2) : 0);
        if (drawing) ctx.lineTo(x, y);
        else ctx.moveTo(x, y);
        drawing = true;
        samples++;
      }
      ctx.stroke();
      canvas.dataset.samples = String(samples);
    }
  }

  function renderReservations(doc) {
    const body = document.createElement("tbody");
    for (const res of doc.reservations) {
      const tr = document.createElement("tr");
      tr.dataset.rid = res.rid;
      tr.dataset.phase = res.phase ?? "";
      for (const [cls, value] of [
        ["rid", res.rid],
        ["instance", res.instance],
        ["node", res.node],
        ["phase", res.phase],
        ["age num", res.age_ms],
      ]) {
        const td = document.createElement("td");
        td.className = cls;
        td.textContent = value === null || value === undefined ? "–" : String(value);
        tr.append(td);
      }
      body.append(tr);
    }
    el.reservations.replaceWith(body);
    el.reservations = body;
    const n = doc.reservations.length;
    el.reservationCount.textContent = doc.truncated
      ? `first ${n} shown (more are live)`
      : `${n} live`;
  }

  async function getJSON(url) {
    const controller = new AbortController();
    const timeout = setTimeout(() => controller.abort(), FETCH_TIMEOUT_MS);
    try {
      const resp = await fetch(url, { cache: "no-store", signal: controller.signal });
      if (!resp.ok) throw new Error(`${url}: HTTP ${resp.status}`);
      return await resp.json();
    } finally {
      clearTimeout(timeout);
    }
  }

  function setStatus(state, text) {
    el.status.dataset.state = state;
    el.status.textContent = text;
  }

  async function poll() {
    timer = null;
    polling = true;
    try {
      const [loads, reservations] = await Promise.all([
        getJSON(LOADS_URL),
        getJSON(`debug/reservations?limit=${RESERVATION_LIMIT}`),
      ]);
      if (paused) return; // a pause pressed while fetching discards the answer
      renderLoads(loads);
      renderReservations(reservations);
      ticks++;
      el.status.dataset.ticks = String(ticks);
      setStatus("live", `live · updated ${new Date().toLocaleTimeString()}`);
    } catch (err) {
      if (!paused) {
        setStatus("error", `error: ${err.message || err} · retrying`);
        el.coordination.dataset.state = "unreachable";
      }
    } finally {
      polling = false;
      if (!paused) timer = setTimeout(poll, INTERVAL_MS);
    }
  }

  function setPaused(value) {
    paused = value;
    el.pause.textContent = paused ? "Resume" : "Pause";
    el.pause.setAttribute("aria-pressed", String(paused));
    document.body.dataset.paused = String(paused);
    if (paused) {
      if (timer !== null) clearTimeout(timer);
      timer = null;
      setStatus("paused", "paused");
    } else if (!polling && timer === null) {
      setStatus("loading", "resuming…");
      poll();
    }
  }

  buildLegend();
  el.pause.addEventListener("click", () => setPaused(!paused));
  document.body.dataset.paused = "false";
  document.body.dataset.intervalMs = String(INTERVAL_MS);
  poll();
})();
