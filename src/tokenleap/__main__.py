"""``python -m tokenleap``: the ``tokenleap`` command."""
import sys

from tokenleap.cli.main import main

sys.exit(main())
