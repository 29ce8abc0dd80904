import sys

from ignite_amp.cli.main import entry

sys.exit(entry())
