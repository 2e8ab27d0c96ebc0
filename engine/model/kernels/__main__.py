"""`python -m engine.model.kernels`: build the kernel variants this CPU runs (the Makefile's step)."""

import sys

from engine.model.kernels.build import main

sys.exit(main())
