"""Helpers shared by the unit and end-to-end tests (not tests themselves)."""
