"""`python -m autopar.memory bench ...`: see :mod:`autopar.memory.bench`."""

import sys

from autopar.memory.bench import main

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] != "bench":
        sys.exit("usage: python -m autopar.memory bench [--layers N] [--hidden H] [--repeats R] [--threads 1 2]")
    main(sys.argv[2:])
