// thunderpool dashboard: one row per known model (its instance's state and load progress,
// placement, memory, throughput, queue), from /v1/cluster's `instances`.
(() => {
  const MIB = 1 << 20;
  const auth = new URLSearchParams(location.search).get("key");
  const headers = auth ? { Authorization: `Bearer ${auth}` } : {};

  function cell(text, cls) {
    const td = document.createElement("td");
    td.textContent = text;
    if (cls) td.className = cls;
    return td;
  }

  function state(m) {
    if (m.state === "loading" || m.state === "recovering") {
      return `${m.state} ${Math.round((m.progress || 0) * 100)}%`;
    }
    return m.state === "failed" ? `failed: ${m.detail}` : m.state;
  }

  function placement(m) {
    if (!m.placement || m.state === "unloaded") return "—";
    const nodes = (m.nodes || []).join(", ");
    return `${m.placement.parallel}${nodes ? ` on ${nodes}` : ""}`;
  }

  function num(v, digits) {
    return v === null || v === undefined ? "—" : Number(v).toFixed(digits);
  }

  function render(instances) {
    const body = document.querySelector("#instances tbody");
    if (!body) return;
    body.replaceChildren(...instances.map((m) => {
      const row = document.createElement("tr");
      row.dataset.model = m.model;
      row.dataset.state = m.state;
      const mem = m.memory_bytes ? `${(m.memory_bytes / MIB).toFixed(1)} MiB` : "—";
      row.append(
        cell(m.model), cell(state(m)), cell(placement(m)), cell(mem, "num"),
        cell(num(m.decode_tokens_per_second, 1), "num"), cell(num(m.queue_depth, 0), "num"),
        cell(String(m.in_flight ?? 0), "num"),
      );
      return row;
    }));
  }

  async function loop() {
    try {
      const res = await fetch("/v1/cluster", { cache: "no-store", headers });
      if (res.ok) render((await res.json()).instances || []);
    } catch { /* the main poll shows the server's state */ }
    setTimeout(loop, 2000);
  }

  loop();
})();
