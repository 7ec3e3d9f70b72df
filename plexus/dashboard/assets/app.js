// The Plexus dashboard: polls /api/state and redraws. Every value from the swarm goes in through
// textContent (never as HTML): peer ids and addresses come from other peers.
"use strict";

const POLL_MS = 1500;
const SVG = "http://www.w3.org/2000/svg";
let lastUpdate = null;

function el(tag, text, className) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (className) node.className = className;
  return node;
}

function number(value, digits = 1) {
  if (value === null || value === undefined) return "-";
  return Number.isInteger(value) ? value.toLocaleString("en") : value.toFixed(digits);
}

function duration(seconds) {
  if (seconds === null || seconds === undefined) return "-";
  if (seconds < 10) return `${seconds.toFixed(1)} s`;
  if (seconds < 60) return `${seconds.toFixed(0)} s`;
  if (seconds < 3600) return `${Math.floor(seconds / 60)} min ${Math.round(seconds % 60)} s`;
  return `${Math.floor(seconds / 3600)} h ${Math.round((seconds % 3600) / 60)} min`;
}

function setText(id, text) {
  document.getElementById(id).textContent = text;
}

function drawChart(svg, points, emptyText, formatX) {
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  const width = 600, height = 200, left = 48, bottom = 22, top = 8, right = 8;
  const add = (tag, attrs, text) => {
    const node = document.createElementNS(SVG, tag);
    for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
    if (text !== undefined) node.textContent = text;
    svg.appendChild(node);
    return node;
  };
  add("line", { x1: left, y1: height - bottom, x2: width - right, y2: height - bottom, class: "axis" });
  add("line", { x1: left, y1: top, x2: left, y2: height - bottom, class: "axis" });
  points = points.filter((p) => p[1] !== null);
  if (points.length === 0) {
    add("text", { x: width / 2, y: height / 2, "text-anchor": "middle" }, emptyText);
    return;
  }
  const xs = points.map((p) => p[0]), ys = points.map((p) => p[1]);
  const xMin = Math.min(...xs), xMax = Math.max(...xs);
  const yMin = Math.min(0, ...ys), yMax = Math.max(...ys) || 1;
  const x = (v) => left + ((v - xMin) / (xMax - xMin || 1)) * (width - left - right);
  const y = (v) => height - bottom - ((v - yMin) / (yMax - yMin || 1)) * (height - top - bottom);
  const path = points.map((p, i) => `${i ? "L" : "M"}${x(p[0]).toFixed(1)},${y(p[1]).toFixed(1)}`).join(" ");
  add("path", { d: path, class: "series" });
  add("text", { x: left - 4, y: top + 10, "text-anchor": "end" }, number(yMax, 2));
  add("text", { x: left - 4, y: height - bottom, "text-anchor": "end" }, number(yMin, 2));
  add("text", { x: left, y: height - 6 }, formatX(xMin));
  add("text", { x: width - right, y: height - 6, "text-anchor": "end" }, formatX(xMax));
}

function renderPeers(peers) {
  const body = document.querySelector("#peers tbody");
  body.replaceChildren();
  if (peers.length === 0) {
    const row = el("tr");
    const cell = el("td", "no peers seen yet", "empty");
    cell.colSpan = 9;
    row.appendChild(cell);
    body.appendChild(row);
    return;
  }
  for (const peer of peers) {
    const row = el("tr", null, `peer status-${peer.status}`);
    row.dataset.peerId = peer.peer_id;
    row.dataset.status = peer.status;
    const id = el("td", peer.peer_id.slice(0, 8) + "..." + peer.peer_id.slice(-6), "peer");
    id.title = peer.peer_id;
    row.appendChild(id);
    row.appendChild(el("td", peer.status, "status"));
    row.appendChild(el("td", peer.nat));
    row.appendChild(el("td", peer.client_mode === null ? "-" : peer.client_mode ? "yes" : "no"));
    row.appendChild(el("td", number(peer.epoch), "num epoch"));
    row.appendChild(el("td", number(peer.samples_accumulated), "num"));
    row.appendChild(el("td", number(peer.samples_per_second), "num"));
    row.appendChild(el("td", peer.last_seen_ago === null ? "-" : `${duration(peer.last_seen_ago)} ago`));
    row.appendChild(el("td", peer.addresses.join("\n") || "-", "addresses"));
    body.appendChild(row);
  }
}

function renderNode(node) {
  const list = document.getElementById("node");
  list.replaceChildren();
  if (!node) return;
  const rows = [
    ["peer id", node.peer_id],
    ["addresses", node.addresses.join(" ") || "none (client mode)"],
    ["reachability", node.reachability],
    ["NAT mode", node.nat_mode],
    ["routing table", `${node.routing_table_size} peers`],
  ];
  for (const [key, value] of rows) {
    list.appendChild(el("dt", key));
    list.appendChild(el("dd", value));
  }
}

function renderWarnings(warnings) {
  const list = document.getElementById("warnings");
  list.replaceChildren();
  if (warnings.length === 0) list.appendChild(el("li", "none", "empty"));
  for (const warning of warnings.slice(-30).reverse()) {
    const item = el("li");
    item.appendChild(el("span", new Date(warning.time * 1000).toLocaleTimeString(), "time"));
    item.appendChild(document.createTextNode(" "));
    item.appendChild(el("span", warning.level, "level"));
    item.appendChild(el("span", `[${warning.logger}] ${warning.message}`));
    list.appendChild(item);
  }
}

function render(state) {
  const swarm = state.swarm;
  setText("run-id", state.run_id ? `run ${state.run_id}` : "(DHT only: no --run_id)");
  setText("epoch", number(swarm.epoch));
  const target = swarm.target_batch_size;
  setText("samples", target ? `${number(swarm.samples_accumulated)} / ${number(target)}${swarm.target_estimated ? "*" : ""}` : number(swarm.samples_accumulated));
  setText("eta", duration(swarm.eta_seconds));
  setText("speed", number(swarm.samples_per_second));
  setText("trainers", number(swarm.trainers));
  setText("clients", number(swarm.clients));
  setText("dht-peers", number(swarm.dht_peers));
  setText("ignored", number(swarm.ignored_records));
  drawChart(
    document.getElementById("speed-chart"),
    state.history.map((p) => [p.time - state.time, p.samples_per_second]),
    "waiting for the first reading",
    (t) => (t > -0.5 ? "now" : `${duration(-t)} ago`),
  );
  drawChart(
    document.getElementById("loss-chart"),
    state.loss.map((p) => [p.step, p.loss]),
    "no loss yet: the training monitor records it",
    (step) => `step ${step}`,
  );
  renderPeers(state.peers);
  renderNode(state.node);
  renderWarnings(state.warnings);
}

async function poll() {
  try {
    const response = await fetch("/api/state?history=600", { cache: "no-store" });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    render(await response.json());
    lastUpdate = Date.now();
    const badge = document.getElementById("connection");
    badge.className = "connection live";
    badge.textContent = "live";
  } catch (error) {
    const badge = document.getElementById("connection");
    badge.className = "connection lost";
    const since = lastUpdate ? ` (last update ${duration((Date.now() - lastUpdate) / 1000)} ago)` : "";
    badge.textContent = `cannot reach the dashboard server${since}`;
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

document.addEventListener("DOMContentLoaded", poll);
