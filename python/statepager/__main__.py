"""python -m statepager ...: command-line entry points (benchmarks)."""
import sys

from statepager.cli import main

sys.exit(main())
