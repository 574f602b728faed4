"""Helpers shared by test modules (never import one test module from another)."""
