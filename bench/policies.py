"""`python -m bench.policies` in a clone; installed, use `tierstore bench-policies` (tierstore.sim.bench)."""

from __future__ import annotations

from tierstore.sim.bench import main

if __name__ == "__main__":
    raise SystemExit(main(prog="python -m bench.policies"))
