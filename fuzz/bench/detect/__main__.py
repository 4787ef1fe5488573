import sys

from fuzz.bench.detect.cli import main

sys.exit(main())
