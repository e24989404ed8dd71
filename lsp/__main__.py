import sys

from lsp.cli import main

sys.exit(main())
