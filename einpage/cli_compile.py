"""`einpage compile` / `inspect` and running saved plans (filled in with the paging compiler)."""
HANDLERS: dict = {}


def add_commands(sub) -> None:
    return None


def run_plan(args, tokens):
    from einpage.errors import InputError
    raise InputError(f"{args.model}: running plan files needs the paging compiler")
