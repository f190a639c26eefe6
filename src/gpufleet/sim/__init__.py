"""The fleet simulator: trace readers, the event loop, reports and plots."""
