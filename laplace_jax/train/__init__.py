"""Training: optimizer and schedule, the jitted step, checkpoints, and the run loop."""
