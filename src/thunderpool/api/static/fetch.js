// thunderpool dashboard: one progress bar per node while it fetches its weights over the
// fabric. Reads /health's `fetch`: per node {node, bytes_done, bytes_total, rate_Bps, eta_s}.
(() => {
  const MIB = 1 << 20;

  function box() {
    let root = document.getElementById("fetches");
    if (!root) {
      root = document.createElement("div");
      root.id = "fetches";
      const anchor = document.getElementById("loading");
      (anchor ? anchor.parentNode : document.body).insertBefore(
        root, anchor ? anchor.nextSibling : null);
    }
    return root;
  }

  function render(clauses) {
    const root = box();
    root.replaceChildren();
    root.hidden = clauses.length === 0;
    for (const c of clauses) {
      const row = document.createElement("div");
      row.className = "fetch-row";
      row.style.cssText = "display:flex;gap:.75em;align-items:center;margin:.25em 1em";
      const name = document.createElement("span");
      name.textContent = `weights → ${c.name}`;
      const track = document.createElement("div");
      track.className = "progress";
      const bar = document.createElement("div");
      bar.style.cssText = `height:100%;width:${c.total ? (100 * c.done) / c.total : 100}%;` +
        "background:var(--accent, #4a8)";
      track.appendChild(bar);
      const text = document.createElement("span");
      text.textContent = `${c.done.toFixed(1)} / ${c.total.toFixed(1)} MiB · ` +
        `${c.rate.toFixed(1)} MiB/s · ETA ${c.eta}`;
      row.append(name, track, text);
      root.appendChild(row);
    }
  }

  async function poll() {
    try {
      const res = await fetch("/health", { cache: "no-store" });
      const body = await res.json();
      const nodes = (body && Array.isArray(body.fetch)) ? body.fetch : [];
      render(nodes.map((n) => ({
        name: n.node, done: n.bytes_done / MIB, total: n.bytes_total / MIB,
        rate: n.rate_Bps / MIB, eta: n.eta_s == null ? "-" : `${Math.round(n.eta_s)} s`,
      })));
    } catch (e) {
      render([]);
    }
  }

  setInterval(poll, 1000);
  poll();
})();
