import sys

from ignite_amp.cli import entry

sys.exit(entry())
