"""`python -m benchmarks`: the whole harness (see `benchmarks/run.py`)."""

from .run import main


main()
