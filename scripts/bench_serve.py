"""`fleet bench serve` as a script, for machines that run it by path (shared/bench):
the load generator itself is fleet/frontend/bench_serve.py.

    python scripts/bench_serve.py --base-url http://127.0.0.1:8000 [flags of fleet bench serve]
"""
from fleet.frontend.bench_serve import main

if __name__ == "__main__":
    main()
