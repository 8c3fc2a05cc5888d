"""Checks of the repository itself: import layering and prose that states the present."""
