"""bench/bootstrap.py's job for a study run as a file (``python bench/studies/X.py``): the checkout
on ``sys.path``."""

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
