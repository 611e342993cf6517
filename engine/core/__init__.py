"""Scheduling: requests, their sequences, KV blocks, what runs each step."""
