"""`python -m pdserve.bench run|sweep|breakeven ...` (same as `pdserve bench ...`)."""
import sys

from pdserve.bench.cli import main

sys.exit(main())
