"""The training loop and what it owns: arguments, optimizer, LR schedule, loss scaling, logging."""
