"""Kits for testing code built on gossiptrain (placeholder until the kits move here)."""
