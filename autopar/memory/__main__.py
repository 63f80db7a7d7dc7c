"""`python -m autopar.memory bench|check ...`: see :mod:`autopar.memory.bench` and :mod:`autopar.memory.check`."""

import sys

_USAGE = (
    "usage: python -m autopar.memory bench [--layers N] [--hidden H] [--repeats R] [--threads 1 2]\n"
    "       python -m autopar.memory check [--device cuda|cpu] [--layers N] [--hidden H] [--seq S] [--batch B]"
)

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in ("bench", "check"):
        sys.exit(_USAGE)
    if sys.argv[1] == "bench":
        from autopar.memory.bench import main

        main(sys.argv[2:])
    else:
        from autopar.memory.check import main

        sys.exit(main(sys.argv[2:]))
