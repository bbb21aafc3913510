"""`python -m hf_prefetch ...`: the command line (see hf_prefetch/cli.py)."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
