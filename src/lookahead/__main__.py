"""`python -m lookahead ...` (what `torchrun ... -m lookahead generate` runs on every rank)."""

from .cli import main

main()
