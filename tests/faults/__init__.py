"""Faults: Redis stopped, cut off, paused, full or evicting; processes that crash or contend; closing under load."""
