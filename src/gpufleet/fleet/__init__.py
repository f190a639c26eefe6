"""Domain types of the control plane: replicas, their states, fleet views, requests, events."""
