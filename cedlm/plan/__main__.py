import sys

from cedlm.plan.report import main

sys.exit(main())
