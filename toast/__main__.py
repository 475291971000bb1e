import sys

from toast.cli import main

sys.exit(main())
