import sys

from zero.cli.main import main

sys.exit(main())
