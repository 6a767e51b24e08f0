"""python -m kvsim ...: the same as the `kvsim` command (kvsim.cli)."""
import sys

from .cli import main

sys.exit(main())
