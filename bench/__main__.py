"""`python -m bench SUITE [flags]`: run one benchmark suite (bench/suites/)."""

import sys

from bench.suites import run

if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
