import sys

from .cli import main_entry

if __name__ == "__main__":
    sys.exit(main_entry())
