"""Drafter training without Ray: the loss (`loss`), the learning-rate schedule, and the training session."""
