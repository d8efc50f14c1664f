// thunderpool dashboard: one progress bar per node while it fetches its weights over the
// fabric. Reads /health's detail ("fetching weights: NAME D/T MiB at R MiB/s, ETA S; ...").
(() => {
  const CLAUSE = /^(.*) ([\d.]+)\/([\d.]+) MiB at ([\d.]+) MiB\/s, ETA (.*)$/;

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
      const detail = (body && body.detail) || "";
      const clauses = detail.startsWith("fetching weights: ")
        ? detail.slice(18).split("; ").map((s) => s.match(CLAUSE)).filter(Boolean).map((m) => ({
            name: m[1], done: +m[2], total: +m[3], rate: +m[4], eta: m[5],
          }))
        : [];
      render(clauses);
    } catch (e) {
      render([]);
    }
  }

  setInterval(poll, 1000);
  poll();
})();
