import sys

from fuzz.bench.kernel.cli import main

sys.exit(main())
