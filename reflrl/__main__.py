"""``python -m reflrl ...`` is the ``reflrl`` command (what scripts use to start runs in child processes)."""
import sys

from reflrl.cli import main

sys.exit(main())
