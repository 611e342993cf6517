"""Speculation: config, proposers per request, draft control, verification."""
