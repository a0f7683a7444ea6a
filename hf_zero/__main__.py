import sys

from hf_zero.cli import main

sys.exit(main())
