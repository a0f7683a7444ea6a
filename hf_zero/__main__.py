import sys

from hf_zero.cli.commands import main

sys.exit(main())
