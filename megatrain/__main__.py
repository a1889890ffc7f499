"""`python -m megatrain` runs the `megatrain` command."""

from megatrain.cli import main

main()
