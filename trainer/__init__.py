"""The trainer: the DSpark draft model, its objective, and the Lightning job that trains it."""
