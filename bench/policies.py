"""`python -m bench.policies`: the cache policy benchmark (see tierstore.sim.bench)."""

from __future__ import annotations

from tierstore.sim.bench import main

if __name__ == "__main__":
    raise SystemExit(main())
