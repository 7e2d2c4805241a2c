"""python -m statepager ...: the command line (the same as the `statepager` command)."""
import sys

from statepager.tools.cli import main

sys.exit(main(prog="python -m statepager"))
