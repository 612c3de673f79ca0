"""Runnable examples of embedding stagewire; each module documents its own command."""
