// The run view of otel-agentcap: one lane per agent (spawn-tree order), events placed by logical
// sequence, causal links as edges. Served by `otel-agentcap ui` (data from its JSON API) or
// embedded in a file written by `otel-agentcap export RUN --format html` (data in the page).
//
// Only the window on screen is drawn, labels are fetched per window of sequences and a payload
// when its event is opened, so a run of 100,000 events stays usable; causal closures are computed
// here on the graph's integer arrays. Text from the log is always set with textContent.
(function () {
  "use strict";

  const SVGNS = "http://www.w3.org/2000/svg";
  const TYPES = {
    model_call: { name: "model call", kind: "model", shape: "hexagon", glyph: "M" },
    tool_invocation: { name: "tool call", kind: "tool call", shape: "diamond", glyph: "T" },
    tool_result: { name: "tool result", kind: "tool result", shape: "square", glyph: "R" },
    memory_read: { name: "memory read", kind: "mem read", shape: "circle", glyph: "r" },
    memory_write: { name: "memory write", kind: "mem write", shape: "triangle-up", glyph: "w" },
    agent_spawn: { name: "spawn", kind: "spawn", shape: "triangle-down", glyph: "S" },
    agent_start: { name: "agent start", kind: "start", shape: "play", glyph: "" },
    agent_end: { name: "agent end", kind: "end", shape: "bar", glyph: "" },
    agent_error: { name: "error", kind: "error", shape: "octagon", glyph: "!" },
  };
  const OTHER = { name: "event", kind: "event", shape: "circle", glyph: "?" };
  const LANE_H = 66, RULER_H = 26, NAMES_W = 260, PAD = 16, NODE_Y = 22;
  const ZOOMS = [40, 72, 112, 160];
  const LABEL_BLOCK = 128;
  const NONE = 0, PAST = 1, FUTURE = 2, SELECTED = 3;

  const embedded = (() => {
    const node = document.getElementById("agentcap-data");
    return node ? JSON.parse(node.textContent) : null;
  })();

  // ------------------------------------------------------------------ data sources

  async function getJSON(url) {
    const response = await fetch(url, { headers: { Accept: "application/json" } });
    let body = null;
    try { body = await response.json(); } catch (err) { body = null; }
    if (!response.ok) throw new Error((body && body.error) || `${response.status} ${response.statusText}`);
    return body;
  }

  function serverSource(runId) {
    const q = (extra) => "run=" + encodeURIComponent(runId) + (extra || "");
    return {
      live: true,
      config: () => getJSON("/api/config"),
      run: () => getJSON("/api/run?" + q()),
      version: () => getJSON("/api/run/version?" + q()),
      labels: (from, to) => getJSON(`/api/run/labels?${q()}&from=${encodeURIComponent(from)}&to=${encodeURIComponent(to)}`),
      event: (agent, seq) => getJSON(`/api/run/event?${q()}&agent=${encodeURIComponent(agent)}&seq=${encodeURIComponent(seq)}`),
      conflict: (id) => getJSON(`/api/run/conflict?${q()}&id=${encodeURIComponent(id)}`),
    };
  }

  // The longest payload (characters of its JSON text) the panel draws whole. The server sends a
  // longer one as a preview with its size, its small fields and the address of the whole payload
  // (documents.PAYLOAD_PREVIEW_CHARS); the exported page cuts its own the same way.
  const PAYLOAD_PREVIEW_CHARS = 65536;
  const FIELD_CHARS = 2000;

  function smallFields(text) {
    let value;
    try { value = JSON.parse(text); } catch (err) { return null; }
    if (!value || typeof value !== "object" || Array.isArray(value)) return null;
    const out = {};
    for (const [key, item] of Object.entries(value)) {
      const shown = JSON.stringify(item);
      out[key] = shown === undefined || shown.length <= FIELD_CHARS ? item : { "$agentcap.truncated": shown.slice(0, 200), size: shown.length };
    }
    return out;
  }

  // An event's or conflict's fields as the server sends them: a long payload as its preview.
  function bounded(fields) {
    const text = fields.payload;
    if (typeof text !== "string" || text.length <= PAYLOAD_PREVIEW_CHARS) return fields;
    const out = Object.assign({}, fields);
    delete out.payload;
    out.payload_preview = text.slice(0, PAYLOAD_PREVIEW_CHARS);
    out.payload_size = text.length;
    out.payload_fields = smallFields(text);
    out.payload_url = URL.createObjectURL(new Blob([text], { type: "application/json" }));
    return out;
  }

  function embeddedSource(data) {
    const ev = data.events;
    return {
      live: false,
      config: async () => data.config || {},
      run: async () => ({ run: data.run, graph: data.graph, version: data.version }),
      version: async () => ({ version: data.version }),
      labels: null, // every label is in data.labels
      event: async (agent, seq, i) => {
        const g = data.graph;
        const event = {
          event_id: ev.id[i], agent_id: agent, seq: seq, event_type: g.types[g.type[i]],
          wall_time: ev.wall[i], idempotency_key: ev.key[i], trace_id: ev.trace[i],
          span_id: ev.span[i], payload: ev.payload[i],
        };
        const conflicts = (data.conflict_rows || []).filter((c) =>
          c.existing_event_id === event.event_id || (c.agent_id === agent && String(c.seq) === String(seq)));
        return { event: bounded(event), conflicts: conflicts.map(bounded) };
      },
      conflict: async (id) => {
        const found = (data.conflict_rows || []).find((c) => c.id === id);
        return { conflict: found && bounded(found) };
      },
    };
  }

  // ------------------------------------------------------------------ state

  const S = {
    source: null, runId: null, config: {}, doc: null, g: null, n: 0, lanes: [],
    laneStart: null, childStart: null, children: null, colOfSeq: null,
    labels: [], blocks: new Map(), badges: new Map(), ghosts: [],
    zoom: 2, colW: ZOOMS[2], selected: -1, mark: null, programOrder: true,
    version: null, detailToken: 0, drawPending: false, pastCount: 0, futureCount: 0,
    lastHighlightMs: null, parentIdsCache: null,
  };

  const canvas = document.getElementById("canvas");
  const plane = document.getElementById("plane");
  const svg = document.getElementById("graph");
  const detail = document.getElementById("detail");

  function svgEl(tag, attrs, parent) {
    const node = document.createElementNS(SVGNS, tag);
    for (const k in attrs) node.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(node);
    return node;
  }

  function el(tag, attrs, text, parent) {
    const node = document.createElement(tag);
    for (const k in attrs || {}) node.setAttribute(k, attrs[k]);
    if (text !== undefined && text !== null) node.textContent = String(text);
    if (parent) parent.appendChild(node);
    return node;
  }

  function showStatus(message, isError) {
    const box = document.getElementById("status");
    box.textContent = message;
    box.className = "status show" + (isError ? " error" : "");
    if (!isError) setTimeout(() => { box.className = "status"; }, 2500);
  }

  const typeName = (i) => S.g.types[S.g.type[i]];
  const typeInfo = (name) => TYPES[name] || OTHER;
  const seqOf = (i) => S.g.seqs[S.g.col[i]];
  const agentOf = (i) => S.lanes[S.g.lane[i]].agent;

  // ------------------------------------------------------------------ graph preparation

  function prepare(doc) {
    const g = doc.graph;
    const n = g.lane.length;
    const lanes = g.lanes.length;
    const laneStart = new Int32Array(lanes + 1);
    for (let i = 0; i < n; i++) laneStart[g.lane[i] + 1]++;
    for (let l = 0; l < lanes; l++) laneStart[l + 1] += laneStart[l];
    const childCount = new Int32Array(n + 1);
    for (let k = 0; k < g.parents.length; k++) childCount[g.parents[k] + 1]++;
    for (let i = 0; i < n; i++) childCount[i + 1] += childCount[i];
    const childStart = childCount.slice();
    const fill = childCount.slice(0, n);
    const children = new Int32Array(g.parents.length);
    for (let i = 0; i < n; i++) {
      for (let k = g.pstart[i]; k < g.pstart[i + 1]; k++) children[fill[g.parents[k]]++] = i;
    }
    S.doc = doc; S.g = g; S.n = n; S.lanes = g.lanes;
    S.laneStart = laneStart; S.childStart = childStart; S.children = children;
    S.colOfSeq = new Map(g.seqs.map((s, c) => [String(s), c]));
    S.labels = embedded ? embedded.labels : new Array(n);
    S.blocks = new Map();
    S.badges = new Map();
    S.ghosts = [];
    for (const c of g.conflicts) {
      if (c.existing !== null && c.existing !== undefined) {
        const list = S.badges.get(c.existing) || [];
        list.push(c);
        S.badges.set(c.existing, list);
        const e = c.existing;
        if (g.lane[e] === c.lane && g.col[e] === c.col) continue;
      }
      S.ghosts.push(c);
    }
    S.missingOf = new Map();
    for (const [i, id] of g.missing) {
      const list = S.missingOf.get(i) || [];
      list.push(id);
      S.missingOf.set(i, list);
    }
    S.mark = new Uint8Array(n);
  }

  function indexOf(agent, seq) {
    const l = S.lanes.findIndex((lane) => lane.agent === agent);
    const c = S.colOfSeq.get(String(seq));
    if (l < 0 || c === undefined) return -1;
    const i = lowerBound(l, c);
    return i < S.laneStart[l + 1] && S.g.col[i] === c ? i : -1;
  }

  function lowerBound(l, col) {
    let lo = S.laneStart[l], hi = S.laneStart[l + 1];
    while (lo < hi) {
      const mid = (lo + hi) >> 1;
      if (S.g.col[mid] < col) lo = mid + 1; else hi = mid;
    }
    return lo;
  }

  // ------------------------------------------------------------------ causal closure

  // The causal past (direction -1) or future (+1) of event s. With program order, an event also
  // depends on every earlier event of its own agent (Lamport's happened-before); then each lane's
  // part of the past is a prefix of that lane and of the future a suffix, so the closure is a
  // frontier per lane and every event is looked at once.
  function closure(s, direction, programOrder, mark, value) {
    const g = S.g;
    let count = 0;
    const visit = (i) => { if (mark[i] === NONE) { mark[i] = value; count++; } };
    if (!programOrder) {
      const stack = [s];
      const seen = new Uint8Array(S.n);
      seen[s] = 1;
      while (stack.length) {
        const i = stack.pop();
        const [from, to, list] = direction < 0
          ? [g.pstart[i], g.pstart[i + 1], g.parents]
          : [S.childStart[i], S.childStart[i + 1], S.children];
        for (let k = from; k < to; k++) {
          const j = list[k];
          if (!seen[j]) { seen[j] = 1; visit(j); stack.push(j); }
        }
      }
      return count;
    }
    const lanes = S.lanes.length;
    // frontier[l]: past: highest index included (prefix); future: lowest index included (suffix).
    // done[l]: how far this lane has been scanned for links.
    const frontier = new Int32Array(lanes);
    const done = new Int32Array(lanes);
    for (let l = 0; l < lanes; l++) {
      frontier[l] = direction < 0 ? S.laneStart[l] - 1 : S.laneStart[l + 1];
      done[l] = frontier[l];
    }
    const work = [];
    const raise = (j) => {
      const l = g.lane[j];
      if (direction < 0 ? j > frontier[l] : j < frontier[l]) { frontier[l] = j; work.push(l); }
    };
    const sl = g.lane[s];
    const links = (i) => {
      if (direction < 0) {
        for (let k = g.pstart[i]; k < g.pstart[i + 1]; k++) raise(g.parents[k]);
      } else {
        for (let k = S.childStart[i]; k < S.childStart[i + 1]; k++) raise(S.children[k]);
      }
    };
    links(s);
    if (direction < 0) { if (s - 1 >= S.laneStart[sl]) raise(s - 1); }
    else if (s + 1 < S.laneStart[sl + 1]) raise(s + 1);
    while (work.length) {
      const l = work.pop();
      if (direction < 0) {
        for (let i = frontier[l]; i > done[l]; i--) { if (i !== s) { visit(i); links(i); } }
      } else {
        for (let i = frontier[l]; i < done[l]; i++) { if (i !== s) { visit(i); links(i); } }
      }
      done[l] = direction < 0 ? Math.max(done[l], frontier[l]) : Math.min(done[l], frontier[l]);
    }
    return count;
  }

  function computeMarks() {
    const mark = new Uint8Array(S.n);
    S.pastCount = S.futureCount = 0;
    if (S.selected >= 0) {
      const t0 = performance.now();
      mark[S.selected] = SELECTED;
      S.pastCount = closure(S.selected, -1, S.programOrder, mark, PAST);
      S.futureCount = closure(S.selected, +1, S.programOrder, mark, FUTURE);
      S.closureMs = performance.now() - t0;
    }
    S.mark = mark;
  }

  // ------------------------------------------------------------------ drawing

  function shapePath(shape) {
    switch (shape) {
      case "hexagon": return "M-11,0 L-5.5,-9.5 L5.5,-9.5 L11,0 L5.5,9.5 L-5.5,9.5 Z";
      case "diamond": return "M0,-11 L11,0 L0,11 L-11,0 Z";
      case "square": return "M-8.5,-8.5 H8.5 V8.5 H-8.5 Z";
      case "triangle-up": return "M0,-11 L10.5,8 L-10.5,8 Z";
      case "triangle-down": return "M0,11 L10.5,-8 L-10.5,-8 Z";
      case "play": return "M-7,-10 L10,0 L-7,10 Z";
      case "bar": return "M-4,-10 H4 V10 H-4 Z";
      case "octagon": return "M-4.5,-10.5 H4.5 L10.5,-4.5 V4.5 L4.5,10.5 H-4.5 L-10.5,4.5 V-4.5 Z";
      default: return "M-9,0 A9,9 0 1,0 9,0 A9,9 0 1,0 -9,0 Z";
    }
  }

  function laneTitle(lane) {
    const parent = lane.parent;
    if (parent && lane.agent.startsWith(parent + "/")) return lane.agent.slice(parent.length + 1);
    return lane.agent;
  }

  function fit(text, width, charW) {
    const max = Math.max(0, Math.floor(width / charW));
    if (text.length <= max) return text;
    return max > 3 ? text.slice(0, max - 2) + ".." : "";
  }

  function planeSize() {
    const width = NAMES_W + PAD * 2 + S.g.seqs.length * S.colW;
    const height = RULER_H + S.lanes.length * LANE_H + 12;
    return [width, height];
  }

  function scheduleDraw() {
    if (S.drawPending) return;
    S.drawPending = true;
    requestAnimationFrame(() => { S.drawPending = false; draw(); });
  }

  function draw() {
    if (!S.g) return;
    const g = S.g;
    const [pw, ph] = planeSize();
    plane.style.width = pw + "px";
    plane.style.height = ph + "px";
    const vw = canvas.clientWidth, vh = canvas.clientHeight;
    svg.setAttribute("width", vw);
    svg.setAttribute("height", vh);
    const sx = canvas.scrollLeft, sy = canvas.scrollTop;
    const colW = S.colW;
    const x = (col) => NAMES_W + PAD + col * colW + colW / 2 - sx;
    const y = (lane) => RULER_H + lane * LANE_H + NODE_Y - sy;
    const c0 = Math.max(0, Math.floor((sx - PAD) / colW) - 1);
    const c1 = Math.min(g.seqs.length - 1, Math.ceil((sx + vw - NAMES_W) / colW) + 1);
    const l0 = Math.max(0, Math.floor(sy / LANE_H) - 1);
    const l1 = Math.min(S.lanes.length - 1, Math.ceil((sy + vh - RULER_H) / LANE_H) + 1);
    const selecting = S.selected >= 0;
    const showText = colW >= 72;

    svg.replaceChildren();
    const defs = svgEl("defs", {}, svg);
    for (const [id, color] of [["arrow", "#8b95a7"], ["arrow-past", "#c2410c"], ["arrow-future", "#0f766e"]]) {
      const m = svgEl("marker", { id, viewBox: "0 0 8 8", refX: "7", refY: "4", markerWidth: "7", markerHeight: "7", orient: "auto-start-reverse" }, defs);
      svgEl("path", { d: "M0,0 L8,4 L0,8 Z", fill: color }, m);
    }
    const bg = svgEl("g", {}, svg);
    const edges = svgEl("g", { class: "edges" }, svg);
    const nodes = svgEl("g", { class: "nodes" }, svg);
    const ghosts = svgEl("g", { class: "ghosts" }, svg);
    const overlay = svgEl("g", {}, svg);

    // lanes
    for (let l = l0; l <= l1; l++) {
      const top = RULER_H + l * LANE_H - sy;
      svgEl("rect", { class: "lane-bg " + (l % 2 ? "odd" : "even"), x: 0, y: top, width: vw, height: LANE_H }, bg);
      const a = S.laneStart[l], b = S.laneStart[l + 1];
      if (b > a) {
        const xa = Math.max(NAMES_W - 4, x(g.col[a])), xb = Math.min(vw + 4, x(g.col[b - 1]));
        if (xb > xa) svgEl("line", { class: "lane-line", x1: xa, x2: xb, y1: y(l), y2: y(l) }, bg);
      }
    }

    // nodes in the window
    const visible = [];
    for (let l = l0; l <= l1; l++) {
      const end = S.laneStart[l + 1];
      for (let i = lowerBound(l, c0); i < end && g.col[i] <= c1; i++) visible.push(i);
    }
    const isVisible = new Set(visible);

    // edges touching the window: into visible events, and out of visible events to hidden ones
    const edgeClass = (p, i) => {
      const mp = S.mark[p], mi = S.mark[i];
      if (!selecting) return "";
      if (mp === PAST && (mi === PAST || mi === SELECTED)) return "past";
      if ((mp === FUTURE || mp === SELECTED) && mi === FUTURE) return "future";
      return "dim";
    };
    const drawEdge = (p, i) => {
      const x1 = x(g.col[p]), y1 = y(g.lane[p]), x2 = x(g.col[i]), y2 = y(g.lane[i]);
      const cls = edgeClass(p, i);
      let d;
      if (g.lane[p] === g.lane[i]) {
        const lift = Math.min(16, 9 + Math.abs(x2 - x1) * 0.05);
        d = `M${x1},${y1 - 11} C${x1},${y1 - 11 - lift} ${x2},${y2 - 11 - lift} ${x2},${y2 - 11}`;
      } else if (x2 > x1) {
        const xm = (x1 + x2) / 2;
        d = `M${x1 + 11},${y1} C${xm},${y1} ${xm},${y2} ${x2 - 12},${y2}`;
      } else {
        d = `M${x1},${y1} L${x2},${y2}`;
      }
      const marker = cls === "past" ? "arrow-past" : cls === "future" ? "arrow-future" : "arrow";
      svgEl("path", {
        class: "edge " + (g.lane[p] === g.lane[i] ? "same " : "cross ") + cls,
        d, "marker-end": `url(#${marker})`, "data-from": p, "data-to": i,
      }, edges);
    };
    for (const i of visible) {
      for (let k = g.pstart[i]; k < g.pstart[i + 1]; k++) drawEdge(g.parents[k], i);
      for (let k = S.childStart[i]; k < S.childStart[i + 1]; k++) {
        const c = S.children[k];
        if (!isVisible.has(c)) drawEdge(i, c);
      }
    }

    const needLabels = new Set();
    for (const i of visible) {
      const name = typeName(i);
      const info = typeInfo(name);
      const m = S.mark[i];
      let cls = "ev t-" + (TYPES[name] ? name : "other");
      if (m === PAST) cls += " past";
      else if (m === FUTURE) cls += " future";
      else if (m === SELECTED) cls += " selected";
      else if (selecting) cls += " dim";
      const seq = seqOf(i);
      const node = svgEl("g", {
        class: cls, transform: `translate(${x(g.col[i])},${y(g.lane[i])})`,
        "data-i": i, "data-agent": S.lanes[g.lane[i]].agent, "data-seq": seq, "data-type": name,
      }, nodes);
      const hitW = Math.max(26, colW - 8);
      svgEl("rect", { class: "hit", x: -hitW / 2, y: -18, width: hitW, height: showText ? 62 : 36 }, node);
      svgEl("circle", { class: "halo", r: 15.5 }, node);
      svgEl("path", { class: "shape", d: shapePath(info.shape) }, node);
      if (info.glyph) svgEl("text", { class: "glyph", y: info.shape === "triangle-down" ? -2 : info.shape === "triangle-up" ? 2 : 0 }, node).textContent = info.glyph;
      const label = S.labels[i];
      if (label === undefined) needLabels.add(Math.floor(g.col[i] / LABEL_BLOCK));
      if (showText) {
        svgEl("text", { class: "kind", y: 27 }, node).textContent = info.kind;
        if (label) svgEl("text", { class: "text", y: 40 }, node).textContent = fit(label, colW - 6, 6.4);
      }
      const title = svgEl("title", {}, node);
      title.textContent = `${info.name} #${seq} (${S.lanes[g.lane[i]].agent})${label ? "\n" + label : ""}`;
      const badge = S.badges.get(i);
      if (badge) {
        svgEl("circle", { class: "badge", cx: 12, cy: -12, r: 7 }, node);
        svgEl("text", { class: "badge-text", x: 12, y: -12 }, node).textContent = "!";
      }
    }

    // conflicting rows kept beside the log, drawn where they would have been
    for (const c of S.ghosts) {
      if (c.lane < l0 || c.lane > l1 || c.col < c0 || c.col > c1) continue;
      const gx = x(c.col), gy = y(c.lane);
      const ghost = svgEl("g", { class: "ghost-node", "data-conflict": c.id }, ghosts);
      svgEl("rect", { class: "ghost", x: gx - 13, y: gy - 13, width: 26, height: 26, rx: 4 }, ghost);
      svgEl("text", { class: "ghost-text", x: gx, y: gy + 27 }, ghost).textContent = "conflict";
      if (c.existing !== null && c.existing !== undefined) {
        svgEl("path", { class: "ghost-link", d: `M${gx},${gy - 13} L${x(g.col[c.existing])},${y(g.lane[c.existing]) + 13}` }, ghost);
      }
      const t = svgEl("title", {}, ghost);
      t.textContent = `conflict ${c.reason}: ${c.type} ${c.event_id}`;
    }

    // ruler (sequence numbers) and lane names stay in place while the plane scrolls
    svgEl("rect", { class: "ruler-bg", x: 0, y: 0, width: vw, height: RULER_H }, overlay);
    const every = Math.max(1, Math.ceil(48 / colW));
    for (let c = c0; c <= c1; c++) {
      if (c % every) continue;
      svgEl("text", { class: "ruler-text", x: x(c), y: 17 }, overlay).textContent = String(g.seqs[c]);
    }
    svgEl("rect", { class: "names-bg", x: -1, y: -1, width: NAMES_W, height: vh + 2 }, overlay);
    svgEl("text", { class: "ruler-title", x: 12, y: 17 }, overlay).textContent = "agent  /  logical sequence \u2192";
    for (let l = l0; l <= l1; l++) {
      const lane = S.lanes[l];
      const top = RULER_H + l * LANE_H - sy;
      if (top + LANE_H < RULER_H) continue;
      const indent = 12 + lane.depth * 16;
      if (lane.depth > 0) {
        svgEl("path", { class: "tree-guide", d: `M${indent - 10},${top + 2} V${top + 24} H${indent - 3}` }, overlay);
      }
      const name = svgEl("text", { class: "lane-name" + (lane.depth ? " child" : ""), x: indent, y: top + 28, "data-lane": l }, overlay);
      name.textContent = fit(laneTitle(lane), NAMES_W - indent - 8, 7.2);
      const full = svgEl("title", {}, name);
      full.textContent = lane.agent;
      name.addEventListener("click", () => scrollToEvent(S.laneStart[l]));
      const count = S.laneStart[l + 1] - S.laneStart[l];
      let sub = `${count} event${count === 1 ? "" : "s"}`;
      if (lane.spawn !== null && lane.spawn !== undefined) sub += ` \u00b7 spawned at #${seqOf(lane.spawn)}`;
      else if (lane.parent) sub += " \u00b7 spawn not stored";
      svgEl("text", { class: "lane-sub", x: indent, y: top + 44 }, overlay).textContent = sub;
    }
    svgEl("rect", { class: "ruler-bg", x: 0, y: 0, width: NAMES_W - 1, height: RULER_H }, overlay);
    svgEl("text", { class: "ruler-title", x: 12, y: 17 }, overlay).textContent = "agent";

    if (S.source.labels && needLabels.size) for (const b of needLabels) loadLabels(b);
    document.body.dataset.rendered = String((Number(document.body.dataset.rendered) || 0) + 1);
  }

  async function loadLabels(block) {
    if (S.blocks.has(block)) return;
    const g = S.g;
    const first = block * LABEL_BLOCK;
    const last = Math.min(g.seqs.length, first + LABEL_BLOCK) - 1;
    const doc = S.doc;
    S.blocks.set(block, "loading");
    try {
      const body = await S.source.labels(g.seqs[first], g.seqs[last]);
      if (S.doc !== doc) return;
      for (const [agent, seq, text] of body.labels) {
        const i = indexOf(agent, seq);
        if (i >= 0) S.labels[i] = text;
      }
      for (let l = 0; l < S.lanes.length; l++) {
        const end = S.laneStart[l + 1];
        for (let i = lowerBound(l, first); i < end && g.col[i] <= last; i++) {
          if (S.labels[i] === undefined) S.labels[i] = "";
        }
      }
      S.blocks.set(block, "done");
      for (const b of detail.querySelectorAll("button.ref")) b.textContent = refText(Number(b.dataset.i));
      scheduleDraw();
    } catch (err) {
      S.blocks.delete(block);
      showStatus("cannot load labels: " + err.message, true);
    }
  }

  // ------------------------------------------------------------------ selection and details

  function scrollToEvent(i, center) {
    if (i < 0 || i >= S.n) return;
    const cx = NAMES_W + PAD + S.g.col[i] * S.colW + S.colW / 2;
    const cy = RULER_H + S.g.lane[i] * LANE_H + NODE_Y;
    const vw = canvas.clientWidth, vh = canvas.clientHeight;
    const inX = cx - canvas.scrollLeft > NAMES_W + 20 && cx - canvas.scrollLeft < vw - 20;
    const inY = cy - canvas.scrollTop > RULER_H + 10 && cy - canvas.scrollTop < vh - 30;
    if (center || !inX) canvas.scrollLeft = Math.max(0, cx - NAMES_W - (vw - NAMES_W) / 2);
    if (center || !inY) canvas.scrollTop = Math.max(0, cy - vh / 2);
    scheduleDraw();
  }

  function select(i, opts) {
    S.selected = i;
    const t0 = performance.now();
    computeMarks();
    draw();
    S.lastHighlightMs = performance.now() - t0;
    document.body.dataset.highlightMs = S.lastHighlightMs.toFixed(2);
    if (i < 0) {
      // A payload still loading for the event deselected must not land in the cleared panel.
      S.detailToken++;
      history.replaceState(null, "", location.pathname + location.search);
      detail.replaceChildren();
      el("p", { class: "hint" }, "Click an event to see its payload and its causal past and future.", detail);
      return;
    }
    if (!opts || opts.scroll !== false) scrollToEvent(i);
    const hash = "#e=" + encodeURIComponent(agentOf(i)) + "@" + encodeURIComponent(String(seqOf(i)));
    history.replaceState(null, "", location.pathname + location.search + hash);
    showDetail(i);
  }

  function refText(i) {
    const label = S.labels[i] ? " " + S.labels[i] : "";
    return `${typeInfo(typeName(i)).name} #${seqOf(i)}${label} \u00b7 ${agentOf(i)}`;
  }

  function refButton(i, parent) {
    const li = el("li", {}, null, parent);
    const b = el("button", { type: "button", class: "ref", "data-i": i }, refText(i), li);
    b.addEventListener("click", () => select(i));
    return li;
  }

  function row(table, key, value, mono) {
    if (value === undefined || value === null || value === "") return null;
    const tr = el("tr", {}, null, table);
    el("th", {}, key, tr);
    const td = el("td", mono ? { class: "mono" } : {}, null, tr);
    if (value instanceof Node) td.appendChild(value); else td.textContent = show(value);
    return tr;
  }

  // A payload value as text. Not String(): a payload object whose "toString" or "valueOf" is not
  // a function ({"toString": 1}) makes String() throw, and the panel would stop half drawn.
  function show(value) {
    return typeof value === "string" ? value : JSON.stringify(value);
  }

  // Re-indents JSON text without parsing it, so numbers keep every digit PostgreSQL stored.
  function prettyJson(text) {
    if (typeof text !== "string") return JSON.stringify(text, null, 2);
    let out = "", depth = 0, inString = false;
    const nl = () => "\n" + "  ".repeat(depth);
    for (let k = 0; k < text.length; k++) {
      const ch = text[k];
      if (inString) {
        out += ch;
        if (ch === "\\") { out += text[++k]; } else if (ch === '"') inString = false;
        continue;
      }
      if (ch === '"') { inString = true; out += ch; }
      else if (ch === "{" || ch === "[") {
        let j = k + 1;
        while (j < text.length && /\s/.test(text[j])) j++;
        if (text[j] === (ch === "{" ? "}" : "]")) { out += ch + text[j]; k = j; }
        else { depth++; out += ch + nl(); }
      } else if (ch === "}" || ch === "]") { depth--; out += nl() + ch; }
      else if (ch === ",") out += "," + nl();
      else if (ch === ":") out += ": ";
      else if (!/\s/.test(ch)) out += ch;
    }
    return out;
  }

  // A payload in a <pre>: whole, or (over PAYLOAD_PREVIEW_CHARS) its first characters, its size
  // and a link to the whole of it.
  function payloadBlock(fields, parent, attrs) {
    if (fields.payload !== undefined) {
      return el("pre", attrs || {}, fields.payload === null ? "null" : prettyJson(fields.payload), parent);
    }
    const note = el("p", { class: "hint payload-cut" },
      `${Number(fields.payload_size).toLocaleString("en")} characters: the first ` +
      `${fields.payload_preview.length.toLocaleString("en")} are shown. `, parent);
    el("a", { href: fields.payload_url, target: "_blank", rel: "noopener noreferrer", class: "payload-whole" },
      "Open the whole payload", note);
    return el("pre", attrs || {}, fields.payload_preview, parent);
  }

  function pre(value, parent) {
    const text = typeof value === "string" ? value : JSON.stringify(value, null, 2);
    return el("pre", {}, text, parent);
  }

  function section(root, title) {
    el("h3", {}, title, root);
    return el("table", {}, null, root);
  }

  function shapeIcon(name) {
    const info = typeInfo(name);
    const icon = document.createElementNS(SVGNS, "svg");
    icon.setAttribute("width", "26"); icon.setAttribute("height", "26"); icon.setAttribute("viewBox", "-13 -13 26 26");
    const g = svgEl("g", { class: "ev t-" + (TYPES[name] ? name : "other") }, icon);
    svgEl("path", { class: "shape", d: shapePath(info.shape) }, g);
    if (info.glyph) svgEl("text", { class: "glyph" }, g).textContent = info.glyph;
    return icon;
  }

  function millis(a, b) {
    const d = new Date(b).getTime() - new Date(a).getTime();
    return isFinite(d) ? d : null;
  }

  function jaegerLink(traceId, spanId) {
    const base = S.config.jaeger_url;
    // Only a web address makes a link (a javascript: base would make one that runs script).
    if (!base || !traceId || !/^https?:\/\//i.test(base)) return null;
    let href = base.replace(/\/+$/, "") + "/trace/" + encodeURIComponent(traceId);
    if (spanId) href += "?uiFind=" + encodeURIComponent(spanId);
    const a = el("a", { href, target: "_blank", rel: "noopener noreferrer", class: "jaeger" }, "open the span in Jaeger");
    return a;
  }

  function typeSection(name, payload, root) {
    if (!payload || typeof payload !== "object") return;
    if (name === "model_call") {
      const t = section(root, "Model call");
      row(t, "model", payload.model);
      if (payload.request_model && payload.request_model !== payload.model) row(t, "requested", payload.request_model);
      row(t, "status", payload.status);
      row(t, "stop reason", payload.stop_reason);
      row(t, "error", payload.error_type);
      const u = payload.usage || {};
      const usage = [];
      if (u.input_tokens !== undefined) usage.push(`${show(u.input_tokens)} in`);
      if (u.output_tokens !== undefined) usage.push(`${show(u.output_tokens)} out`);
      if (u.cache_read_input_tokens) usage.push(`${show(u.cache_read_input_tokens)} cache read`);
      if (u.cache_creation_input_tokens) usage.push(`${show(u.cache_creation_input_tokens)} cache write`);
      row(t, "usage", usage.join(", "));
      if (payload.time_to_first_chunk_ms !== undefined) row(t, "first chunk", `${show(payload.time_to_first_chunk_ms)} ms`);
      row(t, "streamed", payload.stream === undefined ? null : show(payload.stream));
      const ids = Array.isArray(payload.tool_use_ids) ? payload.tool_use_ids : [];
      row(t, "tool_use ids", ids.length ? ids.map(show).join("\n") : "none", true);
      row(t, "response id", payload.response_id, true);
      row(t, "request id", payload.request_id, true);
      row(t, "recorded by", payload.instrumentation);
      if (payload.content) {
        el("h3", {}, "Content", root);
        for (const key of ["system_instructions", "input_messages", "output_messages", "partial_output_messages", "tool_definitions"]) {
          if (payload.content[key] === undefined) continue;
          el("div", { class: "mono" }, key, root);
          pre(payload.content[key], root);
        }
      } else {
        el("p", { class: "hint" }, "Message content was not recorded (content capture is off).", root);
      }
    } else if (name === "tool_invocation" || name === "tool_result") {
      const t = section(root, name === "tool_result" ? "Tool result" : "Tool call");
      row(t, "tool", payload.tool);
      row(t, "invocation id", payload.invocation_id, true);
      if (name === "tool_invocation" && payload.arguments !== undefined) { el("div", { class: "sub" }, "arguments", root); pre(payload.arguments, root); }
      if (name === "tool_result" && payload.result !== undefined) { el("div", { class: "sub" }, "result", root); pre(payload.result, root); }
    } else if (name === "memory_read" || name === "memory_write") {
      const t = section(root, name === "memory_read" ? "Memory read" : "Memory write");
      row(t, "memory", payload.memory);
      row(t, "key", typeof payload.key === "string" ? payload.key : JSON.stringify(payload.key), true);
      if (name === "memory_read") {
        row(t, "found", payload.found === undefined ? null : show(payload.found));
        if (payload.found !== false && payload.value !== undefined) { el("div", { class: "sub" }, "value", root); pre(payload.value, root); }
      } else {
        row(t, "operation", payload.op);
        el("div", { class: "sub" }, "before", root);
        if (payload.before_found === false) el("p", { class: "hint" }, "(no value: the key was not set)", root);
        else pre(payload.before === undefined ? null : payload.before, root);
        el("div", { class: "sub" }, "after", root);
        if (payload.after_found === false) el("p", { class: "hint" }, "(no value: the key was deleted)", root);
        else pre(payload.after === undefined ? null : payload.after, root);
      }
    } else if (name === "agent_error") {
      const t = section(root, "Error");
      row(t, "type", payload.error_type, true);
      row(t, "message", payload.message);
      if (payload.timed_out) row(t, "timed out", "yes");
      row(t, "tool", payload.tool);
      row(t, "invocation id", payload.invocation_id, true);
      if (Array.isArray(payload.discarded_state_keys)) row(t, "discarded state", payload.discarded_state_keys.map(show).join(", "));
    } else if (name === "agent_spawn") {
      const t = section(root, "Spawn");
      const child = payload.child_agent_id;
      const l = S.lanes.findIndex((lane) => lane.agent === child);
      if (l >= 0 && S.laneStart[l + 1] > S.laneStart[l]) {
        const b = el("button", { type: "button", class: "linkish" }, child);
        b.addEventListener("click", () => select(S.laneStart[l]));
        row(t, "child agent", b);
      } else {
        row(t, "child agent", child);
      }
      row(t, "key", payload.key);
      row(t, "child name", payload.child_name);
    }
  }

  async function showDetail(i) {
    const token = ++S.detailToken;
    const g = S.g;
    const name = typeName(i);
    const info = typeInfo(name);
    detail.replaceChildren();
    const h = el("h2", {}, null, detail);
    h.appendChild(shapeIcon(name));
    el("span", {}, info.name, h);
    el("span", { class: "chip" }, "#" + seqOf(i), h);
    if (S.badges.has(i)) el("span", { class: "chip bad" }, "conflict", h);
    el("p", { class: "where" }, agentOf(i), detail);
    const closureBox = el("div", { class: "closure", id: "closure-summary" }, null, detail);
    el("b", { class: "p" }, `${S.pastCount}`, closureBox);
    closureBox.appendChild(document.createTextNode(" events in its causal past, "));
    el("b", { class: "f" }, `${S.futureCount}`, closureBox);
    closureBox.appendChild(document.createTextNode(
      ` in its future (${S.programOrder ? "causal links and each agent's program order" : "causal links only"}).`));

    const loading = el("p", { class: "hint" }, "loading the payload...", detail);
    const refs = el("div", {}, null, detail);
    el("h3", {}, `Causal parents (${g.pstart[i + 1] - g.pstart[i] + (S.missingOf.get(i) || []).length})`, refs);
    const pl = el("ul", { class: "refs", id: "parents" }, null, refs);
    for (let k = g.pstart[i]; k < g.pstart[i + 1]; k++) refButton(g.parents[k], pl);
    for (const id of S.missingOf.get(i) || []) el("li", { class: "missing mono" }, "not stored: " + id, pl);
    el("h3", {}, `Causal children (${S.childStart[i + 1] - S.childStart[i]})`, refs);
    const cl = el("ul", { class: "refs", id: "children" }, null, refs);
    for (let k = S.childStart[i]; k < S.childStart[i + 1]; k++) refButton(S.children[k], cl);

    let body;
    try {
      body = await S.source.event(agentOf(i), seqOf(i), i);
    } catch (err) {
      if (token === S.detailToken) loading.textContent = "cannot load the event: " + err.message;
      return;
    }
    if (token !== S.detailToken) return;
    loading.remove();
    const ev = body.event;
    let payload = null;
    if (ev.payload === undefined) payload = ev.payload_fields || null; // a long payload: its small fields
    else try { payload = ev.payload === null ? null : JSON.parse(ev.payload); } catch (err) { payload = null; }
    const top = el("div", {}, null);
    detail.insertBefore(top, refs);
    const table = el("table", { id: "event-fields" }, null, top);
    row(table, "wall time", ev.wall_time, true);
    const latency = el("span", { id: "latency" });
    row(table, "latency", latency);
    if (payload && typeof payload.latency_ms === "number") latency.textContent = `${payload.latency_ms} ms`;
    row(table, "event id", ev.event_id, true);
    row(table, "idempotency key", ev.idempotency_key, true);
    row(table, "trace id", ev.trace_id, true);
    row(table, "span id", ev.span_id, true);
    const link = jaegerLink(ev.trace_id, ev.span_id);
    if (link) row(table, "Jaeger", link);
    typeSection(ev.event_type, payload, el("div", {}, null, top));
    if (!latency.textContent && ["tool_result", "agent_error"].includes(ev.event_type) && payload && payload.invocation_id) {
      for (let k = g.pstart[i]; k < g.pstart[i + 1]; k++) {
        const p = g.parents[k];
        if (typeName(p) !== "tool_invocation") continue;
        S.source.event(agentOf(p), seqOf(p), p).then((pb) => {
          const ms = millis(pb.event.wall_time, ev.wall_time);
          if (token === S.detailToken && ms !== null) latency.textContent = `${ms.toFixed(1)} ms after its tool call`;
        }).catch(() => {});
        break;
      }
    }
    if (!latency.textContent && !["tool_result", "agent_error"].includes(ev.event_type)) latency.closest("tr").remove();

    if (body.conflicts && body.conflicts.length) {
      el("h3", {}, `Conflicts (${body.conflicts.length})`, detail);
      for (const c of body.conflicts) conflictBox(c, detail, i);
    }
    el("h3", {}, "Payload", detail);
    payloadBlock(ev, detail, { id: "payload" });
  }

  function conflictBox(c, parent, storedIndex) {
    const box = el("div", { class: "conflict" }, null, parent);
    const t = el("table", {}, null, box);
    row(t, "reason", c.reason, true);
    row(t, "detected", c.detected_at, true);
    row(t, "incoming", `${c.event_type} #${c.seq} of ${c.agent_id}`);
    row(t, "its event id", c.event_id, true);
    row(t, "its key", c.idempotency_key, true);
    row(t, "its wall time", c.wall_time, true);
    if (c.existing_event_id) {
      const stored = storedIndex !== undefined && storedIndex >= 0 ? storedIndex : -1;
      if (stored >= 0) {
        const b = el("button", { type: "button" }, c.existing_event_id);
        b.addEventListener("click", () => select(stored));
        row(t, "stored event", b, true);
      } else {
        row(t, "stored event", c.existing_event_id, true);
      }
    }
    const d = el("details", {}, null, box);
    el("summary", {}, "incoming payload", d);
    payloadBlock(c, d);
  }

  async function showConflict(id) {
    const token = ++S.detailToken;
    const c = S.g.conflicts.find((x) => x.id === id);
    detail.replaceChildren();
    const h = el("h2", {}, null, detail);
    el("span", {}, "conflict", h);
    el("span", { class: "chip bad" }, c ? c.reason : "", h);
    el("p", { class: "hint" }, "A different event that collided with a stored one; kept in agentcap.conflicts, never in the log.", detail);
    try {
      const body = await S.source.conflict(id);
      if (token !== S.detailToken) return;
      conflictBox(body.conflict, detail, c ? (c.existing === null ? -1 : c.existing) : -1);
    } catch (err) {
      el("p", { class: "missing" }, "cannot load the conflict: " + err.message, detail);
    }
  }

  // ------------------------------------------------------------------ header, legend, live

  function renderHeader() {
    const run = S.doc.run;
    document.getElementById("run-title").textContent = run.run_id;
    document.title = run.run_id + " - otel-agentcap";
    const dl = document.getElementById("run-totals");
    dl.replaceChildren();
    const dur = run.duration_s === null ? "" : run.duration_s < 1 ? `${(run.duration_s * 1000).toFixed(0)} ms` : `${run.duration_s.toFixed(2)} s`;
    const items = [
      ["agents", run.agents], ["events", run.events], ["model calls", run.model_calls],
      ["tokens", run.tokens], ["errors", run.errors], ["conflicts", run.conflicts], ["wall time", dur],
    ];
    for (const [k, v] of items) {
      const div = el("div", { "data-key": k, class: (k === "errors" || k === "conflicts") && v > 0 ? "bad" : "" }, null, dl);
      el("dt", {}, k, div);
      el("dd", {}, typeof v === "number" ? v.toLocaleString("en-US") : v, div);
    }
  }

  function renderLegend() {
    const legend = document.getElementById("legend");
    legend.replaceChildren();
    for (const name of Object.keys(TYPES)) {
      const span = el("span", { "data-type": name }, null, legend);
      span.appendChild(shapeIcon(name));
      span.appendChild(document.createTextNode(TYPES[name].name));
    }
    el("span", { class: "key-past" }, "\u25cf causal past", legend);
    el("span", { class: "key-future" }, "\u25cf causal future", legend);
  }

  // Asks every poll_ms whether the run grew; after a minute without change, five times less often.
  let unchanged = 0;
  async function poll() {
    if (!S.source.live) return;
    const every = S.config.poll_ms || 2000;
    try {
      if (!document.hidden) {
        const body = await S.source.version();
        if (JSON.stringify(body.version) !== JSON.stringify(S.version)) {
          unchanged = 0;
          await reload(true);
        } else {
          unchanged++;
        }
      }
    } catch (err) {
      document.getElementById("live").textContent = "offline: " + err.message;
    }
    setTimeout(poll, unchanged * every > 60000 ? every * 5 : every);
  }

  async function reload(keepSelection) {
    const keep = keepSelection && S.selected >= 0 ? [agentOf(S.selected), seqOf(S.selected)] : null;
    const doc = await S.source.run();
    prepare(doc);
    S.version = doc.version;
    renderHeader();
    const live = document.getElementById("live");
    if (S.source.live) {
      live.className = "live on";
      live.textContent = "updated " + new Date().toLocaleTimeString();
    } else {
      live.textContent = "exported file";
    }
    if (keep) {
      S.selected = indexOf(keep[0], keep[1]);
      computeMarks();
      if (S.selected >= 0) showDetail(S.selected);
    } else {
      S.selected = -1;
      computeMarks();
    }
    draw();
  }

  // ------------------------------------------------------------------ events

  svg.addEventListener("click", (event) => {
    const node = event.target.closest(".ev");
    const ghost = event.target.closest(".ghost-node");
    if (node && node.dataset.i !== undefined) select(Number(node.dataset.i), { scroll: false });
    else if (ghost) showConflict(Number(ghost.dataset.conflict));
    else if (!event.target.closest(".lane-name")) select(-1);
  });
  canvas.addEventListener("scroll", () => draw(), { passive: true });
  window.addEventListener("resize", scheduleDraw);
  document.addEventListener("keydown", (event) => {
    if (event.key === "Escape") select(-1);
  });
  document.getElementById("program-order").addEventListener("change", (event) => {
    S.programOrder = event.target.checked;
    if (S.selected >= 0) select(S.selected, { scroll: false });
  });
  function zoom(step) {
    const z = Math.max(0, Math.min(ZOOMS.length - 1, S.zoom + step));
    if (z === S.zoom) return;
    const centerCol = (canvas.scrollLeft + (canvas.clientWidth - NAMES_W) / 2) / S.colW;
    S.zoom = z;
    S.colW = ZOOMS[z];
    draw();
    canvas.scrollLeft = Math.max(0, centerCol * S.colW - (canvas.clientWidth - NAMES_W) / 2);
    draw();
  }
  document.getElementById("zoom-in").addEventListener("click", () => zoom(1));
  document.getElementById("zoom-out").addEventListener("click", () => zoom(-1));

  // ------------------------------------------------------------------ start

  // A malformed escape in the address (/runs/%E0) is kept as typed: the server then answers
  // that no such run is stored, instead of the page stopping on a URIError.
  function decoded(text) {
    try { return decodeURIComponent(text); } catch (err) { return text; }
  }

  async function start() {
    if (embedded) {
      S.source = embeddedSource(embedded);
      S.runId = embedded.run.run_id;
      const home = document.getElementById("home-link");
      home.removeAttribute("href");
    } else {
      const prefix = "/runs/";
      const path = decoded(location.pathname.slice(location.pathname.indexOf(prefix) + prefix.length));
      // /runs/?run=.. (see runs.js); as on the server, the path names the run when it names one
      S.runId = path || new URLSearchParams(location.search).get("run") || "";
      S.source = serverSource(S.runId);
    }
    renderLegend();
    try {
      S.config = await S.source.config();
      await reload(false);
    } catch (err) {
      document.getElementById("run-title").textContent = S.runId;
      showStatus(err.message, true);
      S.detailToken++;
      detail.replaceChildren();
      el("p", { class: "missing" }, err.message, detail);
      document.body.dataset.ready = "error";
      return;
    }
    if (S.n > 5000) S.zoom = 1, S.colW = ZOOMS[1], draw();
    performance.mark("agentcap:first-render");
    document.body.dataset.ready = "1";
    const m = /^#e=([^@]*)@(.*)$/.exec(location.hash);
    if (m) {
      const i = indexOf(decoded(m[1]), decoded(m[2]));
      if (i >= 0) select(i);
    }
    if (S.source.live) setTimeout(poll, S.config.poll_ms || 2000);
  }

  window.agentcapView = {
    select: (agent, seq) => { const i = indexOf(agent, seq); if (i >= 0) select(i); return i; },
    clear: () => select(-1),
    marks: () => {
      const out = { past: [], future: [], selected: null };
      for (let i = 0; i < S.n; i++) {
        const key = [agentOf(i), seqOf(i)];
        if (S.mark[i] === PAST) out.past.push(key);
        else if (S.mark[i] === FUTURE) out.future.push(key);
        else if (S.mark[i] === SELECTED) out.selected = key;
      }
      return out;
    },
    lastHighlightMs: () => S.lastHighlightMs,
    events: () => S.n,
  };

  start();
})();
