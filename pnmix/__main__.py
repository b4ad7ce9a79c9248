import sys

from .cli import main_entry

sys.exit(main_entry())
