// The runs list of otel-agentcap ui: newest first, filtered by the server (run id or attributes),
// sorted in the page. Everything from the log is written with textContent, never as markup.
(function () {
  "use strict";

  const PAGE = 200;
  const state = { runs: [], offset: 0, more: false, query: "", sortKey: "started_at", sortDir: -1 };
  const tbody = document.querySelector("#runs tbody");
  const filter = document.getElementById("filter");

  function el(tag, attrs, text) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }

  function showStatus(message, isError) {
    const box = document.getElementById("status");
    box.textContent = message;
    box.className = "status show" + (isError ? " error" : "");
    if (!isError) setTimeout(() => { box.className = "status"; }, 2500);
  }

  function duration(seconds) {
    if (seconds === null || seconds === undefined) return "";
    if (seconds < 1) return (seconds * 1000).toFixed(0) + " ms";
    if (seconds < 120) return seconds.toFixed(2) + " s";
    if (seconds < 7200) return (seconds / 60).toFixed(1) + " min";
    return (seconds / 3600).toFixed(1) + " h";
  }

  function started(iso) {
    if (!iso) return "";
    const d = new Date(iso);
    if (isNaN(d.getTime())) return iso;
    const pad = (n) => String(n).padStart(2, "0");
    return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ` +
      `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
  }

  function compare(a, b) {
    const k = state.sortKey;
    let x = a[k], y = b[k];
    if (x === null || x === undefined) return 1;
    if (y === null || y === undefined) return -1;
    if (typeof x === "string") return state.sortDir * x.localeCompare(y);
    return state.sortDir * (x - y);
  }

  // A run id "." or ".." would be a dot segment of the address, which the browser removes
  // (/runs/.. is /): such an id goes in the query, which the run page reads too.
  function runHref(id) {
    if (id === "." || id === "..") return "/runs/?run=" + encodeURIComponent(id);
    return "/runs/" + encodeURIComponent(id);
  }

  function render() {
    const rows = state.runs.slice().sort(compare);
    tbody.replaceChildren();
    for (const run of rows) {
      const tr = el("tr", { "data-run": run.run_id });
      const link = el("a", { href: runHref(run.run_id) }, run.run_id);
      const first = el("td", { class: "run" });
      first.appendChild(link);
      tr.appendChild(first);
      tr.appendChild(el("td", { class: "started", title: run.started_at || "" }, started(run.started_at)));
      tr.appendChild(el("td", { "data-key": "duration" }, duration(run.duration_s)));
      for (const key of ["agents", "events", "model_calls", "tokens", "errors", "conflicts"]) {
        const value = run[key];
        const bad = (key === "errors" || key === "conflicts") && value > 0;
        const td = el("td", { "data-key": key, class: bad ? "bad" : "" }, value.toLocaleString("en-US"));
        if (key === "tokens") td.title = `${run.input_tokens} in / ${run.output_tokens} out`;
        tr.appendChild(td);
      }
      tbody.appendChild(tr);
    }
    document.getElementById("empty").hidden = state.runs.length > 0;
    document.getElementById("more").hidden = !state.more;
    document.getElementById("count").textContent =
      state.runs.length ? `${state.runs.length}${state.more ? "+" : ""} run${state.runs.length === 1 && !state.more ? "" : "s"}` : "";
    for (const th of document.querySelectorAll("#runs th")) {
      if (th.dataset.key === state.sortKey) {
        th.setAttribute("aria-sort", state.sortDir > 0 ? "ascending" : "descending");
      } else {
        th.removeAttribute("aria-sort");
      }
    }
  }

  async function load(append) {
    const offset = append ? state.runs.length : 0;
    const params = new URLSearchParams({ limit: String(PAGE), offset: String(offset) });
    if (state.query) params.set("q", state.query);
    try {
      const response = await fetch("/api/runs?" + params.toString());
      const body = await response.json();
      if (!response.ok) throw new Error(body.error || response.statusText);
      state.runs = append ? state.runs.concat(body.runs) : body.runs;
      state.more = body.more;
      render();
      document.body.dataset.ready = "1";
    } catch (err) {
      showStatus("cannot load runs: " + err.message, true);
    }
  }

  for (const th of document.querySelectorAll("#runs th")) {
    th.querySelector("button").addEventListener("click", () => {
      const key = th.dataset.key;
      if (state.sortKey === key) {
        state.sortDir = -state.sortDir;
      } else {
        state.sortKey = key;
        state.sortDir = key === "run_id" ? 1 : -1;
      }
      render();
    });
  }
  let timer = null;
  filter.addEventListener("input", () => {
    clearTimeout(timer);
    timer = setTimeout(() => { state.query = filter.value.trim(); load(false); }, 250);
  });
  document.getElementById("refresh").addEventListener("click", () => load(false));
  document.getElementById("more").addEventListener("click", () => load(true));
  load(false);
})();
