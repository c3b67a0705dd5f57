"""`python -m workers.cli`: the `dlx` command (how `dlx up` starts its workers)."""

from . import main

if __name__ == "__main__":
    main()
