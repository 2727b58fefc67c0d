"""`python -m sartor ...` runs the command line, as the `sartor` script does."""
from .cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
