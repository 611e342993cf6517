"""The worker process: ZeroMQ link, wire protocol, heartbeats, link security."""
