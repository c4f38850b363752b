import sys

from cedlm.bench.cli import main

sys.exit(main())
