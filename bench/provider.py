"""The benchmark's upstream: the test suite's fake provider, served on uvloop.

The same app as ``tests/fake_provider.py`` (the benchmark calls its ``/small`` endpoint
and reads its ``/_calls`` counters), on the same event loop as the proxies, so that the
upstream takes as little of the machine's two cores as it can.

    python bench/provider.py --port 9100
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from serving import run, serve_until_signalled

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import fake_provider  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    run(lambda: serve_until_signalled(fake_provider.create_app(), args.port))


if __name__ == "__main__":
    main()
