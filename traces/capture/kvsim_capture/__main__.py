"""python3 -m kvsim_capture ... (see cli.py)."""
import sys

from .cli import main

sys.exit(main())
