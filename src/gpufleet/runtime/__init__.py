"""Where replicas run: local child processes (default) and Kubernetes."""
