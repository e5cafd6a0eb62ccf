"""`python -m ember.frontends.cli ...`: the `ember` command without the console script."""
import sys

from . import main

sys.exit(main())
