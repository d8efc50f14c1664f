"""Print the family table of README's "Verified model families" from models/verified.json.

Each mlx-lm family × one rank / PP2 / TP2 / EP2 / simulate: "ok" where the all-families
matrix proved it equal to the unsharded model (or the planner priced it), else the reason.
`python scripts/families_table.py [--full]` (--full: the reasons too, for an issue note).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
COLUMNS = ("one", "pp", "tp", "ep")


def simulate(model_type: str) -> str:
    from thunderpool.models import tiny
    from thunderpool.planner.spec import model_spec_from_config

    try:
        spec = model_spec_from_config(tiny.family_config(model_type), dtype_bytes=4.0)
    except Exception as e:  # noqa: BLE001 - shown as the reason
        return f"{type(e).__name__}: {e}"
    return f"ok ({spec.params:,} params)"


def main(full: bool) -> None:
    from thunderpool.models import tiny

    table = json.loads((ROOT / "src/thunderpool/models/verified.json").read_text())
    print(f"<!-- mlx-lm {table['mlx_lm']}: python scripts/families_table.py -->")
    print("| family | one rank | PP2 | TP2 | EP2 | simulate |")
    print("|---|---|---|---|---|---|")
    for family, row in table["families"].items():
        cells = []
        for col in COLUMNS:
            v = row.get(col)
            if v is None:
                cells.append("—")  # not a MoE family (EP)
            elif v == "ok":
                cells.append("✓")
            else:
                cells.append(f"✗ {v}" if full else "✗")
        sim = simulate(family)
        cells.append("✓" if sim.startswith("ok") else (f"✗ {sim}" if full else "✗"))
        print(f"| `{family}` | " + " | ".join(cells) + " |")
    for family, why in sorted(tiny.CANNOT_BUILD.items()):
        print(f"| `{family}` | not built here: {why} | | | | |")


if __name__ == "__main__":
    main("--full" in sys.argv)
