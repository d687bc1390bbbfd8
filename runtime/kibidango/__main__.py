import sys

from kibidango.cli import main

sys.exit(main())
