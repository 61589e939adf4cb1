"""`python -m dppo_harness.evidence verify DIR`."""

import sys

from dppo_harness.evidence.verify import main

sys.exit(main())
