import sys

from fuzz.bench.detect.baselines import main

sys.exit(main())
