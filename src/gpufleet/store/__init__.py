"""Durable records: usage ledger, audit log, jobs."""
