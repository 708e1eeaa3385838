"""listener."""
