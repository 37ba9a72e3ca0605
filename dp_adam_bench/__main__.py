import sys

from dp_adam_bench.cli import main

sys.exit(main())
