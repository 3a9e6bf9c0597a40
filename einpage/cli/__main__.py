"""`python -m einpage.cli`: the `einpage` command."""
from einpage.cli import main

if __name__ == "__main__":
    main()
