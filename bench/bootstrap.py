"""Imported first by every script run as a file (``python bench/X.py``, whose folder is then
``sys.path[0]``): puts the checkout on ``sys.path``, so that ``bench``, ``tests``, ``lsp``,
``context`` and ``engine`` import from this checkout."""

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parent.parent)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
