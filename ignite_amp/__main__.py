import sys

from ignite_amp.cli import main

sys.exit(main())
